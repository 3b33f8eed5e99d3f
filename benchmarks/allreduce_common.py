"""What both modes of benchmarks/allreduce.py share: the run's settings (Config), sizes, the
correctness check against the reference, how many calls a row times, the timing row, the
nccl-tests style table, and the settings the header and the JSON metadata give."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch_xdev import plan

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
TARGET_ROW_SECONDS = 0.5
MIN_ITERS = 5
MAX_ITERS = 20000  # a 4 KiB call takes ~10 us: 200 calls timed 2 ms, too short to trust
CALIBRATION_ITERS = 3
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
    """A size as the plan CLI reads it (torch_xdev.plan.parse_size), for argparse."""
    try:
        return plan.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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


def choose_iters(cfg: Config, seconds_per_call: Callable[[int], float]) -> int:
    """--iters, or as many calls as take about TARGET_ROW_SECONDS (MIN_ITERS..MAX_ITERS),
    estimated by ``seconds_per_call(CALIBRATION_ITERS)``: the mode's timed loop."""
    if cfg.iters is not None:
        return cfg.iters
    estimate = seconds_per_call(CALIBRATION_ITERS)
    wanted = int(TARGET_ROW_SECONDS / max(estimate, 1e-9))
    return max(MIN_ITERS, min(MAX_ITERS, wanted))


def iters_text(cfg: Config) -> str:
    return str(cfg.iters) if cfg.iters is not None else f"auto ({MIN_ITERS}..{MAX_ITERS})"


def sizes_text(cfg: Config) -> str:
    """The header's sizes: the first..the last (how many)."""
    return f"{format_size(cfg.sizes[0])}..{format_size(cfg.sizes[-1])} ({len(cfg.sizes)})"


def settings_metadata(cfg: Config) -> dict[str, Any]:
    """The JSON metadata's fields of the settings both modes take."""
    return {
        "nproc": cfg.nproc,
        "sizes": cfg.sizes,
        "dtype": cfg.dtype,
        "algorithms": cfg.algorithms,
        "warmup": cfg.warmup,
        "iters": cfg.iters,
    }


def init_rank(rank: int, cfg: Config) -> None:
    """Joins the default group (Gloo: the CPU-side coordination and, where it runs, the
    reference), as the fake host of ``--hosts`` where there are several, on one thread."""
    torch.set_num_threads(1)
    if cfg.hosts > 1:  # host-contiguous: ranks 0..L-1 on the first host, and so on
        os.environ["XDEV_HOSTNAME"] = f"fake-host-{rank // (cfg.nproc // cfg.hosts)}"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(cfg.port)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.nproc)
