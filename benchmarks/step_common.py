"""What the training-step benchmarks (ddp_step.py, fsdp_step.py) share.

The model and data, one timed training step, the round-robin turns that interleave variants
so drift on the host hits every variant alike, the slowest-rank reduction of the samples, the
check of the parameters against a reference run's, the statistics and the JSON metadata; the
options both take, the variants' groups and a run's frame (the default group, rank 0's output);
and the check of how a benchmark was launched (torchrun, or not: allreduce.py and
gather_scatter.py start their own ranks). Run as scripts, the benchmarks find this module beside them
(``sys.path`` starts at ``benchmarks/``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import socket
import sys
import statistics
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from run_record import XDEV_PATH, environment, xdev_environment_line

SEED = 20240614
DISTINCT_BATCHES = 4  # per rank, cycled; generated before timing
GROUP_TIMEOUT = datetime.timedelta(seconds=300)

Batches = list[tuple[torch.Tensor, torch.Tensor]]
Say = Callable[[str], None]  # prints a line on rank 0, nothing on the others


def make_model(hidden: int, layers: int) -> nn.Sequential:
    """``layers`` Linear(hidden, hidden) with ReLU between; the same on every rank."""
    torch.manual_seed(SEED)
    modules: list[nn.Module] = []
    for i in range(layers):
        if i:
            modules.append(nn.ReLU())
        modules.append(nn.Linear(hidden, hidden))
    return nn.Sequential(*modules)


def make_batches(hidden: int, batch_size: int, rank: int) -> Batches:
    """This rank's inputs and targets (different on every rank, the same on every run)."""
    gen = torch.Generator().manual_seed(SEED + 1_000_003 * rank)
    return [
        (
            torch.randn(batch_size, hidden, generator=gen),
            torch.randn(batch_size, hidden, generator=gen),
        )
        for _ in range(DISTINCT_BATCHES)
    ]


def train_step(
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    set_to_none: bool = False,
) -> float:
    """One step (zero_grad, forward, MSE backward, optimizer.step); this rank's seconds."""
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=set_to_none)
    loss = (net(x) - y).pow(2).mean()
    loss.backward()  # under DDP/FSDP the collectives are launched and waited for here
    optimizer.step()
    return time.perf_counter() - t0


class Stepper(Protocol):
    """A variant on this rank: ``step`` runs one timed step, ``samples`` collects them."""

    samples: list[float]

    def step(self, batches: Batches) -> float: ...


def max_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise maximum over the ranks, on the default group (which only times)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor]


def parameter_differences(
    mine: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], rtol: float, atol: float
) -> tuple[float, float]:
    """The largest |mine - reference| over every element, and the largest ratio of such a
    difference to what ``torch.isclose`` allows there (``atol + rtol * |reference|``; above 1:
    out of tolerance). For checking a variant's parameters against a reference run's.

    In float64, so the difference of two fp32 values is exact. A non-finite value on either
    side counts as an infinite difference: Python's max() would drop a NaN, which would pass.
    """
    if len(mine) != len(reference):
        raise ValueError(f"{len(mine)} parameters against {len(reference)}")
    worst_diff = worst_ratio = 0.0
    for a, b in zip(mine, reference):
        if a.shape != b.shape:
            raise ValueError(f"a parameter of shape {tuple(a.shape)} against {tuple(b.shape)}")
        if not a.numel():
            continue
        a64, b64 = a.detach().double(), b.detach().double()
        finite = torch.isfinite(a64) & torch.isfinite(b64)
        diff = torch.where(finite, (a64 - b64).abs(), math.inf)
        # Where the difference is 0 it is within any bound, atol = 0 and reference 0 included.
        ratio = torch.where(diff == 0, 0.0, diff / (atol + rtol * b64.abs()))
        worst_diff = max(worst_diff, float(diff.max()))
        worst_ratio = max(worst_ratio, float(torch.where(finite, ratio, math.inf).max()))
    return worst_diff, worst_ratio


class Tolerance(NamedTuple):
    """How far a parameter may be from the reference's: ``atol + rtol * |reference|``."""

    rtol: float
    atol: float


# How far a variant's parameters may end from Gloo's, fp32 (ddp_step.py, fsdp_step.py). The
# whole run moves a parameter very little (SGD at lr 1e-3: by at most 8.2e-6 in the default 30
# steps, 5.8e-5 in the tests' 3 of the small model; the parameters themselves are up to 0.022
# and 0.125), so the bound must sit well below that to catch a wrong reduction, and well above
# fp32 rounding. Measured with DDP:
# - fp32 variants: exactly Gloo's with 2 ranks (a + b is the same in any order); 3.7e-9 (2
#   ulps of the largest parameters) with 4 ranks, hidden 1024, whose sums associate
#   differently: at most 0.04 of this bound.
# - avg_comm_hook swapped for a broadcast of rank 0's gradients (all ranks alike wrong, so
#   equal across ranks): 5.1e-6 at the defaults, 2.1e-5 in the small model: 35 and 100 times
#   this bound (the largest |diff| / (atol + rtol * |p|) over the elements). A much smaller
#   --lr, or fewer steps, shrinks that margin with the update.
# rtol covers the rounding of the larger parameters (ulp = 1.2e-7 relative). fsdp_step.py's
# docstring gives what FSDP2 measured against it.
FP32_TOLERANCE = Tolerance(rtol=1e-5, atol=1e-7)


def run_turn(runner: Stepper, batches: Batches, steps: int, warmup: int) -> None:
    """One variant's turn in a round: ``warmup`` untimed steps, then ``steps`` timed ones."""
    dist.barrier()  # every rank starts the turn together
    for _ in range(warmup):
        runner.step(batches)
    times = [runner.step(batches) for _ in range(steps)]
    runner.samples.extend(max_over_ranks(times))


T = TypeVar("T")


def round_order(variants: Sequence[T], round_index: int) -> list[T]:
    """The variants' order in round ``round_index``: each round starts one variant later, so
    that none is always timed first or always after the same neighbour, and drift on the host
    hits all alike. Every benchmark that interleaves variants takes its turns in this order."""
    start = round_index % len(variants) if variants else 0
    return list(variants[start:]) + list(variants[:start])


def spread_note(label: str, samples: Sequence[float], limit: float = 1.5) -> Optional[str]:
    """A warning line where one variant's rounds disagree by more than ``limit`` (slowest over
    fastest): its median then stands for a machine that changed under it (another process,
    frequency, a noisy neighbour), and the run is worth repeating."""
    fastest, slowest = min(samples), max(samples)
    if len(samples) < 2 or fastest <= 0 or slowest / fastest <= limit:
        return None
    return (
        f"# note: {label}: its rounds differ {slowest / fastest:.1f}x"
        f" ({fastest * 1e6:.1f} to {slowest * 1e6:.1f} us); the machine was not quiet"
    )


def run_rounds(
    runners: Sequence[Stepper], batches: Batches, rounds: int, steps: int, warmup: int
) -> None:
    """Round-robin turns in ``round_order``."""
    for round_index in range(rounds):
        for runner in round_order(runners, round_index):
            run_turn(runner, batches, steps, warmup)


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def timing_stats(samples: Sequence[float]) -> dict[str, Any]:
    """Median, spread and the samples themselves, in milliseconds."""
    return {
        "median_ms": statistics.median(samples) * 1e3,
        "min_ms": min(samples) * 1e3,
        "max_ms": max(samples) * 1e3,
        "p25_ms": percentile(samples, 0.25) * 1e3,
        "p75_ms": percentile(samples, 0.75) * 1e3,
        "samples_ms": [s * 1e3 for s in samples],
    }


def text(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def yes_no(value: Optional[bool], broken: str = "no") -> str:
    return "-" if value is None else ("yes" if value else broken)


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, data and timing options both step benchmarks take."""
    parser.add_argument("--hidden", type=int, default=2048, help="width of the MLP")
    parser.add_argument("--layers", type=int, default=4, help="Linear(hidden, hidden) layers")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")


def check_step_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("hidden", "layers", "batch_size", "rounds", "steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")


def default_json(benchmark: str, world_size: int) -> Path:
    """Where rank 0 saves the rows without --json: benchmarks/results/<benchmark>_<N>ranks.json."""
    return Path(__file__).resolve().parent / "results" / f"{benchmark}_{world_size}ranks.json"


def add_variant_arguments(
    parser: argparse.ArgumentParser, names: Sequence[str], benchmark: str
) -> None:
    """--variants (a subset of ``names``, run in their order) and --json."""
    parser.add_argument(
        "--variants",
        type=lambda s: parse_variant_list(s, names),
        default=list(names),
        help=f"a comma-separated subset of {','.join(names)} (default all; run in this order)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help=f"where rank 0 saves the rows (default benchmarks/results/{benchmark}_<N>ranks.json)",
    )


def parse_variant_list(text_value: str, known: Sequence[str]) -> list[str]:
    names = [n.strip() for n in text_value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"--variants: a comma-separated subset of {', '.join(known)}; got {text_value!r}"
        )
    return names


def new_group(backend: str, pg_options: Any = None) -> dist.ProcessGroup:
    """A group of every rank, for one variant. Collective: every rank creates the variants'
    groups in one order."""
    group = dist.new_group(backend=backend, pg_options=pg_options, timeout=GROUP_TIMEOUT)
    assert group is not None  # every rank is a member
    return group


def say_lines(say: Say, *blocks: Sequence[str]) -> None:
    for block in blocks:
        for line in block:
            say(line)


def run_on_default_group(
    args: argparse.Namespace, run: Callable[[argparse.Namespace, int, int, Say], int]
) -> int:
    """``run(args, rank, world_size, say)`` in a process torchrun started, on a Gloo default
    group; returns its exit status."""
    torch.set_num_threads(args.threads)
    # The default group only times and checks; every variant has a group of its own.
    dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    say: Say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    try:
        return run(args, rank, world_size, say)
    finally:
        # Free the DDP wrappers and FSDP2 modules (gc breaks their reference cycles) while their
        # groups are still registered: see examples/ddp_train.py for the deadlock the other
        # order risks.
        gc.collect()
        dist.destroy_process_group()


def started_by_torchrun() -> bool:
    """Whether torchrun (or a launcher like it) started this process: it sets these two."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def under_torchrun(script: str) -> bool:
    """Whether torchrun started this process; says how to run it otherwise."""
    if started_by_torchrun():
        return True
    print(f"run this under torchrun, e.g. torchrun --nproc_per_node 2 {script}", file=sys.stderr)
    return False


def refused_under_torchrun(script: str) -> bool:
    """For the benchmarks that start their own ranks (mp.spawn): True, after saying how to run
    it, where torchrun started this process. Under torchrun every process would start a world
    of its own, whose ranks inherit torchrun's rendezvous settings (such as
    TORCHELASTIC_USE_AGENT_STORE) and wait forever for a store nobody serves."""
    if not started_by_torchrun():
        return False
    print(
        f"{Path(script).name} starts its own ranks: run it without torchrun, e.g."
        f" python {script} --nproc 2",
        file=sys.stderr,
    )
    return True


def host_line(variables: Sequence[str] = ()) -> str:
    """The header lines that say which torch, which torch_xdev and which host ran, and with
    which XDEV_* variables (they change what runs without a flag that says so)."""
    shown = "".join(f"{v}={os.environ.get(v, '(unset)')}  " for v in variables)
    return (
        f"# {shown}torch {torch.__version__}  torch_xdev from {XDEV_PATH}"
        f"  host {socket.gethostname()}\n{xdev_environment_line()}"
    )


def metadata(
    benchmark: str, args: argparse.Namespace, world_size: int, params: int
) -> dict[str, Any]:
    """What a JSON result says about the run besides its rows."""
    return {
        "benchmark": benchmark,
        "world_size": world_size,
        "hidden": args.hidden,
        "layers": args.layers,
        "parameters": params,
        "gradient_bytes": params * 4,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "variants": args.variants,
        **environment(),
    }
