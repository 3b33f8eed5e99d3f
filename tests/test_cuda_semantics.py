"""The CUDA path on real GPUs: stream semantics, layouts, delegation and bad input.

- ``test_stream_semantics``: a kernel queued on the current stream just before the call is
  seen; Work.wait() makes the current (side) stream wait without blocking the host, and
  Work.block_current_stream() makes it wait too; Work.wait(timeout) blocks the host until
  the GPU work is done and raises when that takes longer than the timeout;
  several allreduces in flight; get_future() and then(); the caching allocator does not
  hand out an in-flight input.
- ``test_layouts_coalesced_mixed_dtypes``: non-contiguous views, a slice at a storage
  offset (neighbours untouched), channels-last, 0-dim, allreduce_coalesced, and one
  coalesced call mixing 8 dtypes (through ProcessGroup.allreduce_coalesced: the Python
  wrapper refuses mixed dtypes).
- ``test_delegated_collectives_share_gpu``: broadcast, all_gather, barrier and an op
  without a native kernel (BAND) on CUDA tensors; with ranks sharing a GPU the engine is
  Gloo, and describe() says so.
- ``test_bad_input``: tensors on two devices in one call, and mismatched calls across
  ranks, fail on every rank; the group stays usable.
- ``test_peer_dying_mid_collective_stops_every_queued_window``: a peer gone after the host
  barrier leaves rank 0's kernels waiting on the GPU; the first window gives up at the
  timeout and the ones queued behind it return at once.
- ``test_world_of_one``: one rank, CUDA tensors: every allreduce leaves the tensor as it is.

The module skips, with the reason, where torch sees no GPU or torch_xdev was built without
its CUDA path (cuda_ranks.why_skip).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import cuda_ranks
import torch_xdev
from collective_cases import OPS, check_close, digest, make_input, reference
from cuda_ranks import (
    SHARED_GPU_PLAN,
    SLOT,
    XDEV_TIMEOUT_S,
    assert_native,
    assert_same_on_all_ranks,
    first_cuda_collective,
    last_allreduce,
    run_or_skip,
    setup_rank,
    skip_or_fail,
)
from harness import run_ranks

cuda_ranks.skip_module_without_cuda()

# torch.cuda._sleep cycles: at least half a second on a GPU clocked at 2 GHz or less. Long
# enough that the host has long returned from an allreduce queued behind it.
SLEEP_CYCLES = 1_000_000_000


# ---------------------------------------------------------------------------------------
# c. Stream semantics


def _streams(rank: int, world: int) -> dict[str, Any]:
    device = setup_rank(rank)
    dist.init_process_group(
        "xdev",
        rank=rank,
        world_size=world,
        pg_options=torch_xdev.Options(algorithm=SHARED_GPU_PLAN, timeout=XDEV_TIMEOUT_S),
    )
    info = first_cuda_collective(device)
    if not info["transport"]:
        dist.destroy_process_group()
        return {"skip": f"no CUDA transport: {info['transport_note']}"}
    total = float(sum(range(1, world + 1)))
    n = 4 << 20  # 16 MiB of float32

    # 1. A kernel queued on the current stream just before the call (here: behind a sleep,
    #    so it surely runs late) must be seen: the internal stream waits for the current one.
    #    Once with the default stream current, once with another stream current.
    for current in (torch.cuda.current_stream(device), torch.cuda.Stream(device)):
        with torch.cuda.stream(current):
            t = torch.full((n,), float(rank + 1), device=device)
            torch.cuda._sleep(SLEEP_CYCLES)
            t.mul_(2)
            dist.all_reduce(t)
            assert_native(what="producer on the current stream")
            wrong = int((t != 2 * total).sum())  # on the current stream, after wait()
            assert wrong == 0, f"{wrong} of {n} elements missed the mul_ before the allreduce"

    # 2. Work.wait() makes the *current* stream wait (here a side stream), not the host.
    side = torch.cuda.Stream(device)
    t = torch.full((n,), float(rank + 1), device=device)
    torch.cuda.synchronize(device)
    dist.barrier()  # the ranks start together
    torch.cuda._sleep(SLEEP_CYCLES)  # the collective starts after this
    work = dist.all_reduce(t, async_op=True)
    with torch.cuda.stream(side):
        work.wait()
        pending = not work.is_completed()
        out = t.clone()  # runs on the side stream, after the collective
    side.synchronize()
    assert pending, "Work.wait() blocked the host until the GPU work was done"
    assert torch.equal(out.cpu(), torch.full((n,), total)), "side stream read a stale result"
    assert work.is_completed()

    # 2b. Work.block_current_stream() does the same (c10d's default released the stream once
    #     the Work's future completed: here at launch, before the kernels had run).
    t = torch.full((n,), float(rank + 1), device=device)
    torch.cuda.synchronize(device)
    dist.barrier()
    torch.cuda._sleep(SLEEP_CYCLES)
    work = dist.all_reduce(t, async_op=True)
    with torch.cuda.stream(side):
        work.block_current_stream()
        out = t.clone()
    side.synchronize()
    assert torch.equal(out.cpu(), torch.full((n,), total)), "block_current_stream: stale result"

    # 2c. Work.wait(timeout): the host waits for the GPU work too (ProcessGroupNCCL's rule), and
    #     a timeout shorter than that work raises; the call itself goes on and completes.
    t = torch.full((n,), float(rank + 1), device=device)
    torch.cuda.synchronize(device)
    dist.barrier()
    torch.cuda._sleep(SLEEP_CYCLES)
    work = dist.all_reduce(t, async_op=True)
    raised = ""
    try:
        work.wait(timeout=timedelta(milliseconds=20))
    except dist.DistBackendError as e:
        raised = str(e)
    assert "not done within the timeout" in raised, f"wait(20 ms) raised {raised!r}"
    work.wait(timeout=timedelta(seconds=XDEV_TIMEOUT_S))
    assert work.is_completed(), "wait(timeout) returned before the GPU work was done"
    assert torch.equal(t.cpu(), torch.full((n,), total)), "wait(timeout): wrong result"

    # 3. Several allreduces in flight at once (queued behind a sleep), waited for in reverse.
    ops = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG, dist.ReduceOp.MIN)
    cases = []
    for i in range(6):
        op = ops[i % len(ops)]
        numel = 1000 * (i + 1) + 3
        inputs = [make_input(500 + i, r, numel, torch.float32, op) for r in range(world)]
        cases.append((inputs[rank].to(device, copy=True), inputs, op))
    torch.cuda._sleep(SLEEP_CYCLES // 10)
    works = [dist.all_reduce(x, op=op, async_op=True) for x, _, op in cases]
    for (x, inputs, op), w in reversed(list(zip(cases, works))):
        w.wait()
        check_close(x.cpu(), reference(inputs, op), op, world, f"in flight {op} n={x.numel()}")

    # 4. get_future(): its value is the list of result tensors (DDP's comm hooks use it).
    t = torch.full((4097,), float(rank + 1), device=device)
    fut = dist.all_reduce(t, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    value = fut.wait()
    assert isinstance(value, list) and len(value) == 1, value
    assert value[0].data_ptr() == t.data_ptr(), "the future's value is not the input tensor"
    assert torch.equal(value[0].cpu(), torch.full((4097,), total))
    assert torch.equal(doubled.wait().cpu(), torch.full((4097,), 2 * total))

    # 5. An input whose last reference goes away while the allreduce is still queued: the
    #    caching allocator must not hand its memory out (recordStream on the internal stream).
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") in ("", "0"):
        numel = (3 << 20) // 4 + 77  # an unusual size: no other block of it is free
        x = torch.full((numel,), 1.0, device=device)
        address = x.data_ptr()
        torch.cuda._sleep(SLEEP_CYCLES)
        dist.all_reduce(x, async_op=True)  # the Work is dropped at once
        del x
        y = torch.empty(numel, device=device)
        reused = y.data_ptr() == address
        torch.cuda.synchronize(device)
        assert not reused, "the memory of an in-flight allreduce input was handed out again"

    torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()
    return {}


def test_stream_semantics() -> None:
    run_or_skip(_streams, 2, timeout=300)


# ---------------------------------------------------------------------------------------
# d. Layouts, allreduce_coalesced and mixed dtypes


def _layouts(rank: int, world: int) -> dict[str, Any]:
    device = setup_rank(rank)
    options = torch_xdev.Options(
        algorithm=SHARED_GPU_PLAN, cuda_slot_bytes=SLOT, shm_slot_bytes=SLOT, timeout=XDEV_TIMEOUT_S
    )
    dist.init_process_group("xdev", rank=rank, world_size=world, pg_options=options)
    info = first_cuda_collective(device)
    if not info["transport"]:
        dist.destroy_process_group()
        return {"skip": f"no CUDA transport: {info['transport_note']}"}
    total = float(sum(range(1, world + 1)))
    digests: list[int] = []
    labels: list[str] = []

    # Transposed view: written back in place.
    base = torch.arange(600, dtype=torch.float32, device=device).view(20, 30) * (rank + 1)
    dist.all_reduce(base.t())
    assert_native(what="transposed")
    assert torch.equal(base.cpu(), torch.arange(600, dtype=torch.float32).view(20, 30) * total)
    # Strided slice: only every third element changes.
    strided = torch.zeros(3000, dtype=torch.float64, device=device)
    strided[::3] = rank + 1
    dist.all_reduce(strided[::3])
    assert_native(what="strided")
    host = strided.cpu()
    assert torch.equal(host[::3], torch.full((1000,), total, dtype=torch.float64))
    assert torch.equal(host[1::3], torch.zeros(1000, dtype=torch.float64))
    assert torch.equal(host[2::3], torch.zeros(1000, dtype=torch.float64))
    # A contiguous slice at a storage offset, three windows long: runs in place, and the
    # elements on either side stay untouched.
    buf = torch.full((5000,), -7.0, device=device)
    buf[1000:3501] = rank + 1
    dist.all_reduce(buf[1000:3501])
    assert_native(what="slice at an offset")
    host = buf.cpu()
    assert torch.equal(host[1000:3501], torch.full((2501,), total))
    assert torch.equal(host[:1000], torch.full((1000,), -7.0)), "wrote before the slice"
    assert torch.equal(host[3501:], torch.full((1499,), -7.0)), "wrote after the slice"
    # Channels-last 4-D half tensor (small integers: exact in fp16).
    pattern = (torch.arange(2 * 3 * 5 * 7) % 8).view(2, 3, 5, 7).to(torch.float16)
    cl = (pattern * (rank + 1)).to(device, copy=True).contiguous(memory_format=torch.channels_last)
    dist.all_reduce(cl)
    assert torch.equal(cl.cpu(), pattern * total)
    # 0-dim.
    scalar = torch.tensor(float(rank + 1), device=device)
    dist.all_reduce(scalar, op=dist.ReduceOp.MAX)
    assert scalar.item() == float(world)

    # allreduce_coalesced of one dtype, some members non-contiguous, one empty.
    shapes = [(5,), (0,), (1,), (3, 7), (300,), (17,), (2000,)]
    lists = [
        [
            make_input(60 + i, r, int(torch.Size(s).numel()), torch.float32, OPS[0]).view(s)
            for i, s in enumerate(shapes)
        ]
        for r in range(world)
    ]
    mine = []
    for i, t in enumerate(lists[rank]):
        if t.dim() == 2:  # a transposed holder: non-contiguous
            holder = torch.empty(t.shape[::-1], device=device).t()
            holder.copy_(t)
            mine.append(holder)
        elif i == 4:  # every other element of a longer tensor
            holder = torch.zeros(2 * t.numel(), device=device)[::2]
            holder.copy_(t)
            mine.append(holder)
        else:
            mine.append(t.to(device, copy=True))
    dist.all_reduce_coalesced(mine)
    assert_native(what="coalesced")
    for i in range(len(shapes)):
        want = reference([lists[r][i].flatten() for r in range(world)], OPS[0])
        what = f"coalesced #{i} {shapes[i]}"
        check_close(mine[i].cpu().flatten(), want, OPS[0], world, what)
        digests.append(digest(mine[i]))
        labels.append(what)

    # One call mixing dtypes (one flat buffer and one run of windows per dtype). The Python
    # wrapper refuses mixed dtypes, so this goes to the ProcessGroup directly.
    specs = [
        (torch.float32, (37,)),
        (torch.float16, (3000,)),
        (torch.int32, (5, 7)),
        (torch.float64, (1500,)),
        (torch.bfloat16, (0,)),
        (torch.int8, (4500,)),
        (torch.float32, (2100,)),
        (torch.int64, (9,)),
        (torch.uint8, (33,)),
        (torch.float16, (1,)),
    ]
    pg = dist.group.WORLD
    assert pg is not None
    for o, op in enumerate((dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX)):
        inputs = [
            [
                make_input(300 + 10 * o + i, r, int(torch.Size(shape).numel()), dtype, op).view(
                    shape
                )
                for i, (dtype, shape) in enumerate(specs)
            ]
            for r in range(world)
        ]
        tensors = []
        for t in inputs[rank]:
            if t.dim() == 2:
                holder = torch.empty(t.shape[::-1], dtype=t.dtype, device=device).t()
                holder.copy_(t)
                tensors.append(holder)
            else:
                tensors.append(t.to(device, copy=True))
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = dist.ReduceOp(op)
        pg.allreduce_coalesced(tensors, opts).wait()
        assert_native(what=f"mixed dtypes {op}")
        for i, (dtype, shape) in enumerate(specs):
            want = reference([inputs[r][i].flatten() for r in range(world)], op)
            what = f"mixed dtypes {op} #{i} {dtype} {shape}"
            got = tensors[i].cpu()
            assert got.dtype == dtype and tuple(got.shape) == shape, what
            check_close(got.flatten(), want, op, world, what)
            digests.append(digest(got))
            labels.append(what)

    assert_same_on_all_ranks(digests, labels, world)
    torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()
    return {}


@pytest.mark.parametrize("world", [2, 3])
def test_layouts_coalesced_mixed_dtypes(world: int) -> None:
    run_or_skip(_layouts, world, timeout=300)


# ---------------------------------------------------------------------------------------
# e. Delegated collectives when ranks share a GPU


def _delegated(rank: int, world: int) -> dict[str, Any]:
    device = setup_rank(rank)
    dist.init_process_group(
        "xdev",
        rank=rank,
        world_size=world,
        pg_options=torch_xdev.Options(algorithm=SHARED_GPU_PLAN, timeout=XDEV_TIMEOUT_S),
    )
    before = dict(torch_xdev.describe()["cuda"])
    assert before["built"] is True, before
    assert before["initialized"] is False and before["fallback_backend"] is None, before

    # The first CUDA collective is a delegated one: it must run the GPU rendezvous itself.
    for root in range(world):
        for dtype in (torch.float32, torch.int64, torch.float16):
            b = torch.arange(5000).to(dtype) * (root + 1)
            x = b.to(device, copy=True) if rank == root else torch.zeros_like(b, device=device)
            dist.broadcast(x, src=root)
            assert torch.equal(x.cpu(), b), f"broadcast from {root} {dtype}"
    after = dict(torch_xdev.describe()["cuda"])
    assert after["initialized"] is True, after
    share = bool(after["ranks_share_gpu"])
    if world > torch.cuda.device_count():
        assert share, after
    assert after["fallback_backend"] == ("gloo" if share else "nccl"), after

    mine = torch.arange(1000, dtype=torch.float32, device=device) + 1000 * rank
    outs = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(outs, mine)
    for r in range(world):
        assert torch.equal(outs[r].cpu(), torch.arange(1000, dtype=torch.float32) + 1000 * r)

    dist.barrier()

    # An op without a native kernel goes to the same engine, and is right.
    values = [torch.tensor([0b1111 ^ (1 << r), 0x7F, -1], dtype=torch.int32) for r in range(world)]
    t = values[rank].to(device, copy=True)
    dist.all_reduce(t, op=dist.ReduceOp.BAND)
    algorithm, reason = last_allreduce()
    assert algorithm == "fallback", (algorithm, reason)
    expected = values[0].clone()
    for v in values[1:]:
        expected &= v
    assert torch.equal(t.cpu(), expected)

    # PREMUL_SUM: NCCL runs its own; where Gloo is the engine (ranks sharing a GPU), xdev
    # multiplies the inputs and runs a SUM.
    inputs = [torch.arange(2 * world, dtype=torch.float32) + 10 * r for r in range(world)]
    expected = torch.stack([x * 0.5 for x in inputs]).sum(0)
    t = inputs[rank].to(device, copy=True)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    assert torch.equal(t.cpu(), expected), ("premul all_reduce", t, expected)
    block = torch.empty(2, device=device)
    full = inputs[rank].to(device, copy=True)
    dist.reduce_scatter_tensor(block, full, op=dist._make_nccl_premul_sum(0.5))
    assert torch.equal(block.cpu(), expected[2 * rank : 2 * rank + 2]), "premul reduce_scatter"
    assert torch.equal(full.cpu(), inputs[rank]), "premul reduce_scatter changed its input"

    # And native allreduce still runs natively afterwards.
    t = torch.full((2049,), float(rank + 1), device=device)
    dist.all_reduce(t)
    if after["transport"]:
        assert_native(what="after delegated collectives")
    assert torch.equal(t.cpu(), torch.full((2049,), float(sum(range(1, world + 1)))))
    torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()
    return {"cuda": after}


@pytest.mark.parametrize("world", [2, 3])
def test_delegated_collectives_share_gpu(world: int) -> None:
    results = run_ranks(_delegated, world, timeout=300)
    assert results[0]["cuda"]["fallback_backend"] in ("gloo", "nccl")


# ---------------------------------------------------------------------------------------
# f. Bad input


def _bad_input(rank: int, world: int) -> dict[str, Any]:
    device = setup_rank(rank)
    dist.init_process_group(
        "xdev",
        rank=rank,
        world_size=world,
        pg_options=torch_xdev.Options(algorithm=SHARED_GPU_PLAN, timeout=60.0),
    )
    info = first_cuda_collective(device)
    if not info["transport"]:
        dist.destroy_process_group()
        return {"skip": f"no CUDA transport: {info['transport_note']}"}
    total = float(sum(range(1, world + 1)))

    def still_usable() -> None:
        ok = torch.full((33,), float(rank + 1), device=device)
        dist.all_reduce(ok)
        assert_native(what="after an error")
        assert torch.equal(ok.cpu(), torch.full((33,), total))

    # Two devices in one call: refused before any peer is involved (every rank passes the
    # same bad list here, so every rank raises).
    with pytest.raises((ValueError, RuntimeError), match="one device"):
        dist.all_reduce_coalesced([torch.ones(4, device=device), torch.ones(4)])
    still_usable()
    with pytest.raises((ValueError, RuntimeError), match="one device"):
        dist.all_reduce_coalesced([torch.ones(4), torch.ones(4, device=device)])
    still_usable()
    if torch.cuda.device_count() > 1:
        other = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
        with pytest.raises((ValueError, RuntimeError), match="one device"):
            dist.all_reduce_coalesced([torch.ones(4, device=device), torch.ones(4, device=other)])
        with pytest.raises((ValueError, RuntimeError), match="runs CUDA collectives on"):
            dist.all_reduce(torch.ones(4, device=other))
        still_usable()

    # Calls that differ across ranks: DistBackendError on every rank, then the group works.
    cases = [
        torch.ones(10 + rank, device=device),  # shape
        torch.ones(10, dtype=torch.float32 if rank == 0 else torch.float64, device=device),
        torch.ones(0 if rank == 0 else 5, device=device),  # empty on one rank only
        torch.ones(4, 5, device=device) if rank == 0 else torch.ones(5, 4, device=device),
    ]
    for t in cases:
        with pytest.raises(dist.DistBackendError, match="mismatched collectives"):
            dist.all_reduce(t)
        still_usable()
    # The same payload split differently: [4, 4] on rank 0, [8] on the others.
    with pytest.raises(dist.DistBackendError, match="mismatched collectives"):
        if rank == 0:
            dist.all_reduce_coalesced([torch.ones(4, device=device), torch.ones(4, device=device)])
        else:
            dist.all_reduce_coalesced([torch.ones(8, device=device)])
    still_usable()
    with pytest.raises(dist.DistBackendError, match="mismatched"):
        dist.all_reduce(
            torch.ones(8, device=device),
            op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX,
        )
    still_usable()
    # One rank in a barrier, the others in an allreduce of CUDA tensors.
    with pytest.raises(dist.DistBackendError, match="mismatched"):
        if rank == 0:
            dist.barrier()
        else:
            dist.all_reduce(torch.ones(2, device=device))
    still_usable()
    torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()
    return {}


def test_bad_input() -> None:
    run_or_skip(_bad_input, 2, timeout=300)


def _peer_goes_mid_collective(rank: int, world: int, timeout_s: float, how: str) -> dict[str, Any]:
    device = setup_rank(rank)
    options = torch_xdev.Options(algorithm=SHARED_GPU_PLAN, cuda_slot_bytes=SLOT, timeout=timeout_s)
    dist.init_process_group("xdev", rank=rank, world_size=world, pg_options=options)
    info = first_cuda_collective(device)
    if not info["transport"]:
        dist.destroy_process_group()
        return {"skip": f"no CUDA transport: {info['transport_note']}"}
    t = torch.ones(16 * SLOT // 4, device=device)  # 16 windows, one kernel each
    if rank == 1:
        # Past the host barrier, its kernels wait behind a GPU sleep.
        if how == "exits":
            # The process ends before they run, so rank 0's kernels wait for a peer that never
            # arrives on the GPU; the host's peer watch sees the exit.
            torch.cuda._sleep(SLEEP_CYCLES)
            dist.all_reduce(t)
            os._exit(0)
        # Alive, its kernels behind a sleep of about twice rank 0's timeout: nothing for the
        # peer watch to see, so rank 0's first window gives up at the timeout itself.
        torch.cuda._sleep(int(4e9 * timeout_s))
        dist.all_reduce(t)
        time.sleep(3 * timeout_s)
        os._exit(0)
    dist.all_reduce(t)
    start = time.monotonic()
    torch.cuda.synchronize(device)
    elapsed = time.monotonic() - start
    with pytest.raises(dist.DistBackendError, match="exited|GPU barrier timed out") as failure:
        dist.all_reduce(torch.ones(4, device=device))
    return {"elapsed": elapsed, "error": str(failure.value)}


def _peer_goes(timeout_s: float, how: str) -> dict[str, Any]:
    results = run_ranks(_peer_goes_mid_collective, 2, timeout_s, how, timeout=300, expect_dead=(1,))
    if "skip" in results[0]:
        skip_or_fail(results[0]["skip"])
    return results[0]


def test_peer_dying_mid_collective_stops_every_queued_window() -> None:
    # The first window stops, and the 15 queued behind it return at once, instead of each
    # waiting out a timeout of its own.
    result = _peer_goes(3.0, "exits")
    assert result["elapsed"] < 9.0, result


def test_peer_stalling_mid_collective_times_out_and_stops_every_queued_window() -> None:
    # The first window waits out the timeout; the 15 queued behind it return at once.
    result = _peer_goes(3.0, "stalls")
    assert 2.7 < result["elapsed"] < 9.0, result
    assert "timed out waiting for rank 1" in result["error"], result


def test_peer_exiting_stops_the_kernels_long_before_the_timeout() -> None:
    """The host watches the peers while kernels wait for them (PeerWatch): with a timeout of
    two minutes, the kernels waiting for a peer that exited stop within seconds, and the next
    call names the peer."""
    result = _peer_goes(120.0, "exits")
    assert result["elapsed"] < 15.0, result
    assert "rank 1" in result["error"] and "exited" in result["error"], result


# ---------------------------------------------------------------------------------------
# A world of one (torchrun --nproc_per_node 1)


def _world_of_one(rank: int, world: int) -> dict[str, Any]:
    device = setup_rank(rank)
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=60.0)
    )
    # The first CUDA allreduce runs the GPU rendezvous; later ones must still leave the
    # tensor as it is (a world of one holds its result), whatever path they take.
    for d, dtype in enumerate((torch.float32, torch.bfloat16, torch.int64, torch.uint8)):
        for o, op in enumerate(OPS):
            x = make_input(d * 10 + o, 0, 1021, dtype, op).to(device, copy=True)
            expected = x.clone()
            dist.all_reduce(x, op=op)
            assert torch.equal(x.cpu(), expected.cpu()), f"one rank, {dtype} {op}"
    xs = [torch.full((n,), 3.0, device=device) for n in (5, 0, 4099)]
    dist.all_reduce_coalesced(xs)
    assert all(bool((x == 3.0).all()) for x in xs)
    dist.barrier()
    last = torch_xdev.describe()["last_allreduce"]
    torch.cuda.synchronize(device)
    dist.destroy_process_group()
    return {"last_allreduce": last}


def test_world_of_one() -> None:
    results = run_ranks(_world_of_one, 1, timeout=300)
    assert results[0]["last_allreduce"] is not None
