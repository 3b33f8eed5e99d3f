"""DDP training-step benchmark: xdev's bucket paths against Gloo, a no-op comm hook and no DDP.

Usage (under torchrun, one process per rank)::

    torchrun --nproc_per_node 2 benchmarks/ddp_step.py [--hidden 2048] [--layers 4]
        [--batch-size 32] [--bucket-mb MB] [--rounds 7] [--steps 3] [--warmup 1]
        [--threads 1] [--variants xdev_shared,...,no_ddp] [--json out.json]

Every variant trains its own copy of one MLP (``--layers`` square ``Linear(hidden, hidden)``
layers with ReLU between them; the defaults give 16.8M parameters, 67 MB of fp32 gradients,
in DDP's default buckets of 25 MiB) with SGD on synthetic data that differs per rank:

- ``xdev_shared``: DDP on an xdev group with ``Options(shared_buckets=True)``: DDP's buckets
  live in memory every rank maps, so their allreduce runs in place.
- ``xdev_shared_avg``: the same plus ``torch_xdev.avg_comm_hook`` (AVG folded into the
  allreduce) and ``gradient_as_bucket_view=True`` (no copy of the gradients into buckets).
- ``xdev_shared_view`` and ``xdev_shared_avg_noview``: its two halves apart, the bucket view
  with DDP's own hook, and the AVG hook without the view.
- ``xdev_shared_avg_overlap``: ``xdev_shared_avg`` with a hook that never waits for its
  allreduce. ``avg_comm_hook`` waits where the ranks have fewer than two cores each
  (``torch_xdev.ddp.waits_for_cpu_buckets``); this variant shows what that wait gains.
- ``xdev_staged``: DDP on an xdev group with ``Options(shared_buckets=False)``: ordinary
  buckets, allreduced through xdev's staging slots.
- ``gloo``: DDP on a Gloo group.
- ``xdev_fp16_hook`` and ``gloo_fp16_hook``: DDP with PyTorch's ``fp16_compress_hook``,
  which allreduces each bucket as a new fp16 tensor (so staged on xdev) and casts it back.
- ``noop_hook``: DDP (on a Gloo group: ordinary buckets) with a comm hook that returns each
  bucket unchanged: the whole DDP step without communication. A variant's median step minus
  this one's is what communication costs it per step.
- ``noop_hook_view``: the same with ``gradient_as_bucket_view=True``, the baseline of
  the variants with the view (which save the copies between gradients and buckets that
  ``noop_hook`` still makes).
- ``no_ddp``: the bare model, local forward/backward/step.

Each variant has its own process group (created in the same order on every rank), model and
optimizer. After two untimed steps per variant (DDP fills one bucket in its first backward and
rebuilds its buckets, in the order the gradients came, in its second forward), the variants
run round-robin for ``--rounds`` rounds, each round starting one variant later, and each turn
times ``--steps`` steps after ``--warmup`` untimed ones, so drift on the host hits every
variant alike. A step's time is the slowest rank's wall time from ``zero_grad`` to the end of
``optimizer.step()``; the table reports the median, minimum and maximum over all timed steps.
``zero_grad(set_to_none=False)`` (unless ``--set-to-none``) zeroes the gradients in place, so
with ``gradient_as_bucket_view`` they stay views of DDP's buckets and backward accumulates
straight into them. Only the variants that communicate must keep their parameters equal
across ranks (the ranks see different data); this is checked after the timed steps, so a
variant whose allreduce is broken cannot be reported as fast. Equal across ranks is not
enough (a reduction every rank gets alike wrong, such as rank 0's gradients broadcast instead
of the average, keeps them equal), so every variant that communicates has also run the same
steps on the same batches as ``gloo`` and must end with Gloo's parameters within a tolerance
(``FP32_TOLERANCE``; ``FP16_TOLERANCE`` for the fp16 hooks, which ``xdev_fp16_hook`` meets
against ``gloo_fp16_hook`` where that runs): BROKEN and exit status 1 beyond it. Without
``gloo`` among ``--variants`` that check cannot run, and the output says so.

Two environment variables matter: ``DDP_DISABLE_COMM_MEM`` must be ``0`` for DDP to ask a
backend for its buckets at all (``import torch_xdev`` sets it when unset on a host without a
GPU; the header prints it, and the table says per xdev group whether its buckets are shared),
and ``XDEV_SHARED_BUCKETS`` must be unset (it would override the per-group option and make
``xdev_shared`` and ``xdev_staged`` alike; the benchmark refuses to run with it).
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares a hook's
# annotations with dist.GradBucket and Future[Tensor] themselves, not with strings.
import argparse
import dataclasses
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Collection, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import torch_xdev
from run_record import write_results
from step_common import (
    FP32_TOLERANCE,
    Batches,
    Say,
    Tolerance,
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
    yes_no,
)

COMM_MEM_VARIABLE = "DDP_DISABLE_COMM_MEM"
SHARED_BUCKETS_VARIABLE = "XDEV_SHARED_BUCKETS"
BUCKET_CAP_DEFAULT_MB = 25  # DistributedDataParallel's bucket_cap_mb when not given


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    backend: Optional[str]  # of the variant's process group; None: no DDP, no group
    shared_buckets: Optional[bool] = None  # xdev's Options(shared_buckets=...)
    comm_hook: Optional[str] = None  # "avg" (avg_comm_hook), "avg_overlap", "fp16" or "noop"
    gradient_as_bucket_view: bool = False

    @property
    def communicates(self) -> bool:
        """Whether the ranks' gradients are averaged, so their parameters stay equal."""
        return self.backend is not None and self.comm_hook != "noop"


VARIANTS = (
    Variant("xdev_shared", "xdev", shared_buckets=True),
    Variant(
        "xdev_shared_avg",
        "xdev",
        shared_buckets=True,
        comm_hook="avg",
        gradient_as_bucket_view=True,
    ),
    # The two halves of xdev_shared_avg apart: the bucket view alone, the AVG hook alone.
    Variant("xdev_shared_view", "xdev", shared_buckets=True, gradient_as_bucket_view=True),
    Variant("xdev_shared_avg_noview", "xdev", shared_buckets=True, comm_hook="avg"),
    Variant(
        "xdev_shared_avg_overlap",
        "xdev",
        shared_buckets=True,
        comm_hook="avg_overlap",
        gradient_as_bucket_view=True,
    ),
    Variant("xdev_staged", "xdev", shared_buckets=False),
    Variant("gloo", "gloo"),
    Variant("xdev_fp16_hook", "xdev", shared_buckets=True, comm_hook="fp16"),
    Variant("gloo_fp16_hook", "gloo", comm_hook="fp16"),
    Variant("noop_hook", "gloo", comm_hook="noop"),
    Variant("noop_hook_view", "gloo", comm_hook="noop", gradient_as_bucket_view=True),
    Variant("no_ddp", None),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)
GLOO = "gloo"
GLOO_FP16 = "gloo_fp16_hook"

# The step without communication that a variant is compared with, by its
# gradient_as_bucket_view.
NO_COMM_BASELINE = {False: "noop_hook", True: "noop_hook_view"}


# FP32_TOLERANCE (step_common.py, shared with fsdp_step.py) bounds the fp32 variants.
# fp16_compress_hook rounds every gradient to fp16 (2^-11 relative, and the many gradients
# below fp16's normal range 6.1e-5 go subnormal, in absolute steps of 6e-8) before it
# allreduces, so the fp16 hooks' parameters end further from fp32 Gloo's: measured 4.3e-8 with
# 2 ranks (defaults), 5.6e-8 with 4 (hidden 1024), 1.5e-8 for xdev_fp16_hook against
# gloo_fp16_hook with 4 ranks (0 with 2). Ten times fp32's atol leaves them 18 times inside
# it; the broadcast above would still be 4 times this bound at the defaults.
FP16_TOLERANCE = Tolerance(rtol=1e-5, atol=1e-6)


def avg_overlap_hook(
    state: Optional[dist.ProcessGroup], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """``avg_comm_hook`` without its wait: the AVG allreduce overlaps the rest of backward."""
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.AVG, group=state, async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


def noop_comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that communicates nothing: each bucket comes back as it went in."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


@dataclasses.dataclass
class Runner:
    """One variant on this rank: its group, model (wrapped or not) and optimizer."""

    variant: Variant
    group: Optional[dist.ProcessGroup]
    model: nn.Module  # the bare module
    net: nn.Module  # what forward runs: the DDP wrapper, or the bare module
    optimizer: torch.optim.Optimizer
    set_to_none: bool = False  # how zero_grad clears the gradients
    samples: list[float] = dataclasses.field(default_factory=list)  # slowest rank, seconds
    steps_run: int = 0

    def step(self, batches: Batches) -> float:
        """One training step; returns this rank's wall time of it in seconds."""
        x, y = batches[self.steps_run % len(batches)]
        self.steps_run += 1
        return train_step(self.net, self.optimizer, x, y, self.set_to_none)


def make_group(variant: Variant) -> Optional[dist.ProcessGroup]:
    """The variant's own process group. Collective: every rank creates them in one order."""
    if variant.backend is None:
        return None
    pg_options = None
    if variant.backend == torch_xdev.BACKEND_NAME:
        pg_options = torch_xdev.Options(shared_buckets=bool(variant.shared_buckets))
    return new_group(variant.backend, pg_options)


def make_runner(variant: Variant, args: argparse.Namespace) -> Runner:
    group = make_group(variant)
    model = make_model(args.hidden, args.layers)
    net: nn.Module = model
    if group is not None:
        ddp = DistributedDataParallel(
            model,
            process_group=group,
            bucket_cap_mb=args.bucket_mb,
            gradient_as_bucket_view=variant.gradient_as_bucket_view,
        )
        if variant.comm_hook == "avg":
            ddp.register_comm_hook(group, torch_xdev.avg_comm_hook)
        elif variant.comm_hook == "avg_overlap":
            ddp.register_comm_hook(group, avg_overlap_hook)
        elif variant.comm_hook == "fp16":
            ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        elif variant.comm_hook == "noop":
            ddp.register_comm_hook(None, noop_comm_hook)
        net = ddp
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr)
    return Runner(variant, group, model, net, optimizer, set_to_none=args.set_to_none)


def params_checksum(model: nn.Module) -> float:
    """A float64 digest of the parameters: equal bits on two ranks give equal digests."""
    total = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(model.parameters()):
        values = p.detach().double()
        total += values.sum() + (i + 1) * values.square().sum()
    return float(total)


def ranks_agree(runners: list[Runner]) -> list[Optional[bool]]:
    """Per runner: whether every rank holds the same finite parameters (None: not expected).

    Collective over the default group; every rank gets the same answers.
    """
    sums = torch.tensor([params_checksum(r.model) for r in runners], dtype=torch.float64)
    high, low = sums.clone(), sums.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    verdicts: list[Optional[bool]] = []
    for runner, hi, lo in zip(runners, high.tolist(), low.tolist()):
        if not runner.variant.communicates:
            verdicts.append(None)  # each rank trained on its own data
        else:
            verdicts.append(hi == lo and math.isfinite(hi))
    return verdicts


def reference_of(variant: Variant, present: Collection[str]) -> Optional[str]:
    """The Gloo variant whose parameters this one's must match (None: none to compare with).

    ``gloo`` for every variant that communicates, itself included (a difference of 0, as in
    fsdp_step.py); ``xdev_fp16_hook`` is compared with ``gloo_fp16_hook`` where that runs,
    which rounds its gradients to fp16 the same way.
    """
    if not variant.communicates:
        return None
    if variant.comm_hook == "fp16" and variant.name != GLOO_FP16 and GLOO_FP16 in present:
        return GLOO_FP16
    return GLOO if GLOO in present else None


def tolerance_of(variant: Variant) -> Tolerance:
    return FP16_TOLERANCE if variant.comm_hook == "fp16" else FP32_TOLERANCE


@dataclasses.dataclass(frozen=True)
class GlooMatch:
    """How a variant's parameters compare with its reference's (a Gloo variant's)."""

    reference: str
    max_diff: float  # the largest |parameter - reference's parameter|
    ratio: float  # the largest such difference over what its tolerance allows there

    @property
    def matches(self) -> bool:
        return self.ratio <= 1.0


def local_differences(runners: Sequence[Runner]) -> list[Optional[GlooMatch]]:
    """Per runner: how this rank's parameters compare with the reference's on this rank."""
    by_name = {r.variant.name: r for r in runners}
    matches: list[Optional[GlooMatch]] = []
    for runner in runners:
        reference = reference_of(runner.variant, by_name)
        if reference is None:
            matches.append(None)
            continue
        tolerance = tolerance_of(runner.variant)
        max_diff, ratio = parameter_differences(
            list(runner.model.parameters()),
            list(by_name[reference].model.parameters()),
            tolerance.rtol,
            tolerance.atol,
        )
        matches.append(GlooMatch(reference, max_diff, ratio))
    return matches


def differences_from_gloo(runners: Sequence[Runner]) -> list[Optional[GlooMatch]]:
    """Per runner: the comparison with its reference on the rank where it is worst (None: not
    compared). Collective over the default group; every rank compares the same variants (they
    run on every rank) and gets the same answers."""
    local = local_differences(runners)
    compared = [m for m in local if m is not None]
    worst = iter(max_over_ranks([v for m in compared for v in (m.max_diff, m.ratio)]))
    return [None if m is None else GlooMatch(m.reference, next(worst), next(worst)) for m in local]


def bucket_info(runner: Runner) -> dict[str, Any]:
    """How DDP bucketed the gradients, and whether they live in xdev's shared memory."""
    info: dict[str, Any] = {
        "num_buckets": None,
        "ddp_shared_buckets": None,
        "ddp_shared_buckets_note": None,
        "heap_bytes_in_use": None,
    }
    if isinstance(runner.net, DistributedDataParallel):
        # DDP's logging data says nothing of the rebuilt buckets until a sampled iteration;
        # the Reducer's list of them is current (it returns zeroed copies, freed at once).
        info["num_buckets"] = len(runner.net.reducer._get_zeros_like_grad_buckets())
    if runner.variant.backend == torch_xdev.BACKEND_NAME:
        described = torch_xdev.describe(runner.group)
        # Whether DDP's buckets on this group are taken from its symmetric heap, and why not.
        info["ddp_shared_buckets"] = described.get("ddp_shared_buckets")
        info["ddp_shared_buckets_note"] = described.get("ddp_shared_buckets_note")
        # The group serves this one model, so what its heap holds is that model's buckets:
        # seen from the other side, it confirms where they went.
        heap = described.get("symmetric_heap")
        if isinstance(heap, dict):
            info["heap_bytes_in_use"] = heap.get("bytes_in_use")
    return info


def summarise(
    runners: list[Runner],
    verdicts: list[Optional[bool]],
    infos: list[dict[str, Any]],
    gloo_matches: list[Optional[GlooMatch]],
) -> list[dict[str, Any]]:
    """The table's rows: times in ms, communication per step, ratios against Gloo."""
    medians = {r.variant.name: statistics.median(r.samples) for r in runners}
    gloo = medians.get(GLOO)
    noop = medians.get(NO_COMM_BASELINE[False])
    gloo_comm = None if gloo is None or noop is None else gloo - noop
    rows: list[dict[str, Any]] = []
    for runner, verdict, info, match in zip(runners, verdicts, infos, gloo_matches):
        v = runner.variant
        median = medians[v.name]
        baseline_name = NO_COMM_BASELINE[v.gradient_as_bucket_view]
        baseline = medians.get(baseline_name) if v.communicates else None
        comm = None if baseline is None else median - baseline
        rows.append(
            {
                "variant": v.name,
                "backend": v.backend,
                "shared_buckets_option": v.shared_buckets,
                "comm_hook": v.comm_hook,
                "gradient_as_bucket_view": v.gradient_as_bucket_view,
                **info,
                **timing_stats(runner.samples),
                "comm_ms": None if comm is None else comm * 1e3,
                "comm_baseline": baseline_name if comm is not None else None,
                "step_vs_gloo": None if gloo is None else gloo / median,
                "comm_vs_gloo": (
                    gloo_comm / comm if gloo_comm is not None and comm and comm > 0 else None
                ),
                "ranks_equal": verdict,
                # The Gloo variant compared with ("gloo", or "gloo_fp16_hook" for
                # xdev_fp16_hook) and the largest |parameter - its parameter| on any rank.
                "compared_with": None if match is None else match.reference,
                "max_diff_vs_gloo": None if match is None else match.max_diff,
                "matches_gloo": None if match is None else match.matches,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"{'variant':<16} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'comm ms':>8}"
        f" {'vs gloo':>8} {'comm vs':>8} {'buckets':>7} {'shared':>7} {'heap MB':>8}"
        f" {'ranks =':>8}"
    ]
    for row in rows:
        heap = row["heap_bytes_in_use"]
        lines.append(
            f"{row['variant']:<16} {row['median_ms']:>10.2f} {row['min_ms']:>8.2f}"
            f" {row['max_ms']:>8.2f} {text(row['comm_ms'], '.2f'):>8}"
            f" {text(row['step_vs_gloo'], '.2f', 'x'):>8}"
            f" {text(row['comm_vs_gloo'], '.2f', 'x'):>8} {text(row['num_buckets'], 'd'):>7}"
            f" {yes_no(row['ddp_shared_buckets']):>7}"
            f" {text(None if heap is None else heap / 1e6, '.1f'):>8}"
            f" {yes_no(row['ranks_equal'], 'BROKEN'):>8}"
        )
    for row in rows:
        if row["ddp_shared_buckets"] is False and row["shared_buckets_option"]:
            lines.append(f"# {row['variant']}: no shared buckets: {row['ddp_shared_buckets_note']}")
    return lines


def check_lines(rows: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The lines after the table that say how the parameters were checked, and the variants
    that fail a check (across ranks, or against Gloo)."""
    lines: list[str] = []
    compared = [r for r in rows if r["compared_with"] is not None]
    if compared:
        lines.append(
            "# Gloo check: largest |parameter - Gloo's|: "
            + ", ".join(
                f"{r['variant']} {r['max_diff_vs_gloo']:.1e}"
                + ("" if r["compared_with"] == GLOO else f" (vs {r['compared_with']})")
                for r in compared
            )
        )
    unchecked = [
        r["variant"] for r in rows if r["ranks_equal"] is not None and r["compared_with"] is None
    ]
    if unchecked:
        lines.append(
            f"# NOT CHECKED against Gloo (no '{GLOO}' in --variants): {', '.join(unchecked)}"
        )
        lines.append(
            "#   only equal across ranks, as a reduction every rank gets alike wrong also is"
        )
    across = [r["variant"] for r in rows if r["ranks_equal"] is False]
    if across:
        lines.append(f"# BROKEN: parameters differ across ranks for {', '.join(across)}")
    against = [r for r in rows if r["matches_gloo"] is False]
    if against:
        lines.append(
            "# BROKEN: parameters differ from Gloo's beyond tolerance for "
            + ", ".join(
                f"{r['variant']} (|diff| up to {r['max_diff_vs_gloo']:.1e} vs"
                f" {r['compared_with']})"
                for r in against
            )
        )
    broken = [r["variant"] for r in rows if r["ranks_equal"] is False or r["matches_gloo"] is False]
    return lines, broken


LEGEND = [
    "# median/min/max: the slowest rank's step (zero_grad, forward, backward, optimizer.step),",
    "#   over every timed step. comm: median minus the median of noop_hook (noop_hook_view with",
    "#   gradient_as_bucket_view), what communication adds to a step. vs gloo: Gloo's median",
    "#   step / this one. comm vs: Gloo's comm / this comm.",
    "# buckets: DDP's buckets after its rebuild. shared: describe(group)['ddp_shared_buckets'];",
    "#   heap MB: bytes in use in the group's symmetric heap (this model's buckets when shared).",
    "# ranks =: parameters equal on every rank after the run ('-': no communication, so each",
    "#   rank trained on its own data).",
    "# Gloo check: every variant that communicates ran gloo's steps on gloo's batches: its",
    f"#   parameters must be Gloo's within rtol {FP32_TOLERANCE.rtol:g}, atol"
    f" {FP32_TOLERANCE.atol:g} (fp16 hooks: rtol {FP16_TOLERANCE.rtol:g},",
    f"#   atol {FP16_TOLERANCE.atol:g}, xdev_fp16_hook against {GLOO_FP16} where it runs).",
]


def bucket_text(bucket_mb: Optional[float]) -> str:
    """DDP's bucket caps; its "MB" are MiB."""
    if bucket_mb is None:
        first = dist._DEFAULT_FIRST_BUCKET_BYTES / (1 << 20)
        return f"DDP's default ({BUCKET_CAP_DEFAULT_MB} MiB, the first {first:g} MiB)"
    return f"bucket_cap_mb={bucket_mb:g} (MiB)"


def header(args: argparse.Namespace, world_size: int, params: int) -> list[str]:
    grad_mb = params * 4 / 1e6
    return [
        f"# ddp_step: {world_size} ranks, MLP of {args.layers} x Linear({args.hidden},"
        f" {args.hidden}): {params / 1e6:.2f}M parameters, {grad_mb:.1f} MB fp32 gradients,"
        f" buckets: {bucket_text(args.bucket_mb)}",
        f"# batch {args.batch_size} per rank; SGD, zero_grad(set_to_none={args.set_to_none});"
        f" {args.threads} thread(s) per rank",
        f"# {args.rounds} rounds x {args.steps} timed steps (+{args.warmup} untimed) per variant,"
        " round-robin, each round starting one variant later",
        host_line([COMM_MEM_VARIABLE]),
    ]


def save_json(
    path: Path, args: argparse.Namespace, world_size: int, params: int, rows: Any
) -> None:
    meta = metadata("ddp_step", args, world_size, params)
    meta.update(
        bucket_mb=args.bucket_mb,
        set_to_none=args.set_to_none,
        match_tolerance={
            "fp32": FP32_TOLERANCE._asdict(),
            "fp16_hooks": FP16_TOLERANCE._asdict(),
        },
        **{COMM_MEM_VARIABLE: os.environ.get(COMM_MEM_VARIABLE)},
    )
    write_results(path, meta, rows)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_arguments(parser)
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="DDP's bucket_cap_mb (default: DDP's own, 25 MB and a first bucket of 1 MB)",
    )
    parser.add_argument(
        "--set-to-none",
        action="store_true",
        help="zero_grad(set_to_none=True): fresh gradients every backward (default: zeroed in"
        " place, so with gradient_as_bucket_view they stay views of DDP's buckets)",
    )
    add_variant_arguments(parser, VARIANT_NAMES, "ddp_step")
    args = parser.parse_args(argv)
    check_step_arguments(parser, args)
    if args.bucket_mb is not None and args.bucket_mb <= 0:
        parser.error("--bucket-mb must be > 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not under_torchrun(sys.argv[0]):
        return 2
    if SHARED_BUCKETS_VARIABLE in os.environ:
        # The environment overrides Options, so "shared" and "staged" would run alike.
        print(
            f"unset {SHARED_BUCKETS_VARIABLE}: each xdev variant sets shared_buckets itself",
            file=sys.stderr,
        )
        return 2
    return run_on_default_group(args, run)


def run(args: argparse.Namespace, rank: int, world_size: int, say: Say) -> int:
    variants = [v for v in VARIANTS if v.name in args.variants]
    runners = [make_runner(v, args) for v in variants]  # same order on every rank
    params = sum(p.numel() for p in runners[0].model.parameters())
    say_lines(say, header(args, world_size, params))
    batches = make_batches(args.hidden, args.batch_size, rank)
    for runner in runners:
        dist.barrier()
        # DDP puts every gradient in one bucket for its first backward, which records the
        # order they come in, and rebuilds its buckets in that order in the second forward.
        runner.step(batches)
        runner.step(batches)
    infos = [bucket_info(r) for r in runners]
    run_rounds(runners, batches, args.rounds, args.steps, args.warmup)
    verdicts = ranks_agree(runners)
    rows = summarise(runners, verdicts, infos, differences_from_gloo(runners))
    lines, broken = check_lines(rows)
    say_lines(say, format_table(rows), LEGEND, lines)
    if rank == 0:
        path = Path(args.json) if args.json else default_json("ddp_step", world_size)
        save_json(path, args, world_size, params, rows)
    del runners
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
