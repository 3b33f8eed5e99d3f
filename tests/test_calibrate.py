"""benchmarks/calibrate.py: the fit recovers a model from data the model itself produced.

The parameters may not be identifiable (a memory bandwidth that never binds can take any large
value), so the test compares predictions, not parameters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType
from typing import Optional

import pytest

from benchmark_modules import load_benchmark

MIB = 1 << 20
SIZES = [MIB << k for k in range(5)]  # 1 .. 16 MiB
ALGORITHMS = ["flat", "reduce_to_one"]
RANKS = [2, 4]


# Neither the defaults nor a start point: core-bound at 2 ranks, memory-bound at 4.
TRUTH = {
    "cores": 2,
    "window_bytes": 256 << 10,
    "core_gbps": 8.0,
    "memory_gbps": 14.0,
    "launch_us": 40.0,
    "barrier_us": 12.0,
    "step_us": 0.5,
    "sleeping_barrier_us": 30.0,
}


@pytest.fixture(scope="module")
def calibrate() -> ModuleType:
    return load_benchmark("calibrate", needs_build=True)


def synthetic(calibrate: ModuleType, truth: dict) -> list[dict]:
    return [
        {
            "ranks": n,
            "algorithm": a,
            "size_bytes": s,
            "time_us": calibrate.predict_us(truth, n, a, s),
        }
        for n in RANKS
        for a in ALGORITHMS
        for s in SIZES
    ]


def test_fit_recovers_synthetic_predictions(calibrate: ModuleType) -> None:
    truth = TRUTH
    data = synthetic(calibrate, truth)
    result = calibrate.fit(data, truth["cores"], truth["window_bytes"])
    assert result["cores"] == 2 and result["window_bytes"] == 256 << 10
    assert result["rows"] == len(data)
    worst = 0.0
    for row in data:
        predicted = calibrate.predict_us(result, row["ranks"], row["algorithm"], row["size_bytes"])
        error = abs(predicted / row["time_us"] - 1.0)
        worst = max(worst, error)
        assert error < 0.05, (row, predicted, result)
    assert result["rms_log_error"] < 0.05
    assert worst < 0.05


def test_fit_is_deterministic_and_weights_count(calibrate: ModuleType) -> None:
    truth = {
        "cores": 2,
        "window_bytes": 256 << 10,
        "core_gbps": 6.0,
        "memory_gbps": 30.0,
        "launch_us": 20.0,
        "barrier_us": 5.0,
        "step_us": 0.0,
        "sleeping_barrier_us": 15.0,
    }
    data = [r for r in synthetic(calibrate, truth) if r["ranks"] == 2]
    # A wild row with weight 0 must not move the fit.
    data.append({"ranks": 2, "algorithm": "flat", "size_bytes": MIB, "time_us": 1e6, "weight": 0.0})
    kwargs = {"starts": calibrate.STARTS[:1], "max_evals": 400}
    a = calibrate.fit(data, 2, 256 << 10, **kwargs)
    b = calibrate.fit(data, 2, 256 << 10, **kwargs)
    assert a == b
    assert a["rows"] == len(data) - 1
    assert a["rms_log_error"] < 0.05


def test_fit_rejects_auto_and_empty_input(calibrate: ModuleType) -> None:
    with pytest.raises(ValueError):
        calibrate.fit(
            [{"ranks": 2, "algorithm": "auto", "size_bytes": MIB, "time_us": 100.0}], 2, 1 << 18
        )
    with pytest.raises(ValueError):
        calibrate.fit([], 2, 1 << 18)


def _results_file(path: Path, calibrate: ModuleType, truth: dict, **metadata: object) -> Path:
    """A benchmarks/allreduce.py result of 2 ranks on 2 cores, timed by the model itself."""
    rows = [
        {"backend": "xdev/flat", "algorithm": "flat", "size_bytes": s, "time_us": t}
        for s in SIZES
        for t in [calibrate.predict_us(truth, 2, "flat", s)]
    ]
    meta = {"nproc": 2, "cpu_count": 2, "slot_bytes": 256 << 10, "dtype": "float32", **metadata}
    path.write_text(json.dumps({"metadata": meta, "rows": rows}))
    return path


def test_model_file_leaves_out_what_the_runs_do_not_determine(
    calibrate: ModuleType, tmp_path: Path
) -> None:
    truth = TRUTH
    results = _results_file(tmp_path / "allreduce_2ranks.json", calibrate, truth)
    out = tmp_path / "model.json"
    # The network fit wrote this file first (--net-model-out): its parameters stay.
    out.write_text(json.dumps({"params": {"net_latency_us": 700.0}, "network_fit": {"rows": 3}}))
    assert calibrate.main(["--results", str(results), "--out", str(out)]) == 0
    model = json.loads(out.read_text())
    assert model["model"] == "cpu_machine"
    assert model["params"]["net_latency_us"] == 700.0 and model["network_fit"] == {"rows": 3}
    upper = {n.split(" ")[0] for n in model["summary"]["at_bound"] if n.endswith("(upper)")}
    fitted = {"cores", "window_bytes", *calibrate.PARAM_NAMES}
    # 2 ranks on 2 cores: the sleeping barrier is left out too.
    left_out = upper | {"sleeping_barrier_us"}
    assert set(model["params"]) == (fitted - left_out) | {"net_latency_us"}
    # The sleeping barrier is not written, the backend keeps its default, where no run had
    # more ranks than cores, wherever the fit put it: a run of 2 ranks on 2 cores, which never
    # sleep in a barrier, once wrote a 100 ms barrier (its upper bound), and later a 0.015 us
    # one (its lower), that 3- and 4-rank groups then planned by.
    two_ranks = [r for r in synthetic(calibrate, truth) if r["ranks"] == 2]
    result = calibrate.fit(two_ranks, 2, 256 << 10, starts=calibrate.STARTS[:1], max_evals=200)
    for bound in calibrate.BOX.bounds["sleeping_barrier_us"]:
        result["sleeping_barrier_us"] = bound
        params, left_out = calibrate.params_to_write(result, most_ranks=2)
        assert left_out == ["sleeping_barrier_us"] and "sleeping_barrier_us" not in params
        assert params["launch_us"] == result["launch_us"]
    # Runs with more ranks than cores determine it: written, unless at the upper bound.
    result["sleeping_barrier_us"] = 40.0
    assert calibrate.params_to_write(result, most_ranks=4)[0]["sleeping_barrier_us"] == 40.0


@pytest.mark.parametrize(
    "contents, problem",
    [
        ({"device": "cuda"}, "the CPU model is fitted to CPU runs on one host"),
        ({"hosts": 2}, "the CPU model is fitted to CPU runs on one host"),
        (None, "not a benchmarks/allreduce.py result (KeyError"),
    ],
)
def test_results_the_cpu_fit_cannot_use(
    calibrate: ModuleType, tmp_path: Path, contents: Optional[dict[str, object]], problem: str
) -> None:
    path = tmp_path / "allreduce_2ranks.json"
    if contents is None:
        path.write_text('{"rows": []}')
    else:
        _results_file(path, calibrate, TRUTH, **contents)
    with pytest.raises(SystemExit, match=re.escape(problem)):
        calibrate.load_results([path])
