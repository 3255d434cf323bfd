"""Box records: the frozen values every layer passes around (no raw pod leaves a backend)."""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from devbox.units import age

if TYPE_CHECKING:
    import subprocess


class BoxState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    IDLE = "idle"
    RELEASING = "releasing"
    FAILED = "failed"
    GONE = "gone"


@dataclass(frozen=True, kw_only=True)
class Toleration:
    """A Kubernetes toleration, as a profile names it (validated in devbox.profiles)."""

    key: str = ""
    operator: str = "Equal"  # or "Exists"
    value: str = ""
    effect: str = ""  # NoSchedule, PreferNoSchedule, NoExecute; empty: every effect
    toleration_seconds: int | None = None  # NoExecute only

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"key": self.key, "operator": self.operator}
        if self.value:
            data["value"] = self.value
        if self.effect:
            data["effect"] = self.effect
        if self.toleration_seconds is not None:
            data["toleration_seconds"] = self.toleration_seconds
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Toleration:
        seconds = data.get("toleration_seconds")
        return cls(
            key=str(data.get("key", "")),
            operator=str(data.get("operator", "Equal")),
            value=str(data.get("value", "")),
            effect=str(data.get("effect", "")),
            toleration_seconds=None if seconds is None else int(seconds),
        )


@dataclass(frozen=True, kw_only=True)
class BoxSpec:
    """What a box is made of: its profile's shape, after any --gpus override. The defaults
    are the built-in "default" profile. The local backend applies only `gpus`."""

    gpus: int = 0
    profile: str = "default"
    image: str = ""  # empty: the config's image
    # Kubernetes quantities, requested (never limited: see backends/kubernetes/pods.py).
    cpu: str = "1"
    memory: str = "2Gi"
    # Label key -> value pairs, sorted by key: a tuple keeps the spec frozen and hashable.
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Toleration, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "profile": self.profile,
            "image": self.image,
            "cpu": self.cpu,
            "memory": self.memory,
            "node_selector": dict(self.node_selector),
            "tolerations": [t.to_json() for t in self.tolerations],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BoxSpec:
        """Inverse of to_json; records written before profiles had resources (gpus,
        profile, image only) load with the built-in defaults for the rest."""
        default = cls()
        selector = dict(data.get("node_selector") or {})
        return cls(
            gpus=int(data.get("gpus", 0)),
            profile=str(data.get("profile", default.profile)),
            image=str(data.get("image", "")),
            cpu=str(data.get("cpu", default.cpu)),
            memory=str(data.get("memory", default.memory)),
            node_selector=tuple(sorted((str(k), str(v)) for k, v in selector.items())),
            tolerations=tuple(Toleration.from_json(dict(t)) for t in data.get("tolerations", ())),
        )


@dataclass(frozen=True, kw_only=True)
class Box:
    name: str
    owner: str
    backend: str
    spec: BoxSpec
    state: BoxState
    # Where the agent's SSH server listens, as the backend reaches it.
    host: str = ""
    port: int = 0
    # The agent's public host key line ("ssh-ed25519 AAAA...") and its SHA256 fingerprint.
    host_key: str = ""
    host_key_fingerprint: str = ""
    gpu_ids: tuple[str, ...] = ()
    created_at: float = 0.0
    # Wall-clock time of the last user input the agent saw; 0 when unknown.
    last_activity: float = 0.0
    # Why the box is in its state, when that is not obvious (a failure, a warning).
    reason: str = ""
    # Wall-clock time until which `devbox keep` holds the box against idle release; 0: not kept.
    keep_until: float = 0.0
    # The autoscaler's recorded decisions: when it will release the box unless it is used
    # (0: no warning), why ("idle", "lifetime" or "hung"), and since when its agent has been
    # silent (0: healthy).
    release_at: float = 0.0
    release_reason: str = ""
    unhealthy_since: float = 0.0
    # Where the backend runs the box, in its own terms: a pod's name; empty locally.
    place: str = ""
    # The box's persistent session: "screen", "tmux" or "none"; empty: the backend cannot tell.
    multiplexer: str = ""
    # devbox.probe's model alerts as one short cell ("nan:fc"), for `devbox ls`; empty: none.
    alerts: str = ""
    # Since when the agent judges the box hung (devbox.hang); 0: it is not.
    hung_since: float = 0.0
    # Which of the user's clusters ([clusters.NAME] in config.toml) holds the box; empty:
    # one cluster, or the local backend.
    cluster: str = ""
    # Details only the backend that wrote them reads (a keeper's pid, a home path).
    extra: dict[str, str] = field(default_factory=dict)

    def autoscaler_note(self, now: float) -> str:
        """What the autoscaler has said about the box, for `devbox ls` and the TUI."""
        parts = []
        if self.release_at:
            left = max(0.0, self.release_at - now)
            why = _NOTE_WHY.get(self.release_reason, "at its maximum lifetime")
            parts.append(
                f"{why}: released in {age(left)} unless used (or `devbox keep {self.name}`)"
            )
        if self.unhealthy_since:
            parts.append(f"unhealthy: agent silent for {age(now - self.unhealthy_since)}")
        return "; ".join(parts)

    def kept_for(self, now: float) -> float | None:
        """Seconds `devbox keep` still holds the box; None when it is not kept."""
        return self.keep_until - now if self.keep_until > now else None

    def idle_seconds(self, now: float) -> float | None:
        if self.last_activity <= 0:
            return None
        # Never idle for longer than the box has been someone's (a backend's activity clock
        # may start before the claim: a warm pod's agent, a box adopted by a new agent).
        return max(0.0, now - max(self.last_activity, self.created_at))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["spec"] = self.spec.to_json()
        data["state"] = self.state.value
        data["gpu_ids"] = list(self.gpu_ids)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Box:
        """Inverse of to_json; raises KeyError/TypeError/ValueError on a malformed record."""
        spec = BoxSpec.from_json(dict(data["spec"]))
        extra = {str(k): str(v) for k, v in dict(data.get("extra", {})).items()}
        return cls(
            name=str(data["name"]),
            owner=str(data["owner"]),
            backend=str(data["backend"]),
            spec=spec,
            state=BoxState(data["state"]),
            host=str(data.get("host", "")),
            port=int(data.get("port", 0)),
            host_key=str(data.get("host_key", "")),
            host_key_fingerprint=str(data.get("host_key_fingerprint", "")),
            gpu_ids=tuple(str(g) for g in data.get("gpu_ids", ())),
            created_at=float(data.get("created_at", 0.0)),
            last_activity=float(data.get("last_activity", 0.0)),
            reason=str(data.get("reason", "")),
            keep_until=float(data.get("keep_until", 0.0)),
            release_at=float(data.get("release_at", 0.0)),
            release_reason=str(data.get("release_reason", "")),
            unhealthy_since=float(data.get("unhealthy_since", 0.0)),
            place=str(data.get("place", "")),
            # A record an earlier devbox wrote kept the session's kind among the extras.
            multiplexer=str(data.get("multiplexer", extra.pop("multiplexer", ""))),
            alerts=str(data.get("alerts", "")),
            hung_since=float(data.get("hung_since", 0.0)),
            cluster=str(data.get("cluster", "")),
            extra=extra,
        )


def session_name(box_name: str) -> str:
    """The screen/tmux session of a box; shared by the agent, the runs and the backends.

    screen's `-S NAME` picks any session whose name starts with NAME, so the name ends in
    a character no box name (a DNS-1123 label) has: `devbox-dx.box` never begins
    `devbox-dx-2.box`, and every command reaches exactly one box's session.
    """
    return f"devbox-{box_name}.box"


def _legacy_session_name(box_name: str) -> str:
    """The name sessions had before session_name ended in ".box"; only ever ended, exactly."""
    return f"devbox-{box_name}"


# tmux: the one session in a box's server, and its login window (runs get windows of
# their own beside it, so a shell is always there to land on).
TMUX_SESSION = "main"
LOGIN_WINDOW = "login"


@dataclass(frozen=True)
class Multiplexer:
    """The terminal multiplexer that keeps a box's shell alive, and how to drive it.

    Lives here, not in the agent, because a backend must also end the session of
    a box whose agent died.
    """

    kind: str  # "screen", "tmux" or "none"
    path: str = ""

    def attach_argv(self, box: str) -> list[str] | None:
        """The command that creates or joins the box's session; None means a plain shell.

        It lands on the login window (screen's window 0, tmux's "login"), never on a run's
        window that `devbox run` or `devbox attach` left in front, where a stray ctrl-c
        would end the run."""
        name = session_name(box)
        if self.kind == "screen":
            # -x joins even when another client is attached (two laptops, one session);
            # -RR creates the session the first time.
            return [self.path, "-xRR", "-S", name, "-p", "0"]
        if self.kind == "tmux":
            # A server socket per box, so ending the box ends exactly its sessions; "="
            # makes a target exact (tmux also matches prefixes).
            return [self.path, "-L", name, "new-session", "-A", "-s", TMUX_SESSION,
                    "-n", LOGIN_WINDOW, ";",
                    "select-window", "-t", f"={TMUX_SESSION}:={LOGIN_WINDOW}"]  # fmt: skip
        return None

    def quit_argv(self, box: str) -> list[str] | None:
        name = session_name(box)
        if self.kind == "screen":
            return [self.path, "-S", name, "-X", "quit"]
        if self.kind == "tmux":
            return [self.path, "-L", name, "kill-server"]
        return None

    def running(self, box: str) -> bool:
        name = session_name(box)
        if self.kind == "screen":
            out = _quiet([self.path, "-ls", name]).stdout
            return f".{name}\t" in out
        if self.kind == "tmux":
            return _quiet([self.path, "-L", name, "has-session"]).returncode == 0
        return False

    def end(self, box: str, *, timeout: float = 5.0) -> None:
        """End the box's session and all that runs in it, and wait until it is gone.

        screen may drop a `-X quit` that races with a client detaching, so the
        command is repeated until the session has really ended.
        """
        argv = self.quit_argv(box)
        if argv is None:
            return
        self._end_legacy(box)
        deadline = time.monotonic() + timeout
        while True:
            _quiet(argv)
            if not self.running(box) or time.monotonic() > deadline:
                return
            time.sleep(0.1)

    def _end_legacy(self, box: str) -> None:
        """A session a box's agent started under the old name (before an upgrade): ended
        by its exact `PID.name` (screen) or socket (tmux), so no other box's is touched."""
        old = _legacy_session_name(box)
        if self.kind == "tmux":
            _quiet([self.path, "-L", old, "kill-server"])
            return
        if self.kind != "screen":
            return
        for line in _quiet([self.path, "-ls", old]).stdout.splitlines():
            exact = line.strip().split("\t", 1)[0]
            if exact.partition(".")[2] == old:
                _quiet([self.path, "-S", exact, "-X", "quit"])

    def message_argv(self, box: str, text: str) -> list[str] | None:
        """Shows `text` in every attached client (the autoscaler's warnings)."""
        name = session_name(box)
        if self.kind == "screen":
            return [self.path, "-S", name, "-X", "wall", text]
        if self.kind == "tmux":
            return [self.path, "-L", name, "display-message", text]
        return None

    def tell(self, box: str, text: str) -> None:
        """Show `text` in the box's attached sessions; nothing when none is attached."""
        argv = self.message_argv(box, text)
        if argv is not None:
            _quiet(argv)


def session_warning(box: Box, *, preference: str) -> str:
    """What `devbox up` says when the box has no persistent session the user did not choose
    to go without (multiplexer = "none"); empty otherwise, or when the backend cannot tell."""
    if box.multiplexer != "none" or preference == "none":
        return ""
    return (
        f"devbox: warning: box {box.name}: no screen or tmux on this machine: "
        "the shell will not survive a disconnect; install screen or tmux"
    )


# The autoscaler's release reasons (devbox.autoscaler.policy's Warn) in words: `devbox ls`
# and the TUI's note, and the warning in the box's terminals.
_NOTE_WHY = {"idle": "idle", "hung": "looks hung", "lifetime": "at its maximum lifetime"}
_WARNING_WHY = {
    "idle": "has been idle",
    "hung": "looks hung (its GPUs busy at low power, no training step, no input)",
    "lifetime": "reached its maximum lifetime",
}


def release_warning(box: str, reason: str, release_at: float, *, keep_inside: bool = False) -> str:
    """The autoscaler's warning, as the box's terminals show it. `keep_inside`: a bare
    `devbox keep` in the box holds it (a local box; a pod's agent may not keep its pod)."""
    clock = time.strftime("%H:%M:%S", time.localtime(release_at))
    why = _WARNING_WHY.get(reason, _WARNING_WHY["lifetime"])
    how = f"`devbox keep {box}`"
    if keep_inside:
        how = f"`devbox keep` here or {how}"
    if reason == "hung":  # input or a training step ends the hang: it is use
        return (
            f"devbox: box {box} {why}; it will be released at {clock} unless used ({how} holds it)"
        )
    return f"devbox: box {box} {why}; it will be released at {clock} ({how} holds it)"


def hung_note(box: Box, since: float, now: float) -> str:
    """`devbox ls`'s and the TUI's word on a box hung since `since` (devbox.hang)."""
    return (
        f"hung for {age(now - since)}: GPUs busy at low power, no training step, no "
        f"input; `devbox probe {box.name} --stacks` shows where it waits"
    )


def release_withdrawn(box: str, why: str) -> str:
    """What the box's terminals show when a warned box will not be released after all."""
    return f"devbox: box {box} will not be released: {why}"


def _quiet(argv: list[str]) -> subprocess.CompletedProcess[str]:
    import subprocess  # only when a session is ended: keeps `import devbox.boxes` light

    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=10, check=False
    )
