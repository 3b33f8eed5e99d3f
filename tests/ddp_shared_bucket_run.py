"""One run of a case of tests/ddp_shared_bucket_cases.py on one backend, as one rank sees it.

``Run`` holds the rank's view of the run and takes snapshots of xdev's group and symmetric heap;
``train`` steps a DDP model with SGD. The heap helpers find what lies in the heap's arenas.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_xdev
from ddp_case_models import Batch, loss_of, mlp_batch

STEPS = 6
LR = 0.1
HEAP_BLOCK_BYTES = 256  # the symmetric heap's allocation granule (SymmetricHeap::kAlignBytes)


def round_up_to_block(nbytes: int) -> int:
    return max(1, -(-nbytes // HEAP_BLOCK_BYTES)) * HEAP_BLOCK_BYTES


def heap_mappings() -> list[tuple[int, int]]:
    """Address ranges of the symmetric heap's arenas (memfd 'xdev-heap') this process maps."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "memfd:xdev-heap" in line:
                begin, end = line.split()[0].split("-")
                ranges.append((int(begin, 16), int(end, 16)))
    return ranges


def lies_in(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    begin = t.data_ptr()
    end = begin + t.numel() * t.element_size()
    return any(lo <= begin and end <= hi for lo, hi in ranges)


def bucket_bytes(ddp: DDP) -> list[int]:
    # Zero tensors shaped like the buckets (DDP's own accessor, used by Join).
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return [b.buffer().numel() * b.buffer().element_size() for b in buckets]


@dataclasses.dataclass
class Run:
    """One case on one backend, as one rank sees it."""

    rank: int
    world: int
    backend: str
    store: dist.Store
    snapshots: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    heap_groups: dict[str, Optional[dist.ProcessGroup]] = dataclasses.field(default_factory=dict)
    algorithm: str = "flat"  # xdev's, see Case.algorithm

    def options(self) -> Optional[torch_xdev.Options]:
        return torch_xdev.Options(algorithm=self.algorithm) if self.backend == "xdev" else None

    def snapshot(
        self,
        models: list[DDP],
        group: Optional[dist.ProcessGroup] = None,
        label: str = "default",
        bucket_view: bool = False,
    ) -> None:
        """What xdev's group and heap look like now, with `models` (all on `group`) alive."""
        if self.backend != "xdev":
            return
        info = torch_xdev.describe(group)
        heap = info["symmetric_heap"]
        grads_in_heap = None
        if bucket_view:
            ranges = heap_mappings()
            grads = [p.grad for m in models for p in m.parameters() if p.grad is not None]
            grads_in_heap = bool(grads) and all(lies_in(g, ranges) for g in grads)
        self.snapshots.append(
            {
                "group": label,
                "shared": info["ddp_shared_buckets"],
                "note": info["ddp_shared_buckets_note"],
                "heap_in_use": None if heap is None else heap["bytes_in_use"],
                "heap_in_place": None if heap is None else heap["in_place_collectives"],
                "heap_staged": None if heap is None else heap["staged_collectives"],
                "bucket_bytes": [b for m in models for b in bucket_bytes(m)],
                "last_allreduce": info["last_allreduce"],
                "grads_in_heap": grads_in_heap,
            }
        )
        self.heap_groups[label] = group


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR)


def train(
    run: Run,
    ddp: DDP,
    batch: Callable[[int, int], Batch] = mlp_batch,
    forward: Callable[[DDP, torch.Tensor, int], torch.Tensor] = lambda ddp, x, s: ddp(x),
    snapshot: Callable[[], None] = lambda: None,
    step: Callable[[int, torch.optim.Optimizer], None] = lambda s, opt: opt.step(),
    steps: int = STEPS,
) -> list[float]:
    """`steps` steps of SGD (`step` runs step s); `snapshot` runs after the last backward.
    Returns the losses."""
    opt = sgd(ddp.module)
    losses = []
    for s in range(steps):
        opt.zero_grad()
        x, y = batch(run.rank, s)
        loss = loss_of(forward(ddp, x, s), y)
        loss.backward()
        if s == steps - 1:
            snapshot()
        step(s, opt)
        losses.append(loss.item())
    return losses


def one_step(ddp: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> float:
    opt.zero_grad()
    loss = loss_of(ddp(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return loss.item()
