"""No module imports another module's private (leading-underscore) name.

A private name is one the module may rename or drop without telling anyone; the day a
second module reaches for it, it is an interface without the promise of one (the session
service lived in `devbox/commands.py` as `_session`/`_open`/`_probe` for that reason).

What counts, in devbox/, agent/, tui/ and benchmarks/, for devbox's own modules:
- `from pkg.mod import _name` (absolute or relative), `import pkg._mod`, `from pkg import _mod`;
- `mod._name` where `mod` is bound in the module by an import of one of devbox's modules.

What is allowed:
- dunders (`__version__`, `__all__`): they are protocol, not privacy;
- a private *module* used inside its own package: `devbox/ssh/_asyncssh.py` is the
  package's own seam, imported by its siblings in devbox/ssh/, never from outside;
- a module's use of its own private names, and the standard library's and third-party
  packages' privates (`os._exit`): the rule is about the seams between devbox's modules.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("devbox", "agent", "tui", "benchmarks")


@dataclass(frozen=True)
class Use:
    where: str  # path:line
    name: str  # the dotted private name reached for

    def __str__(self) -> str:
        return f"{self.where}: {self.name}"


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _first_party(dotted: str, importer: str) -> str | None:
    """The module's full name if it is one of devbox's own, else None. Benchmarks import
    their siblings as top-level modules (`from harness import ...`)."""
    top = dotted.split(".")[0]
    if top in SCANNED or top == "tests":
        return dotted
    if importer.startswith("benchmarks.") and _is_module(f"benchmarks.{top}"):
        return f"benchmarks.{dotted}"
    return None


def _allowed(dotted: str, importer: str) -> bool:
    """A private module may be imported by modules inside the package that holds it."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not _private(part):
            continue
        if not _is_module(".".join(parts[: i + 1])):
            return False  # a private function, class or constant: never
        package = ".".join(parts[:i])
        if not (importer == package or importer.startswith(package + ".")):
            return False
    return True


def _absolute(node: ast.ImportFrom, importer: str, *, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = importer.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dotted(node: ast.expr) -> list[str] | None:
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    names.append(node.id)
    return names[::-1]


def private_uses(source: str, *, importer: str, is_package: bool, where: str) -> list[Use]:
    """The private names of devbox's other modules that `source` (module `importer`) uses."""
    tree = ast.parse(source, filename=where)
    found: list[Use] = []
    modules: dict[str, str] = {}  # a local name -> the first-party module it is bound to

    def check(dotted: str, line: int) -> None:
        if any(_private(p) for p in dotted.split(".")) and not _allowed(dotted, importer):
            found.append(Use(f"{where}:{line}", dotted))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                full = _first_party(alias.name, importer)
                if full is None:
                    continue
                check(full, node.lineno)
                if alias.asname:
                    modules[alias.asname] = full
                else:  # `import a.b` binds `a`, and `a.b.x` reaches through it
                    top = alias.name.split(".")[0]
                    modules[top] = full.split(".")[0] if full == alias.name else full
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, importer, is_package=is_package)
            full = _first_party(source, importer)
            if full is None:
                continue
            for alias in node.names:
                if alias.name == "*":
                    continue
                check(f"{full}.{alias.name}", node.lineno)
                if _is_module(f"{full}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{full}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load | ast.Store):
            continue
        names = _dotted(node)
        if names is None or names[0] not in modules:
            continue
        # Resolve `a.b.c._d` through the bound module, down the chain of submodules.
        base = modules[names[0]]
        for part in names[1:]:
            if _private(part):
                check(f"{base}.{part}", node.lineno)
                break
            if not _is_module(f"{base}.{part}"):
                break
            base = f"{base}.{part}"
    return sorted(set(found), key=str)


def _uses_in(path: Path) -> list[Use]:
    return private_uses(
        path.read_text(),
        importer=_module_name(path),
        is_package=path.name == "__init__.py",
        where=str(path.relative_to(ROOT)),
    )


def _sources() -> list[Path]:
    return sorted(
        p
        for folder in SCANNED
        for p in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in p.parts
    )


# Known uses on their way out (none now: the agent's request reader and error line moved
# to agent/streams.py, public there). Add none.
PENDING: set[tuple[str, str]] = set()


def test_no_module_imports_another_modules_private_name() -> None:
    uses = [
        use
        for path in _sources()
        for use in _uses_in(path)
        if (use.where.rsplit(":", 1)[0], use.name) not in PENDING
    ]
    assert not uses, "private names used across modules:\n" + "\n".join(map(str, uses))


def test_the_walk_finds_each_kind_of_use() -> None:
    """The rule itself: every form in the docstring is caught, and only those."""
    inside = (
        "from devbox.commands import backend_for\n"  # public: fine
        "from devbox.ssh import _asyncssh\n"  # its own package's private module: fine
        "from devbox.statsview import _num\n"  # caught
        "from ..runs import remote\n"
        "import devbox.runs.sync\n"
        "import os\n"
        "remote._error\n"  # caught
        "devbox.runs.sync._method()\n"  # caught
        "os._exit\n"  # the standard library's: not devbox's seam
        "__all__ = []\n"
    )
    found = private_uses(inside, importer="devbox.ssh.example", is_package=False, where="x")
    assert sorted(u.name for u in found) == [
        "devbox.runs.remote._error",
        "devbox.runs.sync._method",
        "devbox.statsview._num",
    ]
    outside = "from devbox.ssh._asyncssh import asyncssh\nimport devbox.ssh._asyncssh\n"
    found = private_uses(outside, importer="tui.example", is_package=False, where="x")
    assert sorted(u.name for u in found) == [
        "devbox.ssh._asyncssh",
        "devbox.ssh._asyncssh.asyncssh",
    ]
