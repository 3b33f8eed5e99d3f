"""DDP training-step time on xdev against Gloo, with what communication costs each.

Run under torchrun, e.g. ``torchrun --nproc_per_node 2 benchmarks/ddp_step.py``. One job holds a
process group per variant and a model per variant, all built alike, and times their steps
round-robin, so drift on the machine hits every variant alike:

- ``xdev-shared``: DDP on xdev, gradient buckets in the group's symmetric heap (in place);
- ``xdev-shared-avg``: the same with ``gradient_as_bucket_view=True`` and
  ``torch_xdev.avg_comm_hook`` (the division folded into the reduction);
- ``xdev-staged``: DDP on xdev with ``Options(shared_buckets=False)`` (buckets are ordinary
  tensors, staged through the group's slots);
- ``gloo``: DDP on Gloo;
- ``no-comm``: DDP with a comm hook that returns the bucket untouched: the step without
  communication, which every variant's communication cost is measured against;
- ``no-ddp``: the bare model, no DDP at all.

A step is forward, backward and an SGD step on a fixed batch. Communication cost per step is a
variant's median step time minus ``no-comm``'s. The default model (4 x Linear(2048, 2048),
16.8M parameters, 67 MB of fp32 gradients in DDP's 25 MB buckets) is one where that cost is
large next to the computation. Rank 0 prints a table and writes JSON (``--json``). At the end
every variant's parameters are checked equal across ranks, so a broken variant cannot pass as
a fast one.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook checks the hook's
# annotations against the real types.
import argparse
import json
import statistics
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_xdev

VARIANTS = ("xdev-shared", "xdev-shared-avg", "xdev-staged", "gloo", "no-comm", "no-ddp")


def no_comm_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def make_model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)  # the same start on every rank and for every variant
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


class Variant:
    """One model and what it steps with."""

    def __init__(self, name: str, module: nn.Module, group: Optional[dist.ProcessGroup]):
        self.name = name
        self.module = module
        self.group = group
        self.optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
        self.times: list[float] = []

    def step(self, x: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        self.module(x).square().mean().backward()
        self.optimizer.step()


def build(name: str, args: argparse.Namespace, groups: dict[str, Any]) -> Variant:
    module = make_model(args.width, args.layers)
    if name == "no-ddp":
        return Variant(name, module, None)
    group = groups[name]
    bucket_view = name == "xdev-shared-avg"
    ddp = DDP(module, process_group=group, gradient_as_bucket_view=bucket_view)
    if name == "xdev-shared-avg":
        ddp.register_comm_hook(group, torch_xdev.avg_comm_hook)
    elif name == "no-comm":
        ddp.register_comm_hook(None, no_comm_hook)
    return Variant(name, ddp, group)


def parameters_agree(variant: Variant, group: dist.ProcessGroup) -> bool:
    """Whether this variant's parameters are the same on every rank."""
    flat = torch.cat([p.detach().reshape(-1) for p in variant.module.parameters()]).double()
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(low, high))


def summarize(variants: list[Variant], skip: int) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    for v in variants:
        kept = v.times[skip:]
        rows[v.name] = {
            "median_ms": 1e3 * statistics.median(kept),
            "min_ms": 1e3 * min(kept),
            "max_ms": 1e3 * max(kept),
        }
    base = rows["no-comm"]["median_ms"]
    gloo = rows["gloo"]["median_ms"] - base
    for name, row in rows.items():
        row["comm_ms"] = row["median_ms"] - base
        row["comm_vs_gloo"] = row["comm_ms"] / gloo if name != "no-ddp" and gloo > 0 else 0.0
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=12, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="rounds left out of the stats")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", default=None, help="where rank 0 writes the results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    dist.init_process_group("gloo")  # the timing barriers; every variant gets its own group
    rank, world = dist.get_rank(), dist.get_world_size()
    # The same groups in the same order on every rank.
    groups: dict[str, Any] = {
        "xdev-shared": dist.new_group(backend="xdev"),
        "xdev-staged": dist.new_group(
            backend="xdev", pg_options=torch_xdev.Options(shared_buckets=False)
        ),
        "gloo": dist.new_group(backend="gloo"),
    }
    groups["xdev-shared-avg"] = groups["xdev-shared"]
    groups["no-comm"] = groups["gloo"]
    variants = [build(name, args, groups) for name in VARIANTS]
    generator = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.batch, args.width, generator=generator)

    for _ in range(args.rounds + args.warmup):
        for v in variants:
            dist.barrier()  # every rank starts the step together
            start = time.perf_counter()
            v.step(x)
            v.times.append(time.perf_counter() - start)

    # no-comm's and no-ddp's ranks step on their own gradients: they need not agree.
    synced = [v for v in variants if v.name not in ("no-comm", "no-ddp")]
    agree = {v.name: parameters_agree(v, groups["gloo"]) for v in synced}
    shared = {
        name: bool(torch_xdev.describe(groups[name])["ddp_shared_buckets"])
        for name in ("xdev-shared", "xdev-staged")
    }
    rows = summarize(variants, args.warmup)
    params = sum(p.numel() for p in variants[0].module.parameters())
    if rank == 0:
        print(
            f"# DDP step: {world} ranks, {args.layers} x Linear({args.width}, {args.width}) "
            f"({params / 1e6:.1f}M parameters, {4 * params / 1e6:.0f} MB of fp32 gradients), "
            f"batch {args.batch}, {args.rounds} rounds after {args.warmup}, "
            f"{args.threads} thread(s) per rank; shared buckets: {shared}"
        )
        print(f"# {'variant':<16} {'median ms':>10} {'min':>8} {'max':>8} {'comm ms':>8} "
              f"{'comm/gloo':>9}  params equal across ranks")
        for name, row in rows.items():
            print(
                f"  {name:<16} {row['median_ms']:10.1f} {row['min_ms']:8.1f} {row['max_ms']:8.1f} "
                f"{row['comm_ms']:8.1f} {row['comm_vs_gloo']:9.3f}  {agree.get(name, '-')}"
            )
        if args.json:
            report = {
                "world_size": world,
                "model": {"width": args.width, "layers": args.layers, "parameters": params},
                "batch": args.batch,
                "rounds": args.rounds,
                "warmup": args.warmup,
                "threads": args.threads,
                "shared_buckets": shared,
                "params_equal_across_ranks": agree,
                "variants": rows,
                "samples_ms": {v.name: [1e3 * t for t in v.times] for v in variants},
            }
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=2)
            print(f"# wrote {args.json}")
    bad = [name for name, ok in agree.items() if not ok]
    variants.clear()  # every DDP model is gone before its group
    dist.destroy_process_group()
    if bad:
        raise SystemExit(f"parameters differ across ranks for {bad}")


if __name__ == "__main__":
    main()
