"""`devbox stats` as text: a telemetry sample rendered for a terminal. Pure: no I/O.

A value the box did not report prints as "-", never as 0.
"""

from __future__ import annotations

import time

from devbox.protocol import BoxProcess, GpuSample, Sample
from devbox.units import MISSING, num, pct, rate, size, table


def _gpu_row(g: GpuSample) -> list[str]:
    if g["lost"]:
        return [str(g["index"]), g["name"], "LOST", "", "", "", "", "", "", ""]
    used, total = g["mem_used"], g["mem_total"]
    memory = f"{size(used)} / {size(total)}"
    power = f"{num(g['power_w'], '')} / {num(g['power_limit_w'], ' W')}"
    pcie = (
        MISSING
        if g["pcie_tx_kbs"] is None and g["pcie_rx_kbs"] is None
        else f"{rate(_kb(g['pcie_tx_kbs']))} / {rate(_kb(g['pcie_rx_kbs']))}"
    )
    ecc = (
        MISSING
        if g["ecc_corrected"] is None and g["ecc_uncorrected"] is None
        else f"{num(g['ecc_corrected'], '')} / {num(g['ecc_uncorrected'], '')}"
    )
    return [
        str(g["index"]),
        g["name"],
        pct(g["util"]),
        pct(g["mem_util"]),
        memory,
        power,
        num(g["temp_c"], " C"),
        num(g["sm_clock_mhz"], " MHz"),
        pcie,
        ecc,
    ]


def _kb(value: int | None) -> float | None:
    return None if value is None else value * 1024.0


def render(box: str, sample: Sample, *, top: int = 10) -> str:
    host = sample["host"]
    cpu = host["cpu"]
    avg = sum(cpu) / len(cpu) if cpu else None
    clock = time.strftime("%H:%M:%S", time.localtime(sample["t"]))
    lines = [
        f"box {box}  {len(sample['gpus'])} GPU(s)  sample {sample['seq']} at {clock}",
        f"host  cpu {pct(avg)} of {len(cpu)} cores  load {num(host['load1'], '', '.2f')}  "
        f"mem {size(host['mem_used'])} / {size(host['mem_total'])}  "
        f"disk r {rate(host['disk_read_bps'])} w {rate(host['disk_write_bps'])}  "
        f"net rx {rate(host['net_rx_bps'])} tx {rate(host['net_tx_bps'])}",
        "",
    ]
    if sample["gpus"]:
        head = ["GPU", "NAME", "UTIL", "MEM-UTIL", "MEMORY", "POWER", "TEMP", "SM CLOCK"]
        lines += table(
            [[*head, "PCIE TX / RX", "ECC CORR / UNCORR"]] + [_gpu_row(g) for g in sample["gpus"]],
            right=(2, 3),
        )
        procs = [(g["index"], p) for g in sample["gpus"] for p in g["processes"]]
        if procs:
            names = {p["pid"]: p["cmdline"] or p["name"] for p in sample["processes"]}
            rows = [["GPU", "PID", "BOX PID", "KIND", "GPU MEMORY", "SM", "COMMAND"]]
            for index, p in procs:
                box_pid = p["box_pid"]
                rows.append(
                    [
                        str(index),
                        str(p["pid"]),
                        MISSING if box_pid is None else str(box_pid),
                        p["kind"],
                        size(p["mem_used"]),
                        pct(p["sm_util"]),
                        names.get(box_pid, MISSING) if box_pid is not None else MISSING,
                    ]
                )
            lines += ["", *table(rows, right=(1, 2, 4, 5))]
    else:
        lines.append("no GPUs in this box")
    lines += ["", *_processes(sample["processes"], top)]
    return "\n".join(lines) + "\n"


def _processes(processes: list[BoxProcess], top: int) -> list[str]:
    busiest = sorted(processes, key=lambda p: (p["cpu"] or 0.0, p["rss"] or 0), reverse=True)
    rows = [["PID", "USER", "CPU", "RSS", "THREADS", "COMMAND"]]
    for p in busiest[:top]:
        rows.append(
            [
                str(p["pid"]),
                p["user"] or MISSING,
                pct(p["cpu"]),
                size(p["rss"]),
                num(p["threads"], ""),
                (p["cmdline"] or p["name"])[:80],
            ]
        )
    noun = "process" if len(processes) == 1 else "processes"
    title = f"{len(processes)} {noun} in the box" + (
        f", the {top} busiest:" if len(processes) > top else ":"
    )
    return [title, *table(rows, right=(0, 2, 3, 4))]
