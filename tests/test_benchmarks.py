"""The benchmark scripts run and print the JSON they promise (tiny sizes; no timing asserts)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = pytest.mark.skipif(
    shutil.which("sshd") is None and not Path("/usr/sbin/sshd").exists(),
    reason="the benchmarks' peer is OpenSSH's sshd (apt-get install openssh-server)",
)


def _run(
    script: str, *args: str, tmp: Path | None = None, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Runs a benchmark; with `tmp`, as its TMPDIR (to see what it leaves behind)."""
    env = None if tmp is None else {**os.environ, "TMPDIR": str(tmp)}
    if extra_env:
        env = {**(env or os.environ), **extra_env}
    out = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=BENCH,
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_throughput_benchmark() -> None:
    result = _run("bench_throughput.py", "--mib", "4", "--repeat", "1")
    ratios = result["ratios_vs_sshd"]
    assert set(ratios) == {
        "agent_direct_upload_ratio",
        "agent_direct_download_ratio",
        "agent_via_proxycommand_upload_ratio",
        "agent_via_proxycommand_download_ratio",
    }
    assert all(r > 0 for r in ratios.values())
    # Like for like: the peer pinned to the agent's key exchange, and each server's defaults.
    same = result["modes"]["same_kex"]["negotiated"]
    assert same["agent"]["kex"] == same["sshd"]["kex"]
    assert len(result["met"]) == 8 and all("met" in m for m in result["met"].values())
    cpu = result["modes"]["defaults"]["cpu_of_exec_takes"]["agent_exec_download"]
    # /proc counts CPU time in 10 ms ticks: a 4 MiB copy may round to none.
    assert cpu["server_cpu_ms_per_MiB"] >= 0 and cpu["client_cpu_ms_per_MiB"] >= 0


def test_startup_benchmark() -> None:
    result = _run("bench_startup.py", "--runs", "1", "--modes", "bytecode")
    mode = result["modes"]["bytecode"]
    assert mode["seconds"]["up_then_ssh_true"]["n"] == 1
    assert mode["devbox_ssh_over_openssh"] > 0 and mode["help_over_python_pass"] > 0
    assert set(mode["met"]) == {"up_then_ssh_true_median_s", "devbox_ssh_over_openssh"}
    assert result["machine_before"]["cpus"] >= 1


def test_echo_benchmark() -> None:
    result = _run("bench_echo.py", "--keys", "40", "--load", "1")
    assert result["agent"]["n"] == 40 and result["sshd"]["n"] == 40
    assert result["busy_processes"] == 1 and "met" in result["met"]["agent_added_p99_ms"]


def test_telemetry_benchmark() -> None:
    result = _run("bench_telemetry.py", "--seconds", "2", "--procs", "10", "--gpus", "2")
    assert set(result["runs"]) == {"1hz", "10hz"}
    for run in result["runs"].values():
        assert run["frames"] >= 1 and run["agent_cpu_pct_of_one_core"] >= 0
        assert run["peers"]["floor"]["cpu_pct_of_one_core"] > 0
        assert run["latency_ms"]["n"] == run["frames"]
        assert run["processes_in_last_sample"] >= 10  # the ones started in the box, and it
    assert set(result["met"]) == {"agent_cpu_pct_at_1hz", "agent_over_floor_at_1hz"}
    assert result["met"]["agent_cpu_pct_at_1hz"]["target"] == 1.0


def test_idle_benchmark() -> None:
    result = _run("bench_idle.py", "--seconds", "1", "--windows", "1", "--settle", "0")
    assert set(result["sets"]) == {"idle", "sshd"}
    box = [p["comm"] for p in result["sets"]["idle"]["processes"]]
    # The keeper and the agent (both python), screen's server and the shell in it.
    assert sorted(box) == ["bash", "python", "python", "screen"]
    assert sorted(p["comm"] for p in result["sets"]["sshd"]["processes"]) == [
        "bash",
        "screen",
        "sshd",
    ]
    for s in result["sets"].values():
        assert s["total"]["pss_mib"] > 0 and s["total"]["wakeups_per_min"] >= 0
    assert set(result["met"]) == {"idle_box_pss_mib", "idle_box_cpu_pct_of_one_core"}
    floor = result["floor"]
    assert 0 < floor["keeper_python_I_S_pss_mib"] < floor["agent_import_asyncssh_pss_mib"]
    assert floor["box_pss_mib"] > floor["agent_import_asyncssh_pss_mib"]


def test_tui_benchmark() -> None:
    result = _run(
        "bench_tui.py", "--boxes", "3", "--gpus", "2", "--seconds", "1", "--settle", "0.5",
        "--runs", "1", "--load", "1",
    )  # fmt: skip
    assert result["benchmark"] == "tui" and set(result["met"]) == {
        "stream_cpu_pct_of_one_core",
        "still_cpu_pct_of_one_core",
        "idle_cpu_pct_of_one_core",
        "key_on_screen_p99_ms",
        "key_load_runnable_tasks_mean",
    }
    assert all(isinstance(m["met"], bool) for m in result["met"].values())
    tui, floors = result["tui"], result["floors"]
    for kind in ("stream", "still", "idle", "keys"):
        assert tui[kind]["cpu_pct_of_one_core"] >= 0 and len(tui[kind]["cpu_pct_runs"]) == 1
    assert tui["stream"]["frames_per_s"] > 0 and tui["stream"]["lines_per_frame"] > 0
    keys = tui["keys"]
    for key in ("p50", "p99", "max"):
        assert keys["key_on_screen_ms"][key] >= keys["key_handled_ms"][key] >= 0
    assert keys["key_on_screen_ms"]["n"] > 0 and keys["busy_processes"] == 1
    for kind in ("intake", "textual", "rich_live", "textual_keys", "sched"):
        assert floors[kind]["cpu_pct_of_one_core"] > 0
    assert floors["textual_keys"]["key_on_screen_ms"]["n"] > 0
    assert floors["sched"]["late_ms"]["n"] > 0 and floors["sched"]["demand_pct"] > 0
    assert result["machine_before"]["cpus"] and result["machine_after"]["cpus"]


def test_run_benchmark() -> None:
    # installed: devbox as `pip install .` leaves it, its box helpers under that venv's Python
    result = _run("bench_run.py", "--runs", "1", "--files", "50", "--modes", "installed")
    assert result["benchmark"] == "run" and result["resync"]["files"] == 50
    mode = result["modes"]["installed"]
    assert "pip install" in mode["devbox_source"]
    for key in ("run_sync_unchanged", "run_no_sync", "openssh_cmd"):
        assert mode["first_line_s"][key]["n"] == 1 and mode["first_line_s"][key]["median"] > 0
    for key in ("devbox_sync", "plain_rsync", "devbox_sftp_sync"):
        assert result["resync"]["one_changed_s"][key]["n"] == 1
    assert (
        mode["run_sync_unchanged_over_ssh"] > 0 and result["resync"]["resync_over_plain_rsync"] > 0
    )
    assert set(mode["met"]) == {"run_sync_unchanged_first_line_over_ssh"}


def test_autoscaler_benchmark() -> None:
    result = _run("bench_autoscaler.py", "--boxes", "10,20", "--passes", "2")
    assert result["benchmark"] == "autoscaler" and set(result["runs"]) == {"10", "20"}
    for size, run in result["runs"].items():
        assert run["boxes"] == int(size) and run["pass_s"]["n"] == 2
        # Polling each box costs a pod and a Lease read per box; a pass reads none.
        assert run["peer_poll_each_box_requests"] == 2 * int(size) + 1
        assert all(r <= 1 for r in run["requests_per_pass"])
    assert result["constant_requests"] is True


# torch.compile builds C++ for the compiled model: about a minute cold on 2 idle cores, and
# past the suite's 120 s on a loaded machine, so its cache is kept beside the CPU PyTorch
# (a fresh TMPDIR per run made every run cold) and the cold first run gets the time it needs.
INDUCTOR_CACHE = Path.home() / ".cache" / "devbox" / "torchinductor"


@pytest.mark.timeout(300)
def test_probe_benchmark(tmp_path: Path) -> None:
    from tests.probe import require_torch

    require_torch()
    result = _run(
        "bench_probe.py",
        "--windows",
        "2",
        "--every",
        "5",
        "--warmup",
        "2",
        "--width",
        "32",
        "--depth",
        "2",
        "--compile-every",
        "2",
        tmp=tmp_path,
        extra_env={"TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_CACHE)},
    )
    # Its sink and wandb's offline run folder go with it (wandb's used to stay in /tmp);
    # torch.compile's cache (torchinductor_USER) is kept by torch on purpose.
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")] == []
    ms = result["ms_per_step_median_of_windows"]
    assert set(ms) == {
        "none",
        "probe_every_1",
        "probe_every_5",
        "probe_every_5_observed_steps",
        "probe_every_5_unobserved_steps",
        "wandb_every_1",
        "wandb_every_5",
    }
    assert all(v > 0 for v in ms.values())
    assert set(result["probe_over_wandb"]) == {"every_5", "every_1"}
    assert result["compile"]["graphs_at_warmup"] >= 1
    assert result["compile"]["graphs_compiled_after_warmup"] >= 0


def test_real_node_benchmark() -> None:
    # On the shared cluster's real node (scripts/test starts it; root, as CI runs).
    result = _run("bench_real_node.py", "--runs", "1", "--mib", "2")
    assert result["benchmark"] == "kubernetes_real_node"
    warm = {"installed", "bytecode_cached", "devbox_compiled_each_run", "raw_peer"}
    assert set(result["claim_to_shell_s"]) == warm | {"cold"}
    assert all(claim["n"] == 1 for claim in result["claim_to_shell_s"].values())
    assert set(result["client_cpu_s"]) == warm
    assert result["warm_over_cold"] > 0 and result["throughput_ratio"] > 0
    assert set(result["throughput_MiBps"]) == {"devbox_port_forward", "kubectl_port_forward"}
    assert len(result["met"]) == 5  # three warm modes, warm over cold, throughput


def test_frameworks_benchmark(tmp_path: Path) -> None:
    """Each framework's probe and its TensorBoard peer run in the same benchmark; the
    tensorboard logs go with it."""
    args = ("--windows", "1", "--warmup", "1", "--every", "2", "--width", "16", "--depth", "1")
    result = _run("bench_frameworks.py", *args, "--batch", "8", tmp=tmp_path)
    assert set(result["frameworks"]) == {"torch", "nnx", "keras-jax", "keras-torch"}
    for measured in result["frameworks"].values():
        assert set(measured["ms_per_step_median_of_windows"]) == {
            "none",
            "probe_every_2",
            "probe_every_1",
            "tensorboard_every_2",
            "tensorboard_every_1",
        }
        assert all(v > 0 for v in measured["ms_per_step_median_of_windows"].values())
        assert set(measured["probe_over_tensorboard"]) == {"every_2", "every_1"}
    assert len(result["met"]) == 8
    assert list(tmp_path.iterdir()) == []
