"""How often an fp16/bf16 allreduce SUM differs from the sum rounded once, per plan.

Usage::

    python benchmarks/rounding.py [--nproc 4] [--numel 262144]

Each rank draws ``numel`` normal values (seed 1000 + rank) in float64 and casts them to
the dtype. Every rank also builds every other rank's input, so it knows the exact sum of
all inputs (float64) rounded once to the dtype. The script allreduces with each xdev
algorithm, with xdev's in-place path (a ``torch_xdev.shared_empty`` tensor), with single
copy, and with Gloo, and prints the fraction of elements whose bits differ from that
reference. Plans that reduce every element in one step show 0; plans that add partial
sums already rounded to the dtype (the hierarchical ones, Gloo) show how often the extra
roundings change the result.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_xdev
from run_record import XDEV_PATH

DTYPES = (torch.bfloat16, torch.float16)
# (label, Options fields, tensor from shared_empty); "gloo" is handled apart.
CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("auto", {"algorithm": "auto"}, False),
    ("direct", {"algorithm": "direct"}, False),
    ("reduce_to_one", {"algorithm": "reduce_to_one"}, False),
    ("flat", {"algorithm": "flat"}, False),
    ("hierarchical_copy", {"algorithm": "hierarchical_copy"}, False),
    ("hierarchical_balanced", {"algorithm": "hierarchical_balanced"}, False),
    ("flat, single copy", {"algorithm": "flat", "single_copy": True}, False),
    (
        "hierarchical_copy, single copy",
        {"algorithm": "hierarchical_copy", "single_copy": True},
        False,
    ),
    ("shared_empty (auto, in place)", {"algorithm": "auto"}, True),
]


def make_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def differing(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.view(torch.int16) != ref.view(torch.int16)).double().mean().item())


def run_rank(rank: int, world: int, port: int, numel: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("xdev", rank=rank, world_size=world)
    hierarchical_ok = world % 2 == 0
    rows: dict[str, dict[str, float]] = {}
    for dtype in DTYPES:
        inputs = [make_input(r, numel, dtype) for r in range(world)]
        once = torch.stack([t.double() for t in inputs]).sum(0).to(dtype)
        for label, fields, shared in CASES:
            if "hierarchical" in label and not hierarchical_ok:
                continue
            group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(**fields))
            if shared:
                t = torch_xdev.shared_empty(numel, dtype=dtype, group=group)
                t.copy_(inputs[rank])
            else:
                t = inputs[rank].clone()
            dist.all_reduce(t, group=group)
            rows.setdefault(label, {})[str(dtype)] = differing(t, once)
            del t
            dist.destroy_process_group(group)
        gloo = dist.new_group(backend="gloo")
        t = inputs[rank].clone()
        dist.all_reduce(t, group=gloo)
        rows.setdefault("gloo", {})[str(dtype)] = differing(t, once)
        dist.destroy_process_group(gloo)
    results.put((rank, rows))
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--numel", type=int, default=1 << 18)
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.numel < 1:
        parser.error("--nproc and --numel must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=run_rank, args=(r, args.nproc, args.port, args.numel, results))
        for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    by_rank: dict[int, dict[str, dict[str, float]]] = {}
    while len(by_rank) < len(procs):
        try:
            rank, rows = results.get(timeout=1.0)
            by_rank[rank] = rows
        except queue.Empty:
            # A rank that died sends nothing, and its peers wait for it in a collective:
            # without this the run would sit until the queue timed out.
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                for p in procs:
                    if p.is_alive():
                        p.terminate()
                    p.join()
                code = procs[failed[0]].exitcode
                print(f"error: rank {failed[0]} failed (exit code {code})", file=sys.stderr)
                return 1
    for p in procs:
        p.join()
    rows = by_rank[0]
    if any(by_rank[r] != rows for r in by_rank):
        print("warning: ranks disagree")
    print(f"# torch_xdev from {XDEV_PATH}; {args.nproc} ranks, {args.numel} elements per rank")
    print("# fraction of elements that differ from the sum of all inputs rounded once")
    names = [str(d).replace("torch.", "") for d in DTYPES]
    print("| plan | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    for label, by_dtype in rows.items():
        cells = " | ".join(f"{100 * by_dtype[str(d)]:.1f}%" for d in DTYPES)
        print(f"| {label} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
