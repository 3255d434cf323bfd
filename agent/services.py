"""What the agent serves besides shells, built once before the SSH server: the activity
record, the telemetry sampler, the probe hub, and the tasks that run them. The server and
the pod binding are handed these; none of them builds or replaces one later."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.activity import Activity
from agent.probehub import ProbeHub
from agent.runs import note as note_runs
from agent.tasks import Tasks
from agent.telemetry import Telemetry
from devbox import hang, private, protocol

log = logging.getLogger("devbox.agent")


@dataclass(frozen=True, kw_only=True)
class AgentServices:
    activity: Activity
    telemetry: Telemetry
    # None when its socket could not be made: the box still serves SSH and telemetry.
    probe_hub: ProbeHub | None
    tasks: Tasks

    async def close(self) -> None:
        await self.tasks.close()
        if self.probe_hub is not None:
            await self.probe_hub.close()


async def build(
    *,
    box: str,
    home: Path,
    gpu_uuids: list[str] | None,
    all_processes: bool,
    telemetry_rate: float,
    activity_file: Path | None,
    probe_socket: Path | None,
    alerts_file: Path | None,
    hang_rule: hang.Rule,
    runs_dir: Callable[[], Path] | None = None,
    keeper_pid: int | None = None,
) -> AgentServices:
    """The services of the box `box`. gpu_uuids None: every GPU this process sees is the
    box's (in a pod the device plugin chose them); all_processes: telemetry shows every
    process visible, not only the agent's and its sessions'; runs_dir: where `devbox run`
    records its runs (asked each time: a warm pod's home is known only once claimed);
    keeper_pid: the local box's keeper, of which every process of the box descends."""
    activity = Activity(activity_file, rule=hang_rule)
    telemetry = _telemetry(
        box,
        activity,
        gpu_uuids=gpu_uuids,
        all_processes=all_processes,
        rate=telemetry_rate,
        runs_dir=runs_dir,
        keeper_pid=keeper_pid,
    )
    activity.on_use = telemetry.hurry
    return AgentServices(
        activity=activity,
        telemetry=telemetry,
        probe_hub=await _probe_hub(
            box, activity, home=home, path=probe_socket, alerts_file=alerts_file
        ),
        tasks=Tasks(),
    )


def _telemetry(
    box: str,
    activity: Activity,
    *,
    gpu_uuids: list[str] | None,
    all_processes: bool,
    rate: float,
    runs_dir: Callable[[], Path] | None,
    keeper_pid: int | None,
) -> Telemetry:
    from agent.sampling import BoxSources  # NVML and /proc: opened in the sampler's thread

    def on_sample(sample: protocol.Sample) -> None:
        if runs_dir is not None:
            note_runs(activity, runs_dir)  # before observe: a run keeps the box unquiet
        activity.observe(sample)

    return Telemetry(
        box=box,
        base_rate=rate,
        activity=activity.snapshot,
        on_sample=on_sample,
        quiet=activity.quiet,
        open_sources=lambda: BoxSources(
            gpu_uuids=gpu_uuids,
            # Under a keeper (a subreaper) the box's processes are exactly its descendants,
            # a daemonised screen server and orphans too: no stranger's environment need
            # be read to tell, nor any stranger looked at (agent.host's tree).
            root_pid=os.getpid() if keeper_pid is None else keeper_pid,
            box_marker=(protocol.BOX_ENV, box) if keeper_pid is None else None,
            tree=keeper_pid is not None,
            all_processes=all_processes,
        ),
    )


async def _probe_hub(
    box: str, activity: Activity, *, home: Path, path: Path | None, alerts_file: Path | None
) -> ProbeHub | None:
    """Start the probe hub; a box without one still serves SSH and telemetry."""
    # Short (Unix socket paths are at most 107 bytes) and private to this agent: a 0700
    # folder of its own, so that only the box's owner can connect.
    path = path or Path(tempfile.mkdtemp(prefix=protocol.PROBE_FOLDER_PREFIX)) / "probe.sock"
    hub = ProbeHub(box=box, path=path, on_batch=activity.probe, alerts_file=alerts_file)
    try:
        await hub.start()
        # For processes not started from one of the agent's sessions: devbox.probe looks here.
        pointer = home / protocol.PROBE_POINTER_FILE
        pointer.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _remove_dead_probe_folder(pointer, keep=path)
        private.write_text(pointer, f"{path}\n")
    except OSError as exc:
        log.error("no probe hub: %s", exc)
        return None
    return hub


def _remove_dead_probe_folder(pointer: Path, *, keep: Path) -> None:
    """The socket folder of the agent before this one on the box (killed, it could not clean
    up): one empty folder in /tmp per crash otherwise. Not while something still listens."""
    try:
        old = Path(pointer.read_text().strip())
    except (OSError, ValueError):
        return
    if old == keep:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(old))
        except OSError:
            private.remove_own_temp_folder(old.parent, protocol.PROBE_FOLDER_PREFIX)
