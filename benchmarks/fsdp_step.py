"""FSDP2 training-step benchmark: ``fully_shard`` on xdev against Gloo and steps without comm.

Usage (under torchrun, one process per rank)::

    torchrun --nproc_per_node 2 benchmarks/fsdp_step.py [--hidden 2048] [--layers 4]
        [--batch-size 32] [--rounds 7] [--steps 3] [--warmup 1] [--threads 1]
        [--variants xdev,...,local] [--profile] [--json out.json]

Every variant trains its own copy of one MLP (``--layers`` square ``Linear(hidden, hidden)``
layers with ReLU between them; the defaults give 16.8M parameters, 67 MB in fp32) with SGD
on synthetic data that differs per rank. The FSDP2 variants call ``fully_shard`` on each
Linear, then on the root, over a process group of their own: each step all-gathers every
layer's parameters in forward and again in backward (the layers reshard after forward) and
reduce-scatters their gradients with AVG.

- ``xdev``: FSDP2 on an xdev group.
- ``xdev_heap``: the same with ``set_allocate_memory_from_process_group_for_comm(True)``:
  FSDP2 takes its all-gather and reduce-scatter buffers from the group's symmetric heap
  (``allocate_tensor``), memory every rank maps.
- ``gloo``: FSDP2 on a Gloo group.
- ``fsdp_alone``: FSDP2 on a group of this rank alone (Gloo, a world of one), training on
  this rank's data: FSDP2's own work (copy-in, copy-out, resharding, DTensor bookkeeping;
  in a world of one it calls no collective) with nobody to talk to.
- ``fsdp_no_comm``: FSDP2 sharded over all the ranks as in the others, with the
  communication removed: ``set_custom_all_gather`` and ``set_custom_reduce_scatter`` put in
  collectives that do nothing, so FSDP2 does all its own work on the same shards (copy-in,
  copy-out, the gradients' chunk-cat, resharding) and sends nothing. Their buffers are
  zeros kept from call to call, so the parameters stay as they are and finite; the other
  variants' buffers are FSDP2's own (fresh per call), so this baseline leaves the cost of
  allocating them on the communicating side.
- ``local``: the plain model, unsharded, local forward/backward/step: the step without
  communication. A variant's median step minus this one's (``comm``) is what sharding and
  communication cost it per step; minus ``fsdp_no_comm``'s (``net``) is what the
  communication alone costs; minus ``fsdp_alone``'s is what talking to the peers costs
  beyond FSDP2's own work in a world of one.

After one untimed step per variant, the variants run round-robin for ``--rounds`` rounds,
each round starting one variant later; each turn times ``--steps`` steps after ``--warmup``
untimed ones, so drift on the host hits every variant alike. A step's time is the slowest
rank's wall time from ``zero_grad`` to the end of ``optimizer.step()``.

Every FSDP2 variant that spans the ranks (``xdev``, ``xdev_heap``, ``gloo``) runs the same
steps on the same batches, so after timing each rank's parameter shards must match Gloo's
within ``FP32_TOLERANCE`` (step_common.py, as ddp_step.py's fp32 variants: ``|p - Gloo's p| <=
atol + rtol * |Gloo's p|`` with rtol 1e-5, atol 1e-7, element by element), and must have moved
from their initial values beyond that same bound somewhere, so that a variant which does not
train (whose collectives leave the gradients at zero, say) cannot match a Gloo that barely
moved. The table's ``diff`` is the largest |p - Gloo's p| on any rank, BROKEN there, a line
saying why and exit status 1 where either check fails; the lines after the table give both
measures, in units of the bound too. The whole run moves a parameter little (by at most
7.9e-6 at the defaults, 3.7e-5 in the tests' 2 steps of ``--hidden 64 --layers 2``), so an
absolute bound of that size (1e-4 here once) passes a variant that never changes its
parameters. Measured against this bound (the largest |diff| / (atol + rtol * |p|) over the
elements):

- ``xdev`` and ``xdev_heap``: exactly Gloo's with 2 ranks; with 3 ranks (whose sums round in
  another order) 1.9e-9 at the defaults, 0.007 of the bound (0.003 in the small model).
- A variant whose parameters never change (``fsdp_no_comm`` compared as if it spanned the
  ranks): 48 times the bound from Gloo's at the defaults, 119 times in the small model, and
  it moved 0; Gloo moved 48 and 119 times the bound. A much smaller ``--lr``, or fewer
  steps, shrinks that margin with the update.

``--profile`` then says where a step's time goes (fsdp_profile.py). First ``--steps`` more
steps of every variant in turn, ``--rounds`` times, with ``dist.all_gather_single`` and
``dist.reduce_scatter_single`` (what FSDP2 calls; synchronously on CPU) wrapped in timers,
each call preceded by a barrier on its group that is timed apart (``arrival``: waiting for
the last rank): per variant, the time per step in each collective, in arrival and in the
rest of the step (the ranks' mean, median over steps). Then one step of each variant under
``torch.profiler``: rank 0's CPU time by operator (the collectives, FSDP2's copy-in and
copy-out, compute).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import resource
import statistics
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

# The interfaces set_custom_all_gather / set_custom_reduce_scatter take; torch exports them
# from no public module (2.13, 2.14).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor

import torch_xdev
from fsdp_profile import breakdown, profile_step
from run_record import write_results
from step_common import (
    FP32_TOLERANCE,
    GROUP_TIMEOUT,
    Batches,
    Say,
    add_step_arguments,
    add_variant_arguments,
    check_step_arguments,
    default_json,
    host_line,
    make_batches,
    make_model,
    max_over_ranks,
    metadata,
    new_group,
    parameter_differences,
    run_on_default_group,
    run_rounds,
    say_lines,
    text,
    timing_stats,
    train_step,
    under_torchrun,
)

GLOO = "gloo"
NO_COMM = "local"
ALONE = "fsdp_alone"
NO_COMM_FSDP = "fsdp_no_comm"


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    backend: Optional[str]  # of the variant's group; None: no FSDP
    heap_buffers: bool = False  # set_allocate_memory_from_process_group_for_comm(True)
    alone: bool = False  # a group of this rank alone
    no_comm: bool = False  # FSDP2's collectives replaced by ones that send nothing

    @property
    def spans_ranks(self) -> bool:
        """Its collectives reach every rank (its parameters must then match Gloo's)."""
        return self.backend is not None and not self.alone and not self.no_comm


VARIANTS = (
    Variant("xdev", "xdev"),
    Variant("xdev_heap", "xdev", heap_buffers=True),
    Variant(GLOO, "gloo"),
    Variant(ALONE, "gloo", alone=True),
    Variant(NO_COMM_FSDP, "gloo", no_comm=True),
    Variant(NO_COMM, None),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


def kept_zeros(
    buffers: dict[tuple[int, torch.dtype, str], torch.Tensor],
    size: Sequence[int | torch.SymInt],
    dtype: torch.dtype,
    device: torch.device,
    role: str,
) -> torch.Tensor:
    """A zero-filled buffer of ``size`` for ``role``, the same one on every call."""
    key = (math.prod(int(s) for s in size), dtype, role)
    if key not in buffers:
        buffers[key] = torch.zeros(key[0], dtype=dtype, device=device)
    return buffers[key]


class NoCommAllGather(AllGather):
    """FSDP2's all-gather without the communication. FSDP2 copies this rank's shard into its
    block of the output (the input is that block) and the unsharded parameters out of it; the
    other ranks' blocks hold zeros. One output per size serves every call: on CPU FSDP2 copies
    an output out before it all-gathers the next."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, torch.dtype, str], torch.Tensor] = {}

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return kept_zeros(self.buffers, size, dtype, device, "output")

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        return None


class NoCommReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter without the communication. FSDP2 asks for the input buffer
    (which its chunk-cat of the gradients fills), then for the output, whose zeros become the
    sharded gradients: SGD leaves the parameters as they are."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, torch.dtype, str], torch.Tensor] = {}
        self.roles = ("input", "output")
        self.allocations = 0

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        role = self.roles[self.allocations % 2]
        self.allocations += 1
        return kept_zeros(self.buffers, size, dtype, device, role)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        # The gradients must land in zeros: fail loudly should FSDP2 ask in another order.
        kept = self.buffers.get((output_tensor.numel(), output_tensor.dtype, "output"))
        if kept is None or kept.data_ptr() != output_tensor.data_ptr():
            raise RuntimeError("fsdp_no_comm: FSDP2 no longer allocates input, then output")
        return None


@dataclasses.dataclass
class Runner:
    """One variant on this rank: its group, model and optimizer."""

    variant: Variant
    group: Optional[dist.ProcessGroup]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    samples: list[float] = dataclasses.field(default_factory=list)  # slowest rank, seconds
    faults: list[int] = dataclasses.field(default_factory=list)  # this rank's, per step
    cpu: list[float] = dataclasses.field(default_factory=list)  # this process's CPU seconds
    steps_run: int = 0
    # Copies of this rank's shards before any step: the variants compared with Gloo only.
    initial: Optional[list[torch.Tensor]] = None

    def step(self, batches: Batches) -> float:
        x, y = batches[self.steps_run % len(batches)]
        self.steps_run += 1
        # Minor page faults (every thread of the process): first touches of freshly mapped
        # memory, such as large buffers the allocator gets from mmap on every step.
        # CPU time of all its threads: above the wall time when threads run side by side.
        before = resource.getrusage(resource.RUSAGE_SELF)
        seconds = train_step(self.model, self.optimizer, x, y)
        after = resource.getrusage(resource.RUSAGE_SELF)
        self.faults.append(after.ru_minflt - before.ru_minflt)
        self.cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        return seconds


def make_group(variant: Variant) -> Optional[dist.ProcessGroup]:
    """The variant's own group. Collective: every rank creates them in one order."""
    if variant.backend is None:
        return None
    if variant.alone:
        # Creates one group per rank on every rank, and returns this rank's.
        mine, _ = dist.new_subgroups(group_size=1, backend=variant.backend, timeout=GROUP_TIMEOUT)
        return mine
    return new_group(variant.backend)


def make_runner(variant: Variant, args: argparse.Namespace) -> Runner:
    group = make_group(variant)
    model = make_model(args.hidden, args.layers)
    if group is not None:
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if variant.no_comm:
            all_gather, reduce_scatter = NoCommAllGather(), NoCommReduceScatter()
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_custom_all_gather(all_gather)
                    module.set_custom_reduce_scatter(reduce_scatter)
        if variant.heap_buffers:
            # The setting is per FSDP module (each fully_shard call has its own buffers):
            # on the root alone it would reach none of the layers.
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_allocate_memory_from_process_group_for_comm(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    initial = None
    if variant.spans_ranks:
        initial = [shard.clone() for shard in local_shards(model)]
    return Runner(variant, group, model, optimizer, initial=initial)


def local_shards(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]


@dataclasses.dataclass(frozen=True)
class Check:
    """How a variant's parameters ended, against Gloo's and against their initial values; each
    a largest |difference| and the largest such difference over what FP32_TOLERANCE allows
    there (above 1: beyond it). The Gloo side is None without ``gloo`` among the variants."""

    max_diff: Optional[float]
    diff_ratio: Optional[float]
    max_change: float
    change_ratio: float

    @property
    def matches_gloo(self) -> Optional[bool]:
        return None if self.diff_ratio is None else self.diff_ratio <= 1.0

    @property
    def trained(self) -> bool:
        """Moved beyond the tolerance somewhere, and finite everywhere."""
        return 1.0 < self.change_ratio < math.inf


def local_checks(runners: list[Runner]) -> list[Optional[Check]]:
    """Per runner: its Check on this rank's shards (None: not checked, as it does not span the
    ranks). Each rank's shards cover the same elements in every variant."""
    gloo = next((r for r in runners if r.variant.name == GLOO), None)
    rtol, atol = FP32_TOLERANCE
    checks: list[Optional[Check]] = []
    for runner in runners:
        if runner.initial is None:
            checks.append(None)
            continue
        shards = local_shards(runner.model)
        # A non-finite parameter counts as an infinite difference (ratio included).
        max_change, change_ratio = parameter_differences(shards, runner.initial, rtol, atol)
        max_diff = diff_ratio = None
        if gloo is not None:
            max_diff, diff_ratio = parameter_differences(
                shards, local_shards(gloo.model), rtol, atol
            )
        checks.append(Check(max_diff, diff_ratio, max_change, change_ratio))
    return checks


def check_parameters(runners: list[Runner]) -> list[Optional[Check]]:
    """Per runner: its Check, each measure on the rank where it is worst (None: not checked).
    Collective over the default group; every rank checks the same variants and gets the same
    answers."""
    local = local_checks(runners)
    values = [
        v
        for c in local
        if c is not None
        for v in (c.max_change, c.change_ratio, c.max_diff, c.diff_ratio)
        if v is not None  # the Gloo side: on every rank, or on none
    ]
    worst = iter(max_over_ranks(values))
    checks: list[Optional[Check]] = []
    for c in local:
        if c is not None:
            max_change, change_ratio = next(worst), next(worst)
            max_diff = diff_ratio = None
            if c.max_diff is not None:
                max_diff, diff_ratio = next(worst), next(worst)
            c = Check(max_diff, diff_ratio, max_change, change_ratio)
        checks.append(c)
    return checks


def per_step_counts(runners: list[Runner]) -> tuple[list[float], list[float]]:
    """Per runner: the median minor page faults and CPU ms of a step, on the rank with most."""
    faults = [float(statistics.median(r.faults)) for r in runners]
    cpu = [statistics.median(r.cpu) * 1e3 for r in runners]
    both = max_over_ranks(faults + cpu)
    return both[: len(runners)], both[len(runners) :]


def heap_reserved(runner: Runner) -> Optional[int]:
    """Bytes an xdev group's symmetric heap has reserved: it grows past its first arena only
    when FSDP2 takes its buffers from it (they are freed after each collective)."""
    if runner.variant.backend != torch_xdev.BACKEND_NAME or runner.group is None:
        return None
    heap = torch_xdev.describe(runner.group).get("symmetric_heap")
    return heap.get("bytes_reserved") if isinstance(heap, dict) else None


def summarise(
    runners: list[Runner],
    checks: list[Optional[Check]],
    heaps: list[Optional[int]],
    faults: list[float],
    cpu: list[float],
) -> list[dict[str, Any]]:
    """The table's rows: times in ms, communication per step, ratios against Gloo."""
    medians = {r.variant.name: statistics.median(r.samples) for r in runners}
    local = medians.get(NO_COMM)
    alone = medians.get(ALONE)
    no_comm = medians.get(NO_COMM_FSDP)
    gloo = medians.get(GLOO)
    gloo_comm = None if gloo is None or local is None else gloo - local
    gloo_net = None if gloo is None or no_comm is None else gloo - no_comm
    rows: list[dict[str, Any]] = []
    for runner, check, heap, fault_count, cpu_ms in zip(runners, checks, heaps, faults, cpu):
        v = runner.variant
        median = medians[v.name]
        comm = median - local if local is not None and v.backend is not None else None
        beyond = median - alone if alone is not None and v.spans_ranks else None
        net = median - no_comm if no_comm is not None and v.spans_ranks else None
        rows.append(
            {
                "variant": v.name,
                "backend": v.backend,
                "heap_buffers": v.heap_buffers,
                "alone": v.alone,
                **timing_stats(runner.samples),
                "comm_ms": None if comm is None else comm * 1e3,
                "beyond_alone_ms": None if beyond is None else beyond * 1e3,
                "net_ms": None if net is None else net * 1e3,
                "step_vs_gloo": None if gloo is None else gloo / median,
                "comm_vs_gloo": (
                    gloo_comm / comm
                    if gloo_comm is not None and comm is not None and comm > 0 and v.spans_ranks
                    else None
                ),
                "net_vs_gloo": (
                    gloo_net / net if gloo_net is not None and net is not None and net > 0 else None
                ),
                # The largest |parameter - Gloo's| on any rank, and whether every element
                # is within FP32_TOLERANCE of Gloo's (None: not compared).
                "max_diff_vs_gloo": None if check is None else check.max_diff,
                "diff_vs_tolerance": None if check is None else check.diff_ratio,
                "matches_gloo": None if check is None else check.matches_gloo,
                # The largest |parameter - its initial value| on any rank, and whether some
                # element moved beyond FP32_TOLERANCE (None: not checked).
                "max_change_from_initial": None if check is None else check.max_change,
                "change_vs_tolerance": None if check is None else check.change_ratio,
                "trained": None if check is None else check.trained,
                "heap_bytes_reserved": heap,
                "minor_faults_per_step": fault_count,
                "cpu_ms_per_step": cpu_ms,
            }
        )
    return rows


def is_broken(row: dict[str, Any]) -> bool:
    return row["matches_gloo"] is False or row["trained"] is False


def check_lines(rows: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The lines after the table that say how the parameters were checked, and the variants
    that fail a check."""
    lines: list[str] = []
    checked = [r for r in rows if r["trained"] is not None]
    if not checked:
        return lines, []
    lines.append(
        f"# parameter check (rtol {FP32_TOLERANCE.rtol:g}, atol {FP32_TOLERANCE.atol:g}):"
        " the largest |p - Gloo's p| and |p - initial p|;"
    )
    lines.append("#   in () the largest difference over what the tolerance allows there (1x)")
    for r in checked:
        lines.append(
            f"#   {r['variant']:<12} vs Gloo {text(r['max_diff_vs_gloo'], '.1e'):>8}"
            f" ({text(r['diff_vs_tolerance'], '.3g', 'x')}), moved"
            f" {r['max_change_from_initial']:.1e} ({r['change_vs_tolerance']:.3g}x)"
        )
    if any(r["matches_gloo"] is None for r in checked):
        names = ", ".join(r["variant"] for r in checked)
        lines.append(f"# NOT CHECKED against Gloo (no '{GLOO}' in --variants): {names}")
    different = [r for r in checked if r["matches_gloo"] is False]
    if different:
        lines.append(
            "# BROKEN: parameters differ from Gloo's beyond tolerance for "
            + ", ".join(
                f"{r['variant']} (|diff| up to {r['max_diff_vs_gloo']:.1e})" for r in different
            )
        )
    still = [r for r in checked if r["trained"] is False]
    if still:
        lines.append(
            "# BROKEN: parameters did not move from their initial values beyond tolerance (or"
            " are not finite) for "
            + ", ".join(
                f"{r['variant']} (|change| up to {r['max_change_from_initial']:.1e})" for r in still
            )
        )
    return lines, [r["variant"] for r in rows if is_broken(r)]


def format_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"{'variant':<12} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'comm ms':>8}"
        f" {'vs alone':>8} {'net ms':>8} {'vs gloo':>8} {'comm vs':>8} {'net vs':>8} {'diff':>8}"
        f" {'heap MB':>8} {'faults':>7} {'cpu ms':>7}"
    ]
    for row in rows:
        heap = row["heap_bytes_reserved"]
        diff = row["max_diff_vs_gloo"]
        lines.append(
            f"{row['variant']:<12} {row['median_ms']:>10.2f} {row['min_ms']:>8.2f}"
            f" {row['max_ms']:>8.2f} {text(row['comm_ms'], '.2f'):>8}"
            f" {text(row['beyond_alone_ms'], '.2f'):>8} {text(row['net_ms'], '.2f'):>8}"
            f" {text(row['step_vs_gloo'], '.2f', 'x'):>8}"
            f" {text(row['comm_vs_gloo'], '.2f', 'x'):>8}"
            f" {text(row['net_vs_gloo'], '.2f', 'x'):>8}"
            f" {'BROKEN' if is_broken(row) else text(diff, '.1e'):>8}"
            f" {text(None if heap is None else heap / 1e6, '.1f'):>8}"
            f" {row['minor_faults_per_step']:>7.0f} {row['cpu_ms_per_step']:>7.1f}"
        )
    return lines


LEGEND = [
    "# median/min/max: the slowest rank's step (zero_grad, forward, backward, optimizer.step),",
    f"#   over every timed step. comm: median minus {NO_COMM}'s (the unsharded model, no",
    f"#   communication). vs alone: median minus {ALONE}'s (FSDP2 on a group of one rank):",
    "#   what talking to the peers adds to FSDP2's own work in a world of one. net: median",
    f"#   minus {NO_COMM_FSDP}'s (FSDP2 on the same shards, its collectives sending nothing):",
    "#   the communication alone. vs gloo: Gloo's median step / this one. comm vs: Gloo's",
    "#   comm / this comm. net vs: Gloo's net / this net.",
    "# diff: largest |parameter - Gloo's parameter| on any rank after the run ('-': not",
    "#   compared); BROKEN where a parameter is beyond tolerance of Gloo's, or none moved beyond",
    "#   it from its initial value (the variant did not train). heap MB: bytes reserved by the",
    "#   group's symmetric heap (past its first arena only when FSDP2's buffers come from it).",
    "#   faults: minor page faults per step (median; the rank with the most), each a first",
    "#   touch of freshly mapped memory. cpu ms: CPU time of a step, all the process's threads",
    "#   (median; the rank with the most).",
]


def header(args: argparse.Namespace, world_size: int, params: int) -> list[str]:
    return [
        f"# fsdp_step: {world_size} ranks, MLP of {args.layers} x Linear({args.hidden},"
        f" {args.hidden}): {params / 1e6:.2f}M parameters ({params * 4 / 1e6:.1f} MB fp32),"
        " fully_shard per Linear and on the root",
        f"# batch {args.batch_size} per rank; SGD; {args.threads} thread(s) per rank",
        f"# {args.rounds} rounds x {args.steps} timed steps (+{args.warmup} untimed) per variant,"
        " round-robin, each round starting one variant later",
        host_line(),
    ]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_arguments(parser)
    add_variant_arguments(parser, VARIANT_NAMES, "fsdp_step")
    parser.add_argument(
        "--profile", action="store_true", help="profile one step of each FSDP2 variant after"
    )
    args = parser.parse_args(argv)
    check_step_arguments(parser, args)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not under_torchrun(sys.argv[0]):
        return 2
    return run_on_default_group(args, run)


def run(args: argparse.Namespace, rank: int, world_size: int, say: Say) -> int:
    variants = [v for v in VARIANTS if v.name in args.variants]
    runners = [make_runner(v, args) for v in variants]  # same order on every rank
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    say_lines(say, header(args, world_size, params))
    batches = make_batches(args.hidden, args.batch_size, rank)
    for runner in runners:
        dist.barrier()
        runner.step(batches)  # first use: lazy initialisation, first buffers
    run_rounds(runners, batches, args.rounds, args.steps, args.warmup)
    checks = check_parameters(runners)
    heaps = [heap_reserved(r) for r in runners]
    rows = summarise(runners, checks, heaps, *per_step_counts(runners))
    lines, broken = check_lines(rows)
    say_lines(say, format_table(rows), LEGEND, lines)
    profile_lines: list[str] = []  # printed, and kept in the JSON
    if args.profile:
        profile_lines += breakdown(runners, batches, args.rounds, args.steps)
        for runner in runners:
            if runner.variant.backend is not None:
                profile_lines += profile_step(runner, batches)
        say_lines(say, profile_lines)
    if rank == 0:
        meta = metadata("fsdp_step", args, world_size, params)
        meta["match_tolerance"] = FP32_TOLERANCE._asdict()
        meta["profile"] = profile_lines
        path = Path(args.json) if args.json else default_json("fsdp_step", world_size)
        write_results(path, meta, rows)
    del runners
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
