"""Allreduce correctness grid on real processes.

algorithm x dtype x op x size (0, 1, primes, larger than the staging buffer) x
packing, each result compared with an independent reference computed in the
test (collective_cases.reference), checked bitwise identical on every rank
(through a Gloo allgather of checksums) and bitwise identical when repeated.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torch_xdev
from collective_cases import (
    assert_same_digests,
    ALL_DTYPES,
    OPS,
    check_close,
    check_coalesced,
    digest,
    make_input,
    reference,
)
from harness import run_ranks

SIZES = (0, 1, 7, 1021, 10007)  # 10007 float64 elements span 20 windows of 4 KiB slots
SMALL_SLOT = 4096


def _variants(algorithm: str, world: int) -> list[dict[str, Any]]:
    base: dict[str, Any] = {"algorithm": algorithm, "shm_slot_bytes": SMALL_SLOT}
    if algorithm in ("hierarchical_copy", "hierarchical_balanced"):
        return [
            base,  # num_packs = world size
            {**base, "num_packs": 3 * world},
            {**base, "num_packs": 0},
            {**base, "num_packs": 3, "shm_slot_bytes": 1 << 20},
            {**base, "bytes_per_pack": 256},
            {**base, "agg_small_grads_max_bytes": 64, "agg_small_grads_max_group": 3},
        ]
    if algorithm == "reduce_to_one":
        return [base, {**base, "reduce_to_rank": world - 1}]
    return [base, {**base, "shm_slot_bytes": 1 << 20}]


def _ops(world: int, variant: int, dtype: int) -> tuple[dist.ReduceOp.RedOpType, ...]:
    """Every op up to 4 ranks. At 8 ranks each dtype meets one op per variant, the next op at the
    next variant: the plans there are the same for every op, and over the hierarchical plans'
    six variants every dtype still meets every op, at a fifth of the cases."""
    if world < 8:
        return OPS
    return (OPS[(dtype + variant) % len(OPS)],)


def _grid(rank: int, world: int, algorithm: str, sizes: tuple[int, ...]) -> int:
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the checker's group
    digests: list[int] = []
    cases = 0
    for v, variant in enumerate(_variants(algorithm, world)):
        group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(**variant))
        for d, dtype in enumerate(ALL_DTYPES):
            for op in _ops(world, v, d):
                o = OPS.index(op)
                for numel in sizes:
                    seed = ((v * 31 + d) * 7 + o) * 100003 + numel
                    inputs = [make_input(seed, r, numel, dtype, op) for r in range(world)]
                    what = f"{variant} {dtype} {op} n={numel}"
                    got = inputs[rank].clone()
                    dist.all_reduce(got, op=op, group=group)
                    check_close(got, reference(inputs, op), op, world, what)
                    again = inputs[rank].clone()
                    dist.all_reduce(again, op=op, group=group)
                    assert torch.equal(got, again), f"{what}: differs run to run"
                    digests.append(digest(got))
                    cases += 1
        # A list of tensors through allreduce_coalesced: exercises packing across tensors.
        shapes = [(5,), (0,), (1,), (3, 7), (300,), (17,), (2000,)]
        digests += check_coalesced(group, rank, world, shapes, 1000, str(variant))
        dist.destroy_process_group(group)
    # Same bits on every rank: compare every result's checksum with rank 0's.
    assert_same_digests(digests, world)
    dist.destroy_process_group()
    return cases


GRID = [
    (1, "auto"),
    (2, "auto"),
    (2, "flat"),
    (2, "reduce_to_one"),
    (2, "hierarchical_copy"),
    (2, "hierarchical_balanced"),
    (2, "direct"),
    (3, "flat"),
    (3, "direct"),
    (3, "reduce_to_one"),
    (4, "flat"),
    (4, "hierarchical_copy"),
    (4, "hierarchical_balanced"),
    (4, "reduce_to_one"),
    (8, "hierarchical_copy"),
    (8, "hierarchical_balanced"),
    (8, "auto"),
]


@pytest.mark.parametrize("world,algorithm", GRID, ids=[f"{w}ranks-{a}" for w, a in GRID])
def test_allreduce_grid(world: int, algorithm: str) -> None:
    sizes = SIZES if world <= 4 else (0, 1, 1021, 10007)
    cases = run_ranks(_grid, world, algorithm, sizes, timeout=600)
    assert cases[0] > 0


def _shapes_and_modes(rank: int, world: int) -> None:
    dist.init_process_group(
        "xdev",
        rank=rank,
        world_size=world,
        pg_options=torch_xdev.Options(shm_slot_bytes=SMALL_SLOT),
    )
    sum_of_ranks = float(sum(range(1, world + 1)))
    # Non-contiguous: a transposed view and a strided slice, written back in place.
    base = torch.arange(600, dtype=torch.float32).view(20, 30) * (rank + 1)
    view = base.t()
    dist.all_reduce(view)
    assert torch.equal(base, torch.arange(600, dtype=torch.float32).view(20, 30) * sum_of_ranks)
    strided = torch.zeros(3000, dtype=torch.float64)
    strided[::3] = rank + 1
    dist.all_reduce(strided[::3])
    assert torch.equal(strided[::3], torch.full((1000,), sum_of_ranks, dtype=torch.float64))
    assert torch.equal(strided[1::3], torch.zeros(1000, dtype=torch.float64))
    # Async: Work.wait and get_future (DDP's comm hooks use the future's value).
    t = torch.full((4097,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    value = work.get_future().wait()
    work.wait()
    assert isinstance(value, list) and value[0] is not None
    assert torch.equal(value[0], torch.full((4097,), sum_of_ranks))
    assert torch.equal(t, torch.full((4097,), sum_of_ranks))
    # Once wait() returns, the future is done too: a caller may read it at once.
    for _ in range(2000):
        work = dist.all_reduce(torch.ones(16), async_op=True)
        work.wait()
        assert work.get_future().done()
    # Many in flight at once complete in order with the right values.
    ts = [torch.full((257 * (i + 1),), float(rank + i)) for i in range(8)]
    works = [dist.all_reduce(x, async_op=True) for x in ts]
    for i, (x, w) in enumerate(zip(ts, works)):
        w.wait()
        assert torch.equal(x, torch.full_like(x, float(sum(r + i for r in range(world)))))
    # The same memory twice in one coalesced call: each entry is reduced from its value before
    # the call (a plan that reads its own input where it writes results used to count a rank
    # twice, differently on each rank). Sizes of one window and of several.
    for n in (9, 3000):
        x = torch.full((n,), float(rank + 1))
        dist.all_reduce_coalesced([x, x])
        assert torch.equal(x, torch.full((n,), sum_of_ranks)), (n, x[:4])
        overlapping = torch.arange(n + n // 2, dtype=torch.float64) * (rank + 1)
        dist.all_reduce_coalesced([overlapping[:n], overlapping[n // 2 :]])
        expected = torch.arange(n + n // 2, dtype=torch.float64) * sum_of_ranks
        assert torch.equal(overlapping, expected), (n, overlapping[:4])
    # So for AVG and PREMUL_SUM: memory listed twice is divided, or scaled, once. On xdev's
    # path and on Gloo's, which has neither (xdev sums there, then divides, or scales first).
    fallback = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(algorithm="fallback"))
    for group in (None, fallback):
        ops = {"AVG": dist.ReduceOp.AVG, "PREMUL_SUM": dist._make_nccl_premul_sum(0.5)}
        for op_name, op in ops.items():

            def expect(total: torch.Tensor) -> torch.Tensor:
                return total / world if op_name == "AVG" else total * 0.5

            x = torch.full((9,), float(rank + 1), dtype=torch.float64)
            dist.all_reduce_coalesced([x, x], op=op, group=group)
            want = expect(torch.full((9,), sum_of_ranks, dtype=torch.float64))
            assert torch.equal(x, want), (op_name, group, x)
            overlapping = torch.arange(15, dtype=torch.float64) * (rank + 1)
            dist.all_reduce_coalesced([overlapping[:9], overlapping[5:]], op=op, group=group)
            want = expect(torch.arange(15, dtype=torch.float64) * sum_of_ranks)
            assert torch.equal(overlapping, want), (op_name, group, overlapping)
    # Broadcast (native) of several dtypes, from every root.
    for root in range(world):
        for dtype in (torch.float32, torch.int64, torch.bool, torch.complex64):
            b = (
                (torch.arange(5000) % 2 == 1)
                if dtype == torch.bool
                else torch.arange(5000).to(dtype)
            )
            x = b.clone() if rank == root else torch.zeros_like(b)
            dist.broadcast(x, src=root)
            assert torch.equal(x, b)
            assert torch_xdev.describe()["last_broadcast"][0] == "native"
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_layouts_async_broadcast(world: int) -> None:
    run_ranks(_shapes_and_modes, world)


def _single_copy(rank: int, world: int) -> bool:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    used = True
    for algorithm in ("flat", "reduce_to_one", "hierarchical_copy"):
        group = dist.new_group(
            backend="xdev", pg_options=torch_xdev.Options(algorithm=algorithm, single_copy=True)
        )
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
                numel = (300 * 1024) // (torch.tensor([], dtype=dtype).element_size()) + 13
                seed = zlib.crc32(f"{algorithm} {dtype} {op}".encode()) % 100000
                inputs = [make_input(seed, r, numel, dtype, op) for r in range(world)]
                got = inputs[rank].clone()
                dist.all_reduce(got, op=op, group=group)
                check_close(got, reference(inputs, op), op, world, f"{algorithm} {dtype} {op}")
                # The call itself ran on the single-copy transport (describe()'s
                # "single_copy" only says the group could).
                ran, reason = torch_xdev.describe(group)["last_allreduce"]
                used = used and ran == algorithm and "single-copy transport" in reason
                mine = torch.tensor([digest(got)], dtype=torch.int64)
                everyone = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(everyone, mine)
                assert all(torch.equal(d, mine) for d in everyone), "ranks disagree"
        dist.destroy_process_group(group)
    dist.destroy_process_group()
    return used


@pytest.mark.parametrize("world", [2, 4])
def test_single_copy_large_payloads(world: int) -> None:
    used = run_ranks(_single_copy, world)
    # Where the host forbids process_vm_readv the staged path runs instead; on
    # the CI machines (same user, no Yama) single copy must really be used.
    assert all(used)


def _guarded_tensors(rank: int, world: int) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    total = float(sum(range(1, world + 1)))

    def leaf_view(rows: int, cols: int, value: float) -> torch.Tensor:
        # A non-contiguous view of a leaf that requires grad (staged, then copied back).
        return torch.full((cols, rows), value, requires_grad=True).t()

    def inference_view(rows: int, cols: int, value: float) -> torch.Tensor:
        with torch.inference_mode():
            made = torch.full((cols, rows), value)
        return made.t()

    # Tensors that autograd or inference mode guard against in-place ops are written as the
    # engines write them (Gloo writes raw memory), sums and all.
    for make in (leaf_view, inference_view):
        x = make(8, 3, float(rank + 1))
        dist.all_reduce(x)
        assert torch.equal(x.detach(), torch.full((8, 3), total)), make.__name__
        big = make(1 << 12, 33, float(rank + 1))  # several windows
        dist.all_reduce(big)
        assert torch.equal(big.detach(), torch.full((1 << 12, 33), total)), make.__name__
        b = make(8, 3, float(rank + 1))
        dist.broadcast(b, src=world - 1)
        assert torch.equal(b.detach(), torch.full((8, 3), float(world))), make.__name__
        gathered = make(4 * world, 2, 0.0)
        dist.all_gather_into_tensor(gathered, torch.full((4, 2), float(rank + 1)))
        expected = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(4)
        assert torch.equal(gathered.detach(), expected[:, None].expand(-1, 2)), make.__name__
        scattered = make(4, 2, 0.0)
        dist.reduce_scatter_tensor(scattered, torch.full((4 * world, 2), float(rank + 1)))
        assert torch.equal(scattered.detach(), torch.full((4, 2), total)), make.__name__
    # A tensor autograd saved for backward: the write bumps its version, so backward says so
    # instead of using the overwritten values.
    leaf = torch.ones(8, 3, requires_grad=True)
    saved = (leaf * 2).t()
    out = saved.sin()
    dist.all_reduce(saved.detach())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_tensors_autograd_or_inference_mode_guard_are_written(world: int) -> None:
    run_ranks(_guarded_tensors, world, timeout=180)


def _async_then_sync(rank: int, world: int) -> None:
    """Synchronous calls queue behind the asynchronous ones before them, on every path.

    A synchronous call runs on the caller's thread when nothing is queued and behind the
    queue otherwise. Each chain below reduces one tensor with ops whose order changes the
    result (sum, then product, then sum again), so a synchronous call that overtook the
    queue would give a different value; and when it returns, every earlier Work must
    already be complete.
    """
    dist.init_process_group(
        "xdev",
        rank=rank,
        world_size=world,
        pg_options=torch_xdev.Options(shm_slot_bytes=SMALL_SLOT),
    )
    SUM, PRODUCT = dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT
    for trial in range(12):
        numel = (1, 1021, 3000)[trial % 3]  # 3000 int64 elements span several 4 KiB windows
        inputs = [make_input(trial, r, numel, torch.int64, PRODUCT) for r in range(world)]
        expected = reference(inputs, SUM)
        expected = reference([expected] * world, PRODUCT)
        expected = reference([expected] * world, SUM)
        # Independent tensors queued alongside, of several sizes and dtypes.
        others = [
            make_input(100 + trial * 7 + i, r, 257 * (i + 1), dtype, SUM)
            for r in range(world)
            for i, dtype in enumerate((torch.float32, torch.int32, torch.float64))
        ]
        mine = [t.clone() for t in others[3 * rank : 3 * rank + 3]]
        if trial % 2:
            dist.all_reduce(mine[0])  # synchronous with nothing queued: runs on this thread
        x = inputs[rank].clone()
        works = [dist.all_reduce(x, op=SUM, async_op=True)]
        works += [dist.all_reduce(t, async_op=True) for t in mine[trial % 2 :]]
        works.append(dist.all_reduce(x, op=PRODUCT, async_op=True))
        dist.all_reduce(x, op=SUM)  # synchronous, behind the queue
        assert all(w.is_completed() for w in works), "a synchronous call overtook the queue"
        assert torch.equal(x, expected), f"trial {trial}: the chain ran out of order"
        for i, t in enumerate(mine):
            want = reference([others[3 * r + i] for r in range(world)], SUM)
            check_close(t, want, SUM, world, f"trial {trial}, tensor {i}")
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_async_then_sync_keeps_order(world: int) -> None:
    run_ranks(_async_then_sync, world)


def _nan_wins(rank: int, world: int) -> None:
    """MIN and MAX: a NaN on any rank comes out on every rank, whatever the plan and dtype."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    algorithms = ["auto", "flat", "direct", "reduce_to_one"]
    if world % 2 == 0:
        algorithms += ["hierarchical_copy", "hierarchical_balanced"]
    for algorithm in algorithms:
        group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(algorithm=algorithm))
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            for holder in range(world):
                for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX):
                    # 40 elements: vector lanes and a tail; a NaN in every third one.
                    t = torch.full((40,), float(rank + 1), dtype=dtype)
                    if rank == holder:
                        t[::3] = float("nan")
                    dist.all_reduce(t, op=op, group=group)
                    want = torch.full((40,), 1.0 if op == dist.ReduceOp.MIN else float(world))
                    want[::3] = float("nan")
                    what = (algorithm, dtype, holder, op)
                    assert torch.equal(t.isnan(), want.isnan()), what
                    assert torch.equal(t.float()[~want.isnan()], want[~want.isnan()]), what
        dist.destroy_process_group(group)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_min_max_keep_a_nan_from_any_rank(world: int) -> None:
    run_ranks(_nan_wins, world)


def _collectives_from_callbacks(rank: int, world: int) -> None:
    """What DDP comm hooks such as PowerSGD do, and what a barrier must not wait for."""
    dist.init_process_group("xdev", rank=rank, world_size=world)
    total = float(sum(range(1, world + 1)))
    # A Work's callbacks run where it completes: on the thread that ran it. A collective issued
    # there, waited for at once (PowerSGD's hook: all_reduce(...).get_future().wait()), used
    # to queue behind that very thread and wait forever.
    inner = torch.full((4,), float(rank + 1))
    synced = torch.full((3,), float(rank + 1))

    def reduce_more(fut: torch.futures.Future[Any]) -> torch.Tensor:
        dist.all_reduce(synced)
        return dist.all_reduce(inner, async_op=True).get_future().wait()[0]

    chained = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(reduce_more)
    assert torch.equal(chained.wait(), torch.full((4,), total))
    assert torch.equal(synced, torch.full((3,), total))
    # An async barrier waits for the engine's work issued before it, not after: the later
    # all_to_all needs the last rank, which only calls anything once rank 0 has issued all
    # three (the Store key), and then waits in its own barrier first.
    store = dist.distributed_c10d._get_default_store()
    before = torch.full((4,), float(rank + 1))
    out = torch.empty(world)
    if rank == 0:
        works = [
            dist.all_reduce(before, async_op=True),
            dist.barrier(async_op=True),
            dist.all_to_all_single(out, torch.arange(float(world)) + 10 * rank, async_op=True),
        ]
        store.set("callbacks/issued", "1")
        for work in works:
            work.wait()
    else:
        store.wait(["callbacks/issued"])
        dist.all_reduce(before)
        dist.barrier()
        dist.all_to_all_single(out, torch.arange(float(world)) + 10 * rank)
    assert torch.equal(before, torch.full((4,), total))
    assert torch.equal(out, torch.tensor([10.0 * r + rank for r in range(world)]))
    # Several tensors in one non-coalesced call follow c10d's rule (Gloo's): one result over
    # every tensor of every rank (the native path used to reduce them one by one), and a
    # broadcast gives every tensor the root's rootTensor.
    group = dist.distributed_c10d._get_default_group()
    pair = [torch.full((2,), float(rank + 1)), torch.full((2,), 10.0 * (rank + 1))]
    group.allreduce(pair).wait()
    assert all(torch.equal(t, torch.full((2,), 11 * total)) for t in pair), pair
    pair = [torch.full((2,), float(rank + 1)), torch.full((2,), 10.0 * (rank + 1))]
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast(pair, opts).wait()
    assert all(torch.equal(t, torch.full((2,), 1.0)) for t in pair), pair
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_from_callbacks_and_barrier_order(world: int) -> None:
    run_ranks(_collectives_from_callbacks, world, timeout=120)


def _callbacks_keep_program_order(rank: int, world: int) -> None:
    """A collective issued from a callback takes the place where the callback was attached.

    Rank 0 issues everything before any peer has issued anything (a Store key holds them
    back), so its callbacks run on xdev's worker thread with the later collective already
    queued; its peers let each Work complete before going on, so theirs run in program order.
    Both orders must pair the same calls: a wrong pairing is a mismatch error, or sums of the
    wrong tensors.
    """
    dist.init_process_group("xdev", rank=rank, world_size=world)
    store = dist.distributed_c10d._get_default_store()
    total = float(sum(range(1, world + 1)))

    def full(n: int, scale: float) -> torch.Tensor:
        return torch.full((n,), scale * (rank + 1))

    # DDP's pattern (PowerSGD on several buckets): the hook attaches a callback that issues
    # a collective and waits for it; the backward pass then issues the next bucket.
    first, inner, later = full(3, 1.0), full(5, 10.0), full(7, 100.0)

    def issue_inner(fut: torch.futures.Future[Any]) -> torch.Tensor:
        return dist.all_reduce(inner, async_op=True).get_future().wait()[0]

    def issue_first() -> torch.futures.Future[Any]:
        return dist.all_reduce(first, async_op=True).get_future().then(issue_inner)

    if rank == 0:
        chained = issue_first()
        last = dist.all_reduce(later, async_op=True)
        store.set("order/ddp", "issued")
    else:
        store.wait(["order/ddp"])
        chained = issue_first()
        chained.wait()  # the callback ran, in program order
        last = dist.all_reduce(later, async_op=True)
    chained.wait()
    last.wait()
    for tensor, scale in ((first, 1.0), (inner, 10.0), (later, 100.0)):
        assert torch.equal(tensor, torch.full_like(tensor, scale * total)), (scale, tensor)

    # A callback attached after a later collective was issued: it goes after that one.
    first, later, inner = full(2, 1.0), full(4, 100.0), full(6, 10.0)
    if rank == 0:
        work = dist.all_reduce(first, async_op=True)
        last = dist.all_reduce(later, async_op=True)
        chained = work.get_future().then(issue_inner)
        store.set("order/late", "issued")
    else:
        store.wait(["order/late"])
        work = dist.all_reduce(first, async_op=True)
        work.wait()
        last = dist.all_reduce(later, async_op=True)
        chained = work.get_future().then(issue_inner)  # runs at once, on this thread
    chained.wait()
    last.wait()
    for tensor, scale in ((first, 1.0), (inner, 10.0), (later, 100.0)):
        assert torch.equal(tensor, torch.full_like(tensor, scale * total)), (scale, tensor)

    # A callback that waits for a later Work of the group (Gloo completes this): on rank 0 that
    # Work is still queued behind the callback's own thread, which runs it first. The integer
    # AVG goes to Gloo as a SUM, then a division queued on the same thread.
    first, later = full(3, 1.0), full(5, 100.0)
    ints = torch.full((4,), 6 * (rank + 1), dtype=torch.int64)
    if rank == 0:
        future = dist.all_reduce(first, async_op=True).get_future()
        later_works = [
            dist.all_reduce(ints, op=dist.ReduceOp.AVG, async_op=True),
            dist.all_reduce(later, async_op=True),
        ]

        def wait_for_later(fut: torch.futures.Future[Any]) -> torch.Tensor:
            for later_work in later_works:
                later_work.wait()
            return fut.value()[0] + 1

        chained = future.then(wait_for_later)
        store.set("order/wait_later", "issued")
    else:
        store.wait(["order/wait_later"])
        dist.all_reduce(first)
        dist.all_reduce(ints, op=dist.ReduceOp.AVG)
        dist.all_reduce(later)
        chained = torch.futures.Future()
        chained.set_result(first + 1)
    assert torch.equal(chained.wait(), torch.full((3,), total + 1))
    assert torch.equal(ints, torch.full((4,), 6 * int(total) // world)), ints
    assert torch.equal(later, torch.full((5,), 100.0 * total))

    # Destroying the group from a callback on its worker thread (rank 0's: its peers only
    # join the allreduce once the callback is attached) is refused, and the group goes on.
    refused: list[str] = []

    def destroy_group(fut: torch.futures.Future[Any]) -> None:
        try:
            dist.destroy_process_group()
        except RuntimeError as e:
            refused.append(str(e))

    x = full(3, 1.0)
    if rank == 0:
        attempt = dist.all_reduce(x, async_op=True).get_future().then(destroy_group)
        store.set("order/destroy", "issued")
        attempt.wait()
        assert len(refused) == 1 and "cannot be destroyed from a callback" in refused[0], refused
    else:
        store.wait(["order/destroy"])
        dist.all_reduce(x)
    assert torch.equal(x, torch.full_like(x, total))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full_like(x, world * total))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_callbacks_keep_program_order(world: int) -> None:
    run_ranks(_callbacks_keep_program_order, world, timeout=120)
