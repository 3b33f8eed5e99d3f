"""Allreduce benchmark: xdev algorithms side by side with Gloo, nccl-tests style.

Usage::

    python benchmarks/allreduce.py --nproc 2 [--sizes 4KiB:64MiB] [--dtype float32]
        [--algorithms auto,direct,flat,reduce_to_one,hierarchical_copy,hierarchical_balanced]
        [--iters N] [--warmup N] [--json out.json] [--slot-bytes B]

Every rank runs one Gloo default group plus one xdev group per algorithm; each row is
the slowest rank's mean time per ``all_reduce``. Before timing an xdev algorithm its
result on random data is checked against Gloo's. The parent process also measures
single-core ``copy_`` bandwidth so each row can be compared to memcpy.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_xdev

UNITS = {"B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}
# (rtol, atol) for the correctness guard; integer sums must match exactly.
TOLERANCES = {
    "float32": (1e-5, 1e-5),
    "float64": (1e-10, 1e-10),
    "float16": (5e-3, 1e-2),
    "bfloat16": (2e-2, 5e-2),
    "int32": (0.0, 0.0),
    "int64": (0.0, 0.0),
}
DEFAULT_ALGORITHMS = "auto,direct,flat,reduce_to_one,hierarchical_copy,hierarchical_balanced"
TARGET_ROW_SECONDS = 0.5
MIN_ITERS = 5
MAX_ITERS = 200
CALIBRATION_ITERS = 3
MEMCPY_BYTES = 256 << 20
SEED = 20240611


@dataclasses.dataclass
class Config:
    nproc: int
    sizes: list[int]
    dtype: str
    algorithms: list[str]
    iters: Optional[int]
    warmup: int
    json_path: str
    slot_bytes: Optional[int]
    memcpy_gbps: float
    memcpy_us: dict[int, float]
    port: int


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in UNITS | {"": 1}:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 4096, 4KiB, 64MiB, 1GiB)")
    return int(match.group(1)) * UNITS.get(match.group(2).upper(), 1)


def parse_sizes(text: str) -> list[int]:
    """'LO:HI' doubles from LO up to HI inclusive; 'A,B,C' is an explicit list."""
    if ":" in text:
        lo_text, hi_text = text.split(":", 1)
        lo, hi = parse_size(lo_text), parse_size(hi_text)
        if lo <= 0 or hi < lo:
            raise argparse.ArgumentTypeError(f"bad size range {text!r}")
        sizes = []
        while lo <= hi:
            sizes.append(lo)
            lo *= 2
        return sizes
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"bad size list {text!r}")
    return sizes


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def best_copy_seconds(nbytes: int, min_reps: int = 5, budget_s: float = 0.05) -> float:
    """Best single-threaded ``dst.copy_(src)`` time for ``nbytes`` bytes."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = math.inf
    reps = 0
    started = time.perf_counter()
    while reps < min_reps or (time.perf_counter() - started < budget_s and reps < 10000):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best


def measure_memcpy(sizes: list[int]) -> tuple[float, dict[int, float]]:
    """Returns (GB/s of a 256 MiB copy, {row size: best copy time in us}), on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gbps = MEMCPY_BYTES / best_copy_seconds(MEMCPY_BYTES, min_reps=10, budget_s=0.0) / 1e9
        per_size = {size: best_copy_seconds(size) * 1e6 for size in sizes}
    finally:
        torch.set_num_threads(threads)
    return gbps, per_size


def random_input(count: int, dtype: torch.dtype, rank: int, size_index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + 1000003 * rank + size_index)
    if dtype.is_floating_point:
        return torch.randn(count, generator=gen, dtype=torch.float32).to(dtype)
    return torch.randint(-100, 100, (count,), generator=gen, dtype=dtype)


def check_against_gloo(
    cfg: Config, name: str, group: Any, data: torch.Tensor, expected: torch.Tensor
) -> None:
    """Aborts (on every rank together) when ``group``'s allreduce disagrees with Gloo's."""
    got = data.clone()
    dist.all_reduce(got, group=group)
    rtol, atol = TOLERANCES[cfg.dtype]
    ok = torch.allclose(got, expected, rtol=rtol, atol=atol)
    err = (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
    verdict = torch.tensor([1.0 if ok else 0.0, err], dtype=torch.float64)
    flags = verdict[:1].clone()
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    errs = verdict[1:].clone()
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    if flags.item() < 1.0:
        raise RuntimeError(
            f"correctness check failed: {name} at {format_size(data.numel() * data.element_size())}"
            f" ({cfg.dtype}) differs from gloo; max |diff| over ranks = {errs.item():.3g}"
            f" (rtol={rtol}, atol={atol})"
        )


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def timed_loop(tensor: torch.Tensor, group: Any, iters: int) -> float:
    """Slowest rank's seconds per allreduce over ``iters`` back-to-back calls."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor, group=group)
    elapsed = time.perf_counter() - t0
    return max_over_ranks(elapsed / iters)


def choose_iters(cfg: Config, tensor: torch.Tensor, group: Any) -> int:
    if cfg.iters is not None:
        return cfg.iters
    estimate = timed_loop(tensor, group, CALIBRATION_ITERS)
    wanted = int(TARGET_ROW_SECONDS / max(estimate, 1e-9))
    return max(MIN_ITERS, min(MAX_ITERS, wanted))


COLUMNS = (
    f"{'size(B)':>12} {'count':>11} {'dtype':>9}  {'backend/algorithm':<30} {'time(us)':>11}"
    f" {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'vs_gloo':>8} {'algbw/memcpy':>12}"
    f" {'memcpy(us)':>11} {'iters':>5}"
)


def format_row(row: dict[str, Any]) -> str:
    return (
        f"{row['size_bytes']:>12} {row['count']:>11} {row['dtype']:>9}  {row['backend']:<30}"
        f" {row['time_us']:>11.2f} {row['algbw_gbps']:>11.3f} {row['busbw_gbps']:>11.3f}"
        f" {row['vs_gloo']:>8.2f} {row['algbw_vs_memcpy']:>12.3f} {row['memcpy_us']:>11.2f}"
        f" {row['iters']:>5}"
    )


def run_rank(rank: int, cfg: Config) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(cfg.port)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.nproc)
    groups: list[tuple[str, Any]] = [("gloo", dist.group.WORLD)]
    for algorithm in cfg.algorithms:
        options = torch_xdev.Options(algorithm=algorithm)
        if cfg.slot_bytes is not None:
            options = torch_xdev.Options(algorithm=algorithm, shm_slot_bytes=cfg.slot_bytes)
        groups.append((f"xdev/{algorithm}", dist.new_group(backend="xdev", pg_options=options)))

    dtype = DTYPES[cfg.dtype]
    element_size = torch.empty((), dtype=dtype).element_size()
    n = cfg.nproc
    rows: list[dict[str, Any]] = []
    if rank == 0:
        print(COLUMNS, flush=True)
    for size_index, size in enumerate(cfg.sizes):
        count = size // element_size
        data = random_input(count, dtype, rank, size_index)
        expected = data.clone()
        dist.all_reduce(expected)
        tensor = torch.zeros(count, dtype=dtype)  # stays zero: no overflow, no denormals
        gloo_time: Optional[float] = None
        for name, group in groups:
            if name != "gloo":
                check_against_gloo(cfg, name, group, data, expected)
            for _ in range(cfg.warmup):
                dist.all_reduce(tensor, group=group)
            iters = choose_iters(cfg, tensor, group)
            seconds = timed_loop(tensor, group, iters)
            label, picked = name, None
            if name == "xdev/auto":
                last = torch_xdev.describe(group)["last_allreduce"]
                picked = None if last is None else str(last[0])
                label = f"{name}({picked})"
            if gloo_time is None:
                gloo_time = seconds
            algbw = size / seconds / 1e9
            row = {
                "size_bytes": size,
                "count": count,
                "dtype": cfg.dtype,
                "backend": label,
                "backend_base": name.split("/")[0],
                "algorithm": name.split("/")[1] if "/" in name else None,
                "auto_picked": picked,
                "iters": iters,
                "time_us": seconds * 1e6,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (n - 1) / n,
                "vs_gloo": gloo_time / seconds,
                "algbw_vs_memcpy": algbw / cfg.memcpy_gbps,
                "memcpy_us": cfg.memcpy_us[size],
            }
            rows.append(row)
            if rank == 0:
                print(format_row(row), flush=True)
        del data, expected, tensor

    if rank == 0:
        write_json(cfg, rows)
    dist.barrier()
    dist.destroy_process_group()


def write_json(cfg: Config, rows: list[dict[str, Any]]) -> None:
    path = Path(cfg.json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "nproc": cfg.nproc,
        "sizes": cfg.sizes,
        "dtype": cfg.dtype,
        "algorithms": cfg.algorithms,
        "warmup": cfg.warmup,
        "iters": cfg.iters,
        "slot_bytes": cfg.slot_bytes,
        "torch_version": torch.__version__,
        "torch_xdev_version": torch_xdev.__version__,
        "cpu_count": os.cpu_count(),
        "memcpy_gbps": cfg.memcpy_gbps,
        "memcpy_bytes": MEMCPY_BYTES,
        "memcpy_us_per_size": {str(k): v for k, v in cfg.memcpy_us.items()},
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }
    path.write_text(json.dumps({"metadata": meta, "rows": rows}, indent=2) + "\n")
    print(f"# wrote {path}", flush=True)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=parse_sizes("4KiB:64MiB"),
        help="LO:HI (doubling) or a comma list; units B, KiB, MiB, GiB (default 4KiB:64MiB)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--algorithms", default=DEFAULT_ALGORITHMS, help="xdev algorithms")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default: auto)")
    parser.add_argument("--warmup", type=int, default=3, help="warmup iterations (default 3)")
    parser.add_argument("--json", default=None, help="output file (default benchmarks/results/)")
    parser.add_argument("--slot-bytes", type=parse_size, default=None, help="xdev shm_slot_bytes")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.nproc < 1:
        sys.exit("--nproc must be >= 1")
    if args.iters is not None and args.iters < 1 or args.warmup < 0:
        sys.exit("--iters must be >= 1 and --warmup >= 0")
    element_size = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    bad_sizes = [s for s in args.sizes if s % element_size]
    if bad_sizes:
        sys.exit(f"sizes {bad_sizes} are not multiples of the {args.dtype} element size")
    algorithms: list[str] = []
    for algorithm in (a.strip() for a in args.algorithms.split(",") if a.strip()):
        if algorithm not in torch_xdev.ALGORITHMS:
            sys.exit(f"unknown algorithm {algorithm!r}; choose from {torch_xdev.ALGORITHMS}")
        if algorithm.startswith("hierarchical") and args.nproc % 2:
            print(f"# note: skipping {algorithm} (needs an even nproc, got {args.nproc})")
            continue
        if algorithm not in algorithms:
            algorithms.append(algorithm)
    if args.slot_bytes is not None:
        torch_xdev.Options(shm_slot_bytes=args.slot_bytes)  # validates early

    default_json = Path(__file__).resolve().parent / "results" / f"allreduce_{args.nproc}ranks.json"
    memcpy_gbps, memcpy_us = measure_memcpy(args.sizes)
    cfg = Config(
        nproc=args.nproc,
        sizes=args.sizes,
        dtype=args.dtype,
        algorithms=algorithms,
        iters=args.iters,
        warmup=args.warmup,
        json_path=str(args.json or default_json),
        slot_bytes=args.slot_bytes,
        memcpy_gbps=memcpy_gbps,
        memcpy_us=memcpy_us,
        port=free_port(),
    )
    iters_text = cfg.iters if cfg.iters is not None else f"auto ({MIN_ITERS}..{MAX_ITERS})"
    print(f"# torch-xdev allreduce benchmark  nproc={cfg.nproc}  dtype={cfg.dtype}")
    print(
        f"# torch {torch.__version__}  torch_xdev {torch_xdev.__version__}  cpus {os.cpu_count()}"
    )
    print(f"# single-core memcpy ({format_size(MEMCPY_BYTES)} copy_): {memcpy_gbps:.2f} GB/s")
    print(
        f"# iters {iters_text}  warmup {cfg.warmup}  slot_bytes {cfg.slot_bytes or 'default'}"
        f"  sizes {format_size(cfg.sizes[0])}..{format_size(cfg.sizes[-1])} ({len(cfg.sizes)})"
    )
    print("# time = slowest rank's mean per call; busbw = algbw*2(n-1)/n; vs_gloo = speedup")
    sys.stdout.flush()
    try:
        mp.spawn(run_rank, args=(cfg,), nprocs=cfg.nproc, join=True)
    except mp.ProcessRaisedException as e:
        message = str(e).strip().splitlines()[-1]
        print(f"error: a rank failed: {message}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"error: a rank exited abnormally: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
