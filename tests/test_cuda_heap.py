"""CUDA tensors from the group's CUDA heap (``allocate_tensor`` on a CUDA device): their
allreduce reads the peers' copies in place, and DDP's buckets land there under
``DDP_DISABLE_COMM_MEM=0``.

Ranks share the GPU(s) (cuda_ranks). The groups force ``flat``: auto would leave ranks that
share a GPU without CUDA MPS to Gloo, and a plan forced by any other name keeps its staged
schedule on heap tensors. Skips without a GPU.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import cuda_ranks
import torch_xdev
from collective_cases import check_close, digest, make_input, reference
from cuda_ranks import close_group, first_cuda_collective, run_or_skip, setup_rank

cuda_ranks.skip_module_without_cuda()

SUM, AVG, MAX = dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX
CASES = [
    (dtype, op, numel)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32)
    for op in (SUM, AVG, MAX)
    for numel in (1, 1000, 300_001)
    if not (op == AVG and dtype == torch.int32)
]


def _heap(group: Any) -> dict[str, Any]:
    heap = torch_xdev.describe(group)["cuda"]["heap"]
    assert heap is not None, "describe() reports no CUDA heap"
    return dict(heap)


def _allocate(group: Any, device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    backend = group._get_backend(device)
    assert backend.supports_tensor_alloc(device)
    return backend.allocate_tensor(numel, dtype=dtype, device=device)


def _in_place(rank: int, world: int) -> dict[str, Any]:
    device = setup_rank(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=cuda_ranks.GROUP_TIMEOUT)
    group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(algorithm="flat"))
    info = first_cuda_collective(device, group)
    if not info["transport"]:
        return {"skip": f"no CUDA transport: {info['transport_note']}"}
    assert _heap(group)["in_place_allreduces"] == 0
    # The heap's first arena, made on every rank before any call on it: a call whose arena a
    # peer has not published yet when this rank looks stages (once), which would make the
    # count below depend on timing. The cases' blocks all fit in this arena.
    first = _allocate(group, device, 1, torch.float32)
    dist.barrier()
    del first
    digests: list[int] = []
    for dtype, op, numel in CASES:
        seed = zlib.crc32(f"{world} {dtype} {op} {numel}".encode())
        inputs = [make_input(seed, r, numel, dtype, op) for r in range(world)]
        t = _allocate(group, device, numel, dtype)
        t.copy_(inputs[rank])
        dist.all_reduce(t, op=op, group=group)
        what = f"{world} ranks, heap tensor, {dtype} {op} n={numel}"
        check_close(t.cpu(), reference(inputs, op), op, world, what)
        digests.append(digest(t))
        del t  # its block goes back to the heap
    in_place = _heap(group)["in_place_allreduces"]
    assert in_place == len(CASES), f"{in_place} of {len(CASES)} allreduces ran in place"

    # Blocks freed above are placed again, and the heap stays as large as it was.
    reserved = _heap(group)["bytes_reserved"]
    assert _heap(group)["live_blocks"] == 0
    again = [_allocate(group, device, 300_001, torch.float32) for _ in range(3)]
    for i, t in enumerate(again):
        t.fill_(float(rank + i))
        dist.all_reduce(t, group=group)
        assert bool(torch.all(t == float(sum(range(world)) + world * i))), i
    assert _heap(group)["bytes_reserved"] == reserved

    # Ranks whose places differ (rank 1 allocates one more block first) stage: same sums.
    extra = _allocate(group, device, 1000, torch.float32) if rank == 1 else None
    misplaced = _allocate(group, device, 5000, torch.float32)
    misplaced.fill_(float(rank + 1))
    dist.all_reduce(misplaced, group=group)
    assert bool(torch.all(misplaced == float(world * (world + 1) // 2)))
    assert _heap(group)["in_place_allreduces"] == len(CASES) + len(again)
    del extra, misplaced, again
    cuda_ranks.assert_same_on_all_ranks(digests, [str(c) for c in CASES], world)
    close_group(group)
    dist.destroy_process_group()
    return {"cases": len(CASES)}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cuda_heap_tensors_allreduce_in_place(world: int) -> None:
    results = run_or_skip(_in_place, world, timeout=600)
    assert results[0]["cases"] == len(CASES)


def _train(group: Any, device: torch.device, rank: int, steps: int) -> tuple[torch.Tensor, int]:
    """The parameters after ``steps`` DDP steps, and how many blocks of the group's CUDA heap
    were live at the end (DDP's buckets, while its Reducer holds them; 0 without a heap)."""
    torch.manual_seed(5)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)
    ).to(device)
    # Small buckets: several of them, each allocated from the group.
    model = DistributedDataParallel(net, process_group=group, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g).to(device)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    heap = torch_xdev.describe(group)["cuda"].get("heap") if _is_xdev(group) else None
    live = 0 if heap is None else int(heap["live_blocks"])
    return torch.cat([p.detach().reshape(-1).cpu() for p in net.parameters()]), live


def _is_xdev(group: Any) -> bool:
    return dist.get_backend(group) == "xdev"


def _ddp(rank: int, world: int) -> dict[str, Any]:
    device = setup_rank(rank)
    os.environ["DDP_DISABLE_COMM_MEM"] = "0"  # PyTorch's Reducer asks the backend for buckets
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=cuda_ranks.GROUP_TIMEOUT)
    xdev = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(algorithm="flat"))
    info = first_cuda_collective(device, xdev)
    if not info["transport"]:
        return {"skip": f"no CUDA transport: {info['transport_note']}"}
    assert info["ddp_shared_buckets"], info["ddp_shared_buckets_note"]
    ours, live = _train(xdev, device, rank, steps=6)
    assert live >= 2, live  # DDP's buckets after its rebuild (about 100 KB each)
    in_place = _heap(xdev)["in_place_allreduces"]
    assert in_place >= 6, in_place
    gloo = dist.new_group(backend="gloo")
    theirs, _ = _train(gloo, device, rank, steps=6)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    cuda_ranks.assert_same_on_all_ranks([digest(ours)], ["parameters"], world)
    close_group(xdev)
    dist.destroy_process_group()
    return {"in_place": in_place}


def test_ddp_buckets_on_cuda_come_from_the_heap_and_match_gloo() -> None:
    results = run_or_skip(_ddp, 2, timeout=600)
    assert results[0]["in_place"] >= 6
