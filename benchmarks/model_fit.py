"""Fitting a cost model's parameters to measured allreduce times: what the calibration scripts
share.

benchmarks/calibrate.py (the CPU model) and benchmarks/calibrate_gpu.py (ranks sharing one GPU)
both fit a handful of positive parameters by minimising the mean squared log error of the
model's predictions. The search runs in log space (every parameter is a rate or a latency, so
relative steps are the natural ones), inside a box of bounds, with a deterministic Nelder-Mead
multi-started from fixed points. No scipy.

They also share the rows: a measured allreduce the fit reads (Measurement), a row of the
measured-versus-predicted table (ComparedRow), and how a model file is written.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Callable, Mapping, NotRequired, Optional, Sequence, TypedDict, TypeVar

Vector = list[float]
Row = TypeVar("Row", bound=Mapping[str, Any])
Params = TypeVar("Params")
MIB = 1 << 20

# What benchmarks/allreduce.py's rows name: the explicit algorithms the models predict, and the
# bytes of each dtype.
ALGORITHMS = ("direct", "reduce_to_one", "flat", "hierarchical_copy", "hierarchical_balanced")
HIERARCHICAL = ("hierarchical_copy", "hierarchical_balanced")
ELEM_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}


class Measurement(TypedDict):
    """One measured allreduce of benchmarks/allreduce.py, as the fits read it."""

    ranks: int
    algorithm: str
    size_bytes: int
    time_us: float
    elem_bytes: NotRequired[int]  # 4 when absent
    weight: NotRequired[float]  # 1 when absent; 0 leaves the row out of the fit


def measurement(
    ranks: int,
    algorithm: str,
    size: int,
    time_us: float,
    elem_bytes: int,
    min_fit_bytes: int,
    small_weight: float = 0.0,
) -> Measurement:
    """A row for the fit; one below min_fit_bytes, outside the criterion, weighs small_weight."""
    return Measurement(
        ranks=ranks,
        algorithm=algorithm,
        size_bytes=size,
        time_us=time_us,
        elem_bytes=elem_bytes,
        weight=1.0 if size >= min_fit_bytes else small_weight,
    )


class ComparedRow(TypedDict):
    """A row of a calibration's table: a measured time beside the fitted model's."""

    ranks: int
    algorithm: str
    size_bytes: int
    measured_us: float
    predicted_us: float
    in_criterion: bool  # size >= min_fit_bytes


def num_packs(algorithm: str, ranks: int) -> int:
    """What the backends use when an algorithm is forced: one pack per rank for the
    hierarchical plans, none for the others."""
    return ranks if algorithm in HIERARCHICAL else 0


def nelder_mead(
    f: Callable[[Vector], float],
    x0: Vector,
    step: float,
    project: Callable[[Vector], Vector] = lambda x: x,
    ftol: float = 1e-6,
    xtol: float = 1e-3,
    max_evals: int = 500,
) -> tuple[Vector, float, int]:
    """Minimises f from x0 with the standard coefficients (1, 2, 0.5, 0.5).

    The initial simplex is x0 plus `step` along each axis; every point is passed through
    `project` (e.g. onto a box). Stops when the simplex's values differ by less than
    ftol * (1 + |best|), or its extent is below xtol, or after max_evals evaluations.
    Returns (best x, f(best x), evaluations).
    """
    n = len(x0)
    simplex: list[Vector] = [project(list(x0))]
    for i in range(n):
        x = list(x0)
        x[i] += step
        simplex.append(project(x))
    values = [f(x) for x in simplex]
    evals = n + 1

    def order() -> None:
        nonlocal simplex, values
        ranked = sorted(range(n + 1), key=lambda k: (values[k], k))
        simplex = [simplex[k] for k in ranked]
        values = [values[k] for k in ranked]

    while evals < max_evals:
        order()
        extent = max(abs(simplex[k][i] - simplex[0][i]) for k in range(1, n + 1) for i in range(n))
        if values[-1] - values[0] <= ftol * (1.0 + abs(values[0])) or extent < xtol:
            break
        centroid = [sum(simplex[k][i] for k in range(n)) / n for i in range(n)]
        worst = simplex[-1]

        def towards(t: float) -> Vector:
            return project([c + t * (w - c) for c, w in zip(centroid, worst)])

        reflected = towards(-1.0)
        fr = f(reflected)
        evals += 1
        if fr < values[0]:
            expanded = towards(-2.0)
            fe = f(expanded)
            evals += 1
            if fe < fr:
                simplex[-1], values[-1] = expanded, fe
            else:
                simplex[-1], values[-1] = reflected, fr
            continue
        if fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
            continue
        contracted = towards(-0.5) if fr < values[-1] else towards(0.5)
        fc = f(contracted)
        evals += 1
        if fc < min(fr, values[-1]):
            simplex[-1], values[-1] = contracted, fc
            continue
        best = simplex[0]
        for k in range(1, n + 1):
            simplex[k] = project([b + 0.5 * (x - b) for b, x in zip(best, simplex[k])])
            values[k] = f(simplex[k])
            evals += 1
    order()
    return simplex[0], values[0], evals


class LogBox:
    """Named positive parameters searched as their logarithms, within [low, high] each."""

    def __init__(self, bounds: Mapping[str, tuple[float, float]]) -> None:
        for name, (lo, hi) in bounds.items():
            if not 0 < lo < hi:
                raise ValueError(f"{name}: bounds must satisfy 0 < low < high, got {lo}, {hi}")
        self.names = tuple(bounds)
        self.bounds = dict(bounds)

    def clamp(self, x: Vector) -> Vector:
        """x projected onto the box (in log space)."""
        return [
            min(math.log(self.bounds[name][1]), max(math.log(self.bounds[name][0]), xi))
            for name, xi in zip(self.names, x)
        ]

    def values(self, x: Vector) -> dict[str, float]:
        """The parameters at log-space point x, each within its bounds."""
        out = {}
        for name, xi in zip(self.names, x):
            lo, hi = self.bounds[name]
            out[name] = min(hi, max(lo, math.exp(xi)))
        return out

    def point(self, values: Sequence[float]) -> Vector:
        """The log-space point of parameter values given in the order of `names`."""
        return self.clamp([math.log(v) for v in values])

    def at_bound(self, values: Mapping[str, Any]) -> list[str]:
        """The parameters within a factor 2 of a bound: the data do not pin them. ``values``
        may hold other keys too (a fit's whole result): only ``names`` are read."""
        out = []
        for name in self.names:
            lo, hi = self.bounds[name]
            value = float(values[name])
            if value <= lo * 2 or value >= hi / 2:
                out.append(f"{name} ({'lower' if value <= lo * 2 else 'upper'})")
        return out


def mean_squared_log_error(
    predicted: Sequence[float], measured: Sequence[float], weights: Sequence[float]
) -> float:
    """Weighted mean of log(predicted / measured) ** 2; the weights must sum to > 0."""
    total = sum(weights)
    if not total > 0:
        raise ValueError("no measurements with a weight > 0")
    return sum(w * math.log(p / m) ** 2 for p, m, w in zip(predicted, measured, weights)) / total


def minimise(
    objective: Callable[[Vector], float],
    starts: Sequence[Vector],
    box: LogBox,
    max_evals: int,
) -> tuple[Vector, float]:
    """The best point found from each of `starts` (log-space points).

    From each start, Nelder-Mead (at most max_evals / len(starts) evaluations each) is restarted
    from its best point with a simplex half as large until a restart no longer improves; the
    best of all starts wins. Deterministic.
    """
    budget = max(1, max_evals // max(1, len(starts)))
    best_x: Optional[Vector] = None
    best_f = math.inf
    for start in starts:
        x = box.clamp(list(start))
        fx = objective(x)
        used, step = 0, 1.0
        while used < budget and step >= 0.03:
            nx, nf, n = nelder_mead(objective, x, step, box.clamp, max_evals=budget - used)
            used += n
            gained = fx - nf
            if nf < fx:
                x, fx = nx, nf
            if gained <= 1e-6 * (1.0 + abs(fx)):
                break
            step /= 2
        if fx < best_f:
            best_x, best_f = x, fx
    if best_x is None:
        raise ValueError("no starting points")
    return best_x, best_f


def weighted_rows(measurements: Sequence[Row]) -> list[Row]:
    """The rows a fit uses: those of weight > 0 (1 when absent). Raises ValueError for a row
    the models cannot predict (not an explicit algorithm, or a time that is not > 0)."""
    for m in measurements:
        if m["algorithm"] not in ALGORITHMS:
            raise ValueError(f"not an algorithm the model can predict: {m['algorithm']!r}")
        if not m["time_us"] > 0:
            raise ValueError(f"measured time must be > 0: {m}")
    fitted = [m for m in measurements if m.get("weight", 1.0) > 0]
    if not fitted:
        raise ValueError("no measurements with a weight > 0")
    return fitted


def fit_in_box(
    loss: Callable[[Vector], float], starts: Sequence[Sequence[float]], box: LogBox, max_evals: int
) -> tuple[Vector, int]:
    """minimise() of `loss` (a function of a log-space point) from the parameter points
    `starts`, each point evaluated once; returns the best log-space point and how many
    distinct points were evaluated."""
    cache: dict[tuple[float, ...], float] = {}

    def objective(x: Vector) -> float:
        key = tuple(round(v, 9) for v in x)
        if key not in cache:
            cache[key] = loss(x)
        return cache[key]

    best_x, _ = minimise(objective, [box.point(s) for s in starts], box, max_evals)
    return best_x, len(cache)


class FitQuality(TypedDict):
    """How well a fit's parameters meet the rows, and what finding them cost."""

    loss: float  # weighted mean of squared log errors
    rms_log_error: float
    evaluations: int  # distinct parameter points evaluated
    rows: int  # rows with a weight > 0


def fit_params(
    to_params: Callable[[Vector], Params],
    loss_of: Callable[[Params, Sequence[Row]], float],
    measurements: Sequence[Row],
    starts: Sequence[Sequence[float]],
    box: LogBox,
    max_evals: int,
) -> tuple[Params, FitQuality]:
    """The parameters (to_params of a log-space point of `box`) that minimise loss_of over the
    rows of weight > 0, by fit_in_box from `starts`, and how well they fit. Raises ValueError as
    weighted_rows does."""
    fitted = weighted_rows(measurements)
    best_x, evaluations = fit_in_box(
        lambda x: loss_of(to_params(x), fitted), starts, box, max_evals
    )
    params = to_params(best_x)
    loss = loss_of(params, fitted)
    return params, FitQuality(
        loss=loss, rms_log_error=math.sqrt(loss), evaluations=evaluations, rows=len(fitted)
    )


def weighted_loss(
    predict: Callable[[list[Row]], list[float]], measurements: Sequence[Row]
) -> float:
    """mean_squared_log_error of predict's µs against the rows of weight > 0 (1 when absent)."""
    rows = [m for m in measurements if m.get("weight", 1.0) > 0]
    return mean_squared_log_error(
        predict(rows), [m["time_us"] for m in rows], [m.get("weight", 1.0) for m in rows]
    )


def predict_rows_us(machine: Callable[[int], Any], rows: Sequence[Row]) -> list[float]:
    """The model's time in µs of each row's allreduce (its ranks, algorithm, size_bytes and
    elem_bytes, 4 when absent) on machine(ranks), each rank count's machine made once."""
    from torch_xdev._C import plan  # imported here: the rest of this module needs no build

    machines: dict[int, Any] = {}
    out: list[float] = []
    for row in rows:
        ranks = row["ranks"]
        if ranks not in machines:
            machines[ranks] = machine(ranks)
        algorithm = row["algorithm"]
        predicted = plan.predict(
            machines[ranks],
            algorithm,
            num_packs(algorithm, ranks),
            row["size_bytes"],
            row.get("elem_bytes", 4),
        )
        out.append(1e6 * predicted["seconds"])
    return out


def predict_one_us(
    machine: Callable[[int], Any], ranks: int, algorithm: str, size: int, elem_bytes: int = 4
) -> float:
    """predict_rows_us of one allreduce of `size` bytes."""
    row = {"ranks": ranks, "algorithm": algorithm, "size_bytes": size, "elem_bytes": elem_bytes}
    return predict_rows_us(machine, [row])[0]


def add_fit_arguments(parser: argparse.ArgumentParser, default_out: Path) -> None:
    """The options both calibration scripts take: where to write, which rows to judge, and
    how strictly."""
    parser.add_argument("--out", type=Path, default=default_out, help=f"output ({default_out})")
    parser.add_argument(
        "--min-fit-bytes",
        type=int,
        default=MIB,
        help="rows of at least this size are fitted and judged (default 1 MiB)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=25.0,
        help="acceptance: |predicted / measured - 1| in %% (default 25)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a judged row is outside --tolerance"
    )


def print_fit_quality(result: Mapping[str, Any], box: LogBox) -> list[str]:
    """Prints how well the fit meets its rows and which parameters sit at a search bound (the
    rows do not determine them); returns those. ``result`` holds the FitQuality fields and the
    parameters of ``box``."""
    print(
        f"# {result['rows']} rows fitted, rms log error {result['rms_log_error']:.4f}, "
        f"{result['evaluations']} model evaluations"
    )
    bound = box.at_bound(result)
    if bound:
        print("# at a search bound (these rows do not determine it): " + ", ".join(bound))
    return bound


def quality_of(result: Mapping[str, Any]) -> FitQuality:
    """The FitQuality fields of a fit's result (parameters and quality in one dict)."""
    return FitQuality(
        loss=result["loss"],
        rms_log_error=result["rms_log_error"],
        evaluations=result["evaluations"],
        rows=result["rows"],
    )


def write_model_file(path: Path, model: Mapping[str, Any]) -> None:
    """Writes a fitted model (its parameters, the fit and the table) as JSON to ``path``, its
    folder made, and says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(model, indent=2) + "\n")
    print(f"# wrote {path}")
