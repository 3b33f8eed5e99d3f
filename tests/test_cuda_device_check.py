"""CUDA collectives without the host barrier (``cuda_host_check=False``): only the kernels'
GPU barrier checks that every rank runs the same call (csrc/transport/gpu_barrier_word.h).

- ``test_collectives_without_the_host_check``: allreduce (several windows), reduce-scatter and
  all-gather against references computed here; no CUDA heap (running in place needs the host's
  agreement on places), so DDP gets ordinary buckets.
- ``test_a_mismatch_stops_every_rank_at_the_gpu_barrier``: ranks whose calls differ in shape
  queue their kernels, which stop at the call's first barrier; the group's next CUDA
  collective raises on every rank, naming the peer that ran a different collective.

Needs a GPU (ranks share it); skipped elsewhere, like the other CUDA tests.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import cuda_ranks
import torch_xdev
from cuda_ranks import (
    GROUP_TIMEOUT,
    SHARED_GPU_PLAN,
    SLOT,
    XDEV_TIMEOUT_S,
    close_group,
    first_cuda_collective,
    run_or_skip,
    setup_rank,
)

cuda_ranks.skip_module_without_cuda()


def _group(rank: int, world: int, device: torch.device) -> tuple[Any, dict[str, Any]]:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    options = torch_xdev.Options(
        algorithm=SHARED_GPU_PLAN,
        cuda_slot_bytes=SLOT,
        cuda_host_check=False,
        timeout=XDEV_TIMEOUT_S,
    )
    group = dist.new_group(backend="xdev", pg_options=options)
    info = first_cuda_collective(device, group)
    assert info["cuda_host_check"] is False, info
    return group, info


def _collectives(rank: int, world: int) -> dict[str, Any]:
    device = setup_rank(rank)
    group, info = _group(rank, world, device)
    if not info["transport"]:
        return {"skip": f"no CUDA transport: {info['transport_note']}"}
    for numel in (1, 1021, 3 * SLOT // 4 + 5):  # the last: several windows of SLOT bytes
        inputs = [torch.arange(numel, dtype=torch.float32) * (r + 1) for r in range(world)]
        t = inputs[rank].to(device)
        dist.all_reduce(t, group=group)
        expected = torch.stack(inputs).sum(dim=0)
        assert torch.equal(t.cpu(), expected), f"allreduce n={numel}"

        full = torch.cat([inputs[r] for r in range(world)]).to(device)
        block = torch.empty(numel, device=device)
        dist.reduce_scatter_tensor(block, full * (rank + 1), group=group)
        scaled = [torch.cat(inputs) * (r + 1) for r in range(world)]
        own = torch.stack(scaled).sum(dim=0)[rank * numel : (rank + 1) * numel]
        assert torch.equal(block.cpu(), own), f"reduce_scatter n={numel}"

        gathered = torch.empty(world * numel, device=device)
        dist.all_gather_into_tensor(gathered, inputs[rank].to(device), group=group)
        assert torch.equal(gathered.cpu(), torch.cat(inputs)), f"all_gather n={numel}"

    # No CUDA heap (DDP's buckets are ordinary tensors): running in place needs the host
    # barrier's agreement on places.
    cuda = torch_xdev.describe(group)["cuda"]
    assert cuda["heap"] is None and not cuda["ddp_shared_buckets"], cuda
    assert "cuda_host_check" in cuda["ddp_shared_buckets_note"], cuda
    assert not group._get_backend(device).supports_tensor_alloc(device)
    close_group(group)
    dist.destroy_process_group()
    return {}


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_without_the_host_check(world: int) -> None:
    run_or_skip(_collectives, world, timeout=300)


def _mismatch(rank: int, world: int) -> dict[str, Any]:
    device = setup_rank(rank)
    group, info = _group(rank, world, device)
    if not info["transport"]:
        return {"skip": f"no CUDA transport: {info['transport_note']}"}
    # No host barrier: the call returns on every rank; its kernels stop at the GPU barrier.
    dist.all_reduce(torch.ones(10 + rank, device=device), group=group)
    torch.cuda.synchronize(device)
    with pytest.raises(dist.DistBackendError, match="ran a different collective") as raised:
        dist.all_reduce(torch.ones(8, device=device), group=group)
        torch.cuda.synchronize(device)
    # With two ranks each names the other.
    names_peer = world != 2 or f"rank {1 - rank} ran a different collective" in str(raised.value)
    # The group is broken now: the default (Gloo) group lines the ranks up before it goes.
    dist.barrier()
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    return {"names_peer": names_peer}


def test_a_mismatch_stops_every_rank_at_the_gpu_barrier() -> None:
    results = run_or_skip(_mismatch, 2, timeout=300)
    assert all(r["names_peer"] for r in results), results
