"""benchmarks/calibrate_gpu.py: the shared-GPU model's fit recovers known parameters from the
model's own times, refuses runs it must not be fitted to, and meets the H100 measurements."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from benchmark_modules import load_benchmark

REPO = Path(__file__).resolve().parents[1]
H100_MPS = REPO / "docs" / "results" / "h100" / "cuda_allreduce_2ranks_mps.json"
H100_TIME_SLICED = REPO / "docs" / "results" / "h100" / "cuda_allreduce_2ranks.json"
MIB = 1 << 20
SIZES = [64 << 10, MIB, 16 * MIB, 64 * MIB, 256 * MIB]
ALGORITHMS = ["direct", "reduce_to_one", "flat", "hierarchical_copy", "hierarchical_balanced"]
TRUTH = {"window_bytes": 32 << 20, "memory_gbps": 2500.0, "launch_us": 6.0, "step_us": 3.0}


@pytest.fixture(scope="module")
def cg() -> ModuleType:
    return load_benchmark("calibrate_gpu", needs_build=True)


def synthetic(cg: ModuleType, noise: float = 0.0) -> list[dict[str, Any]]:
    """Times the binding predicts with TRUTH on 2 ranks, each scaled by up to 1 +- noise."""
    rng = random.Random(7)
    return [
        {
            "ranks": 2,
            "algorithm": a,
            "size_bytes": s,
            "time_us": cg.model_us(TRUTH, 2, a, s) * (1.0 + rng.uniform(-noise, noise)),
        }
        for a in ALGORITHMS
        for s in SIZES
    ]


def test_direct_prediction_by_hand(cg: ModuleType) -> None:
    # direct on 2 ranks, 4 MiB in one window: staging 2B per rank, then each rank reads both
    # slots (2B) and writes its output (B): 10B through the one memory, after the launch and
    # one barrier.
    b = 4 * MIB
    expected = TRUTH["launch_us"] + TRUTH["step_us"] + 10 * b / (TRUTH["memory_gbps"] * 1e3)
    assert cg.model_us(TRUTH, 2, "direct", b) == pytest.approx(expected, rel=1e-9)


def test_fit_recovers_synthetic_parameters(cg: ModuleType) -> None:
    data = synthetic(cg)
    result = cg.fit(data, TRUTH["window_bytes"], starts=cg.STARTS[:1], max_evals=600)
    assert result["rows"] == len(data)
    for name in ("memory_gbps", "launch_us", "step_us"):
        assert result[name] == pytest.approx(TRUTH[name], rel=0.03), (name, result)
    assert result["rms_log_error"] < 0.01


def test_fit_with_noise_stays_close(cg: ModuleType) -> None:
    data = synthetic(cg, noise=0.05)
    result = cg.fit(data, TRUTH["window_bytes"], starts=cg.STARTS[:1], max_evals=600)
    # The bandwidth is pinned by the large rows, where 5% noise is 5% at most.
    assert result["memory_gbps"] == pytest.approx(TRUTH["memory_gbps"], rel=0.05)
    for row, predicted in zip(data, cg.predict_all(result, data)):
        assert predicted == pytest.approx(row["time_us"], rel=0.12), row
    assert result["rms_log_error"] < 0.05


def test_fit_rejects_rows_it_cannot_predict(cg: ModuleType) -> None:
    with pytest.raises(ValueError, match="not an algorithm"):
        cg.fit([{"ranks": 2, "algorithm": "auto", "size_bytes": MIB, "time_us": 40.0}])
    with pytest.raises(ValueError, match="weight > 0"):
        cg.fit([{"ranks": 2, "algorithm": "flat", "size_bytes": MIB, "time_us": 40.0, "weight": 0}])


def test_binding_validates_its_arguments() -> None:
    from torch_xdev._C import plan

    m = plan.shared_gpu_machine(2, 3000.0, 5.0, 2.0)
    assert m.name == "shared-gpu-2" and m.num_devices == 2
    assert m.window_bytes == 32 << 20 and m.barrier_between_phases
    assert m.barrier_latency_s == pytest.approx(2e-6) and m.launch_latency_s == pytest.approx(5e-6)
    bad: list[tuple[tuple[Any, ...], str]] = [
        ((0, 3000.0, 5.0, 2.0), "ranks"),
        ((2, 0.0, 5.0, 2.0), "memory_gbps"),
        ((2, float("nan"), 5.0, 2.0), "memory_gbps"),
        ((2, 3000.0, -1.0, 2.0), "launch_us"),
        ((2, 3000.0, 5.0, float("inf")), "step_us"),
        ((2, 3000.0, 5.0, 2.0, -1), "window_bytes"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            plan.shared_gpu_machine(*args)


def write(tmp_path: Path, name: str, data: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def run_main(cg: ModuleType, tmp_path: Path, *results: Path) -> int:
    argv = ["--out", str(tmp_path / "gpu_model.json")]
    if results:
        argv += ["--results", *map(str, results)]
    return int(cg.main(argv))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"device": "cpu"}, "device 'cpu'"),
        ({"ranks_share_gpu": False}, "ranks_share_gpu is False"),
        ({"ranks_share_gpu": None}, "ranks_share_gpu is None"),
        ({"mps_pipe_directory": None}, "without an MPS daemon"),
    ],
)
def test_refuses_runs_not_of_ranks_sharing_a_gpu_at_once(
    cg: ModuleType, tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    data = json.loads(H100_MPS.read_text())
    data["metadata"].update(change)
    with pytest.raises(SystemExit, match=message):
        run_main(cg, tmp_path, write(tmp_path, "bad.json", data))


def test_refuses_the_time_sliced_h100_run(cg: ModuleType, tmp_path: Path) -> None:
    # Written before allreduce.py recorded the MPS daemon: refused by its millisecond calls.
    assert "mps_pipe_directory" not in json.loads(H100_TIME_SLICED.read_text())["metadata"]
    with pytest.raises(SystemExit, match="time-sliced"):
        run_main(cg, tmp_path, H100_TIME_SLICED)


def test_refuses_unreadable_or_empty_input(cg: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="cannot read"):
        run_main(cg, tmp_path, tmp_path / "missing.json")
    with pytest.raises(SystemExit, match="not a benchmarks/allreduce.py JSON"):
        run_main(cg, tmp_path, write(tmp_path, "list.json", []))  # type: ignore[arg-type]
    data = copy.deepcopy(json.loads(H100_MPS.read_text()))
    data["rows"] = [r for r in data["rows"] if r["size_bytes"] < MIB]
    with pytest.raises(SystemExit, match="no xdev rows"):
        run_main(cg, tmp_path, write(tmp_path, "small.json", data))


def test_h100_fit_meets_every_row_from_1_mib(cg: ModuleType, tmp_path: Path) -> None:
    assert run_main(cg, tmp_path) == 0  # the default input is the H100 MPS run
    out = json.loads((tmp_path / "gpu_model.json").read_text())
    assert out["sources"] == [str(H100_MPS)]
    params = out["params"]
    # Between a copy's measured rate (1.43 TB/s each way) and HBM3's datasheet 3.35 TB/s.
    assert 1500 < params["memory_gbps"] < 3500, params
    judged = [r for r in out["rows"] if r["in_criterion"]]
    assert len(judged) == 20  # 5 algorithms x 1, 16, 64, 256 MiB
    for row in judged:
        assert 0.75 <= row["ratio"] <= 1.25, row
        # The table's ratio is recomputed here from the row's own numbers.
        assert row["ratio"] == pytest.approx(
            max(row["model_us"], row["host_us"]) / row["measured_us"]
        )
    assert out["summary"]["within_tolerance"] is True
