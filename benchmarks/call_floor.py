"""The host-time floor of one collective call from Python on this machine.

Usage::

    python benchmarks/call_floor.py [--device cpu|cuda] [--calls 300]

One process, no peers. Prints the median and minimum wall time of:

- one in-place PyTorch op on a 4 KiB tensor (on CUDA: one kernel launch);
- ``dist.all_reduce(t, async_op=True)`` on a world of one, for xdev, Gloo and, on CUDA, NCCL
  (a world of one moves no data: what remains is each backend's cost of a call).

``benchmarks/allreduce.py`` reports each backend's host overhead per call; this script says
how much of that any call from Python pays here before a backend does anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

import torch_xdev  # noqa: F401  (registers the xdev backend)

WARMUP = 20


def timed_us(fn: Callable[[], object], calls: int, device: torch.device) -> tuple[float, float]:
    """(median, min) wall microseconds of fn() over `calls` calls."""
    for _ in range(WARMUP):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(samples), min(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    if args.calls < 1:
        sys.exit("--calls must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA GPU")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    x = torch.ones(1024, device=device)
    rows = [("x.add_(1)", timed_us(lambda: x.add_(1), args.calls, device))]
    backends = ["xdev", "gloo"] + (
        ["nccl"] if args.device == "cuda" and dist.is_nccl_available() else []
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    for backend in backends:
        dist.init_process_group(backend, rank=0, world_size=1)
        result = timed_us(lambda: dist.all_reduce(x, async_op=True), args.calls, device)
        rows.append((f"{backend} all_reduce(async_op=True), world of one", result))
        dist.destroy_process_group()
    print(f"# {args.calls} calls, 4 KiB float32 on {device}, torch {torch.__version__}")
    for name, (median, low) in rows:
        print(f"{name:<48} median {median:8.2f} us   min {low:8.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
