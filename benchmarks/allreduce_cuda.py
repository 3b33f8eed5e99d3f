"""CUDA mode of benchmarks/allreduce.py (``--device cuda``): xdev's algorithms on CUDA tensors
next to NCCL (Gloo where ranks share a GPU), timed with CUDA events, beside the GPU's copy_
bandwidth and each backend's host time per call."""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

import torch_xdev
from run_record import XDEV_PATH, environment, write_results, xdev_environment_line
from allreduce_common import (
    DTYPES,
    Config,
    format_size,
    random_input,
    check_result,
    choose_iters,
    max_over_ranks,
    group_allreduce,
    timing_row,
    table_columns,
    table_row,
    make_config,
    iters_text,
    sizes_text,
    settings_metadata,
    init_rank,
)

COPY_BYTES = 256 << 20  # CUDA mode: the copy_ whose bandwidth is the reference
COPY_BATCH_BYTES = 64 << 20  # small copies are timed in batches of about this many bytes
HOST_OVERHEAD_BYTES = 4096
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


def heap_in_place(group: Any) -> int:
    """How many allreduces of ``group`` read the peers' copies in its CUDA heap (0 without)."""
    heap = torch_xdev.describe(group)["cuda"].get("heap")
    return 0 if heap is None else int(heap["in_place_allreduces"])


def run_rank_cuda(rank: int, cfg: Config) -> None:
    if cfg.topo_file is not None:
        os.environ["XDEV_TOPO_FILE"] = cfg.topo_file
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    # Gloo is also the reference on CUDA tensors where NCCL cannot run.
    init_rank(rank, cfg)
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
    heap_groups: set[str] = set()  # xdev groups with a CUDA heap: a "/heap" row each
    for name, group in groups:
        warm = torch.ones(4, device=device)
        dist.all_reduce(warm, group=group)
        if name != cfg.reference:
            info = dict(torch_xdev.describe(group)["cuda"])
            cuda_info = cuda_info or info
            if info.get("heap") is not None:
                heap_groups.add(name)
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
        zeros = torch.zeros(count, dtype=dtype, device=device)  # stays zero
        reference_time: Optional[float] = None
        # Each xdev group with a CUDA heap runs twice: on an ordinary tensor and on one from
        # its heap (as DDP's buckets are under DDP_DISABLE_COMM_MEM=0), which runs in place.
        variants = [(name, group, False) for name, group in groups]
        variants += [(f"{name}/heap", group, True) for name, group in groups if name in heap_groups]
        for name, group, heap in variants:
            ran: Optional[str] = None
            label = name
            tensor = zeros
            if heap:
                tensor = group._get_backend(device).allocate_tensor(
                    count, dtype=dtype, device=device
                )
                tensor.zero_()
            if name != cfg.reference:
                in_place_before = heap_in_place(group)
                check_result(
                    cfg, name, group_allreduce(group), data, expected, cfg.reference, tensor
                )
                tensor.zero_()
                last = torch_xdev.describe(group)["last_allreduce"]
                ran = None if last is None else str(last[0])
                if heap:
                    # The in-place program ran (or the places differed and it staged).
                    ran = f"{ran}, in place" if heap_in_place(group) > in_place_before else ran
                if ran != name.split("/")[1]:
                    label = f"{name}({ran})"  # auto's pick, or a forced plan not honoured
            for _ in range(cfg.warmup):
                dist.all_reduce(tensor, group=group)
            iters = choose_iters(cfg, functools.partial(cuda_timed_loop, tensor, group))
            seconds = cuda_timed_loop(tensor, group, iters)
            if reference_time is None:
                reference_time = seconds
            row = {"device": "cuda"} | timing_row(cfg, size, count, name, label, iters, seconds)
            row |= {
                "ran": ran,
                "heap": heap,  # a tensor from the group's CUDA heap
                "auto_picked": ran if name == "xdev/auto" else None,
                "reference": cfg.reference,
                "vs_reference": reference_time / seconds,
                "algbw_vs_copy": row["algbw_gbps"] / copy_gbps,
                "copy_us": copy_us[size],
            }
            rows.append(row)
            if rank == 0:
                print(format_cuda_row(row), flush=True)
            del tensor
        del data, expected, zeros

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
    meta = {
        "device": "cuda",
        **settings_metadata(cfg),
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
        "torch_cuda_version": torch.version.cuda,
        **environment(),
    }
    write_results(Path(cfg.json_path), meta, rows)


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
    print(xdev_environment_line())
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
        f"  sizes {sizes_text(cfg)}"
    )
    print(
        "# time = slowest rank's mean per call (CUDA events); busbw = algbw*2(n-1)/n;"
        f" vs_ref = speedup over {cfg.reference}; algbw/copy = algbw / the GPU's copy_ GB/s"
        f" ({format_size(COPY_BYTES)}, bytes copied per second); copy(us) = copy_ of the row's size"
    )
    return cfg
