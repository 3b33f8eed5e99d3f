"""torch_xdev.shared_empty: tensors every rank maps, reduced in place."""

from __future__ import annotations

import gc
import os
import stat
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch_xdev
from harness import run_ranks, xdev_shm_mappings

DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int32)
OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT)
COUNTS = (0, 1, 17, 4099, 300_007)  # 300_007 floats: far past the 256 KiB slot


def _input(rank: int, count: int, dtype: torch.dtype, case: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    if dtype.is_floating_point:
        # Near 1 so that PRODUCT stays finite; distinct per rank and element.
        return (1 + 0.1 * torch.randn(count, generator=g, dtype=torch.float64)).to(dtype)
    return torch.randint(-3, 4, (count,), generator=g, dtype=dtype)


def _reference(world: int, count: int, dtype: torch.dtype, case: int, op: Any) -> torch.Tensor:
    """The reduction of every rank's input, computed here in float64 (int64 for integers)."""
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    xs = [_input(r, count, dtype, case).to(wide) for r in range(world)]
    if op == dist.ReduceOp.MAX:
        return torch.stack(xs).amax(0)
    if op == dist.ReduceOp.PRODUCT:
        return torch.stack(xs).prod(0)
    total = torch.stack(xs).sum(0)
    if op == dist.ReduceOp.AVG:
        return (
            total / world
            if dtype.is_floating_point
            else torch.div(total, world, rounding_mode="trunc")
        )
    return total


def _last_reason() -> str:
    last = torch_xdev.describe()["last_allreduce"]
    return f"{last[0]}: {last[1]}"


def _grid(rank: int, world: int) -> None:
    # A short timeout: a rank whose check fails leaves its peers waiting.
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=60.0)
    )
    case = 0
    for dtype in DTYPES:
        for count in COUNTS:
            shared = torch_xdev.shared_empty(count, dtype=dtype)
            assert shared.dtype == dtype and shared.shape == (count,)
            for op in OPS:
                case += 1
                x = _input(rank, count, dtype, case)
                shared.copy_(x)
                dist.all_reduce(shared, op=op)
                # (An empty tensor has no place in the buffer: it is staged, a no-op.)
                assert ("shared buffer" in _last_reason()) == (count > 0), _last_reason()
                staged = x.clone()  # an ordinary tensor: the staged flat plan
                dist.all_reduce(staged, op=op)
                assert "shared buffer" not in _last_reason(), _last_reason()
                # Same sums in the same order: the same bits as the staged path.
                assert torch.equal(shared, staged), (dtype, count, op)
                want = _reference(world, count, dtype, case, op)
                tol = {torch.bfloat16: 2e-2, torch.float32: 1e-5}.get(dtype, 1e-12)
                torch.testing.assert_close(shared.to(want.dtype), want, rtol=tol, atol=tol)
    # A contiguous view at the same place on every rank runs in place too;
    # the rest of the buffer is left alone.
    buf = torch_xdev.shared_empty(2, 1000)
    buf.fill_(-1.0)
    view = buf[1, 3:803]
    view.copy_(torch.arange(800, dtype=torch.float32) * (rank + 1))
    work = dist.all_reduce(view, async_op=True)
    work.wait()
    assert "shared buffer" in _last_reason()
    total = sum(range(1, world + 1))
    assert torch.equal(view, torch.arange(800, dtype=torch.float32) * total)
    assert torch.equal(buf[0], torch.full((1000,), -1.0))
    assert torch.equal(buf[1, :3], torch.full((3,), -1.0))
    # A forced algorithm other than flat stages as usual, with the same result.
    direct = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(algorithm="direct"))
    d = torch_xdev.shared_empty(1000, group=direct)
    d.fill_(rank + 1.0)
    dist.all_reduce(d, group=direct)
    last = torch_xdev.describe(direct)["last_allreduce"]
    assert last[0] == "direct" and "shared buffer" not in last[1], last
    assert torch.equal(d, torch.full((1000,), float(total)))
    # A buffer of one group is an ordinary tensor to another: staged there.
    other = dist.new_group(backend="xdev")
    buf.fill_(float(rank))
    dist.all_reduce(buf, group=other)
    assert "shared buffer" not in torch_xdev.describe(other)["last_allreduce"][1]
    assert torch.equal(buf, torch.full((2, 1000), float(sum(range(world)))))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shared_tensor_allreduce_matches_reference_and_staged_bits(world: int) -> None:
    run_ranks(_grid, world, timeout=300)


def heap_mappings() -> list[str]:
    """The address ranges of the symmetric heap arenas (memfd files) this process maps."""
    with open("/proc/self/maps") as maps:
        return [line.split()[0] for line in maps if "/memfd:xdev-heap" in line]


def _misuse_and_hygiene(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=60.0)
    )
    before = len(xdev_shm_mappings())  # the group's own segment
    t = torch_xdev.shared_empty(1 << 16)
    mapped = xdev_shm_mappings()
    modes = {p: stat.S_IMODE(os.stat(f"/proc/self/map_files/{r}").st_mode) for r, p in mapped}
    assert torch_xdev.describe()["shared_buffers"] == 1
    # One rank passes a shared tensor, the other an ordinary one: both fail
    # with a message naming both, and the group stays usable.
    x = t if rank == 0 else torch.ones(1 << 16)
    with pytest.raises(dist.DistBackendError, match="mismatched") as info:
        dist.all_reduce(x)
    assert "shared buffer #0" in str(info.value) and "(staged)" in str(info.value)
    ok = torch.ones(10)
    dist.all_reduce(ok)
    assert torch.equal(ok, torch.full((10,), float(world)))
    # Different offsets into the buffer on different ranks: also a mismatch.
    with pytest.raises(dist.DistBackendError, match="mismatched"):
        dist.all_reduce(t[rank * 64 : rank * 64 + 64])
    # Sizes as torch.empty takes them: integers, numpy's and 0-d tensors too, but no floats
    # (shared_empty(2, 3.9) was a buffer of 2 x 3).
    with pytest.raises(TypeError, match="size must be integers"):
        torch_xdev.shared_empty(2, 3.9)  # type: ignore[arg-type]
    assert torch_xdev.shared_empty(torch.tensor(2), np.int64(3)).shape == (2, 3)
    # Different sizes or dtypes: ValueError on every rank, naming them (the same bytes too).
    with pytest.raises(ValueError, match=r"different sizes or dtypes \(rank 0: Float\[10\]"):
        torch_xdev.shared_empty(10 + rank)
    with pytest.raises(ValueError, match=r"rank 0: Float\[8\], rank 1: Int\[8\]"):
        torch_xdev.shared_empty(8, dtype=torch.float32 if rank == 0 else torch.int32)
    with pytest.raises(ValueError, match=r"rank 0: Float\[4,2\], rank 1: Float\[8\]"):
        torch_xdev.shared_empty((4, 2) if rank == 0 else (8,))
    # describe() and shared_empty() on a group this rank is not in: new_group gave it no group.
    outsider = dist.new_group([0], backend="xdev")
    if rank != 0:
        with pytest.raises(ValueError, match="this rank is not a member of that group"):
            torch_xdev.describe(outsider)
        with pytest.raises(ValueError, match="this rank is not a member of that group"):
            torch_xdev.shared_empty(4, group=outsider)
    with pytest.raises(ValueError, match="negative dimension"):
        torch_xdev.shared_empty(-1) if rank == 0 else torch_xdev.shared_empty(0, -2)
    # One rank alone refuses its size: the others learn it at the same call (they used to
    # go on, pairing their next call with its next one, or to wait out the timeout).
    if rank == world - 1:
        with pytest.raises(ValueError, match="negative dimension"):
            torch_xdev.shared_empty(-1)
    else:
        with pytest.raises(RuntimeError, match=f"rank {world - 1}: torch_xdev.shared_empty: neg"):
            torch_xdev.shared_empty(4)
    # shared_empty against an allreduce: both fail where the ranks meet, and the calls after
    # them stay paired (the failed call took no number on either rank).
    with pytest.raises(dist.DistBackendError, match="mismatched"):
        torch_xdev.shared_empty(4) if rank == 0 else dist.all_reduce(torch.ones(4))
    paired = torch_xdev.shared_empty(8)
    paired.fill_(float(rank))
    dist.all_reduce(paired)
    assert torch.equal(paired, torch.full((8,), float(sum(range(world)))))
    del paired
    # Sizes whose bytes overflow, or exceed what memory could hold: ValueError, no tensor.
    with pytest.raises(ValueError, match="too large"):
        torch_xdev.shared_empty(1 << 62)
    with pytest.raises(ValueError, match="too large"):
        torch_xdev.shared_empty(1 << 40, 1 << 40)
    backend = torch_xdev._registration.backend_of()
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="too large"):
        backend.allocate_tensor(1 << 62, dtype=torch.float32, device=cpu)
    # More than the machine's memory: refused at once, as torch.empty refuses it, instead of
    # a tensor whose pages the process could never fill.
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(ValueError, match="too large .*this machine has"):
        backend.allocate_tensor(memory // 4 + 1024, dtype=torch.float32, device=cpu)
    with pytest.raises(ValueError, match="too large .*this machine has"):
        torch_xdev.shared_empty(memory // 4 + 1024)
    # No CUDA collective has run on this group (here: no CUDA at all), so no CUDA heap:
    # DDP's Reducer then makes ordinary buckets, and a direct call says why not.
    cuda0 = torch.device("cuda", 0)
    assert not backend.supports_tensor_alloc(cuda0)
    with pytest.raises(ValueError, match="no CUDA heap for cuda:0"):
        backend.allocate_tensor(16, dtype=torch.float32, device=cuda0)
    t.fill_(1.0)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((1 << 16,), float(world)))
    del t, x, info
    gc.collect()
    after_free = len(xdev_shm_mappings())
    assert torch_xdev.describe()["shared_buffers"] == 0
    # A tensor outlives its group: its memory is its own. A heap tensor reduced in place maps
    # the peers' arenas; they go with the group, and the rank keeps only its own.
    kept = torch_xdev.shared_empty(100)
    kept.fill_(3.0)
    bucket = backend.allocate_tensor(1 << 20, dtype=torch.float32, device=cpu)
    bucket.fill_(1.0)
    dist.all_reduce(bucket)
    assert torch.equal(bucket, torch.full((1 << 20,), float(world)))
    heap_arenas = torch_xdev.describe()["symmetric_heap"]["arenas"]
    assert len(heap_mappings()) == world * heap_arenas, heap_mappings()
    dist.destroy_process_group()
    assert torch.equal(kept, torch.full((100,), 3.0))
    assert len(heap_mappings()) == heap_arenas
    bucket.add_(1.0)
    assert torch.equal(bucket, torch.full((1 << 20,), float(world + 1)))
    # The destroyed group's backend says so (it used to say it had no heap), as its every
    # other call does.
    with pytest.raises(RuntimeError, match="has been destroyed"):
        backend.allocate_tensor(16, dtype=torch.float32, device=torch.device("cpu"))
    return {"before": before, "mapped": mapped, "modes": modes, "after_free": after_free}


def test_shared_buffer_misuse_fails_cleanly_and_leaves_nothing() -> None:
    results = run_ranks(_misuse_and_hygiene, 2, timeout=180)
    for res in results:
        # One segment per rank, mapped by every rank, each 0600 and unlinked.
        assert len(res["mapped"]) == res["before"] + 2, res
        assert res["modes"] and all(m == 0o600 for m in res["modes"].values()), res["modes"]
        for _, path in res["mapped"]:
            assert not os.path.exists(path), path
        assert res["after_free"] == res["before"], res  # freed with the tensor


def _two_hosts(rank: int, world: int) -> str:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    with pytest.raises(ValueError, match="one host") as info:
        torch_xdev.shared_empty(10)
    dist.destroy_process_group()
    return str(info.value)


def test_shared_empty_refuses_groups_spanning_hosts() -> None:
    env = [{"XDEV_HOSTNAME": f"host{r}"} for r in range(2)]
    run_ranks(_two_hosts, 2, per_rank_env=env, timeout=120)


def _xdev_for_cuda_tensors_only(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("cpu:gloo,cuda:xdev", rank=rank, world_size=world)
    try:
        info = torch_xdev.describe()  # said the group did not use xdev
        # Not "on" for CPU buckets, which Gloo's allocateTensor would make (a world of one
        # has its own reason).
        assert not info["ddp_shared_buckets"], info["ddp_shared_buckets_note"]
        if world > 1:
            assert "hands CPU tensors to another backend" in info["ddp_shared_buckets_note"]
        # CPU tensors go to Gloo here: a shared buffer would never be reduced in place.
        with pytest.raises(ValueError, match="does not use the xdev backend for cpu tensors"):
            torch_xdev.shared_empty(8)
        if not torch_xdev._C.built_with_cuda:  # said "no GPU", where the build is the reason
            with pytest.raises(ValueError, match="this build of torch_xdev has no CUDA path"):
                torch_xdev.prepare_cuda_graph_capture()
        return {"backend": info["backend"], "devices": info["devices"]}
    finally:
        dist.destroy_process_group()


def test_xdev_as_the_cuda_backend_only() -> None:
    for world in (1, 2):
        expected = [{"backend": "xdev", "devices": ["cuda"]}] * world
        assert run_ranks(_xdev_for_cuda_tensors_only, world) == expected


def _without_shared_memory(rank: int, world: int) -> None:
    options = torch_xdev.Options(algorithm="fallback")  # no shared memory: Gloo runs every call
    dist.init_process_group("xdev", rank=rank, world_size=world, pg_options=options)
    grads = torch_xdev.shared_empty(4, 5)
    assert torch.equal(grads, torch.zeros(4, 5))
    grads.fill_(float(rank + 1))
    dist.all_reduce(grads)
    assert torch.equal(grads, torch.full((4, 5), float(sum(range(1, world + 1)))))
    assert torch_xdev.describe()["shared_buffers"] == 0  # an ordinary tensor
    dist.destroy_process_group()


def test_shared_empty_without_shared_memory_gives_an_ordinary_tensor() -> None:
    run_ranks(_without_shared_memory, 2)


def _store_keys_over_calls(rank: int, world: int) -> list[int]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    store = dist.distributed_c10d._get_default_store()
    counts = []
    for calls in range(12):
        t = torch_xdev.shared_empty(1000 + calls)
        t.fill_(rank)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full_like(t, sum(range(world))))
        del t
        dist.barrier()  # every rank is out of this call (and forgot its keys of the one before)
        if calls >= 2:
            counts.append(store.num_keys())
        dist.barrier()  # before anyone starts the next call
    dist.destroy_process_group()
    return counts


def test_shared_empty_called_every_step_leaves_no_store_keys_behind() -> None:
    # A call's keys go once every rank has left it: the store stays the same size.
    for rank, counts in enumerate(run_ranks(_store_keys_over_calls, 2)):
        assert len(set(counts)) == 1, (rank, counts)


def _heap_outcome(rank: int, world: int, misplace: bool) -> dict[str, int]:
    # Flat: the plan a heap tensor runs in place with (auto may choose another at this size).
    options = torch_xdev.Options(algorithm="flat")
    dist.init_process_group("xdev", rank=rank, world_size=world, pg_options=options)
    world_group = dist.group.WORLD
    assert world_group is not None
    backend = world_group._get_backend(torch.device("cpu"))
    cpu = torch.device("cpu")
    keep = []
    if misplace and rank == 1:  # every later block of rank 1 lies past this one
        keep.append(backend.allocate_tensor(4096, dtype=torch.uint8, device=cpu))
    numel = 1 << 16
    bucket = backend.allocate_tensor(numel, dtype=torch.float32, device=cpu)
    bucket.copy_(torch.arange(numel, dtype=torch.float32) * (rank + 1))
    dist.all_reduce(bucket)
    expected = torch.arange(numel, dtype=torch.float32) * sum(range(1, world + 1))
    assert torch.equal(bucket, expected)
    heap = torch_xdev.describe()["symmetric_heap"]
    dist.destroy_process_group()
    return {"in_place": heap["in_place_collectives"], "staged": heap["staged_collectives"]}


@pytest.mark.parametrize("misplace", [False, True], ids=["same-place", "rank1-elsewhere"])
def test_heap_counts_whether_its_allreduce_ran_in_place(misplace: bool) -> None:
    """describe() says what ran: in place, or staged by every rank when one rank's block lies
    elsewhere (it allocated in another order), with the same sum either way."""
    results = run_ranks(_heap_outcome, 3, misplace, timeout=120)
    expected = {"in_place": 0, "staged": 1} if misplace else {"in_place": 1, "staged": 0}
    assert results == [expected] * 3, results
