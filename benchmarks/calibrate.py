"""Calibrate the CPU cost model (torch_xdev._C.plan.cpu_machine) against measured allreduces.

Usage::

    python benchmarks/calibrate.py [--results FILE ...] [--out benchmarks/results/cpu_model.json]
    python benchmarks/calibrate.py --run [--nproc 2 4] [--sizes 1MiB:64MiB] [--run-dir DIR]

Reads the JSON files of benchmarks/allreduce.py (by default every
benchmarks/results/allreduce_<N>ranks.json there is; with ``--run``, the files that a fresh run
of benchmarks/allreduce.py for each ``--nproc`` writes to ``--run-dir``, plus any ``--results``)
and fits ONE parameter set of the CPU machine model to every measured xdev row of an explicit
algorithm (not "auto") of every rank count: core_gbps, memory_gbps, launch_us, barrier_us,
step_us and sleeping_barrier_us.
The cores are the files' ``cpu_count``, the window their ``slot_bytes`` (262144 by default).

The fit minimises the weighted mean of squared log errors log(predicted / measured) over the
rows of at least ``--min-fit-bytes`` (1 MiB); smaller rows take part with ``--small-weight``
(0 by default: shown for information only). The optimiser is a deterministic Nelder-Mead in
log space with restarts, multi-started from a few fixed points (no scipy; benchmarks/model_fit.py,
shared with benchmarks/calibrate_gpu.py).

Prints the fitted parameters and a prediction-versus-measurement table, and saves both as
JSON (``--out``). See docs/calibration.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, TypedDict

import torch_xdev
from torch_xdev._C import plan
from torch_xdev._registration import CPU_MODEL_KIND
from torch_xdev.plan import format_size

from model_fit import (
    ALGORITHMS,
    ELEM_BYTES,
    HIERARCHICAL,
    MIB,
    ComparedRow,
    FitQuality,
    LogBox,
    Measurement,
    Vector,
    add_fit_arguments,
    fit_params,
    measurement,
    predict_one_us,
    predict_rows_us,
    print_fit_quality,
    quality_of,
    weighted_loss,
    write_model_file,
)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DEFAULT_OUT = RESULTS / "cpu_model.json"
DEFAULT_WINDOW_BYTES = 256 << 10  # torch_xdev.Options.shm_slot_bytes

# The fitted parameters, their search bounds and the starting points of the multi-start.
PARAM_NAMES = (
    "core_gbps",
    "memory_gbps",
    "launch_us",
    "barrier_us",
    "step_us",
    "sleeping_barrier_us",
)
BOUNDS: dict[str, tuple[float, float]] = {
    "core_gbps": (0.05, 2000.0),
    "memory_gbps": (0.05, 20000.0),
    "launch_us": (0.01, 1e5),
    "barrier_us": (0.01, 1e5),
    "step_us": (0.001, 1e4),
    "sleeping_barrier_us": (0.01, 1e5),
}
STARTS: tuple[tuple[float, float, float, float, float, float], ...] = (
    (5.0, 10.0, 10.0, 5.0, 0.1, 10.0),  # csrc/plan/machines.h CpuHostParams defaults
    (20.0, 20.0, 30.0, 20.0, 1.0, 20.0),
    (10.0, 200.0, 100.0, 50.0, 10.0, 50.0),
)

BOX = LogBox({name: BOUNDS[name] for name in PARAM_NAMES})


class Params(TypedDict):
    """A CPU machine model: the arguments of plan.cpu_machine except the rank count."""

    cores: int
    window_bytes: int
    core_gbps: float
    memory_gbps: float
    launch_us: float
    barrier_us: float
    step_us: float
    sleeping_barrier_us: float  # a barrier with more ranks than cores (it sleeps)


class FitResult(Params, FitQuality):
    """fit()'s answer: the parameters, and how well and at what cost they were found."""


class Loaded(TypedDict):
    measurements: list[Measurement]
    cores: int
    window_bytes: int
    sources: list[str]


class TableRow(ComparedRow):
    error_pct: float  # 100 * (predicted / measured - 1)


# ---------------------------------------------------------------------------
# The model


def machine(params: Params, ranks: int) -> plan.MachineModel:
    return plan.cpu_machine(
        ranks,
        params["cores"],
        params["core_gbps"],
        params["memory_gbps"],
        params["launch_us"],
        params["barrier_us"],
        params["window_bytes"],
        params["step_us"],
        params["sleeping_barrier_us"],
    )


def _predict_all(params: Params, measurements: Sequence[Measurement]) -> list[float]:
    return predict_rows_us(lambda ranks: machine(params, ranks), measurements)


def predict_us(params: Params, ranks: int, algorithm: str, size: int, elem_bytes: int = 4) -> float:
    """The model's time for one allreduce of `size` bytes, in microseconds."""
    return predict_one_us(lambda n: machine(params, n), ranks, algorithm, size, elem_bytes)


# ---------------------------------------------------------------------------
# The fit


def _to_params(x: Vector, cores: int, window_bytes: int) -> Params:
    values = BOX.values(x)
    return Params(
        cores=cores,
        window_bytes=window_bytes,
        core_gbps=values["core_gbps"],
        memory_gbps=values["memory_gbps"],
        launch_us=values["launch_us"],
        barrier_us=values["barrier_us"],
        step_us=values["step_us"],
        sleeping_barrier_us=values["sleeping_barrier_us"],
    )


def loss_of(params: Params, measurements: Sequence[Measurement]) -> float:
    """Weighted mean of squared log errors, log(predicted / measured)."""
    return weighted_loss(lambda rows: _predict_all(params, rows), measurements)


def fit(
    measurements: Sequence[Measurement],
    cores: int,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    starts: Sequence[Sequence[float]] = STARTS,
    max_evals: int = 2400,
) -> FitResult:
    """One parameter set for all measurements (any rank counts, explicit algorithms).

    Minimises loss_of() over PARAM_NAMES in log (model_fit.minimise)
    space within BOUNDS: Nelder-Mead from each of `starts` (at most max_evals / len(starts)
    evaluations each), restarted from its best point with a smaller simplex until a restart
    no longer improves; the best of all wins. Deterministic.
    """
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    params, quality = fit_params(
        lambda x: _to_params(x, cores, window_bytes), loss_of, measurements, starts, BOX, max_evals
    )
    return FitResult(**params, **quality)


# ---------------------------------------------------------------------------
# Measurements


def default_result_files() -> list[Path]:
    def ranks_of(p: Path) -> int:
        digits = p.name.removeprefix("allreduce_").removesuffix("ranks.json")
        return int(digits) if digits.isdigit() else 1 << 30

    return sorted(RESULTS.glob("allreduce_*ranks.json"), key=lambda p: (ranks_of(p), p.name))


def load_results(
    paths: Sequence[Path], min_fit_bytes: int = MIB, small_weight: float = 0.0
) -> Loaded:
    """The xdev rows of explicit algorithms in benchmarks/allreduce.py JSON files.

    Rows below min_fit_bytes get weight small_weight. All files must agree on cpu_count and
    slot_bytes (one machine, one window).
    """
    measurements: list[Measurement] = []
    cores: Optional[int] = None
    window: Optional[int] = None
    sources: list[str] = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            meta: dict[str, Any] = data["metadata"]
            rows_of_file = list(data["rows"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(
                f"{path}: not a benchmarks/allreduce.py result ({type(e).__name__}: {e})"
            ) from None
        if meta.get("device", "cpu") != "cpu" or int(meta.get("hosts", 1)) != 1:
            raise SystemExit(
                f"{path}: a run on {meta.get('device')} tensors over {meta.get('hosts', 1)} "
                "host(s); the CPU model is fitted to CPU runs on one host (calibrate_gpu.py "
                "fits CUDA runs, --net-model-out the network)"
            )
        if meta.get("arrival", "back-to-back") != "back-to-back":
            raise SystemExit(
                f"{path}: measured with --arrival {meta['arrival']}; the model is fitted to"
                " back-to-back calls"
            )
        try:
            file_cores = int(meta["cpu_count"])
            file_window = int(meta.get("slot_bytes") or DEFAULT_WINDOW_BYTES)
            ranks = int(meta["nproc"])
        except (KeyError, TypeError, ValueError) as e:
            raise SystemExit(f"{path}: metadata without a usable {e}") from None
        if cores is not None and (file_cores, file_window) != (cores, window):
            raise SystemExit(
                f"{path}: cpu_count {file_cores} / slot_bytes {file_window} differ from the "
                f"other files' {cores} / {window}; calibrate one machine and window at a time"
            )
        cores, window = file_cores, file_window
        dtype = str(meta.get("dtype", "float32"))
        if dtype not in ELEM_BYTES:
            raise SystemExit(f"{path}: unknown dtype {dtype!r}")
        sources.append(str(path))
        for row in rows_of_file:
            if row.get("backend_base", str(row["backend"]).split("/")[0]) != "xdev":
                continue
            algorithm = row.get("algorithm")
            if algorithm not in ALGORITHMS:  # "auto", "fallback", None
                continue
            if algorithm in HIERARCHICAL and ranks % 2:
                continue
            try:
                size, time_us = int(row["size_bytes"]), float(row["time_us"])
            except (KeyError, TypeError, ValueError) as e:
                raise SystemExit(f"{path}: a {algorithm} row without a usable {e}") from None
            measurements.append(
                measurement(
                    ranks,
                    str(algorithm),
                    size,
                    time_us,
                    ELEM_BYTES[dtype],
                    min_fit_bytes,
                    small_weight,
                )
            )
    if cores is None or window is None:
        raise SystemExit("no result files: run benchmarks/allreduce.py first, or pass --run")
    return Loaded(measurements=measurements, cores=cores, window_bytes=window, sources=sources)


def run_benchmarks(nprocs: Sequence[int], sizes: str, algorithms: str, out_dir: Path) -> list[Path]:
    """Runs benchmarks/allreduce.py once per rank count; returns the files it wrote."""
    paths: list[Path] = []
    for n in nprocs:
        path = out_dir / f"allreduce_{n}ranks.json"
        command = [
            sys.executable,
            str(HERE / "allreduce.py"),
            "--nproc",
            str(n),
            "--sizes",
            sizes,
            "--algorithms",
            algorithms,
            "--no-deepspeed",
            "--json",
            str(path),
        ]
        print("# running " + " ".join(command[1:]), flush=True)
        done = subprocess.run(command)
        if done.returncode != 0:
            raise SystemExit(f"benchmarks/allreduce.py --nproc {n} failed ({done.returncode})")
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------
# Report


def table(
    params: Params, measurements: Sequence[Measurement], min_fit_bytes: int
) -> list[TableRow]:
    ordered = sorted(
        measurements,
        key=lambda m: (m["ranks"], ALGORITHMS.index(m["algorithm"]), m["size_bytes"]),
    )
    predicted = _predict_all(params, ordered)
    return [
        TableRow(
            ranks=m["ranks"],
            algorithm=m["algorithm"],
            size_bytes=m["size_bytes"],
            measured_us=m["time_us"],
            predicted_us=p,
            error_pct=100.0 * (p / m["time_us"] - 1.0),
            in_criterion=m["size_bytes"] >= min_fit_bytes,
        )
        for m, p in zip(ordered, predicted)
    ]


def print_table(rows: Sequence[TableRow], title: str) -> None:
    print(title)
    print(
        f"{'ranks':>5}  {'algorithm':<21} {'size':>7} {'measured(us)':>13} "
        f"{'predicted(us)':>13} {'error':>8}"
    )
    for r in rows:
        print(
            f"{r['ranks']:>5}  {r['algorithm']:<21} {format_size(r['size_bytes']):>7} "
            f"{r['measured_us']:>13.1f} {r['predicted_us']:>13.1f} {r['error_pct']:>+7.1f}%"
        )


def params_to_write(result: FitResult, most_ranks: int) -> tuple[dict[str, Any], list[str]]:
    """The parameters a model file sets, and the names left out. A parameter at its upper
    search bound is one the rows do not determine: the backend keeps its own default rather
    than plan by the bound (a 100 ms barrier). So is the sleeping barrier wherever no run had
    more ranks (`most_ranks`) than cores: such runs never sleep in a barrier, and the fit puts
    it anywhere, at either bound. Another parameter at its lower bound says "small", and is
    written."""
    undetermined = [n.split(" ")[0] for n in at_bound(result) if n.endswith("(upper)")]
    if most_ranks <= result["cores"] and "sleeping_barrier_us" not in undetermined:
        undetermined.append("sleeping_barrier_us")
    params = {
        k: result[k]  # type: ignore[literal-required]
        for k in ("cores", "window_bytes", *PARAM_NAMES)
        if k not in undetermined
    }
    return params, undetermined


def _read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} where there is none (no file, or not an object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def at_bound(params: Params) -> list[str]:
    """The fitted parameters within a factor 2 of a search bound: the data do not pin them."""
    return BOX.at_bound(params)


def print_params(result: FitResult) -> None:
    print(
        f"# fitted CPU model: cores {result['cores']}  window {result['window_bytes']} B  "
        f"core {result['core_gbps']:.3f} GB/s  memory {result['memory_gbps']:.3f} GB/s  "
        f"launch {result['launch_us']:.2f} us  barrier {result['barrier_us']:.2f} us  "
        f"step {result['step_us']:.3f} us  "
        f"sleeping barrier {result['sleeping_barrier_us']:.2f} us"
    )
    print_fit_quality(result, BOX)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results",
        nargs="+",
        type=Path,
        default=None,
        help="benchmarks/allreduce.py JSON files (default: benchmarks/results/allreduce_*ranks.json)",
    )
    parser.add_argument("--run", action="store_true", help="run benchmarks/allreduce.py first")
    parser.add_argument(
        "--nproc", nargs="+", type=int, default=[2, 4], help="rank counts for --run (default 2 4)"
    )
    parser.add_argument(
        "--sizes", default="1MiB:64MiB", help="sizes for --run (default 1MiB:64MiB)"
    )
    parser.add_argument(
        "--algorithms",
        default=None,
        help="algorithms for --run (default: every explicit one this build runs)",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=RESULTS,
        help="where --run writes allreduce_<N>ranks.json (default benchmarks/results)",
    )
    add_fit_arguments(parser, DEFAULT_OUT)
    parser.add_argument(
        "--small-weight",
        type=float,
        default=0.0,
        help="fit weight of the rows below --min-fit-bytes (default 0: shown only)",
    )
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.small_weight < 0 or args.min_fit_bytes < 0 or args.tolerance <= 0:
        sys.exit("--small-weight and --min-fit-bytes must be >= 0, --tolerance > 0")
    paths: list[Path] = list(args.results or [])
    if args.run:
        algorithms = args.algorithms or ",".join(
            a for a in ALGORITHMS if a in torch_xdev.ALGORITHMS
        )
        paths += run_benchmarks(args.nproc, args.sizes, algorithms, args.run_dir)
    elif not paths:
        paths = default_result_files()
    loaded = load_results(paths, args.min_fit_bytes, args.small_weight)
    measurements = loaded["measurements"]
    if not any(m.get("weight", 1.0) > 0 for m in measurements):
        sys.exit(f"no xdev rows of an explicit algorithm >= {args.min_fit_bytes} bytes to fit")
    print("# measurements: " + ", ".join(loaded["sources"]))
    result = fit(measurements, loaded["cores"], loaded["window_bytes"])
    print_params(result)
    rows = table(result, measurements, args.min_fit_bytes)
    big = [r for r in rows if r["in_criterion"]]
    small = [r for r in rows if not r["in_criterion"]]
    print_table(big, f"# sizes >= {format_size(args.min_fit_bytes)} (the fit criterion)")
    if small:
        weight = f"fit weight {args.small_weight:g}" if args.small_weight > 0 else "not fitted"
        print_table(
            small, f"# sizes < {format_size(args.min_fit_bytes)}: outside the criterion, {weight}"
        )
    worst = max(big, key=lambda r: abs(r["error_pct"])) if big else None
    max_error = abs(worst["error_pct"]) if worst else 0.0
    within = max_error <= args.tolerance
    if worst is not None:
        print(
            f"# max |error| at >= {format_size(args.min_fit_bytes)}: {max_error:.1f}% "
            f"({worst['ranks']} ranks, {worst['algorithm']}, {format_size(worst['size_bytes'])}); "
            f"every row within {args.tolerance:g}%: {'yes' if within else 'no'} "
            f"({sum(abs(r['error_pct']) <= args.tolerance for r in big)}/{len(big)})"
        )
    params, undetermined = params_to_write(result, max(m["ranks"] for m in measurements))
    if undetermined:
        print(f"# left out of the file (the backend keeps its defaults): {', '.join(undetermined)}")
    # A model file the network fit wrote (--net-model-out) keeps its network parameters.
    previous = _read_json_object(args.out)
    kept = previous.get("params")
    if isinstance(kept, dict):
        params.update({k: v for k, v in kept.items() if k.startswith("net_")})
    out: dict[str, Any] = {
        "model": CPU_MODEL_KIND,
        "params": params,
        "fit": {
            **quality_of(result),
            "min_fit_bytes": args.min_fit_bytes,
            "small_weight": args.small_weight,
        },
        "summary": {
            "at_bound": at_bound(result),
            "max_abs_error_pct": max_error,
            "tolerance_pct": args.tolerance,
            "within_tolerance": within,
        },
        "sources": loaded["sources"],
        "rows": rows,
        **({"network_fit": previous["network_fit"]} if "network_fit" in previous else {}),
    }
    write_model_file(args.out, out)
    return 1 if args.strict and not within else 0


if __name__ == "__main__":
    sys.exit(main())
