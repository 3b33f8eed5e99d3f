"""Allreduce benchmark: xdev algorithms side by side with Gloo (CPU) or NCCL (CUDA), nccl-tests style.

Usage::

    python benchmarks/allreduce.py --nproc 2 [--sizes 4KiB:64MiB] [--dtype float32]
        [--algorithms auto,shared_empty,direct,flat,reduce_to_one,hierarchical_copy,...]
        [--iters N] [--warmup N] [--rounds N] [--json out.json] [--slot-bytes B]
        [--arrival back-to-back|skewed] [--no-deepspeed]
    python benchmarks/allreduce.py --device cuda --nproc 8 [--sizes 4KiB:256MiB]
        [--cuda-slot-bytes B] [--topo-file dgx1.json] [--host-overhead-calls N] ...

CPU mode (the default): every rank runs one Gloo default group plus one xdev group per
algorithm; each row is the slowest rank's mean time per ``all_reduce``. The pseudo-algorithm
``shared_empty`` is ``auto`` on a tensor from ``torch_xdev.shared_empty``, which every rank
maps, so the allreduce runs in place; the other rows reduce ordinary tensors, as DDP's
buckets are. Before timing an xdev algorithm its result on random data is checked against
Gloo's. The parent process also
measures single-core ``copy_`` bandwidth so each row can be compared to memcpy.

Where ``deepspeed`` is importable, CPU mode adds a ``deepspeed_shm`` row per size: DeepSpeed's
shared-memory allreduce (``deepspeed.comm.inference_all_reduce``) in the same processes,
checked against Gloo like the xdev rows (``benchmarks/deepspeed_shm.py``; ``--no-deepspeed``
leaves it out). Where it cannot run, the header says why and the JSON records it.

``--arrival skewed`` puts a Gloo barrier before every timed call and times the call alone:
ranks then reach each call tens to hundreds of microseconds apart, as they do after
unequal work, and a row measures how well the backend waits (the default, back-to-back
calls, keeps the ranks in step). ``--rounds N`` times every row N times, the backends of
one size taking turns, and reports the mean: on a noisy machine the rows then share its
slow spells.

CUDA mode (``--device cuda``): rank r uses GPU ``r % device_count``. xdev's algorithms run
on CUDA tensors next to NCCL where NCCL can run (every rank on its own GPU); when ranks
share a GPU NCCL refuses to run, so the reference is Gloo on the same CUDA tensors instead
(the table says which). Times come from CUDA events around back-to-back calls after a
warmup (slowest rank's mean per call); xdev is checked against the reference first. Rank 0
also measures the GPU's device-to-device ``copy_`` bandwidth (algbw/copy compares each row
with it), and every backend's host overhead: the mean wall time of one
``all_reduce(t, async_op=True)`` call on a 4 KiB tensor. ``--topo-file`` passes a GPU link
matrix to xdev (``XDEV_TOPO_FILE``), e.g. a DGX-1 matrix to make ``auto`` run
hierarchical_copy on ranks sharing one GPU. Ranks sharing a GPU are time-sliced by the
driver, so their xdev times measure that, not the algorithms, unless an MPS daemon runs
(``nvidia-cuda-mps-control -d``), which lets their kernels run at once. The reduction kernels alone,
against the copy bandwidth, are benchmarked by ``benchmarks/cuda_kernels.py``.
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
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deepspeed_shm
import network_fit
import torch_xdev

# Which build runs: run from a checkout, `python benchmarks/allreduce.py` imports the installed
# package (sys.path starts at benchmarks/), not an in-place build; set PYTHONPATH to the
# checkout for that. The header says which one it got.
XDEV_PATH = str(Path(torch_xdev.__file__).resolve().parent)
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
DEFAULT_ALGORITHMS = (
    "auto,shared_empty,direct,flat,reduce_to_one,hierarchical_copy,hierarchical_balanced"
)
# Not an Options.algorithm: "auto" on a torch_xdev.shared_empty tensor (CPU only).
SHARED_EMPTY = "shared_empty"
TARGET_ROW_SECONDS = 0.5
MIN_ITERS = 5
MAX_ITERS = 200
CALIBRATION_ITERS = 3
MEMCPY_BYTES = 256 << 20
SEED = 20240611
DEFAULT_SIZES = {"cpu": "4KiB:64MiB", "cuda": "4KiB:256MiB"}
COPY_BYTES = 256 << 20  # CUDA mode: the copy_ whose bandwidth is the reference
COPY_BATCH_BYTES = 64 << 20  # small copies are timed in batches of about this many bytes
HOST_OVERHEAD_BYTES = 4096
KERNEL_BENCHMARK = "benchmarks/cuda_kernels.py"


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
    device: str = "cpu"
    cuda_slot_bytes: Optional[int] = None
    topo_file: Optional[str] = None
    reference: str = "gloo"  # CUDA mode: "nccl", or "gloo" on CUDA tensors
    reference_note: str = ""
    ranks_share_gpu: bool = False
    host_overhead_calls: int = 200
    arrival: str = "back-to-back"  # CPU mode: or "skewed" (a Gloo barrier before each call)
    rounds: int = 1
    deepspeed_skipped: Optional[str] = None  # why the DeepSpeed row is left out; None: try it
    hosts: int = 1  # CPU mode: the ranks split over this many hosts (XDEV_HOSTNAME)
    net_model_path: Optional[str] = None  # --hosts: where the fitted network model goes


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


def check_result(
    cfg: Config,
    name: str,
    allreduce: Callable[[torch.Tensor], Any],
    data: torch.Tensor,
    expected: torch.Tensor,
    reference: str,
    into: Optional[torch.Tensor] = None,
) -> None:
    """Aborts (on every rank together) when ``allreduce`` disagrees with the reference.

    ``data`` may be a CPU or CUDA tensor; it is reduced in a clone, or copied into ``into``
    first when given. The verdict is exchanged over the default (Gloo) group.
    """
    got = data.clone() if into is None else into.copy_(data)
    allreduce(got)
    rtol, atol = TOLERANCES[cfg.dtype]
    ok = torch.allclose(got, expected, rtol=rtol, atol=atol)
    err = (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
    flags = torch.tensor([1.0 if ok else 0.0], dtype=torch.float64)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    errs = torch.tensor([err], dtype=torch.float64)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    if flags.item() < 1.0:
        where = "CUDA, " if data.is_cuda else ""
        raise RuntimeError(
            f"correctness check failed: {name} at {format_size(data.numel() * data.element_size())}"
            f" ({where}{cfg.dtype}) differs from {reference}; max |diff| over ranks ="
            f" {errs.item():.3g} (rtol={rtol}, atol={atol})"
        )


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def group_allreduce(group: Any) -> Callable[[torch.Tensor], Any]:
    return lambda tensor: dist.all_reduce(tensor, group=group)


def timed_loop(
    tensor: torch.Tensor, allreduce: Callable[[torch.Tensor], Any], iters: int, skewed: bool
) -> float:
    """Slowest rank's seconds per allreduce over ``iters`` calls.

    Back to back, or with ``skewed`` each call after a Gloo barrier (the default group),
    which releases the ranks some microseconds apart; then only the calls are timed.
    """
    dist.barrier()
    if not skewed:
        t0 = time.perf_counter()
        for _ in range(iters):
            allreduce(tensor)
        return max_over_ranks((time.perf_counter() - t0) / iters)
    elapsed = 0.0
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        allreduce(tensor)
        elapsed += time.perf_counter() - t0
    return max_over_ranks(elapsed / iters)


def choose_iters(
    cfg: Config, tensor: torch.Tensor, allreduce: Callable[[torch.Tensor], Any]
) -> int:
    if cfg.iters is not None:
        return cfg.iters
    estimate = timed_loop(tensor, allreduce, CALIBRATION_ITERS, cfg.arrival == "skewed")
    wanted = int(TARGET_ROW_SECONDS / max(estimate, 1e-9))
    return max(MIN_ITERS, min(MAX_ITERS, wanted))


def timing_row(
    cfg: Config, size: int, count: int, name: str, label: str, iters: int, seconds: float
) -> dict[str, Any]:
    """The fields every table row has, CPU or CUDA: what ran, how long, at what bandwidth."""
    algbw = size / seconds / 1e9
    n = cfg.nproc
    return {
        "size_bytes": size,
        "count": count,
        "dtype": cfg.dtype,
        "backend": label,
        "backend_base": name.split("/")[0],
        "algorithm": name.split("/")[1] if "/" in name else None,
        "iters": iters,
        "time_us": seconds * 1e6,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * 2 * (n - 1) / n,
    }


def table_columns(reference: str, baseline: str) -> str:
    """The nccl-tests style header; ``reference`` and ``baseline`` name the two ratio columns."""
    return (
        f"{'size(B)':>12} {'count':>11} {'dtype':>9}  {'backend/algorithm':<30} {'time(us)':>11}"
        f" {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'vs_' + reference:>8}"
        f" {'algbw/' + baseline:>12} {baseline + '(us)':>11} {'iters':>5}"
    )


def table_row(row: dict[str, Any], ratio_key: str, baseline_key: str, baseline_us_key: str) -> str:
    return (
        f"{row['size_bytes']:>12} {row['count']:>11} {row['dtype']:>9}  {row['backend']:<30}"
        f" {row['time_us']:>11.2f} {row['algbw_gbps']:>11.3f} {row['busbw_gbps']:>11.3f}"
        f" {row[ratio_key]:>8.2f} {row[baseline_key]:>12.3f} {row[baseline_us_key]:>11.2f}"
        f" {row['iters']:>5}"
    )


COLUMNS = table_columns("gloo", "memcpy")


def format_row(row: dict[str, Any]) -> str:
    return table_row(row, "vs_gloo", "algbw_vs_memcpy", "memcpy_us")


def run_rank(rank: int, cfg: Config) -> None:
    if cfg.device == "cuda":
        run_rank_cuda(rank, cfg)
        return
    torch.set_num_threads(1)
    if cfg.hosts > 1:  # host-contiguous: ranks 0..L-1 on the first host, and so on
        os.environ["XDEV_HOSTNAME"] = f"fake-host-{rank // (cfg.nproc // cfg.hosts)}"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(cfg.port)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.nproc)
    # (row name, allreduce, its group: None for DeepSpeed, which has its own channel)
    variants: list[tuple[str, Callable[[torch.Tensor], Any], Any]] = [
        ("gloo", group_allreduce(dist.group.WORLD), dist.group.WORLD)
    ]
    for algorithm in cfg.algorithms:
        plan = "auto" if algorithm == SHARED_EMPTY else algorithm
        options = torch_xdev.Options(algorithm=plan)
        if cfg.slot_bytes is not None:
            options = torch_xdev.Options(algorithm=plan, shm_slot_bytes=cfg.slot_bytes)
        group = dist.new_group(backend="xdev", pg_options=options)
        variants.append((f"xdev/{algorithm}", group_allreduce(group), group))
    deepspeed_skipped = cfg.deepspeed_skipped
    if deepspeed_skipped is None:
        ds_allreduce, deepspeed_skipped = deepspeed_shm.start(rank, cfg.nproc, cfg.dtype)
        if ds_allreduce is not None:
            variants.append((deepspeed_shm.LABEL, ds_allreduce, None))
    if rank == 0:
        if deepspeed_skipped:
            print(f"# {deepspeed_shm.LABEL}: skipped: {deepspeed_skipped}")
        else:
            print(
                f"# {deepspeed_shm.LABEL}: DeepSpeed {deepspeed_shm.version()} SHM allreduce"
                " (deepspeed.comm.inference_all_reduce; its waits spin, never sleep)"
            )
        print(COLUMNS, flush=True)

    dtype = DTYPES[cfg.dtype]
    element_size = torch.empty((), dtype=dtype).element_size()
    skewed = cfg.arrival == "skewed"
    rows: list[dict[str, Any]] = []
    for size_index, size in enumerate(cfg.sizes):
        count = size // element_size
        data = random_input(count, dtype, rank, size_index)
        expected = data.clone()
        dist.all_reduce(expected)
        tensor = torch.zeros(count, dtype=dtype)  # stays zero: no overflow, no denormals
        timed: dict[str, torch.Tensor] = {}
        iters: dict[str, int] = {}
        for name, allreduce, group in variants:
            # Collective: every rank allocates it in the same order.
            shared = (
                torch_xdev.shared_empty(count, dtype=dtype, group=group)
                if name == f"xdev/{SHARED_EMPTY}"
                else None
            )
            if name != "gloo":
                check_result(cfg, name, allreduce, data, expected, "gloo", into=shared)
            timed[name] = tensor if shared is None else shared.zero_()
            for _ in range(cfg.warmup):
                allreduce(timed[name])
            iters[name] = choose_iters(cfg, timed[name], allreduce)
        seconds: dict[str, float] = {name: 0.0 for name, _, _ in variants}
        for _ in range(cfg.rounds):
            for name, allreduce, _ in variants:
                seconds[name] += timed_loop(timed[name], allreduce, iters[name], skewed)
        del timed
        gloo_time = seconds["gloo"] / cfg.rounds
        for name, _, group in variants:
            mean = seconds[name] / cfg.rounds
            label, picked = name, None
            if name == "xdev/auto":
                last = torch_xdev.describe(group)["last_allreduce"]
                picked = None if last is None else str(last[0])
                label = f"{name}({picked})"
            row = timing_row(cfg, size, count, name, label, iters[name], mean)
            row |= {
                "auto_picked": picked,
                "vs_gloo": gloo_time / mean,
                "algbw_vs_memcpy": row["algbw_gbps"] / cfg.memcpy_gbps,
                "memcpy_us": cfg.memcpy_us[size],
            }
            rows.append(row)
            if rank == 0:
                print(format_row(row), flush=True)
        del data, expected, tensor

    if rank == 0:
        write_json(cfg, rows, deepspeed_skipped)
        if cfg.hosts > 1:
            fit_and_write_network(cfg, rows)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# CUDA mode

CUDA_COLUMNS = table_columns("ref", "copy")


def mps_pipe_directory() -> Optional[str]:
    """The pipe directory of a running CUDA MPS control daemon, or None."""
    pipes = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    return str(pipes) if (pipes / "control").exists() else None


def format_cuda_row(row: dict[str, Any]) -> str:
    return table_row(row, "vs_reference", "algbw_vs_copy", "copy_us")


def timing_event() -> Any:
    """A CUDA event that records time (``torch.cuda.Event`` has no type annotations)."""
    event_type: Any = torch.cuda.Event
    return event_type(enable_timing=True)


def best_cuda_copy_seconds(nbytes: int, device: torch.device, batches: int = 5) -> float:
    """Best time of one ``dst.copy_(src)`` between two tensors on ``device`` (CUDA events).

    Small copies are timed in batches (so the launch latency is amortised as it is in a
    stream of back-to-back collectives) and the batch time divided by its length.
    """
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    per_batch = max(1, min(1000, COPY_BATCH_BYTES // max(nbytes, 1)))
    start = timing_event()
    end = timing_event()
    torch.cuda.synchronize(device)
    best = math.inf
    for _ in range(batches):
        start.record()
        for _ in range(per_batch):
            dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / per_batch)
    return best


def measure_cuda_copy(
    cfg: Config, device: torch.device, rank: int
) -> tuple[float, dict[int, float]]:
    """Rank 0 measures copy_ bandwidth while the others wait; every rank gets the numbers.

    Returns (GB/s of a 256 MiB copy, {row size: best copy time in us}). GB/s counts the
    bytes copied; the memory traffic is twice that (every byte is read and written).
    """
    values = torch.zeros(1 + len(cfg.sizes), dtype=torch.float64)
    if rank == 0:
        values[0] = COPY_BYTES / best_cuda_copy_seconds(COPY_BYTES, device, batches=10) / 1e9
        for i, size in enumerate(cfg.sizes):
            values[1 + i] = best_cuda_copy_seconds(size, device) * 1e6
        torch.cuda.empty_cache()
    dist.broadcast(values, src=0)  # default group: Gloo, CPU tensor
    return float(values[0]), {size: float(values[1 + i]) for i, size in enumerate(cfg.sizes)}


def cuda_timed_loop(tensor: torch.Tensor, group: Any, iters: int) -> float:
    """Slowest rank's seconds per allreduce over ``iters`` back-to-back calls (CUDA events
    on the current stream, which each call's wait() orders after the collective)."""
    start = timing_event()
    end = timing_event()
    torch.cuda.synchronize(tensor.device)
    dist.barrier()
    start.record()
    for _ in range(iters):
        dist.all_reduce(tensor, group=group)
    end.record()
    end.synchronize()
    return max_over_ranks(start.elapsed_time(end) / 1e3 / iters)


def choose_cuda_iters(cfg: Config, tensor: torch.Tensor, group: Any) -> int:
    if cfg.iters is not None:
        return cfg.iters
    estimate = cuda_timed_loop(tensor, group, CALIBRATION_ITERS)
    wanted = int(TARGET_ROW_SECONDS / max(estimate, 1e-9))
    return max(MIN_ITERS, min(MAX_ITERS, wanted))


def host_overhead(group: Any, device: torch.device, calls: int) -> dict[str, float]:
    """Wall time of one ``all_reduce(t, async_op=True)`` call until it returns (4 KiB tensor).

    The calls run back to back and are waited for afterwards. Mean and median over the
    calls, each the slowest rank's. For xdev the call includes the host-side check that
    every rank runs the same collective (a barrier with the peers), so it is bounded below
    by the ranks' skew.
    """
    t = torch.zeros(HOST_OVERHEAD_BYTES // 4, dtype=torch.float32, device=device)
    for _ in range(5):
        dist.all_reduce(t, group=group)
    torch.cuda.synchronize(device)
    dist.barrier()
    times: list[float] = []
    works: list[Any] = []
    for _ in range(calls):
        t0 = time.perf_counter()
        work = dist.all_reduce(t, group=group, async_op=True)
        times.append(time.perf_counter() - t0)
        works.append(work)
    for work in works:
        work.wait()
    torch.cuda.synchronize(device)
    times.sort()
    return {
        "mean_us": max_over_ranks(sum(times) / len(times)) * 1e6,
        "median_us": max_over_ranks(times[len(times) // 2]) * 1e6,
        "min_us": max_over_ranks(times[0]) * 1e6,
    }


def run_rank_cuda(rank: int, cfg: Config) -> None:
    torch.set_num_threads(1)
    if cfg.hosts > 1:  # host-contiguous: ranks 0..L-1 on the first host, and so on
        os.environ["XDEV_HOSTNAME"] = f"fake-host-{rank // (cfg.nproc // cfg.hosts)}"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(cfg.port)
    if cfg.topo_file is not None:
        os.environ["XDEV_TOPO_FILE"] = cfg.topo_file
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    # The default group is Gloo: CPU-side coordination, and the reference on CUDA tensors
    # when NCCL cannot run.
    dist.init_process_group("gloo", rank=rank, world_size=cfg.nproc)
    copy_gbps, copy_us = measure_cuda_copy(cfg, device, rank)
    reference_group: Any = dist.group.WORLD
    if cfg.reference == "nccl":
        reference_group = dist.new_group(backend="nccl")
    groups: list[tuple[str, Any]] = [(cfg.reference, reference_group)]
    for algorithm in cfg.algorithms:
        fields: dict[str, Any] = {"algorithm": algorithm}
        if cfg.cuda_slot_bytes is not None:
            fields["cuda_slot_bytes"] = cfg.cuda_slot_bytes
        options = torch_xdev.Options(**fields)
        groups.append((f"xdev/{algorithm}", dist.new_group(backend="xdev", pg_options=options)))

    # Every group's first CUDA collective (xdev: its GPU rendezvous) before anything is timed.
    cuda_info: Optional[dict[str, Any]] = None
    for name, group in groups:
        warm = torch.ones(4, device=device)
        dist.all_reduce(warm, group=group)
        if cuda_info is None and name != cfg.reference:
            cuda_info = dict(torch_xdev.describe(group)["cuda"])
    if rank == 0:
        if cuda_info is not None:
            print(describe_cuda_line(cuda_info))
        print(CUDA_COLUMNS, flush=True)

    dtype = DTYPES[cfg.dtype]
    element_size = torch.empty((), dtype=dtype).element_size()
    rows: list[dict[str, Any]] = []
    for size_index, size in enumerate(cfg.sizes):
        count = size // element_size
        data = random_input(count, dtype, rank, size_index).to(device)
        expected = data.clone()
        dist.all_reduce(expected, group=reference_group)
        tensor = torch.zeros(count, dtype=dtype, device=device)  # stays zero
        reference_time: Optional[float] = None
        for name, group in groups:
            ran: Optional[str] = None
            label = name
            if name != cfg.reference:
                check_result(cfg, name, group_allreduce(group), data, expected, cfg.reference)
                last = torch_xdev.describe(group)["last_allreduce"]
                ran = None if last is None else str(last[0])
                if ran != name.split("/")[1]:
                    label = f"{name}({ran})"  # auto's pick, or a forced plan not honoured
            for _ in range(cfg.warmup):
                dist.all_reduce(tensor, group=group)
            iters = choose_cuda_iters(cfg, tensor, group)
            seconds = cuda_timed_loop(tensor, group, iters)
            if reference_time is None:
                reference_time = seconds
            row = {"device": "cuda"} | timing_row(cfg, size, count, name, label, iters, seconds)
            row |= {
                "ran": ran,
                "auto_picked": ran if name == "xdev/auto" else None,
                "reference": cfg.reference,
                "vs_reference": reference_time / seconds,
                "algbw_vs_copy": row["algbw_gbps"] / copy_gbps,
                "copy_us": copy_us[size],
            }
            rows.append(row)
            if rank == 0:
                print(format_cuda_row(row), flush=True)
        del data, expected, tensor

    overheads: list[dict[str, Any]] = []
    for name, group in groups:
        stats = host_overhead(group, device, cfg.host_overhead_calls)
        overheads.append(
            {"backend": name, "bytes": HOST_OVERHEAD_BYTES, "calls": cfg.host_overhead_calls}
            | stats
        )
    if rank == 0:
        print(
            f"# host overhead: wall time of one all_reduce(async_op=True) call returning,"
            f" {format_size(HOST_OVERHEAD_BYTES)} float32, {cfg.host_overhead_calls} calls"
            " back to back (slowest rank)"
        )
        for entry in overheads:
            print(
                f"#   {entry['backend']:<30} mean {entry['mean_us']:9.2f} us   median"
                f" {entry['median_us']:9.2f} us   min {entry['min_us']:9.2f} us"
            )
        write_cuda_json(cfg, rows, overheads, copy_gbps, copy_us, cuda_info, device)
    torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()


def describe_cuda_line(info: dict[str, Any]) -> str:
    if not info.get("initialized"):
        return f"# xdev on CUDA: {info.get('note')}"
    return (
        f"# xdev on CUDA: topology {info.get('topology_class')} ({info.get('topology_source')}),"
        f" ranks share a GPU: {info.get('ranks_share_gpu')}, transport"
        f" {info.get('transport_note')}, CUDA fallback engine {info.get('fallback_backend')}"
    )


def write_cuda_json(
    cfg: Config,
    rows: list[dict[str, Any]],
    overheads: list[dict[str, Any]],
    copy_gbps: float,
    copy_us: dict[int, float],
    cuda_info: Optional[dict[str, Any]],
    device: torch.device,
) -> None:
    path = Path(cfg.json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": "cuda",
        "nproc": cfg.nproc,
        "sizes": cfg.sizes,
        "dtype": cfg.dtype,
        "algorithms": cfg.algorithms,
        "warmup": cfg.warmup,
        "iters": cfg.iters,
        "cuda_slot_bytes": cfg.cuda_slot_bytes,
        "topo_file": cfg.topo_file,
        "reference": cfg.reference,
        "reference_note": cfg.reference_note,
        "ranks_share_gpu": cfg.ranks_share_gpu,
        "mps_pipe_directory": mps_pipe_directory(),
        "gpu": torch.cuda.get_device_name(device),
        "device_count": torch.cuda.device_count(),
        "copy_gbps": copy_gbps,
        "copy_bytes": COPY_BYTES,
        "copy_us_per_size": {str(k): v for k, v in copy_us.items()},
        "host_overhead": overheads,
        "xdev_cuda": cuda_info,
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "torch_xdev_version": torch_xdev.__version__,
        "torch_xdev_path": XDEV_PATH,
        "cpu_count": os.cpu_count(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }
    path.write_text(json.dumps({"metadata": meta, "rows": rows}, indent=2) + "\n")
    print(f"# wrote {path}", flush=True)


def write_json(cfg: Config, rows: list[dict[str, Any]], deepspeed_skipped: str) -> None:
    path = Path(cfg.json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "nproc": cfg.nproc,
        "sizes": cfg.sizes,
        "dtype": cfg.dtype,
        "algorithms": cfg.algorithms,
        "warmup": cfg.warmup,
        "iters": cfg.iters,
        "rounds": cfg.rounds,
        "arrival": cfg.arrival,
        "deepspeed": {
            "row": deepspeed_shm.LABEL,
            "version": deepspeed_shm.version(),
            "skipped": deepspeed_skipped or None,
        },
        "slot_bytes": cfg.slot_bytes,
        "torch_version": torch.__version__,
        "torch_xdev_version": torch_xdev.__version__,
        "torch_xdev_path": XDEV_PATH,
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
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "--device cuda runs xdev's CUDA path next to NCCL (or Gloo on CUDA tensors where"
            " ranks share a GPU) and reports the GPU's copy_ bandwidth and each backend's host"
            f" overhead per call. The reduction kernels alone are benchmarked by {KERNEL_BENCHMARK}"
            " (against the same device-to-device copy bandwidth)."
        ),
    )
    parser.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (default): CPU tensors, xdev vs Gloo; cuda: rank r on GPU r %% device_count,"
        " xdev vs NCCL",
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=None,
        help="LO:HI (doubling) or a comma list; units B, KiB, MiB, GiB (default 4KiB:64MiB;"
        " with --device cuda 4KiB:256MiB)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--algorithms", default=DEFAULT_ALGORITHMS, help="xdev algorithms")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default: auto)")
    parser.add_argument("--warmup", type=int, default=3, help="warmup iterations (default 3)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="CPU mode: time every row this many times, the backends of a size taking turns,"
        " and report the mean (default 1)",
    )
    parser.add_argument(
        "--arrival",
        choices=("back-to-back", "skewed"),
        default="back-to-back",
        help="CPU mode: back-to-back calls (default), or skewed: a Gloo barrier before every"
        " timed call, so ranks arrive apart; only the calls are timed",
    )
    parser.add_argument(
        "--no-deepspeed",
        action="store_true",
        help="CPU mode: leave out the DeepSpeed SHM allreduce row (added where deepspeed is"
        " importable)",
    )
    parser.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="CPU mode: split the ranks over this many hosts as xdev sees them (XDEV_HOSTNAME),"
        " host by host; xdev runs auto (the two-level plan across hosts) next to Gloo, and the"
        " header gives each plan's traffic per host from the plans; after the run the network"
        " model's latency and per-stream rate are fitted to Gloo's times (default 1)",
    )
    parser.add_argument(
        "--net-model-out",
        default=None,
        metavar="PATH",
        help="--hosts: where the network model fitted to Gloo's times goes, an XDEV_CPU_MODEL"
        " file; an existing file keeps its other parameters (default"
        " benchmarks/results/network_model_<N>hosts.json)",
    )
    parser.add_argument("--json", default=None, help="output file (default benchmarks/results/)")
    parser.add_argument("--slot-bytes", type=parse_size, default=None, help="xdev shm_slot_bytes")
    parser.add_argument(
        "--cuda-slot-bytes",
        type=parse_size,
        default=None,
        help="xdev cuda_slot_bytes (--device cuda; default: xdev's, 32MiB)",
    )
    parser.add_argument(
        "--topo-file",
        default=None,
        metavar="PATH",
        help="GPU link matrix for xdev (sets XDEV_TOPO_FILE in the ranks; --device cuda), e.g."
        " a DGX-1 matrix so that auto runs hierarchical_copy; format: torch_xdev/topology.py",
    )
    parser.add_argument(
        "--host-overhead-calls",
        type=int,
        default=200,
        help="async all_reduce calls timed for the host overhead (--device cuda; default 200)",
    )
    return parser.parse_args(argv)


def cuda_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Checks the CUDA mode's arguments in the parent; returns the Config fields they set."""
    if not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA GPU")
    if not getattr(torch_xdev._C, "built_with_cuda", False):
        print(
            "# note: torch_xdev was built without its CUDA path: xdev hands CUDA tensors to"
            " its fallback engine, so its rows measure that engine"
        )
    if args.host_overhead_calls < 1:
        sys.exit("--host-overhead-calls must be >= 1")
    if args.cuda_slot_bytes is not None:
        torch_xdev.Options(cuda_slot_bytes=args.cuda_slot_bytes)  # validates early
    topo_file: Optional[str] = None
    if args.topo_file is not None:
        from torch_xdev.topology import load_topology_file

        topo_file = str(Path(args.topo_file).resolve())
        try:
            topo = load_topology_file(topo_file)
        except ValueError as e:
            sys.exit(f"--topo-file: {e}")
        if len(topo["nvlink"]) != args.nproc:
            sys.exit(
                f"--topo-file describes {len(topo['nvlink'])} GPUs but --nproc is {args.nproc}"
                " (its rows are the ranks)"
            )
    gpus = torch.cuda.device_count()
    share = args.nproc > gpus
    if share:
        reference = "gloo"
        note = (
            f"{args.nproc} ranks on {gpus} GPU(s) share GPUs: NCCL refuses two ranks on one GPU,"
            " so it is skipped; the reference is Gloo on the same CUDA tensors"
        )
    elif not dist.is_nccl_available():
        reference = "gloo"
        note = "this torch has no NCCL; the reference is Gloo on the same CUDA tensors"
    else:
        reference, note = "nccl", "NCCL: every rank on its own GPU"
    return {
        "device": "cuda",
        "cuda_slot_bytes": args.cuda_slot_bytes,
        "topo_file": topo_file,
        "reference": reference,
        "reference_note": note,
        "ranks_share_gpu": share,
        "host_overhead_calls": args.host_overhead_calls,
    }


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.sizes is None:
        args.sizes = parse_sizes(DEFAULT_SIZES[args.device])
    if args.nproc < 1:
        sys.exit("--nproc must be >= 1")
    if args.iters is not None and args.iters < 1 or args.warmup < 0 or args.rounds < 1:
        sys.exit("--iters and --rounds must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and (args.arrival != "back-to-back" or args.rounds != 1):
        sys.exit("--arrival and --rounds apply to CPU mode only")
    element_size = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    bad_sizes = [s for s in args.sizes if s % element_size]
    if bad_sizes:
        sys.exit(f"sizes {bad_sizes} are not multiples of the {args.dtype} element size")
    algorithms: list[str] = []
    for algorithm in (a.strip() for a in args.algorithms.split(",") if a.strip()):
        if algorithm == SHARED_EMPTY and args.device == "cuda":
            continue  # CPU tensors only; the default list has it
        if algorithm not in torch_xdev.ALGORITHMS and algorithm != SHARED_EMPTY:
            choices = (*torch_xdev.ALGORITHMS, SHARED_EMPTY)
            sys.exit(f"unknown algorithm {algorithm!r}; choose from {choices}")
        if algorithm.startswith("hierarchical") and args.nproc % 2:
            print(f"# note: skipping {algorithm} (needs an even nproc, got {args.nproc})")
            continue
        if algorithm not in algorithms:
            algorithms.append(algorithm)
    if args.slot_bytes is not None:
        torch_xdev.Options(shm_slot_bytes=args.slot_bytes)  # validates early
    if args.hosts != 1:
        if args.device != "cpu" or args.hosts < 1 or args.nproc % args.hosts:
            sys.exit("--hosts needs CPU mode and divides --nproc")
        algorithms = ["auto"]  # the forced native plans need one host
        args.no_deepspeed = True

    if args.device == "cuda":
        cfg = make_cuda_config(args, algorithms)
    else:
        cfg = make_cpu_config(args, algorithms)
    return launch(cfg)


def make_config(
    args: argparse.Namespace, algorithms: list[str], json_name: str, **mode_fields: Any
) -> Config:
    """The Config both modes share, plus the mode's own fields; JSON under results/ by default."""
    default_json = Path(__file__).resolve().parent / "results" / json_name
    return Config(
        nproc=args.nproc,
        sizes=args.sizes,
        dtype=args.dtype,
        algorithms=algorithms,
        iters=args.iters,
        warmup=args.warmup,
        json_path=str(args.json or default_json),
        slot_bytes=args.slot_bytes,
        port=free_port(),
        **mode_fields,
    )


def iters_text(cfg: Config) -> str:
    return str(cfg.iters) if cfg.iters is not None else f"auto ({MIN_ITERS}..{MAX_ITERS})"


def make_cuda_config(args: argparse.Namespace, algorithms: list[str]) -> Config:
    # Not allreduce_*ranks.json: benchmarks/calibrate.py fits the CPU model to those files.
    cfg = make_config(
        args,
        algorithms,
        f"cuda_allreduce_{args.nproc}ranks.json",
        memcpy_gbps=0.0,
        memcpy_us={},
        **cuda_settings(args),
    )
    print(f"# torch-xdev allreduce benchmark (CUDA)  nproc={cfg.nproc}  dtype={cfg.dtype}")
    print(
        f"# torch {torch.__version__} (CUDA {torch.version.cuda})  torch_xdev"
        f" {torch_xdev.__version__}  GPUs {torch.cuda.device_count()}"
    )
    print(f"# torch_xdev from {XDEV_PATH}")
    print(f"# reference: {cfg.reference_note}")
    if cfg.ranks_share_gpu:
        mps = mps_pipe_directory()
        if mps is not None:
            print(f"# note: an MPS daemon is running ({mps}): ranks sharing a GPU run concurrently")
        else:
            print(
                "# note: ranks sharing a GPU are time-sliced by the driver (no MPS daemon found);"
                " each GPU barrier waits about one time slice, so xdev's times below measure"
                " that, not its algorithms (start `nvidia-cuda-mps-control -d` to avoid it)"
            )
    print(
        f"# iters {iters_text(cfg)}  warmup {cfg.warmup}  cuda_slot_bytes"
        f" {cfg.cuda_slot_bytes or 'default'}  topo_file {cfg.topo_file or '-'}"
        f"  sizes {format_size(cfg.sizes[0])}..{format_size(cfg.sizes[-1])} ({len(cfg.sizes)})"
    )
    print(
        "# time = slowest rank's mean per call (CUDA events); busbw = algbw*2(n-1)/n;"
        f" vs_ref = speedup over {cfg.reference}; algbw/copy = algbw / the GPU's copy_ GB/s"
        f" ({format_size(COPY_BYTES)}, bytes copied per second); copy(us) = copy_ of the row's size"
    )
    return cfg


def make_cpu_config(args: argparse.Namespace, algorithms: list[str]) -> Config:
    memcpy_gbps, memcpy_us = measure_memcpy(args.sizes)
    deepspeed_skipped = (
        "left out by --no-deepspeed or --hosts"
        if args.no_deepspeed
        else deepspeed_shm.unavailable_reason("cpu", args.dtype)
    )
    # Skewed rows are not for benchmarks/calibrate.py, which reads allreduce_*ranks.json.
    suffix = "_skewed" if args.arrival == "skewed" else ""
    if args.hosts > 1:
        suffix += f"_{args.hosts}hosts"
    cfg = make_config(
        args,
        algorithms,
        f"allreduce_{args.nproc}ranks{suffix}.json",
        memcpy_gbps=memcpy_gbps,
        memcpy_us=memcpy_us,
        arrival=args.arrival,
        rounds=args.rounds,
        deepspeed_skipped=deepspeed_skipped,
        hosts=args.hosts,
        net_model_path=str(
            args.net_model_out
            or Path(__file__).resolve().parent / "results" / f"network_model_{args.hosts}hosts.json"
        ),
    )
    print(f"# torch-xdev allreduce benchmark  nproc={cfg.nproc}  dtype={cfg.dtype}")
    if cfg.hosts > 1:
        print_traffic(cfg)
    print(
        f"# torch {torch.__version__}  torch_xdev {torch_xdev.__version__}  cpus {os.cpu_count()}"
    )
    print(f"# torch_xdev from {XDEV_PATH}")
    print(f"# single-core memcpy ({format_size(MEMCPY_BYTES)} copy_): {memcpy_gbps:.2f} GB/s")
    print(
        f"# iters {iters_text(cfg)}  warmup {cfg.warmup}  rounds {cfg.rounds}  slot_bytes"
        f" {cfg.slot_bytes or 'default'}  sizes {format_size(cfg.sizes[0])}.."
        f"{format_size(cfg.sizes[-1])} ({len(cfg.sizes)})"
    )
    arrival = (
        "skewed: a Gloo barrier before every call, the call alone timed"
        if cfg.arrival == "skewed"
        else "back-to-back calls"
    )
    print(f"# arrival: {arrival}")
    print("# time = slowest rank's mean per call; busbw = algbw*2(n-1)/n; vs_gloo = speedup")
    return cfg


def print_traffic(cfg: Config) -> None:
    """Where each plan's bytes go, per host, from the plans (loopback hides it here)."""
    per_host = cfg.nproc // cfg.hosts
    print(
        f"# {cfg.hosts} hosts x {per_host} ranks (XDEV_HOSTNAME); per host, from the plans:"
        " MB sent to other hosts / sequential steps across hosts / streams leaving at once /"
        " MB between ranks of one host through sockets"
    )
    for size in cfg.sizes:
        plans = torch_xdev._C.plan.across_hosts_traffic(cfg.hosts, per_host, size)
        cells = [
            f"{name} {t['inter_host_bytes'] / 1e6:.3f} / {t['inter_host_steps']} /"
            f" {t['inter_host_streams']} / {t['intra_host_socket_bytes'] / 1e6:.3f}"
            for name, t in (("two-level", plans["two_level"]), ("gloo ring", plans["flat_ring"]))
        ]
        print(f"#   {format_size(size):>8}: " + ";  ".join(cells))


def fit_and_write_network(cfg: Config, rows: list[dict[str, Any]]) -> None:
    """Fits the network model to Gloo's ring over all ranks across the hosts, prints it next to
    the defaults and writes it as an XDEV_CPU_MODEL file (benchmarks/network_fit.py)."""
    gloo = [r for r in rows if r["backend"] == "gloo"]
    if len(gloo) < 2:
        print("# network fit: needs at least two sizes")
        return
    per_host = cfg.nproc // cfg.hosts
    sizes = [r["size_bytes"] for r in gloo]
    seconds = [r["time_us"] * 1e-6 for r in gloo]
    fit = network_fit.fit_network(cfg.hosts, per_host, sizes, seconds)
    for line in network_fit.format_fit(fit):
        print(line)
    for size, t in zip(sizes, seconds):
        fitted = network_fit.predict_ring_s(
            cfg.hosts, per_host, size, fit["net_latency_us"], fit["net_stream_gbps"]
        )
        default = network_fit.predict_ring_s(
            cfg.hosts,
            per_host,
            size,
            network_fit.DEFAULT_LATENCY_US,
            network_fit.DEFAULT_STREAM_GBPS,
        )
        print(
            f"#   {format_size(size):>8}: Gloo measured {t * 1e6:10.1f} us, fitted model"
            f" {fitted * 1e6:10.1f} us, default model {default * 1e6:10.1f} us"
        )
    assert cfg.net_model_path is not None
    source = {"benchmark": cfg.json_path, "hosts": cfg.hosts, "ranks_per_host": per_host}
    network_fit.write_model(Path(cfg.net_model_path), fit, source)
    print(f"# wrote {cfg.net_model_path} (use it with XDEV_CPU_MODEL={cfg.net_model_path})")


def launch(cfg: Config) -> int:
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
