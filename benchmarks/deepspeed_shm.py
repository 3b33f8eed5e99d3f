"""DeepSpeed's shared-memory CPU allreduce as an optional column of benchmarks/allreduce.py.

DeepSpeed is not a dependency of torch-xdev. Where it is importable, the benchmark's ranks
load its SHM op (``ShareMemCommBuilder``; the first use JIT-compiles it with ninja, which
takes a minute or two, later runs load it from torch's extension cache) on top of the
Gloo default group, and time ``deepspeed.comm.inference_all_reduce`` next to xdev in the
same processes. Where it is not, or the op cannot run the benchmark's dtype on this CPU,
the column is skipped and the reason printed and recorded in the JSON.

Two properties of the op matter when reading its numbers: its waits spin without ever
sleeping (fast when every rank has an idle core, slow when ranks share cores with each
other or with other work), and it sums float32, bfloat16 and float16 only. The op leaves
its shared-memory files in /dev/shm; this module unlinks them once every rank has mapped
them, so the memory goes with the processes.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

LABEL = "deepspeed_shm"
# The op's vector code per dtype: 1 needs AVX2, 2 needs AVX-512BW (DeepSpeed's own
# vector_kernel_level(); below it, inference_all_reduce falls back to torch.distributed).
KERNEL_LEVEL_NEEDED = {"float32": 1, "bfloat16": 2, "float16": 2}
# How the op names its per-rank segment (deepspeed/ops/csrc/cpu/comm/shm.cpp, 0.19).
SEGMENT_NAME = "deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def version() -> Optional[str]:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def unavailable_reason(device: str, dtype: str) -> Optional[str]:
    """Why the column cannot run, decided in the parent without importing deepspeed."""
    if device != "cpu":
        return "DeepSpeed's SHM allreduce takes CPU tensors only"
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (optional; `pip install deepspeed` adds this column)"
    if dtype not in KERNEL_LEVEL_NEEDED:
        return f"DeepSpeed's SHM allreduce sums float32, bfloat16 and float16 only, not {dtype}"
    return None


def _load_on_this_rank(rank: int, world_size: int, dtype: str) -> tuple[Any, Optional[str]]:
    """Loads the op in this rank; returns (deepspeed.comm, None) or (None, why not)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    # The op checks that every rank is on this host (LOCAL_SIZE == world size);
    # init_distributed looks for these before it would try MPI discovery.
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world_size)
    )
    try:
        import deepspeed
        import deepspeed.comm as ds_comm

        with contextlib.redirect_stdout(io.StringIO()):  # "... built successfully" per rank
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    except Exception as e:  # a failed JIT build surfaces here, as any exception type
        return None, f"DeepSpeed's SHM op did not load: {type(e).__name__}: {e}"
    if not hasattr(torch.ops, "deepspeed") or not hasattr(
        torch.ops.deepspeed, "inference_all_reduce_"
    ):
        return None, "DeepSpeed did not build its SHM op on this machine (ShareMemCommBuilder)"
    level = int(getattr(ds_comm.comm.cdb, "shm_vector_kernel_level", 0))
    if level < KERNEL_LEVEL_NEEDED[dtype]:
        isa = "AVX-512BW" if KERNEL_LEVEL_NEEDED[dtype] == 2 else "AVX2"
        return None, f"DeepSpeed's SHM op needs {isa} for {dtype}; this CPU lacks it"
    return ds_comm, None


def start(rank: int, world_size: int, dtype: str) -> tuple[Optional[Callable[[Any], Any]], str]:
    """Collective over the Gloo default group: every rank gets the allreduce or none does.

    Returns (allreduce, "") when every rank loaded the op, else (None, the first reason).
    """
    ds_comm, reason = _load_on_this_rank(rank, world_size, dtype)
    reasons: list[Optional[str]] = [None] * world_size
    dist.all_gather_object(reasons, reason)  # returns once every rank is past its init
    if ds_comm is not None:
        # Every rank's init has returned, and an init maps every peer's segment before it
        # returns: nothing will open this name again.
        segment = SEGMENT_NAME.format(
            uid=os.getuid(),
            addr=os.environ.get("MASTER_ADDR", ""),
            port=os.environ.get("MASTER_PORT", ""),
            rank=rank,
        )
        Path("/dev/shm", segment).unlink(missing_ok=True)
    first = next((f"rank {r}: {why}" for r, why in enumerate(reasons) if why), None)
    if first is not None or ds_comm is None:
        return None, first or "no DeepSpeed module on this rank"

    def allreduce(tensor: Any) -> Any:
        return ds_comm.inference_all_reduce(tensor)

    return allreduce, ""
