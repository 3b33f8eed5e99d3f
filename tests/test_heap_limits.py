"""The CPU symmetric heap where something goes wrong on one rank. Out of address space, it
cannot grow its heap or cannot map a peer's new arena: neither may fail that rank alone (its
peers would wait for it at the next collective), so the call stages, with the right sum, and
the group stays usable. After a failed call, the group hands out no heap memory again."""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist

import torch_xdev
from harness import run_ranks

# A rank's address-space limit is set this far above what it has mapped: too little for a new
# 32 MiB arena (the heap's first) or a peer's 40 MiB one, enough for the tensors themselves.
MARGIN = 16 << 20
BIG = 10 << 20  # float32 elements: a 40 MiB tensor, in an arena of its own


def _mapped_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def _limit_address_space(margin: int) -> tuple[int, int]:
    """Limits this process to what it has mapped plus ``margin``; returns the old limits."""
    old = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_mapped_bytes() + margin, old[1]))
    return old


def _heap_tensor(numel: int) -> torch.Tensor:
    world = dist.group.WORLD
    assert world is not None
    backend = world._get_backend(torch.device("cpu"))
    return backend.allocate_tensor(numel, dtype=torch.float32, device=torch.device("cpu"))


def _allreduce_is_right(t: torch.Tensor, rank: int, world: int) -> bool:
    t.fill_(rank + 1.0)
    dist.all_reduce(t)
    return bool(torch.all(t == world * (world + 1) / 2))


def _live_heap_blocks() -> int:
    return int(torch_xdev.describe()["symmetric_heap"]["live_blocks"])


def _heap_cannot_grow(rank: int, world: int) -> list[bool]:
    dist.init_process_group(torch_xdev.BACKEND_NAME, rank=rank, world_size=world)
    # The group's first arena (32 MiB) exists from its creation: fill most of it, so that
    # the next tensor needs a second arena.
    filler = _heap_tensor(7 << 20)
    old = _limit_address_space(MARGIN) if rank == 1 else None
    try:
        # Rank 1's heap would need a second arena of 32 MiB: it gets an ordinary tensor.
        before = _live_heap_blocks()
        t = _heap_tensor(1 << 21)
        in_heap = _live_heap_blocks() == before + 1
        results = [in_heap == (rank == 0)]
        results += [_allreduce_is_right(t, rank, world), _allreduce_is_right(t, rank, world)]
    finally:
        if old is not None:
            resource.setrlimit(resource.RLIMIT_AS, old)
    del filler
    results.append(_allreduce_is_right(torch.empty(1000), rank, world))  # still usable
    dist.destroy_process_group()
    return results


def test_a_rank_whose_heap_cannot_grow_gets_an_ordinary_tensor() -> None:
    # It used to raise on that rank alone, while its peers went on to the allreduce and
    # waited there for it until the timeout.
    for results in run_ranks(_heap_cannot_grow, 2):
        assert results == [True, True, True, True]


def _peer_arena_out_of_reach(rank: int, world: int) -> list[bool]:
    dist.init_process_group(torch_xdev.BACKEND_NAME, rank=rank, world_size=world)
    store = dist.distributed_c10d._get_default_store()
    small = _heap_tensor(1 << 10)  # every rank's first arena, mapped by its peer on this call
    results = [_allreduce_is_right(small, rank, world)]
    old = None
    if rank == 0:
        big = _heap_tensor(BIG)  # its own new arena, made before the limit
        old = _limit_address_space(MARGIN)
        store.set("limited", "1")
    else:
        store.wait(["limited"])
        big = _heap_tensor(BIG)  # a new arena rank 0 has no room to map
    try:
        # Rank 0 finds rank 1's new arena unpublished or unmappable, before the first barrier
        # either way: every rank stages, where it once mapped it past that barrier and failed
        # there alone (its peers, running in place, then lost it).
        results.append(_allreduce_is_right(big, rank, world))
    finally:
        if old is not None:
            resource.setrlimit(resource.RLIMIT_AS, old)
    results.append(_allreduce_is_right(big, rank, world))  # and again, mapped now
    results.append(_allreduce_is_right(small, rank, world))
    # Rank 0 hosts the store: it leaves last.
    if rank == 0:
        store.wait(["done"])
    else:
        store.set("done", "1")
    dist.destroy_process_group()
    return results


def test_a_peer_arena_out_of_reach_stages_the_call_on_every_rank() -> None:
    for results in run_ranks(_peer_arena_out_of_reach, 2):
        assert results == [True, True, True, True]


def _after_a_failure(rank: int, world: int) -> tuple[int, int]:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(
        backend=torch_xdev.BACKEND_NAME, pg_options=torch_xdev.Options(timeout=2.0)
    )
    backend = group._get_backend(torch.device("cpu"))
    cpu = torch.device("cpu")
    t = backend.allocate_tensor(1 << 10, dtype=torch.float32, device=cpu)
    before = after = 0
    if rank == 0:  # its peer never joins: the call times out and the group is unusable
        try:
            dist.all_reduce(t, group=group)
        except dist.DistBackendError:
            pass
        del t  # its block may still be written by a peer that fell behind
        before = torch_xdev.describe(group)["symmetric_heap"]["live_blocks"]
        again = backend.allocate_tensor(1 << 10, dtype=torch.float32, device=cpu)
        after = torch_xdev.describe(group)["symmetric_heap"]["live_blocks"]
        again.fill_(1.0)
    dist.barrier()  # on Gloo: the peer leaves only after rank 0 is done
    return before, after


def test_a_failed_group_hands_out_no_heap_memory_again() -> None:
    # The freed block could come back from the heap while a peer still wrote into it.
    before, after = run_ranks(_after_a_failure, 2, timeout=120)[0]
    assert after == before, (before, after)
