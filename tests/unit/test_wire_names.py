"""Every name the agent, the backends and the box side exchange (labels, annotations, the
sessions' environment, the files of a local box) is a constant in one module, and no other
module of devbox/, agent/ or tui/ spells it out: two spellings drift apart unseen."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType

from devbox import protocol
from devbox.backends.kubernetes import pods
from devbox.backends.local import store
from devbox.runs import record

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("devbox", "agent", "tui")


def _names(
    module: ModuleType, *, prefixes: tuple[str, ...] = (), suffixes: tuple[str, ...] = ()
) -> dict[str, str]:
    """The string constants `module` defines (not those it imports) by value, to name them."""
    own = ast.parse(Path(module.__file__ or "").read_text())
    assigned = {
        t.id
        for n in own.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    return {
        v: n
        for n, v in vars(module).items()
        if n in assigned and isinstance(v, str) and (n.startswith(prefixes) or n.endswith(suffixes))
    }


# Each home, and its names. A local box's file names count where they are a path's part
# (`folder / "host_key"`): "host_key" is also a key of the box record and the READY frame.
HOMES: dict[str, dict[str, str]] = {
    "devbox/protocol.py": _names(protocol, prefixes=("LABEL_", "ANN_"), suffixes=("_ENV", "_FILE")),
    "devbox/runs/record.py": _names(record, prefixes=("RUNS_",), suffixes=("_ENV",)),
    "devbox/backends/kubernetes/pods.py": _names(pods, prefixes=("LABEL_",)),
}
PATH_HOMES: dict[str, dict[str, str]] = {
    "devbox/backends/local/store.py": _names(
        store, prefixes=("RECORD", "AGENT_", "KEEPER_"), suffixes=("_FILE", "_KEY")
    ),
}
# Where a literal stays, and why.
ALLOWED = {
    # A TAB completes box names from the local state without importing a backend.
    ("devbox/offers.py", "box.json"),
}


def _literals(path: Path) -> list[tuple[int, str, bool]]:
    """(line, text, whether it is a path's part) of every string that is no docstring."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    parts = {
        id(node.right)
        for node in ast.walk(tree)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
    }
    return [
        (node.lineno, node.value, id(node) in parts)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def _spelled(text: str, names: dict[str, str]) -> str | None:
    """The exchanged name `text` spells: itself, or as the start of an env marker (NAME=)."""
    if text in names:
        return text
    head = text.partition("=")[0]
    return head if text.endswith("=") and head in names else None


def test_each_exchanged_name_is_spelled_only_in_its_home() -> None:
    copies = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            literals = _literals(path)
            for home, names in (*HOMES.items(), *PATH_HOMES.items()):
                paths_only = home in PATH_HOMES
                for line, text, part in literals:
                    name = _spelled(text, names)
                    if rel == home or name is None or (paths_only and not part):
                        continue
                    if (rel, name) not in ALLOWED:
                        copies.append(f"{rel}:{line}: {text!r} (use {home}'s {names[name]})")
    assert not copies, "\n".join(copies)


def test_the_allow_list_is_not_stale() -> None:
    for rel, text in ALLOWED:
        assert any(t == text for _, t, _ in _literals(ROOT / rel)), (rel, text)
