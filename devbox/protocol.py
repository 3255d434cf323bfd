"""The agent wire format: versioned, newline-delimited JSON frames.

Shared by the agent, the CLI and the TUI. Every frame is one JSON object on one
line with a protocol version `v` and a `type`. A reader skips types it does not
know (newer agents may send more) and treats a malformed line as an error of
that one stream only.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import types
import typing
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict, cast

from devbox.errors import DevboxError

VERSION = 1
# A frame larger than this is malformed; it bounds what one bad peer can make us buffer.
MAX_FRAME_BYTES = 1 << 20


class ProtocolError(DevboxError, ValueError):
    """A frame that cannot be decoded, or whose body is not what its type says; the stream
    that carried it is closed. A DevboxError: a client that meets one says so in one line."""


@dataclass(frozen=True)
class Frame:
    type: str
    body: dict[str, Any]
    v: int = VERSION


def encode(frame_type: str, **body: Any) -> bytes:
    payload = {"v": VERSION, "type": frame_type, **body}
    return json.dumps(payload, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> Frame:
    if len(line) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(line)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        data = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from None
    except RecursionError:
        # `[[[[...` a few thousand deep fits in any size limit; uncaught, it would end
        # whatever read the frame (before, the whole SSH connection), not one stream.
        raise ProtocolError("frame is nested too deeply") from None
    if not isinstance(data, dict):
        raise ProtocolError("frame is not a JSON object")
    version, frame_type = data.pop("v", None), data.pop("type", None)
    if not isinstance(version, int) or not isinstance(frame_type, str):
        raise ProtocolError("frame lacks an integer 'v' and a string 'type'")
    return Frame(type=frame_type, body=data, v=version)


# Frame types. The agent sends READY (or ERROR) once on its launch pipe when it
# listens; HELLO opens every stream over SSH.
READY = "ready"
ERROR = "error"
HELLO = "hello"

# In every session the agent starts: the box's name. It marks the box's processes too
# (agent/host.py counts those that carry it), and names the box to `devbox keep` in it.
BOX_ENV = "DEVBOX_BOX"


# --- Telemetry. A client opens the SSH subsystem TELEMETRY_SUBSYSTEM on the box's own
# authenticated connection and sends one SUBSCRIBE frame; the agent answers HELLO, then
# (if asked) one HISTORY frame, then SAMPLE frames at the requested rate. A slow reader
# gets the newest sample, never a backlog. A bad request gets one ERROR frame and the
# channel closes; the agent goes on serving everyone else.
#
# In every sample a metric the hardware or OS does not report is null (None), never an
# error and never a made-up zero.
TELEMETRY_SUBSYSTEM = "devbox-telemetry"
SUBSCRIBE = "subscribe"  # body: rate (Hz, float, 0 < rate <= MAX_RATE), history (bool)
HISTORY = "history"  # body: samples (list[Sample], oldest first)
SAMPLE = "sample"  # body: one Sample
MAX_RATE = 20.0
HISTORY_SECONDS = 600  # the ring buffer: 10 minutes at 1 Hz


class GpuProcess(TypedDict):
    pid: int  # as NVML reports it: in a container, a host PID
    box_pid: int | None  # the same process as the box sees it; None when unmapped
    kind: str  # "compute" or "graphics"
    mem_used: int | None  # bytes
    sm_util: float | None  # percent, from NVML's per-process samples
    mem_util: float | None


class GpuSample(TypedDict):
    index: int
    uuid: str
    name: str
    lost: bool  # NVML said GPU_IS_LOST: every metric below is None
    util: float | None  # percent
    mem_util: float | None
    mem_used: int | None  # bytes
    mem_total: int | None
    power_w: float | None
    power_limit_w: float | None
    temp_c: float | None
    sm_clock_mhz: int | None
    pcie_tx_kbs: int | None  # KB/s, as NVML reports it
    pcie_rx_kbs: int | None
    ecc_corrected: int | None  # volatile (since boot) totals
    ecc_uncorrected: int | None
    processes: list[GpuProcess]


class HostSample(TypedDict):
    cpu: list[float]  # percent per core since the previous sample
    load1: float | None
    mem_used: int
    mem_total: int
    swap_used: int
    disk_read_bps: float | None  # None on the first sample: a rate needs two
    disk_write_bps: float | None
    net_rx_bps: float | None
    net_tx_bps: float | None


class BoxProcess(TypedDict):
    pid: int
    ppid: int
    name: str
    cmdline: str
    user: str | None
    cpu: float | None  # percent of one core since the previous sample; None on first sight
    rss: int | None  # bytes
    threads: int | None


class Activity(TypedDict):
    clients: int  # interactive and command channels open now (telemetry not counted)
    # Unix time of the last keystroke in a terminal, or of a command started (ssh host CMD).
    last_input: float
    last_probe: NotRequired[float]  # unix time of the last devbox.probe batch; 0 = never
    # Unix times (0 = never) when traffic from the client through port forwards (an editor's
    # server connection and its terminals, -L/-D/-R), through SFTP/scp, or into a command's
    # stdin last reached TRAFFIC_FLOOR bytes within TRAFFIC_WINDOW seconds: a keepalive or
    # an editor left open and untouched stays under it.
    last_forward: NotRequired[float]
    last_sftp: NotRequired[float]
    last_exec: NotRequired[float]
    runs: NotRequired[int]  # `devbox run` experiments still running
    # The busiest the box's GPUs (mean utilisation, percent) and processes (CPU, percent
    # of one core, the agent itself left out) were over the last ACTIVITY_WINDOW seconds of
    # telemetry; None when unknown. A peak, so a reader that looks every few seconds does
    # not miss a training loop's bursts.
    gpu_util: NotRequired[float | None]
    cpu: NotRequired[float | None]
    # devbox.hang: since when every busy GPU of the box has drawn little power (0: not
    # now), and since when the box is hung, stalled with no probe step and no use for the
    # rule's `after` (0: not hung). The agent judges; everyone else reads.
    stalled_since: NotRequired[float]
    hung_since: NotRequired[float]


ACTIVITY_WINDOW = 15.0
# A kind of traffic is activity when the client sends at least this many bytes of it in
# one window. VS Code's server connection keeps itself alive with a few hundred bytes a
# minute while nobody types; typing in its editor or terminal sends several KiB a minute.
TRAFFIC_FLOOR = 4096
TRAFFIC_WINDOW = 60.0
TRAFFIC_KINDS = ("forward", "sftp", "exec")


class Sample(TypedDict):
    t: float  # unix time the sample was taken, in the agent
    seq: int  # increases by one per sample taken; a gap means the reader skipped some
    gpus: list[GpuSample]
    host: HostSample
    processes: list[BoxProcess]
    activity: NotRequired[Activity]  # absent from older agents


# --- Probe (devbox.probe, inside training code). Two hops, one format:
#  1. a training process connects to the agent's probe socket (a Unix socket in a 0700
#     folder, path in $PROBE_SOCKET_ENV, also written to PROBE_POINTER_FILE under the box's
#     home, whose own path is in $PROBE_POINTER_ENV), sends
#     PROBE_HELLO, then PROBE_STATS batches; the agent sends it PROBE_CONTROL (is anybody
#     watching) and PROBE_REQUEST frames, which it answers with PROBE_REPLY;
#  2. a client opens the SSH subsystem PROBE_SUBSYSTEM and sends PROBE_SUBSCRIBE; the agent
#     answers HELLO (with the processes), then the newest PROBE_STATS of each process and
#     each one after (a slow reader skips to the newest), a process's PROBE_HELLO when it
#     connects after the subscription, PROBE_GONE when a process ends;
#     the client may send PROBE_REQUEST frames, each answered by a PROBE_REPLY with its id.
# A float that is NaN or infinite travels as null; the nan/inf counts say why.
PROBE_SUBSYSTEM = "devbox-probe"
PROBE_SOCKET_ENV = "DEVBOX_PROBE_SOCKET"
PROBE_FOLDER_PREFIX = "devbox-probe-"  # the agent's private temp folder for the socket
PROBE_POINTER_FILE = ".devbox/probe-socket"  # under the box's home: the socket's path
# The pointer file's path, in every session: a local box's sessions keep the user's $HOME,
# not the box's, and an agent restarted since the session began listens somewhere new.
PROBE_POINTER_ENV = "DEVBOX_PROBE_POINTER"
PROBE_HELLO = "probe-hello"  # body: pid, cmd, layers (list[str]), every, framework
PROBE_STATS = "probe-stats"  # body: one ProbeStats
PROBE_CONTROL = "probe-control"  # body: watching (bool)
PROBE_SUBSCRIBE = "probe-subscribe"  # body: nothing yet
PROBE_REQUEST = "probe-request"  # body: one ProbeRequest
PROBE_REPLY = "probe-reply"  # body: one ProbeReply
PROBE_GONE = "probe-gone"  # body: pid
# The release handshake: before a box is released, the agent sends PROBE_RELEASE to every
# process whose hello said `release: true` (it registered probe.on_release or polls
# probe.release_requested); each answers one PROBE_SAVED, or the limit passes.
PROBE_RELEASE = "probe-release"  # body: id, reason, deadline (unix time)
PROBE_SAVED = "probe-saved"  # body: one ProbeSaved
# A PROBE_SAVED's error when the process asked for releases (its link's hello said so) but
# has no way to save: the agent reports it as "no-handler", not as a failed save.
NO_SAVE_HANDLER = "no save handler registered"
# "stacks" is answered by the process's probe thread itself, with every thread's stack:
# it works while the training thread is stuck. Its layer and tensor are "".
PROBE_REQUEST_KINDS = ("histogram", "summary", "save", "stacks")
PROBE_TENSORS = ("activation", "gradient", "weight")
MAX_HISTOGRAM_BINS = 1000


class LayerStats(TypedDict):
    name: str
    act_mean: float | None  # of the layer's output over the batch
    act_std: float | None
    act_absmax: float | None
    act_zeros: float | None  # fraction of exact zeros
    act_dead: float | None  # fraction of output units zero for every sample of the batch
    act_nan: int
    act_inf: int
    grad_norm: float | None  # L2 norm of the layer's own parameters' gradients
    grad_nan: int
    weight_norm: float | None
    update_ratio: float | None  # |w_after - w_before| / |w_before| over one optimizer step


class ProbeAlert(TypedDict):
    kind: str  # "nan", "inf", "exploding", "vanishing", "dead"
    layer: str  # "" when the whole model is meant
    step: int  # the step it was first seen at
    message: str
    pid: NotRequired[int]  # filled in by the agent
    t: NotRequired[float]


class ProbeStats(TypedDict):
    pid: int
    step: int
    t: float
    watched: bool  # False: a heartbeat (alerts only, no layers) while nobody watches
    layers: list[LayerStats]
    alerts: list[ProbeAlert]  # raised at this step


class ProbeRequest(TypedDict):
    id: int
    kind: str  # one of PROBE_REQUEST_KINDS
    layer: str
    tensor: str  # one of PROBE_TENSORS
    bins: NotRequired[int]  # histogram
    pid: NotRequired[int]  # which process; absent: the only one (or the newest)


class ProbeReply(TypedDict):
    id: int
    pid: int
    step: int
    error: NotRequired[str]
    # histogram: counts over [low, high] in len(counts) equal bins
    counts: NotRequired[list[int]]
    low: NotRequired[float]
    high: NotRequired[float]
    # summary
    shape: NotRequired[list[int]]
    dtype: NotRequired[str]
    mean: NotRequired[float | None]
    std: NotRequired[float | None]
    min: NotRequired[float | None]
    max: NotRequired[float | None]
    norm: NotRequired[float | None]
    nan: NotRequired[int]
    inf: NotRequired[int]
    # save: where the tensor was written, inside the box
    path: NotRequired[str]
    # stacks: every thread's Python stack, as a traceback prints it
    stacks: NotRequired[str]


class ProbeSaved(TypedDict):
    id: int
    pid: int
    saved: list[str]  # what the save function returned: paths, or its own words
    error: NotRequired[str]  # the save failed: why, in one line


class SaveResult(TypedDict):
    """One process's part of a release: what `devbox down` and the autoscaler report."""

    pid: int
    cmd: str
    status: str  # one of SAVE_STATUSES
    saved: list[str]
    detail: str  # "" or why (the error, the limit that passed)


SAVE_STATUSES = ("saved", "failed", "timeout", "no-handler")


class _HistoryBody(TypedDict):
    samples: list[Sample]


# --- Typed bodies. A reader takes a frame's body as its TypedDict through these decoders
# only: each checks the frame's type, then every key the TypedDict requires and the type it
# declares for every key present, nested ones too (keys it does not declare are a newer
# peer's and pass), and raises ProtocolError with the first thing wrong. So mypy follows a
# change of a TypedDict into every reader, and a bad peer gets one line, not a KeyError.


def probe_saved(frame: Frame) -> ProbeSaved:
    return cast(ProbeSaved, _checked(frame, PROBE_SAVED, ProbeSaved))


def save_results(value: object) -> list[SaveResult]:
    """What an agent published of a release (a local box's file, a pod's annotation)."""
    try:
        _check(list[SaveResult])(value)
    except _Mismatch as bad:
        raise ProtocolError(f"malformed save results: {bad}") from None
    return cast(list[SaveResult], value)


def sample(frame: Frame) -> Sample:
    return cast(Sample, _checked(frame, SAMPLE, Sample))


def history(frame: Frame) -> list[Sample]:
    return cast(_HistoryBody, _checked(frame, HISTORY, _HistoryBody))["samples"]


def probe_stats(frame: Frame) -> ProbeStats:
    return cast(ProbeStats, _checked(frame, PROBE_STATS, ProbeStats))


def probe_request(frame: Frame) -> ProbeRequest:
    return cast(ProbeRequest, _checked(frame, PROBE_REQUEST, ProbeRequest))


def probe_reply(frame: Frame) -> ProbeReply:
    return cast(ProbeReply, _checked(frame, PROBE_REPLY, ProbeReply))


def alerts(value: object) -> list[ProbeAlert]:
    """The probe's alerts as the agent publishes them for a local box (its alerts file)."""
    try:
        _check(list[ProbeAlert])(value)
    except _Mismatch as bad:
        raise ProtocolError(f"malformed alerts: {bad}") from None
    return cast(list[ProbeAlert], value)


def _checked(frame: Frame, frame_type: str, shape: object) -> dict[str, Any]:
    if frame.type != frame_type:
        raise ProtocolError(f"expected a {frame_type} frame, got {frame.type}")
    try:
        _check(shape)(frame.body)
    except _Mismatch as bad:
        raise ProtocolError(f"malformed {frame_type} frame: {bad}") from None
    return frame.body


class _Mismatch(Exception):
    """Raised deep inside a body; each level on the way out adds its key or index."""

    def __init__(self, problem: str, *path: str) -> None:
        self.problem, self.path = problem, list(path)

    def __str__(self) -> str:
        where = "".join(reversed(self.path)).lstrip(".")
        return f"{where} {self.problem}" if where else self.problem


_Check = Callable[[object], None]
# What each scalar hint admits, by exact type (as Python's json module makes them): true is
# no number. How a value is named in a message is JSON's word for its type.
_SCALARS: dict[object, tuple[tuple[type, ...], str]] = {
    int: ((int,), "an integer"),
    float: ((int, float), "a number"),
    str: ((str,), "a string"),
    bool: ((bool,), "true or false"),
    type(None): ((type(None),), "null"),
}
_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
          type(None): "null", list: "a list", dict: "an object"}  # fmt: skip


def _kind(value: object) -> str:
    return _KINDS.get(type(value), type(value).__name__)


def _scalar(hint: object) -> tuple[tuple[type, ...], str] | None:
    """The exact types a scalar hint (`int`, `float | None`) admits and how to say them;
    None for a list or a TypedDict."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if not all(o in _SCALARS for o in options):
        return None
    admitted = tuple(t for o in options for t in _SCALARS[o][0])
    return admitted, " or ".join(_SCALARS[o][1] for o in options)


@functools.cache
def _check(hint: object) -> _Check:
    """A check of a value against a type of the TypedDicts above, built once per type: the
    TUI checks every sample of every box it shows (about 30 us for one of 8 GPUs)."""
    scalar = _scalar(hint)
    if scalar is not None:
        admitted, expected = scalar

        def one(value: object) -> None:
            if type(value) not in admitted:
                raise _Mismatch(f"is {_kind(value)}, not {expected}")

        return one
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        check_item = _check(item)

        def items(value: object) -> None:
            if type(value) is not list:
                raise _Mismatch(f"is {_kind(value)}, not a list")
            for i, x in enumerate(value):
                try:
                    check_item(x)
                except _Mismatch as bad:
                    bad.path.append(f"[{i}]")
                    raise

        return items
    return _check_typed_dict(hint)


def _check_typed_dict(shape: object) -> _Check:
    hints = typing.get_type_hints(shape, include_extras=True)
    # Under `from __future__ import annotations` Python 3.11 counts NotRequired keys as
    # required in __required_keys__: the hints themselves say which are optional.
    required = frozenset(k for k, h in hints.items() if typing.get_origin(h) is not NotRequired)
    fields = {k: typing.get_args(h)[0] if k not in required else h for k, h in hints.items()}
    # Scalars are checked inline (most keys are), the rest through their own check.
    flat = [(k, s[0]) for k, h in fields.items() if (s := _scalar(h)) is not None]
    nested = [(k, _check(h)) for k, h in fields.items() if _scalar(h) is None]

    def typed_dict(value: object) -> None:
        if type(value) is not dict:
            raise _Mismatch(f"is {_kind(value)}, not an object")
        missing = required - value.keys()
        if missing:
            raise _Mismatch("is missing", f".{min(missing)}")
        for key, admitted in flat:
            if key in value and type(value[key]) not in admitted:
                _at(key, _check(fields[key]), value[key])  # raises, saying what is wrong
        for key, check in nested:
            if key in value:
                _at(key, check, value[key])

    return typed_dict


def _at(key: str, check: _Check, value: object) -> None:
    try:
        check(value)
    except _Mismatch as bad:
        bad.path.append(f".{key}")
        raise


# --- Kubernetes: the labels and annotations through which the backend and an in-cluster
# agent talk (the API server is the channel; no extra port, no CRD).
LABEL_MANAGED = "app.kubernetes.io/managed-by"
MANAGED_BY = "devbox"  # LABEL_MANAGED of all devbox makes: pods, Leases, the homes claim
LABEL_BOX = "devbox.io/box"
LABEL_OWNER = "devbox.io/owner"
LABEL_PROFILE = "devbox.io/profile"
LABEL_STATE = "devbox.io/state"  # "warm" (unclaimed pool pod) or "claimed"
ANN_OWNER_KEY = "devbox.io/owner-key"  # written by the claimer: the one key the agent accepts
# Written by the claimer: the owner's user name as the API server knows it. The admission
# policy (images/k8s/policies.yaml) makes it equal to the user who creates or claims the
# box; LABEL_OWNER is only its selectable encoding (owner_label).
ANN_OWNER_NAME = "devbox.io/owner-name"
ANN_HOST_KEY = "devbox.io/host-key"  # written by the agent: its public host key line
ANN_HOST_KEY_FP = "devbox.io/host-key-fingerprint"
ANN_OWNER_ACK = "devbox.io/owner-ack"  # written by the agent: fingerprint of the key it adopted
ANN_LAST_INPUT = "devbox.io/last-input"  # on the box's Lease: activity, as unix seconds
ANN_CLIENTS = "devbox.io/clients"
ANN_KEEP_UNTIL = "devbox.io/keep-until"  # written by `devbox keep`: unix seconds
# On the box's Lease, with ANN_LAST_INPUT and ANN_CLIENTS: the rest of its Activity.
ANN_LAST_PROBE = "devbox.io/last-probe"
ANN_RUNS = "devbox.io/runs"
ANN_LAST_FORWARD = "devbox.io/last-forward"
ANN_LAST_SFTP = "devbox.io/last-sftp"
ANN_LAST_EXEC = "devbox.io/last-exec"
ANN_GPU_UTIL = "devbox.io/gpu-util"  # absent when the box reports no GPU figure
ANN_CPU = "devbox.io/cpu"
# Written by the autoscaler on the pod (its decisions must outlive it): when it will
# release the box unless it is used (unix seconds), why ("idle" or "lifetime"), and since
# when the agent has been silent. The agent shows a new release-at in the session.
ANN_RELEASE_AT = "devbox.io/release-at"
ANN_RELEASE_REASON = "devbox.io/release-reason"
ANN_UNHEALTHY_SINCE = "devbox.io/unhealthy-since"
ANN_CLAIMED_AT = "devbox.io/claimed-at"  # written by the claimer: unix seconds
ANN_ACK_AT = "devbox.io/owner-ack-at"  # written by the agent with ANN_OWNER_ACK
ANN_ALERTS = "devbox.io/alerts"  # written by the agent: devbox.probe's alerts, alerts_cell()
# On the box's Lease, with the activity: devbox.hang's two times (absent or 0: not now).
ANN_STALLED_SINCE = "devbox.io/stalled-since"
ANN_HUNG_SINCE = "devbox.io/hung-since"
# Written by the agent on its pod as it ends: what its probed processes saved, a JSON
# list of SaveResult (`devbox down` prints it).
ANN_SAVED = "devbox.io/saved"
SSH_PORT = 2222  # the agent's port inside a pod; reached only through port-forward
# Events the agent posts on its pod when something is refused (an owner key changed after
# the claim): the reason, as `kubectl get events` shows it.
EVENT_OWNER_KEY_REFUSED = "OwnerKeyChangeRefused"
EVENT_OWNER_REFUSED = "OwnerRefused"  # the owner's home or uid is not theirs to take
OWNER_HASH_CHARS = 10  # 40 bits of sha256: no two users of one cluster share a label


def owner_label(username: str) -> str:
    """A label value that names one user only: a readable part and a hash of the whole name.

    Label values are 63 characters of [A-Za-z0-9._-], so the readable part alone would
    make `jürgen` and `jörgen` one owner (and every CJK name another); the hash keeps
    them apart, the readable part keeps `kubectl get pods -L devbox.io/owner` useful."""
    import hashlib  # here, not at import: loading OpenSSL is a tenth of a light command

    folded = unicodedata.normalize("NFKD", username).encode("ascii", "ignore").decode()
    readable = re.sub(r"[^a-z0-9]+", "-", folded.lower()).strip("-")[:40].strip("-")
    digest = hashlib.sha256(username.encode()).hexdigest()[:OWNER_HASH_CHARS]
    return f"{readable}-{digest}" if readable else f"u-{digest}"


def home_folder(username: str) -> str:
    """A user's folder on the shared homes volume: the name itself, with only `%` and `/`
    escaped, behind a prefix that no `.` or `..` can be. One-to-one, and simple enough
    that the admission policy computes it in CEL from the requester's name."""
    return "u-" + username.replace("%", "%25").replace("/", "%2F")


def last_use(activity: Activity) -> float:
    """When a person last used the box over SSH, by any signal the agent reports: a
    terminal's keys, a command, port-forward, SFTP or command-input traffic (0: never)."""
    return max(
        activity["last_input"],
        activity.get("last_forward", 0.0),
        activity.get("last_sftp", 0.0),
        activity.get("last_exec", 0.0),
    )


def activity_annotations(activity: Activity) -> dict[str, str]:
    """The Lease annotations that carry a box's activity (the agent writes them)."""
    out = {
        ANN_LAST_INPUT: f"{activity['last_input']:.3f}",
        ANN_CLIENTS: str(activity["clients"]),
        ANN_LAST_PROBE: f"{activity.get('last_probe', 0.0):.3f}",
        ANN_RUNS: str(activity.get("runs", 0)),
    }
    out[ANN_LAST_FORWARD] = f"{activity.get('last_forward', 0.0):.3f}"
    out[ANN_LAST_SFTP] = f"{activity.get('last_sftp', 0.0):.3f}"
    out[ANN_LAST_EXEC] = f"{activity.get('last_exec', 0.0):.3f}"
    for key, name in ((ANN_GPU_UTIL, "gpu_util"), (ANN_CPU, "cpu")):
        value = activity.get(name)
        if isinstance(value, int | float):
            out[key] = f"{value:.1f}"
    out[ANN_STALLED_SINCE] = f"{activity.get('stalled_since', 0.0):.3f}"
    out[ANN_HUNG_SINCE] = f"{activity.get('hung_since', 0.0):.3f}"
    return out


def activity_from_annotations(ann: dict[str, str]) -> Activity | None:
    """Inverse of activity_annotations; None when the agent has not reported (or a value
    was edited into something that is not a number)."""
    if ANN_LAST_INPUT not in ann:
        return None
    try:
        activity: Activity = {
            "last_input": float(ann[ANN_LAST_INPUT]),
            "clients": int(ann.get(ANN_CLIENTS, "0")),
            "last_probe": float(ann.get(ANN_LAST_PROBE, "0")),
            "runs": int(ann.get(ANN_RUNS, "0")),
            "gpu_util": float(ann[ANN_GPU_UTIL]) if ANN_GPU_UTIL in ann else None,
            "cpu": float(ann[ANN_CPU]) if ANN_CPU in ann else None,
            "last_forward": float(ann.get(ANN_LAST_FORWARD, "0")),
            "last_sftp": float(ann.get(ANN_LAST_SFTP, "0")),
            "last_exec": float(ann.get(ANN_LAST_EXEC, "0")),
            "stalled_since": float(ann.get(ANN_STALLED_SINCE, "0")),
            "hung_since": float(ann.get(ANN_HUNG_SINCE, "0")),
        }
    except ValueError:
        return None
    return activity


def alerts_cell(alerts: list[ProbeAlert]) -> str:
    """Model alerts as one word for `devbox ls`: the first as kind:layer, and how many more
    ("nan:fc2(+3)"); "" when there are none."""
    if not alerts:
        return ""
    first = alerts[0]
    text = first["kind"] + (f":{first['layer']}" if first["layer"] else "")
    return text + (f"(+{len(alerts) - 1})" if len(alerts) > 1 else "")


def fingerprint(public_line: str) -> str:
    """OpenSSH's SHA256 fingerprint of a public key line ("SHA256:..." as ssh-keygen -l)."""
    import hashlib  # see owner_label

    blob = base64.b64decode(public_line.split()[1])
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    return f"SHA256:{digest}"
