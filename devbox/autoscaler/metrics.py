"""Prometheus metrics of the autoscaler, in the text exposition format, written by hand:
a dozen series do not justify a dependency, and the format is small and stable."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from devbox.autoscaler import policy

if TYPE_CHECKING:
    from devbox.autoscaler.world import Snapshot

LATENCY_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
# Statuses whose GPUs count as wasted: nobody has used the box for policy.IDLE_AFTER.
_IDLE = ("idle", "warned", "releasing", "deferred")
_STATUSES = (
    "busy",
    "idle",
    "hung",
    "warned",
    "kept",
    "new",
    "unhealthy",
    "releasing",
    "deferred",
)
# A hung box's GPU-hours are their own series, never also idle GPU-hours: a hung box is
# not one nobody uses (a job holds its GPUs and looks busy to every state signal), it is
# one whose job is stuck, and the cure differs (the user's code, NCCL, hung_grace; for
# idle hours: idle_timeout, keep habits). Kept apart, each series says what it says and
# their sum is still the GPUs wasted. A GPU-hour goes to one of them at most: a hung box
# warned for idleness counts as hung.


def _labels(**labels: str | int) -> str:
    if not labels:
        return ""
    inner = ",".join(
        f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in sorted(labels.items())
    )
    return "{" + inner + "}"


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.boxes: dict[str, int] = dict.fromkeys(_STATUSES, 0)
        self.idle_gpu_hours = 0.0
        self.hung_gpus = 0
        self.hung_gpu_hours = 0.0
        self.releases: dict[str, int] = {}
        self.warnings = 0
        self.warm: dict[tuple[str, int], int] = {}
        self.warm_removed: dict[str, int] = {"yield": 0, "stale": 0}
        self.gpu_pending = 0
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.passes = 0
        self.pass_failures = 0
        self.action_failures = 0
        self.pass_seconds = 0.0

    def update(
        self,
        decision: policy.Decision,
        applied: Sequence[policy.Action],
        snap: Snapshot,
        *,
        since_last: float,
        pass_seconds: float,
        failed: int,
    ) -> None:
        with self._lock:
            counts = dict.fromkeys(_STATUSES, 0)
            hung_gpus = 0
            for v in decision.verdicts:
                counts[v.status] = counts.get(v.status, 0) + 1
                # Hung as the (healthy) agent reports it, whatever the verdict: kept,
                # warned and reported-only hung boxes hold stuck GPUs too.
                if v.hung_since:
                    hung_gpus += v.gpus
                    self.hung_gpu_hours += v.gpus * since_last / 3600
                elif v.status in _IDLE:
                    self.idle_gpu_hours += v.gpus * since_last / 3600
            self.boxes = counts
            self.hung_gpus = hung_gpus
            for action in applied:
                if isinstance(action, policy.Release):
                    self.releases[action.reason] = self.releases.get(action.reason, 0) + 1
                elif isinstance(action, policy.Warn):
                    self.warnings += 1
                elif isinstance(action, policy.Yield):
                    self.warm_removed["yield"] += 1
                elif isinstance(action, policy.DropStale):
                    self.warm_removed["stale"] += 1
            self.warm = dict(snap.warm)
            self.gpu_pending = len(snap.pending)
            for seconds in snap.claim_latencies:
                self.latency_sum += seconds
                slot = next(
                    (i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS)
                )
                self.latency_counts[slot] += 1
            self.passes += 1
            self.action_failures += failed
            self.pass_seconds = pass_seconds

    def pass_failed(self) -> None:
        with self._lock:
            self.pass_failures += 1

    def render(self) -> str:
        with self._lock:
            out: list[str] = []

            def series(name: str, kind: str, help_: str, rows: list[tuple[str, float]]) -> None:
                out.append(f"# HELP {name} {help_}")
                out.append(f"# TYPE {name} {kind}")
                out.extend(f"{name}{labels} {value:g}" for labels, value in rows)

            series(
                "devbox_boxes",
                "gauge",
                "Boxes by the autoscaler's verdict.",
                [(_labels(status=s), n) for s, n in sorted(self.boxes.items())],
            )
            series(
                "devbox_idle_gpu_hours_total",
                "counter",
                f"GPU-hours held by boxes idle for over {policy.IDLE_AFTER:g}s.",
                [("", self.idle_gpu_hours)],
            )
            series(
                "devbox_hung_gpus",
                "gauge",
                "GPUs of boxes their agents report hung (devbox.hang), at the last pass.",
                [("", self.hung_gpus)],
            )
            series(
                "devbox_hung_gpu_hours_total",
                "counter",
                "GPU-hours held by boxes their agents report hung (not in the idle series).",
                [("", self.hung_gpu_hours)],
            )
            series(
                "devbox_releases_total",
                "counter",
                "Boxes released, by reason.",
                [(_labels(reason=r), n) for r, n in sorted(self.releases.items())],
            )
            series("devbox_warnings_total", "counter", "Release warnings.", [("", self.warnings)])
            series(
                "devbox_warm_pool_pods",
                "gauge",
                "Unclaimed warm pods, by profile and GPU count.",
                [(_labels(profile=p, gpus=g), n) for (p, g), n in sorted(self.warm.items())],
            )
            series(
                "devbox_warm_pods_removed_total",
                "counter",
                "Unclaimed warm pods deleted: yielded to pending GPU work, or of a stale shape.",
                [(_labels(reason=r), n) for r, n in sorted(self.warm_removed.items())],
            )
            series(
                "devbox_gpu_pending_pods",
                "gauge",
                "Pods the scheduler could not place for lack of GPUs, at the last pass.",
                [("", self.gpu_pending)],
            )
            cumulative, rows = 0, []
            for bound, count in zip(
                (*(f"{b:g}" for b in LATENCY_BUCKETS), "+Inf"), self.latency_counts, strict=True
            ):
                cumulative += count
                rows.append((_labels(le=bound), float(cumulative)))
            out.append("# HELP devbox_claim_latency_seconds From claim to the agent serving.")
            out.append("# TYPE devbox_claim_latency_seconds histogram")
            out.extend(f"devbox_claim_latency_seconds_bucket{lb} {v:g}" for lb, v in rows)
            out.append(f"devbox_claim_latency_seconds_sum {self.latency_sum:g}")
            out.append(f"devbox_claim_latency_seconds_count {cumulative}")
            series(
                "devbox_reconcile_passes_total", "counter", "Reconcile passes.", [("", self.passes)]
            )
            series(
                "devbox_reconcile_failures_total",
                "counter",
                "Passes that failed.",
                [("", self.pass_failures)],
            )
            series(
                "devbox_action_failures_total",
                "counter",
                "Actions that failed.",
                [("", self.action_failures)],
            )
            series(
                "devbox_reconcile_seconds",
                "gauge",
                "Duration of the last pass.",
                [("", self.pass_seconds)],
            )
            return "\n".join(out) + "\n"


def serve(metrics: Metrics, *, address: str, port: int) -> ThreadingHTTPServer:
    """Serve /metrics in a daemon thread; returns the server (its port, when 0 was asked)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = metrics.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a scrape every 15 s is not news

    server = ThreadingHTTPServer((address, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
