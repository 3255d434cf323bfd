"""The Backend seam is declared, never probed: outside devbox/backends/, no code asks a
backend what it is (getattr/hasattr/isinstance on a backend, a comparison of a backend's or
a box's backend name, a read of `Box.extra`, the details only a backend reads); it asks the
backend (devbox/backends/base.py) or reads the Box's typed fields. And each backend
answers every question the protocol declares, as the users of that answer rely on."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest

from devbox.backends.base import Backend, WarmPool
from devbox.backends.kubernetes import KubernetesBackend
from devbox.backends.local import LocalBackend
from devbox.boxes import Box, BoxSpec, BoxState
from devbox.config import BACKENDS, Config
from devbox.errors import UsageError
from devbox.ssh import sshconfig

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("devbox", "tui")
EXEMPT = Path("devbox/backends")  # where a backend's name may be known

# Sites allowed to probe a backend anyway, as (file, the offending source): none. An
# entry must match a site (a stale one fails test_the_allow_list_is_not_stale).
ALLOWED: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Probe:
    path: str
    line: int
    source: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source}"


def _mentions_backend(node: ast.expr) -> bool:
    return "backend" in ast.unparse(node).lower()


def _names_a_backend(node: ast.expr) -> bool:
    """A backend's name, or a collection of them, in a comparison."""
    if isinstance(node, ast.Constant):
        return node.value in BACKENDS
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_backend(e) for e in node.elts)
    return False


def _is_probe(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "extra":
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
        if node.func.id in ("getattr", "hasattr"):
            return _mentions_backend(node.args[0])
        if node.func.id == "isinstance" and len(node.args) == 2:
            return "Backend" in ast.unparse(node.args[1])
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        # `box.backend == "..."`: any string compared with a box's backend.
        if any(isinstance(s, ast.Attribute) and s.attr == "backend" for s in sides) and any(
            isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides
        ):
            return True
        # `backend.name == "local"`, `kind in ("local", "kubernetes")`...
        if any(_names_a_backend(s) for s in sides):
            return any(
                _mentions_backend(s) or (isinstance(s, ast.Attribute) and s.attr == "name")
                for s in sides
                if not _names_a_backend(s)
            )
    return False


def probes_in(source: str, path: str) -> list[Probe]:
    return [
        Probe(path, node.lineno, ast.unparse(node))
        for node in ast.walk(ast.parse(source))
        if _is_probe(node) and isinstance(node, ast.expr)
    ]


def _all_probes() -> list[Probe]:
    found = []
    for folder in SCANNED:
        for file in sorted((ROOT / folder).rglob("*.py")):
            rel = file.relative_to(ROOT)
            if rel.is_relative_to(EXEMPT):
                continue
            found += probes_in(file.read_text(), rel.as_posix())
    return found


def test_no_backend_is_probed_or_named_outside_the_backends() -> None:
    left = [p for p in _all_probes() if (p.path, p.source) not in ALLOWED]
    assert not left, "ask the Backend (devbox/backends/base.py) instead:\n" + "\n".join(
        map(str, left)
    )


def test_the_allow_list_is_not_stale() -> None:
    found = {(p.path, p.source) for p in _all_probes()}
    stale = sorted(ALLOWED - found)
    assert not stale, f"switched already: remove from ALLOWED: {stale}"


@pytest.mark.parametrize(
    "snippet",
    [
        'direct = getattr(backend, "bridge_stdio", None)',
        'hasattr(self.backend, "pool")',
        "isinstance(backend, KubernetesBackend)",
        "isinstance(b, (LocalBackend, KubernetesBackend))",
        'box.backend == "local"',
        'if box.backend != "kubernetes": pass',
        'backend.name == "kubernetes"',
        'self.backend.name != "local"',
        'backend_name in ("local", "kubernetes")',
        'b.extra.get("alerts", "-")',
        'box.extra["pod"]',
    ],
)
def test_the_scan_sees_each_kind_of_probe(snippet: str) -> None:
    assert probes_in(snippet, "x.py"), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        'getattr(args, "namespace", None)',
        "isinstance(exc, DevboxError)",
        'name == "local"',  # a folder, a profile: not a backend's name
        'backend.name if backend is not None else "local"',
        'box.state == "running"',
        "box.alerts or '-'",
    ],
)
def test_the_scan_leaves_other_code_alone(snippet: str) -> None:
    assert not probes_in(snippet, "x.py"), snippet


# --- what each backend declares ------------------------------------------------------


def _box(backend: str, **extra: str) -> Box:
    return Box(
        name="b1",
        owner="ada",
        backend=backend,
        spec=BoxSpec(),
        state=BoxState.RUNNING,
        host="127.0.0.1",
        port=2222,
        extra=extra,
    )


@pytest.fixture
def local(tmp_path: Path) -> LocalBackend:
    return LocalBackend(config=Config(), root=tmp_path / "local")


@pytest.fixture
def kube() -> KubernetesBackend:
    return KubernetesBackend(config=Config(backend="kubernetes"))  # no request until used


def _members(protocol: type) -> set[str]:
    declared = set(inspect.get_annotations(protocol))
    declared |= {n for n, v in vars(protocol).items() if inspect.isfunction(v)}
    return {n for n in declared if not n.startswith("_")}


@pytest.mark.parametrize("cls", [LocalBackend, KubernetesBackend])
def test_every_backend_has_every_declared_member(cls: type) -> None:
    missing = {n for n in _members(Backend) if not hasattr(cls, n)}
    assert not missing, f"{cls.__name__} lacks {sorted(missing)}"


def test_local_boxes_are_dialled_directly(local: LocalBackend) -> None:
    box = _box("local")
    assert local.direct_ssh is True
    assert local.proxy_args(box) == []
    assert local.proxy_stdio(box) is False  # the caller's bridge carries open_socket


def test_kubernetes_boxes_go_through_the_port_forward(kube: KubernetesBackend) -> None:
    assert kube.direct_ssh is False
    assert kube.proxy_args(_box("kubernetes", namespace="team-a")) == ["--namespace", "team-a"]
    assert kube.proxy_args(_box("kubernetes")) == []


def test_only_kubernetes_has_a_warm_pool(local: LocalBackend, kube: KubernetesBackend) -> None:
    with pytest.raises(UsageError, match="the warm pool is a kubernetes feature"):
        local.warm_pool()
    pool: WarmPool = kube.warm_pool()
    assert pool is kube


def test_each_backend_gives_its_autoscaler_world(local: LocalBackend) -> None:
    from devbox.backends.local.autoscaling import LocalWorld

    world = local.autoscaler_world()
    assert isinstance(world, LocalWorld)
    world.close()  # nothing to stop here, and said so without a probe


def test_the_proxy_command_carries_what_the_backend_declares(
    kube: KubernetesBackend, local: LocalBackend
) -> None:
    pod = _box("kubernetes", namespace="team a")
    text = sshconfig.render([pod], proxy_args=kube.proxy_args)
    assert 'proxy --backend kubernetes b1 --namespace "team a"\n' in text
    text = sshconfig.render([_box("local")], proxy_args=local.proxy_args)
    assert "proxy --backend local b1\n" in text


def test_a_fixed_agent_port_is_local_only_and_refused_before_any_request() -> None:
    """`devbox up --port` reaches the backend through its config, not the protocol's claim."""
    kube = KubernetesBackend(config=Config(backend="kubernetes", port=2299))
    with pytest.raises(UsageError, match="--port applies to the local backend only"):
        kube.claim(BoxSpec())  # no kubeconfig here: a request would fail differently
