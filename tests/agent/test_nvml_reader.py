"""GpuReader against the simulated NVML (tests/nvml_sim): the real nvidia-ml-py code runs,
only the driver underneath is simulated. The last test runs the reader against the real
driver where this machine has one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from agent.nvml import GpuReader, discover
from devbox.protocol import GpuProcess, GpuSample
from tests import nvml_sim
from tests.nvml_sim import GIB, SimGpu, SimProcess

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sim_lib(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    lib = nvml_sim.build(tmp_path_factory.mktemp("nvml-sim"))
    with nvml_sim.loaded_in_process(lib):
        yield lib


@pytest.fixture
def gpu_file(sim_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The library getenv()s this on nvmlInit: the live environment, so monkeypatch works.
    path = tmp_path / "gpus"
    monkeypatch.setenv("DEVBOX_NVML_SIM", str(path))
    return path


@pytest.fixture
def open_reader() -> Iterator[Callable[..., GpuReader]]:
    """GpuReader(uuids), closed after the test whatever it asserts."""
    opened: list[GpuReader] = []

    def open_(uuids: Sequence[str] | None = None) -> GpuReader:
        opened.append(GpuReader(uuids))
        return opened[-1]

    yield open_
    for reader in opened:
        reader.close()


def sim_gpu(i: int) -> SimGpu:
    """A GPU whose every value differs from any other index's."""
    return SimGpu(
        uuid=f"GPU-{i:02d}-aaaa",
        name=f"Sim GPU {i}",
        mem_total=(40 + i) * GIB,
        mem_used=i * GIB + 123,
        util=10 + i,
        mem_util=50 + i,
        power_mw=100_000 + 1_517 * i,
        power_limit_mw=400_000 + 10_000 * i,
        temp=30 + i,
        sm_clock=1_100 + 7 * i,
        pcie_tx=1_000 + i,
        pcie_rx=2_000 + i,
        ecc_corrected=3 * i,
        ecc_uncorrected=i,
        minor=20 - i,
    )


def expected(index: int, g: SimGpu, processes: list[GpuProcess] | None = None) -> GpuSample:
    assert g.uuid is not None
    return {
        "index": index,
        "uuid": g.uuid,
        "name": g.name,
        "lost": False,
        "util": float(g.util),
        "mem_util": float(g.mem_util),
        "mem_used": g.mem_used,
        "mem_total": g.mem_total,
        "power_w": g.power_mw / 1000,
        "power_limit_w": g.power_limit_mw / 1000,
        "temp_c": float(g.temp),
        "sm_clock_mhz": g.sm_clock,
        "pcie_tx_kbs": g.pcie_tx,
        "pcie_rx_kbs": g.pcie_rx,
        "ecc_corrected": g.ecc_corrected,
        "ecc_uncorrected": g.ecc_uncorrected,
        "processes": processes or [],
    }


def process(
    pid: int, kind: str, mem: int | None, sm: float | None, mem_util: float | None
) -> GpuProcess:
    return {
        "pid": pid,
        "box_pid": None,
        "kind": kind,
        "mem_used": mem,
        "sm_util": sm,
        "mem_util": mem_util,
    }


METRICS = (
    "util",
    "mem_util",
    "mem_used",
    "mem_total",
    "power_w",
    "power_limit_w",
    "temp_c",
    "sm_clock_mhz",
    "pcie_tx_kbs",
    "pcie_rx_kbs",
    "ecc_corrected",
    "ecc_uncorrected",
)


def test_no_gpus(gpu_file: Path, open_reader: Callable[..., GpuReader]) -> None:
    nvml_sim.write(gpu_file, [])
    reader = open_reader()
    assert reader.gpus == []
    assert reader.read() == []


def test_one_gpu(gpu_file: Path, open_reader: Callable[..., GpuReader]) -> None:
    gpu = replace(sim_gpu(0), power_mw=312_345, power_limit_mw=700_000)
    nvml_sim.write(gpu_file, [gpu])
    reader = open_reader()
    assert [(g.index, g.uuid, g.name) for g in reader.gpus] == [(0, "GPU-00-aaaa", "Sim GPU 0")]
    [sample] = reader.read()
    assert sample["power_w"] == 312.345 and sample["power_limit_w"] == 700.0
    assert sample == expected(0, gpu)


def test_eight_gpus_every_field(gpu_file: Path, open_reader: Callable[..., GpuReader]) -> None:
    gpus = [sim_gpu(i) for i in range(8)]
    nvml_sim.write(gpu_file, gpus)
    reader = open_reader()
    assert [g.index for g in reader.gpus] == list(range(8))
    assert reader.minor_numbers == {i: 20 - i for i in range(8)}
    assert reader.read() == [expected(i, g) for i, g in enumerate(gpus)]


def test_a_brief_read_has_what_a_quiet_tick_needs(
    gpu_file: Path, open_reader: Callable[..., GpuReader]
) -> None:
    """A quiet box's slow tick: utilisation, memory, power and its limit, temperature (the
    hang rule, the activity record, the charts); not the clock, PCIe, ECC or processes.
    A full read after it has them all, the processes' utilisation included."""
    gpus = [sim_gpu(0), sim_gpu(1)]
    nvml_sim.write(gpu_file, gpus, [SimProcess(gpu=0, pid=7, mem=GIB, sm=5, memutil=6, ts=10)])
    reader = open_reader()
    brief = reader.read(brief=True)
    for i, g in enumerate(gpus):
        whole = expected(i, g)
        left_out = (
            "sm_clock_mhz",
            "pcie_tx_kbs",
            "pcie_rx_kbs",
            "ecc_corrected",
            "ecc_uncorrected",
        )
        assert brief[i] == {**whole, **dict.fromkeys(left_out), "processes": []}
    assert reader.read() == [
        expected(0, gpus[0], [process(7, "compute", GIB, 5.0, 6.0)]),
        expected(1, gpus[1]),
    ]


@pytest.mark.parametrize(
    ("call", "fields"),
    [
        ("power", ["power_w"]),
        ("power_limit", ["power_limit_w"]),
        ("util", ["util", "mem_util"]),
        ("mem", ["mem_used", "mem_total"]),
        ("temp", ["temp_c"]),
        ("sm_clock", ["sm_clock_mhz"]),
        ("pcie", ["pcie_tx_kbs", "pcie_rx_kbs"]),
        ("ecc", ["ecc_corrected", "ecc_uncorrected"]),
    ],
)
def test_unsupported_call_is_a_missing_metric(
    gpu_file: Path, open_reader: Callable[..., GpuReader], call: str, fields: list[str]
) -> None:
    gpus = [replace(sim_gpu(0), unsupported=frozenset({call})), sim_gpu(1)]
    nvml_sim.write(gpu_file, gpus, [SimProcess(gpu=0, pid=7, mem=GIB, sm=5, memutil=6, ts=10)])
    sample, other = open_reader().read()
    want = expected(0, gpus[0], [process(7, "compute", GIB, 5.0, 6.0)])
    for field in fields:
        want[field] = None  # type: ignore[literal-required]
    assert sample == want
    assert other == expected(1, gpus[1])


def test_unsupported_minor_number(gpu_file: Path, open_reader: Callable[..., GpuReader]) -> None:
    nvml_sim.write(gpu_file, [replace(sim_gpu(0), unsupported=frozenset({"minor"})), sim_gpu(1)])
    assert open_reader().minor_numbers == {0: None, 1: 19}


def test_function_missing_from_an_old_driver_is_a_missing_metric(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, open_reader: Callable[..., GpuReader]
) -> None:
    lib = nvml_sim.build(
        tmp_path / "old-driver",
        without=["nvmlDeviceGetPowerUsage", "nvmlDeviceGetComputeRunningProcesses_v3"],
    )
    path = nvml_sim.write(
        tmp_path / "gpus",
        [sim_gpu(0)],
        [
            SimProcess(gpu=0, pid=1, mem=GIB, kind="compute"),
            SimProcess(gpu=0, pid=2, mem=2 * GIB, kind="graphics"),
        ],
    )
    monkeypatch.setenv("DEVBOX_NVML_SIM", str(path))
    with nvml_sim.loaded_in_process(lib):
        reader = open_reader()
        [sample] = reader.read()
        reader.close()
    want = expected(0, sim_gpu(0), [process(2, "graphics", 2 * GIB, None, None)])
    want["power_w"] = None
    assert sample == want


def test_gpu_lost_mid_stream(gpu_file: Path, open_reader: Callable[..., GpuReader]) -> None:
    gpus = [sim_gpu(i) for i in range(3)]
    procs = [SimProcess(gpu=1, pid=11, mem=GIB), SimProcess(gpu=2, pid=22, mem=GIB)]
    nvml_sim.write(gpu_file, gpus, procs)
    reader = open_reader()
    assert [s["lost"] for s in reader.read()] == [False, False, False]

    nvml_sim.write(gpu_file, [gpus[0], replace(gpus[1], lost=True), gpus[2]], procs)
    for _ in range(2):  # and the read after a loss still works
        first, lost, last = reader.read()
        assert lost["lost"] is True
        assert (lost["index"], lost["uuid"], lost["name"]) == (1, gpus[1].uuid, gpus[1].name)
        assert all(lost[m] is None for m in METRICS)  # type: ignore[literal-required]
        assert lost["processes"] == []
        assert first == expected(0, gpus[0])
        assert last == expected(2, gpus[2], [process(22, "compute", GIB, None, None)])

    nvml_sim.write(gpu_file, gpus, procs)  # back on the bus
    assert reader.read()[1] == expected(1, gpus[1], [process(11, "compute", GIB, None, None)])


def test_gpu_gone_from_the_machine_reads_as_lost(
    gpu_file: Path, open_reader: Callable[..., GpuReader]
) -> None:
    nvml_sim.write(gpu_file, [sim_gpu(0), sim_gpu(1)])
    reader = open_reader()
    nvml_sim.write(gpu_file, [sim_gpu(0)])
    first, gone = reader.read()
    assert first == expected(0, sim_gpu(0))
    assert gone["lost"] is True


def test_gpu_lost_before_the_reader_opens_is_left_out(
    gpu_file: Path, open_reader: Callable[..., GpuReader]
) -> None:
    # NVML cannot even name it, so no box can own it.
    nvml_sim.write(gpu_file, [sim_gpu(0), replace(sim_gpu(1), lost=True), sim_gpu(2)])
    reader = open_reader()
    assert [g.index for g in reader.gpus] == [0, 2]
    assert reader.read() == [expected(0, sim_gpu(0)), expected(2, sim_gpu(2))]


def test_process_utilisation_only_from_new_samples(
    gpu_file: Path, open_reader: Callable[..., GpuReader]
) -> None:
    gpus = [sim_gpu(0), sim_gpu(1)]

    def write(sm: int, ts: int) -> None:
        procs = [
            SimProcess(gpu=0, pid=1234, mem=GIB, sm=sm, memutil=20, ts=ts),
            SimProcess(gpu=1, pid=99, mem=GIB, sm=1, memutil=2, ts=5_000_000),
        ]
        nvml_sim.write(gpu_file, gpus, procs)

    write(sm=55, ts=1_000_000)
    reader = open_reader()
    assert reader.read()[0]["processes"] == [process(1234, "compute", GIB, 55.0, 20.0)]
    # No sample newer than the last one seen: no utilisation this read.
    assert reader.read()[0]["processes"] == [process(1234, "compute", GIB, None, None)]
    # Each GPU keeps its own last-seen time: GPU 1's newer stamp must not hide GPU 0's sample.
    write(sm=70, ts=2_000_000)
    assert reader.read()[0]["processes"] == [process(1234, "compute", GIB, 70.0, 20.0)]
    assert reader.read()[0]["processes"] == [process(1234, "compute", GIB, None, None)]


def test_compute_and_graphics_processes(
    gpu_file: Path, open_reader: Callable[..., GpuReader]
) -> None:
    gpus = [sim_gpu(0), sim_gpu(1)]
    procs = [
        SimProcess(gpu=0, pid=100, mem=3 * GIB, kind="compute", sm=40, memutil=4, ts=1),
        SimProcess(gpu=0, pid=200, mem=GIB, kind="graphics"),
        SimProcess(gpu=0, pid=300, mem=None, kind="compute"),  # NVML: "not available"
        SimProcess(gpu=0, pid=100, mem=3 * GIB, kind="graphics"),  # both contexts
        SimProcess(gpu=1, pid=400, mem=5 * GIB, kind="graphics", sm=9, memutil=1, ts=7),
    ]
    nvml_sim.write(gpu_file, gpus, procs)
    first, second = open_reader().read()
    assert first["processes"] == [
        process(100, "compute", 3 * GIB, 40.0, 4.0),
        process(300, "compute", None, None, None),
        process(200, "graphics", GIB, None, None),
    ]
    assert second["processes"] == [process(400, "graphics", 5 * GIB, 9.0, 1.0)]


def test_uuid_filter_keeps_the_original_indices(
    gpu_file: Path, open_reader: Callable[..., GpuReader]
) -> None:
    gpus = [sim_gpu(i) for i in range(4)]
    nvml_sim.write(gpu_file, gpus, [SimProcess(gpu=3, pid=5, mem=GIB)])
    reader = open_reader([str(gpus[3].uuid), str(gpus[1].uuid), "GPU-not-here"])
    assert [(g.index, g.uuid) for g in reader.gpus] == [(1, gpus[1].uuid), (3, gpus[3].uuid)]
    assert reader.minor_numbers == {1: 19, 3: 17}
    assert reader.read() == [
        expected(1, gpus[1]),
        expected(3, gpus[3], [process(5, "compute", GIB, None, None)]),
    ]


def test_discover_while_a_reader_is_open(
    gpu_file: Path, open_reader: Callable[..., GpuReader]
) -> None:
    # NVML counts nvmlInit/nvmlShutdown: discover()'s shutdown must not end the reader's.
    nvml_sim.write(gpu_file, [sim_gpu(0)])
    reader = open_reader()
    assert [g.uuid for g in discover()] == [sim_gpu(0).uuid]
    assert reader.read() == [expected(0, sim_gpu(0))]


def test_nvml_absent(
    sim_lib: Path, monkeypatch: pytest.MonkeyPatch, open_reader: Callable[..., GpuReader]
) -> None:
    monkeypatch.delenv("DEVBOX_NVML_SIM", raising=False)  # the sim then fails to initialise
    reader = open_reader()
    assert reader.gpus == []
    assert reader.minor_numbers == {}
    assert reader.read() == []
    reader.close()
    reader.close()


def test_read_after_close_is_empty(gpu_file: Path) -> None:
    nvml_sim.write(gpu_file, [sim_gpu(0)])
    with GpuReader() as reader:
        assert len(reader.read()) == 1
    assert reader.read() == []


REAL_DRIVER = """
import ctypes, json, sys
try:
    ctypes.CDLL("libnvidia-ml.so.1")
except OSError:
    sys.exit(3)
import pynvml
from agent.nvml import GpuReader
try:
    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    pynvml.nvmlShutdown()
except pynvml.NVMLError:
    count = 0
reader = GpuReader()
reader.read()
json.dump({"count": count, "gpus": len(reader.gpus), "samples": reader.read()}, sys.stdout)
reader.close()
"""


def test_real_driver() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DEVBOX_NVML_SIM"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, "-c", REAL_DRIVER],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode == 3:
        pytest.skip("no NVIDIA driver on this machine (libnvidia-ml.so.1 not loadable)")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    if report["count"] == 0:
        pytest.skip("the NVIDIA driver library loads but NVML reports no GPUs")
    assert report["gpus"] == report["count"]
    for sample in report["samples"]:
        assert sample["name"]
        assert sample["uuid"].startswith(("GPU-", "MIG-"))
        assert sample["lost"] is False
        for field in ("util", "mem_util"):
            assert sample[field] is None or 0 <= sample[field] <= 100
        if sample["mem_used"] is not None and sample["mem_total"] is not None:
            assert 0 <= sample["mem_used"] <= sample["mem_total"]
        if sample["power_w"] is not None and sample["power_limit_w"] is not None:
            assert 0 <= sample["power_w"] <= 2 * sample["power_limit_w"]
        assert sample["temp_c"] is None or 0 <= sample["temp_c"] < 120
        for p in sample["processes"]:
            assert p["pid"] > 0 and p["kind"] in ("compute", "graphics")
            assert p["sm_util"] is None or 0 <= p["sm_util"] <= 100
