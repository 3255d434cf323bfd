"""A Feed that makes up boxes and telemetry, deterministically: for snapshot tests and the
TUI benchmark (50 boxes x 8 GPUs at 10 Hz), where real agents would be too many for the
machine or too variable for a picture."""

from __future__ import annotations

import asyncio
import builtins
import math
from collections.abc import AsyncIterator

from devbox import protocol
from devbox.boxes import Box, BoxSpec, BoxState
from devbox.errors import DevboxError
from devbox.protocol import (
    BoxProcess,
    GpuSample,
    HostSample,
    ProbeRequest,
    ProbeStats,
    Sample,
    SaveResult,
)
from devbox.runs.record import Run

GIB = 1 << 30
T0 = 1_800_000_000.0  # a fixed "now" for pictures


def make_box(i: int, gpus: int, *, now: float = T0) -> Box:
    return Box(
        name=f"box-{i:02d}",
        owner="ada",
        backend="local",
        spec=BoxSpec(gpus=gpus),
        state=BoxState.RUNNING,
        created_at=now - 3600 - 60 * i,
        last_activity=now - 30 * i,
    )


def sample(box: int, gpus: int, seq: int, *, t: float, processes: int = 5) -> Sample:
    gpu_list: list[GpuSample] = []
    for g in range(gpus):
        phase = seq / 10 + box + g
        util = round(50 + 45 * math.sin(phase), 1)
        gpu_list.append(
            {
                "index": g,
                "uuid": f"GPU-{box:02d}-{g}",
                "name": "Simulated H100",
                "lost": False,
                "util": util,
                "mem_util": util / 2,
                "mem_used": int((20 + g) * GIB),
                "mem_total": 80 * GIB,
                "power_w": 200 + 4 * util,
                "power_limit_w": 700.0,
                "temp_c": 40 + util / 3,
                "sm_clock_mhz": 1980,
                "pcie_tx_kbs": 1000,
                "pcie_rx_kbs": 2000,
                "ecc_corrected": 0,
                "ecc_uncorrected": 0,
                "processes": [
                    {
                        "pid": 1000 + g,
                        "box_pid": 1000 + g,
                        "kind": "compute",
                        "mem_used": 18 * GIB,
                        "sm_util": util,
                        "mem_util": util / 2,
                    }
                ],
            }
        )
    host: HostSample = {
        "cpu": [25.0, 75.0],
        "load1": 1.5,
        "mem_used": 12 * GIB,
        "mem_total": 64 * GIB,
        "swap_used": 0,
        "disk_read_bps": 0.0,
        "disk_write_bps": 1024.0,
        "net_rx_bps": 2048.0,
        "net_tx_bps": 512.0,
    }
    procs: list[BoxProcess] = [
        {
            "pid": 1000 + p,
            "ppid": 1,
            "name": "python",
            "cmdline": f"python train.py --shard {p}",
            "user": "ada",
            "cpu": 100.0 - p,
            "rss": (2 + p) * GIB,
            "threads": 8,
        }
        for p in range(processes)
    ]
    return {"t": t, "seq": seq, "gpus": gpu_list, "host": host, "processes": procs}


LAYERS = 6


def probe_stats(pid: int, step: int, nan_at: int | None) -> ProbeStats:
    poisoned = nan_at is not None and step >= nan_at
    layers = []
    for i in range(LAYERS):
        wave = math.sin(step / 50 + i)
        layers.append(
            {
                "name": f"layer{i}",
                "act_mean": None if poisoned else round(0.1 * wave, 4),
                "act_std": None if poisoned else 1.0 + i / 10,
                "act_absmax": None if poisoned else 3.0 + i,
                "act_zeros": 0.5 if i % 2 else 0.0,
                "act_dead": 0.0,
                "act_nan": 64 if poisoned else 0,
                "act_inf": 0,
                "grad_norm": None if poisoned else round(1.0 + 0.5 * wave, 4),
                "grad_nan": 1 if poisoned else 0,
                "weight_norm": 10.0 + i,
                "update_ratio": 1e-3,
            }
        )
    alerts = (
        [{"kind": "nan", "layer": "layer0", "step": step, "message": f"NaN in layer0 at {step}"}]
        if poisoned and step == nan_at
        else []
    )
    return {
        "pid": pid,
        "step": step,
        "t": T0 + step,
        "watched": True,
        "layers": layers,  # type: ignore[typeddict-item]
        "alerts": alerts,  # type: ignore[typeddict-item]
    }


class SyntheticFeed:
    """`boxes` boxes of `gpus` GPUs each, streaming at whatever rate is asked."""

    def __init__(
        self,
        boxes: int = 3,
        gpus: int = 2,
        *,
        history: int = 60,
        live: bool = True,
        still: bool = False,
    ) -> None:
        self.live = live  # False: one sample after the history, then silence (pictures)
        # True: every sample carries the same values (only its time and sequence number
        # advance), as an idle lab's GPUs at rest: the benchmark's "nothing changing".
        self.still = still
        self.box_list = [make_box(i, gpus) for i in range(boxes)]
        # What boxes() could not read (a cluster down), as a backend's problems() says.
        self.problem_list: list[str] = []
        self.gpus = gpus
        self.history = history
        self.entered: list[str] = []
        self.attached: list[tuple[str, str]] = []
        # Per box: its runs (two made-up ones each) and how many are running, as the
        # agent's activity counts them; tests change both to end a run.
        self.box_runs = {b.name: make_runs(b.name) for b in self.box_list}
        self.running: dict[str, int] = {b.name: 1 for b in self.box_list}
        self.fail_next_stream: set[str] = set()  # fault injection for reconnect tests
        self.nan_at: int | None = None  # the model's statistics go NaN from this step on
        self.requests: list[ProbeRequest] = []  # what the model screen asked for
        self.saved: dict[str, list[SaveResult]] = {}  # per box: what a release reports saved
        self.hung: dict[str, float] = {}  # per box: since when its agent judges it hung

    async def boxes(self) -> builtins.list[Box]:
        return list(self.box_list)

    def problems(self) -> builtins.list[str]:
        return list(self.problem_list)

    async def stream(self, box: Box, *, rate: float) -> AsyncIterator[protocol.Frame]:
        index = sum(map(ord, box.name)) % 50
        old = [
            sample(index, self.gpus, 0 if self.still else s, t=T0 - self.history + s)
            for s in range(self.history)
        ]
        yield protocol.Frame(protocol.HISTORY, {"samples": old})
        seq = self.history
        while True:
            if box.name in self.fail_next_stream:
                self.fail_next_stream.discard(box.name)
                raise DevboxError(f"lost the connection to box {box.name}: injected")
            t = T0 + (seq - self.history) / rate  # the first live sample is at T0
            body = dict(sample(index, self.gpus, 0 if self.still else seq, t=t))
            body["seq"] = seq
            body["activity"] = {
                "clients": 0,
                "last_input": T0 - 60,
                "last_probe": 0.0,
                "runs": self.running.get(box.name, 0),
                "hung_since": self.hung.get(box.name, 0.0),
            }
            yield protocol.Frame(protocol.SAMPLE, body)
            seq += 1
            if not self.live:
                await asyncio.Event().wait()
            await asyncio.sleep(1.0 / rate)

    async def claim(self, spec: BoxSpec, *, name: str | None, backend: str | None) -> Box:
        box = make_box(len(self.box_list), spec.gpus)
        if name is not None:
            box = Box(**{**box.__dict__, "name": name})
        self.box_list.append(box)
        return box

    async def release(self, box: Box) -> list[SaveResult]:
        self.box_list = [b for b in self.box_list if b.name != box.name]
        return list(self.saved.get(box.name, []))

    async def keep(self, box: Box, *, until: float) -> Box:
        kept = Box(**{**box.__dict__, "keep_until": until})
        self.box_list = [kept if b.name == box.name else b for b in self.box_list]
        return kept

    def enter_argv(self, box: Box) -> builtins.list[str]:
        self.entered.append(box.name)
        return ["true"]

    async def runs(self, box: Box) -> builtins.list[Run]:
        return list(self.box_runs.get(box.name, []))

    async def run_log(self, box: Box, run_id: str) -> str:
        return f"\x1b[1mrun {run_id}\x1b[0m on {box.name}\r\nepoch 1\r\nstep 50%\rstep 100%\r\n"

    def attach_argv(self, box: Box, run_id: str) -> builtins.list[str]:
        self.attached.append((box.name, run_id))
        return ["true"]

    async def probe(
        self, box: Box, *, outbox: asyncio.Queue[ProbeRequest]
    ) -> AsyncIterator[protocol.Frame]:
        """One training process with LAYERS layers; NaN from step `self.nan_at` on; each
        histogram request answered by the next report."""
        pid = 4242
        layers = [f"layer{i}" for i in range(LAYERS)]
        info = {
            "pid": pid,
            "cmd": "python train.py",
            "layers": layers,
            "every": 10,
            "framework": "torch",
        }
        yield protocol.Frame(protocol.HELLO, {"box": box.name, "processes": [info], "alerts": []})
        step = 0
        while True:
            while not outbox.empty():
                request = outbox.get_nowait()
                self.requests.append(request)
                counts = [(step + b) % 7 for b in range(int(request.get("bins", 30)))]
                reply = {"id": request["id"], "pid": pid, "step": step, "counts": counts}
                yield protocol.Frame(protocol.PROBE_REPLY, {**reply, "low": -1.0, "high": 1.0})
            yield protocol.Frame(protocol.PROBE_STATS, dict(probe_stats(pid, step, self.nan_at)))
            step += 10
            if not self.live:
                await asyncio.Event().wait()  # one report, then silence (pictures)
            await asyncio.sleep(0.05)


def make_runs(box: str) -> list[Run]:
    return [
        Run(id="a1b2", box=box, command="python train.py --lr 3e-4", cwd="/home/ada/proj",
            created_at=T0 - 7200, started_at=T0 - 7199, ended_at=T0 - 3600, exit_code=0,
            git_commit="0123456789abcdef", git_dirty=False, gpus="0", state="done"),
        Run(id="c3d4", box=box, command="python train.py --lr 1e-3", cwd="/home/ada/proj",
            created_at=T0 - 600, started_at=T0 - 599, git_commit="0123456789abcdef",
            git_dirty=True, gpus="0", state="running"),
    ]  # fmt: skip
