"""Calibrate the shared-GPU cost model (torch_xdev._C.plan.shared_gpu_machine) against measured
CUDA allreduces of ranks sharing one GPU.

Usage::

    python benchmarks/calibrate_gpu.py [--results FILE ...] [--out FILE] [--min-fit-bytes N]

Reads benchmarks/allreduce.py CUDA JSON files (default:
docs/results/h100/cuda_allreduce_2ranks_mps.json) of ranks that share one GPU with an MPS daemon
running, and fits memory_gbps (the GPU memory every byte goes through), launch_us (per call, on
the GPU) and step_us (one barrier between phases: a flag hand-off) to the xdev rows of explicit
algorithms (not "auto") of at least ``--min-fit-bytes`` (1 MiB), by minimising the mean squared
log error with benchmarks/model_fit.py (the optimiser benchmarks/calibrate.py uses too).

Back-to-back calls overlap the host's work for the next call with the GPU's for this one, so a
call takes the longer of the two. The model predicts the GPU's; the host's is measured by
allreduce.py in the same run (metadata ``host_overhead``: median µs per call of each algorithm)
and is not fitted. The prediction is the larger of that and the model's (``--no-host-floor``:
the model's alone).

Refused: files not measured on CUDA, of ranks on separate GPUs, or of ranks time-sliced by the
driver (no MPS: every barrier waits for the other process's time slice, milliseconds).

Prints the fitted parameters and a measured-versus-predicted table and saves both (``--out``).
See docs/calibration.md, "Calibrating the GPU model".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NotRequired, Optional, Sequence, TypedDict

from torch_xdev._C import plan
from torch_xdev.plan import format_size

from model_fit import (
    ALGORITHMS,
    ELEM_BYTES,
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
DEFAULT_RESULTS = HERE.parent / "docs" / "results" / "h100" / "cuda_allreduce_2ranks_mps.json"
DEFAULT_OUT = HERE / "results" / "gpu_model.json"
DEFAULT_WINDOW_BYTES = 32 << 20  # torch_xdev.Options.cuda_slot_bytes (plan::kCudaWindowBytes)
# Without MPS a barrier of ranks sharing a GPU waits for a time slice (about 2 ms on an H100):
# calls of 1 MiB or less that take longer than this were time-sliced.
TIME_SLICED_US = 1000.0

PARAM_NAMES = ("memory_gbps", "launch_us", "step_us")
BOX = LogBox({"memory_gbps": (1.0, 50000.0), "launch_us": (0.01, 1e4), "step_us": (0.001, 1e4)})
STARTS: tuple[tuple[float, float, float], ...] = (
    (3350.0, 5.0, 2.0),  # the H100's HBM3 datasheet rate, the NVSwitch hosts' latencies
    (1000.0, 20.0, 10.0),
    (8000.0, 1.0, 0.1),
)


class Params(TypedDict):
    """A shared-GPU machine model: plan.shared_gpu_machine's arguments but the rank count."""

    window_bytes: int
    memory_gbps: float
    launch_us: float
    step_us: float


class FitResult(Params, FitQuality):
    """fit()'s answer: the parameters, and how well and at what cost they were found."""


class GpuMeasurement(Measurement):
    host_us: NotRequired[float]  # the host's time per call (a floor); 0 or absent: none


class Loaded(TypedDict):
    measurements: list[GpuMeasurement]
    window_bytes: int
    gpu: str
    sources: list[str]


class TableRow(ComparedRow):
    """A table row; its predicted_us is max(model_us, host_us)."""

    model_us: float  # the GPU's time, as the model predicts it
    host_us: float  # the measured host floor (0: none)
    ratio: float  # predicted / measured


# ---------------------------------------------------------------------------
# The model


def machine(params: Params, ranks: int) -> plan.MachineModel:
    return plan.shared_gpu_machine(
        ranks,
        params["memory_gbps"],
        params["launch_us"],
        params["step_us"],
        params["window_bytes"],
    )


def _model_all(params: Params, measurements: Sequence[GpuMeasurement]) -> list[float]:
    return predict_rows_us(lambda ranks: machine(params, ranks), measurements)


def model_us(params: Params, ranks: int, algorithm: str, size: int, elem_bytes: int = 4) -> float:
    """The model's GPU time for one allreduce of `size` bytes, in microseconds."""
    return predict_one_us(lambda n: machine(params, n), ranks, algorithm, size, elem_bytes)


def predict_all(params: Params, measurements: Sequence[GpuMeasurement]) -> list[float]:
    """Per row: the larger of the model's GPU time and the row's host floor, in µs."""
    return [
        max(gpu, row.get("host_us", 0.0))
        for gpu, row in zip(_model_all(params, measurements), measurements)
    ]


# ---------------------------------------------------------------------------
# The fit


def _to_params(x: Vector, window_bytes: int) -> Params:
    values = BOX.values(x)
    return Params(
        window_bytes=window_bytes,
        memory_gbps=values["memory_gbps"],
        launch_us=values["launch_us"],
        step_us=values["step_us"],
    )


def loss_of(params: Params, measurements: Sequence[GpuMeasurement]) -> float:
    """Weighted mean of squared log errors, log(predicted / measured)."""
    return weighted_loss(lambda rows: predict_all(params, rows), measurements)


def fit(
    measurements: Sequence[GpuMeasurement],
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    starts: Sequence[Sequence[float]] = STARTS,
    max_evals: int = 1500,
) -> FitResult:
    """One parameter set for all measurements, by model_fit.minimise in log space. Raises
    ValueError for rows the model cannot predict or no row with a weight > 0."""
    if window_bytes < 0:
        raise ValueError(f"window_bytes must be >= 0, got {window_bytes}")
    params, quality = fit_params(
        lambda x: _to_params(x, window_bytes), loss_of, measurements, starts, BOX, max_evals
    )
    return FitResult(**params, **quality)


# ---------------------------------------------------------------------------
# Measurements


class BadInput(Exception):
    """A result file the GPU model must not be fitted to; the message says why."""


def host_floors(meta: dict[str, Any]) -> dict[str, float]:
    """Median µs per call of each xdev algorithm, from allreduce.py's host_overhead."""
    floors: dict[str, float] = {}
    for entry in meta.get("host_overhead") or []:
        backend = str(entry.get("backend", ""))
        if backend.startswith("xdev/") and entry.get("median_us"):
            floors[backend.removeprefix("xdev/")] = float(entry["median_us"])
    return floors


def check_shared_gpu(path: Path, data: dict[str, Any]) -> None:
    """Raises BadInput unless the file measured ranks sharing one GPU that ran at once."""
    meta = data.get("metadata")
    if not isinstance(meta, dict) or not isinstance(data.get("rows"), list):
        raise BadInput(f"{path}: not a benchmarks/allreduce.py JSON file (metadata, rows)")
    if meta.get("device") != "cuda":
        raise BadInput(f"{path}: device {meta.get('device')!r}; the GPU model needs a CUDA run")
    if meta.get("ranks_share_gpu") is not True:
        raise BadInput(
            f"{path}: ranks_share_gpu is {meta.get('ranks_share_gpu')!r}; this model is of ranks "
            "sharing ONE GPU (run benchmarks/allreduce.py --device cuda with more ranks than GPUs)"
        )
    if "mps_pipe_directory" in meta:
        if meta["mps_pipe_directory"] is None:
            raise BadInput(
                f"{path}: measured without an MPS daemon; the driver time-slices the ranks and "
                "every barrier waits for a slice (start `nvidia-cuda-mps-control -d`, measure "
                "again)"
            )
        return
    # Older files do not say whether MPS ran: time-slicing shows as milliseconds per call.
    small = [
        float(r["time_us"])
        for r in data["rows"]
        if r.get("backend_base") == "xdev"
        and r.get("algorithm") in ALGORITHMS
        and int(r["size_bytes"]) <= MIB
    ]
    if small and min(small) > TIME_SLICED_US:
        raise BadInput(
            f"{path}: every xdev call of 1 MiB or less took over {TIME_SLICED_US:g} us (at least "
            f"{min(small):.0f}): the ranks were time-sliced (no MPS); the model is not fitted to "
            "waits for a time slice"
        )


def load_results(
    paths: Sequence[Path], min_fit_bytes: int = MIB, host_floor: bool = True
) -> Loaded:
    """The xdev rows of explicit algorithms; rows below min_fit_bytes get weight 0. All files
    must be of one GPU model and one window. Raises BadInput."""
    measurements: list[GpuMeasurement] = []
    window: Optional[int] = None
    gpu: Optional[str] = None
    sources: list[str] = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise BadInput(f"{path}: cannot read: {e}") from e
        if not isinstance(data, dict):
            raise BadInput(f"{path}: not a benchmarks/allreduce.py JSON file")
        check_shared_gpu(path, data)
        meta: dict[str, Any] = data["metadata"]
        file_window = int(meta.get("cuda_slot_bytes") or DEFAULT_WINDOW_BYTES)
        file_gpu = str(meta.get("gpu", "unknown GPU"))
        if window is not None and (file_window, file_gpu) != (window, gpu):
            raise BadInput(
                f"{path}: {file_gpu} with cuda_slot_bytes {file_window} differs from the other "
                f"files' {gpu} with {window}; calibrate one GPU and window at a time"
            )
        window, gpu = file_window, file_gpu
        dtype = str(meta.get("dtype", "float32"))
        if dtype not in ELEM_BYTES:
            raise BadInput(f"{path}: unknown dtype {dtype!r}")
        ranks = int(meta["nproc"])
        floors = host_floors(meta) if host_floor else {}
        sources.append(str(path))
        for row in data["rows"]:
            algorithm = row.get("algorithm")
            if row.get("backend_base") != "xdev" or algorithm not in ALGORITHMS or row.get("heap"):
                continue  # Gloo, NCCL, "auto", and the in-place program on heap tensors
            size, time_us = int(row["size_bytes"]), float(row["time_us"])
            fitted = measurement(
                ranks, str(algorithm), size, time_us, ELEM_BYTES[dtype], min_fit_bytes
            )
            measurements.append(GpuMeasurement(**fitted, host_us=floors.get(str(algorithm), 0.0)))
    if window is None or gpu is None:
        raise BadInput("no result files given")
    if not any(m.get("weight", 1.0) > 0 for m in measurements):
        raise BadInput(f"no xdev rows of an explicit algorithm of >= {min_fit_bytes} bytes to fit")
    return Loaded(measurements=measurements, window_bytes=window, gpu=gpu, sources=sources)


# ---------------------------------------------------------------------------
# Report


def table(
    params: Params, measurements: Sequence[GpuMeasurement], min_fit_bytes: int
) -> list[TableRow]:
    ordered = sorted(
        measurements,
        key=lambda m: (m["ranks"], m["size_bytes"], ALGORITHMS.index(m["algorithm"])),
    )
    gpu = _model_all(params, ordered)
    rows = []
    for m, g in zip(ordered, gpu):
        host = m.get("host_us", 0.0)
        predicted = max(g, host)
        rows.append(
            TableRow(
                ranks=m["ranks"],
                algorithm=m["algorithm"],
                size_bytes=m["size_bytes"],
                measured_us=m["time_us"],
                model_us=g,
                host_us=host,
                predicted_us=predicted,
                ratio=predicted / m["time_us"],
                in_criterion=m["size_bytes"] >= min_fit_bytes,
            )
        )
    return rows


def within(row: TableRow, tolerance_pct: float) -> bool:
    return abs(row["ratio"] - 1.0) * 100.0 <= tolerance_pct


def print_table(rows: Sequence[TableRow], tolerance_pct: float) -> None:
    print(
        f"{'ranks':>5} {'size':>8}  {'algorithm':<21} {'measured(us)':>12} {'gpu(us)':>9} "
        f"{'host(us)':>9} {'predicted(us)':>13} {'ratio':>6}  within {tolerance_pct:g}%"
    )
    for r in rows:
        verdict = ("yes" if within(r, tolerance_pct) else "NO") if r["in_criterion"] else "-"
        print(
            f"{r['ranks']:>5} {format_size(r['size_bytes']):>8}  {r['algorithm']:<21} "
            f"{r['measured_us']:>12.1f} {r['model_us']:>9.1f} {r['host_us']:>9.1f} "
            f"{r['predicted_us']:>13.1f} {r['ratio']:>6.3f}  {verdict}"
        )


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results",
        nargs="+",
        type=Path,
        default=[DEFAULT_RESULTS],
        help="benchmarks/allreduce.py --device cuda JSON files (default: the H100 MPS run)",
    )
    add_fit_arguments(parser, DEFAULT_OUT)
    parser.add_argument(
        "--no-host-floor",
        action="store_true",
        help="predict the model's GPU time alone, without the measured host time per call",
    )
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.min_fit_bytes < 0 or not args.tolerance > 0:
        sys.exit("calibrate_gpu.py: --min-fit-bytes must be >= 0 and --tolerance > 0")
    try:
        loaded = load_results(args.results, args.min_fit_bytes, not args.no_host_floor)
    except BadInput as e:
        sys.exit(f"calibrate_gpu.py: {e}")
    measurements = loaded["measurements"]
    print(f"# measurements ({loaded['gpu']}): " + ", ".join(loaded["sources"]))
    result = fit(measurements, loaded["window_bytes"])
    print(
        f"# fitted shared-GPU model: memory {result['memory_gbps']:.1f} GB/s  launch "
        f"{result['launch_us']:.2f} us  step (barrier) {result['step_us']:.3f} us  window "
        f"{result['window_bytes']} B"
    )
    bound = print_fit_quality(result, BOX)
    rows = table(result, measurements, args.min_fit_bytes)
    print_table(rows, args.tolerance)
    judged = [r for r in rows if r["in_criterion"]]
    worst = max(judged, key=lambda r: abs(r["ratio"] - 1.0))
    ok = all(within(r, args.tolerance) for r in judged)
    print(
        f"# worst ratio at >= {format_size(args.min_fit_bytes)}: {worst['ratio']:.3f} "
        f"({worst['ranks']} ranks, {worst['algorithm']}, {format_size(worst['size_bytes'])}); "
        f"within {args.tolerance:g}%: {sum(within(r, args.tolerance) for r in judged)}"
        f"/{len(judged)}"
    )
    out: dict[str, Any] = {
        "model": "shared_gpu_machine",
        "gpu": loaded["gpu"],
        "params": {k: result[k] for k in ("window_bytes", *PARAM_NAMES)},  # type: ignore
        "fit": {
            **quality_of(result),
            "min_fit_bytes": args.min_fit_bytes,
            "host_floor": not args.no_host_floor,
        },
        "summary": {
            "at_bound": bound,
            "worst_ratio": worst["ratio"],
            "tolerance_pct": args.tolerance,
            "within_tolerance": ok,
        },
        "sources": loaded["sources"],
        "rows": rows,
    }
    write_model_file(args.out, out)
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
