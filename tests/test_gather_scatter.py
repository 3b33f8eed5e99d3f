"""Reduce-scatter and all-gather on real processes: the tensor, coalesced and list forms.

dtype x op x size (0, 1, odd, larger than one slot window) x world, each result compared with a
reference computed here from every rank's input (collective_cases), and every reduce-scatter
compared bitwise with the matching slice of xdev's own flat allreduce of the same inputs (the
same sums in the same order). Also: a mismatched call fails on every rank and the group goes
on; async_op with futures; non-contiguous outputs; the list forms and all_gather_coalesced
(c10d's list of lists); a world of one; the native path shows in the XDEV_DEBUG log.
"""

from __future__ import annotations

import math
import os
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

import torch_xdev
from collective_cases import (
    ALL_DTYPES,
    OPS,
    check_close,
    check_lent_memory_overlaps,
    make_input,
    reference,
)
from harness import run_ranks
from training_cases import sgd_losses, sharded_mlp

SMALL_SLOT = 4096  # 512 float64 elements: a block of 1021 spans several windows on any world
SIZES = (0, 1, 7, 1021)
OTHER_DTYPES = (torch.bool, torch.complex64)  # no kernel: all-gather moves their bytes natively


def _all_gather_input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(numel, generator=torch.Generator().manual_seed(seed + rank)) > 0.5
    if dtype == torch.complex64:
        g = torch.Generator().manual_seed(seed + rank)
        return torch.randn(numel, 2, generator=g).view(torch.complex64).flatten()
    return make_input(seed, rank, numel, dtype, dist.ReduceOp.SUM)


def _grid(rank: int, world: int) -> int:
    options: dict[str, Any] = dict(shm_slot_bytes=SMALL_SLOT)
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(**options)
    )
    flat_options = torch_xdev.Options(algorithm="flat", **options)
    flat = dist.new_group(backend="xdev", pg_options=flat_options)
    cases = 0
    for d, dtype in enumerate(ALL_DTYPES):
        for o, op in enumerate(OPS):
            for numel in SIZES:
                seed = (d * 7 + o) * 100003 + numel
                inputs = [make_input(seed, r, world * numel, dtype, op) for r in range(world)]
                what = f"reduce_scatter {dtype} {op} block={numel}"
                got = torch.full((numel,), 7, dtype=dtype)
                dist.reduce_scatter_tensor(got, inputs[rank].clone(), op=op)
                mine = slice(rank * numel, (rank + 1) * numel)
                check_close(got, reference(inputs, op)[mine], op, world, what)
                reduced = inputs[rank].clone()
                dist.all_reduce(reduced, op=op, group=flat)
                assert torch.equal(got, reduced[mine]), f"{what}: not the bits of flat allreduce"
                cases += 1
        for numel in SIZES:
            seed = d * 1000 + numel
            parts = [_all_gather_input(seed, r, numel, dtype) for r in range(world)]
            out = torch.empty(world * numel, dtype=dtype)
            dist.all_gather_into_tensor(out, parts[rank])
            assert torch.equal(out, torch.cat(parts)), f"all_gather {dtype} n={numel}"
            cases += 1
    for dtype in OTHER_DTYPES:
        parts = [_all_gather_input(5, r, 1021, dtype) for r in range(world)]
        out = torch.empty(world * 1021, dtype=dtype)
        dist.all_gather_into_tensor(out, parts[rank])
        assert torch.equal(out, torch.cat(parts)), f"all_gather {dtype}"
        cases += 1
    dist.destroy_process_group()
    return cases


@pytest.mark.parametrize(
    "world", [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)]  # 8 ranks on 2 cores
)
def test_tensor_forms_grid(world: int) -> None:
    cases = run_ranks(_grid, world, timeout=300)
    assert cases[0] > 0


def _forms_and_failures(rank: int, world: int) -> None:
    options = torch_xdev.Options(shm_slot_bytes=SMALL_SLOT)
    dist.init_process_group("xdev", rank=rank, world_size=world, pg_options=options)
    group = dist.group.WORLD
    # Coalesced forms (c10d's coalescing manager calls *_tensor_coalesced), dtypes mixed, one
    # block larger than a window; reduce-scatter with AVG as FSDP asks.
    shapes = [(1021,), (3,), (0,), (600,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.int64]
    rs_in = [
        [make_input(40 + i, r, world * n[0], dt, dist.ReduceOp.AVG) for r in range(world)]
        for i, (n, dt) in enumerate(zip(shapes, dtypes))
    ]
    rs_out = [torch.empty(s, dtype=dt) for s, dt in zip(shapes, dtypes)]
    with _coalescing_manager(group=group, async_ops=True) as cm:
        for out, ins in zip(rs_out, rs_in):
            dist.reduce_scatter_tensor(out, ins[rank].clone(), op=dist.ReduceOp.AVG)
    cm.wait()
    for i, (out, ins) in enumerate(zip(rs_out, rs_in)):
        n = shapes[i][0]
        expected = reference(ins, dist.ReduceOp.AVG)[rank * n : (rank + 1) * n]
        check_close(out, expected, dist.ReduceOp.AVG, world, f"coalesced reduce_scatter #{i}")
    ag_in = [
        _all_gather_input(60 + i, rank, s[0], dt) for i, (s, dt) in enumerate(zip(shapes, dtypes))
    ]
    ag_out = [torch.empty(world * s[0], dtype=dt) for s, dt in zip(shapes, dtypes)]
    with _coalescing_manager(group=group, async_ops=False):
        for out, x in zip(ag_out, ag_in):
            dist.all_gather_into_tensor(out, x)
    for i, (s, dt) in enumerate(zip(shapes, dtypes)):
        expected = torch.cat([_all_gather_input(60 + i, r, s[0], dt) for r in range(world)])
        assert torch.equal(ag_out[i], expected), f"coalesced all_gather #{i}"

    # In place, as FSDP all-gathers: the input is this rank's block of the output.
    buf = torch.zeros(world * 2000)
    buf[rank * 2000 : (rank + 1) * 2000] = rank + 1.0
    dist.all_gather_into_tensor(buf, buf[rank * 2000 : (rank + 1) * 2000])
    assert torch.equal(buf, torch.arange(1.0, world + 1).repeat_interleave(2000))

    # Non-contiguous outputs (written back) and inputs.
    out_t = torch.zeros(30, 20 * world).t()  # (20 * world, 30), not contiguous
    x = (torch.arange(600.0) + rank).view(20, 30)
    dist.all_gather_into_tensor(out_t, x)
    everyone = [(torch.arange(600.0) + r).view(20, 30) for r in range(world)]
    assert torch.equal(out_t, torch.cat(everyone))
    rs_t = torch.zeros(30, 20).t()
    # Column-major: a non-contiguous input.
    full = torch.cat([torch.full((20, 30), float(rank + j)) for j in range(world)])
    full = full.t().contiguous().t()
    assert not full.is_contiguous()
    dist.reduce_scatter_tensor(rs_t, full)
    assert torch.equal(rs_t, torch.full((20, 30), float(sum(r + rank for r in range(world)))))

    # Async with futures, several in flight, completing in order.
    works, outs = [], []
    for i in range(6):
        o = torch.empty(4097)
        outs.append(o)
        x = torch.full((world * 4097,), float(rank + i))
        works.append(dist.reduce_scatter_tensor(o, x, async_op=True))
    value = works[0].get_future().wait()  # before any Work.wait(): the future's own result
    assert isinstance(value, list) and value[0] is outs[0]
    assert torch.equal(value[0], torch.full((4097,), float(sum(range(world)))))
    for i, (o, w) in enumerate(zip(outs, works)):
        w.wait()
        assert torch.equal(o, torch.full((4097,), float(sum(r + i for r in range(world)))))
    ag = torch.empty(world * 5000, dtype=torch.int32)
    x = torch.full((5000,), rank, dtype=torch.int32)
    work = dist.all_gather_into_tensor(ag, x, async_op=True)
    work.get_future().wait()
    assert torch.equal(ag, torch.arange(world, dtype=torch.int32).repeat_interleave(5000))

    # List forms: all_gather into a list (non-contiguous entries too), reduce_scatter from one.
    lst = [torch.zeros(40, 25).t() for _ in range(world)]
    dist.all_gather(lst, torch.full((25, 40), float(rank)))
    for r in range(world):
        assert torch.equal(lst[r], torch.full((25, 40), float(r)))
    out = torch.zeros(999, dtype=torch.float64)
    pieces = [torch.full((999,), float(rank * j), dtype=torch.float64) for j in range(world)]
    dist.reduce_scatter(out, pieces, op=dist.ReduceOp.MAX)
    assert torch.equal(out, torch.full((999,), float((world - 1) * rank), dtype=torch.float64))

    # Uneven list sizes (rank j's block holds sizes[j] elements, one empty), several windows.
    sizes = [1500 + 37 * j for j in range(world)]
    sizes[1] = 0
    sum_op = dist.ReduceOp.SUM
    pieces = [make_input(90 + j, rank, n, torch.float32, sum_op) for j, n in enumerate(sizes)]
    out = torch.empty(sizes[rank])
    dist.reduce_scatter(out, pieces)
    everyone = [make_input(90 + rank, r, sizes[rank], torch.float32, sum_op) for r in range(world)]
    check_close(out, reference(everyone, sum_op), sum_op, world, "uneven reduce_scatter")
    gathered = [torch.full((n,), -1, dtype=torch.int16) for n in sizes]
    dist.all_gather(gathered, torch.arange(sizes[rank], dtype=torch.int16) + rank)
    for j, n in enumerate(sizes):
        assert torch.equal(gathered[j], torch.arange(n, dtype=torch.int16) + j), f"uneven {j}"

    # A mismatched shape or dtype fails on every rank, and the group goes on.
    bad = 10 + (rank == world - 1)
    with pytest.raises(dist.DistBackendError, match="mismatched"):
        dist.reduce_scatter_tensor(torch.empty(bad), torch.ones(world * bad))
    dt = torch.float32 if rank == 0 else torch.int32
    with pytest.raises(dist.DistBackendError, match="mismatched"):
        dist.all_gather_into_tensor(torch.empty(world * 8, dtype=dt), torch.ones(8, dtype=dt))
    after = torch.empty(100)
    dist.reduce_scatter_tensor(after, torch.ones(world * 100))
    assert torch.equal(after, torch.full((100,), float(world)))
    # Arguments only the last rank gets wrong: it raises ValueError, the others a mismatch
    # that names its refusal, and the calls after it stay paired (they used to pair each
    # rank's next call with its peers' one after).
    last = rank == world - 1
    wrong = world * 4 + last  # one element too many on the last rank
    ones4 = torch.ones(4)
    # An output of a dtype without a native kernel (bool) once sent the last rank alone to
    # Gloo, and its peers' native call paired with its next one (two wrong sums, no error).
    out_dtype = torch.bool if last else torch.float32
    for name, bad_call in [
        (
            "reduce_scatter_tensor into bool",
            lambda: dist.reduce_scatter_tensor(
                torch.empty(4, dtype=out_dtype), torch.ones(world * 4)
            ),
        ),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(wrong), ones4)),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(ones4, torch.ones(wrong))),
        ("all_gather", lambda: dist.all_gather([torch.empty(4)] * (world + last), ones4)),
        (
            "all_gather_coalesced",
            lambda: dist.all_gather_coalesced([[torch.empty(4 + last)]] * world, [ones4]),
        ),
    ]:
        if last:
            with pytest.raises(ValueError, match="xdev"):  # xdev's own check, named
                bad_call()
        else:
            with pytest.raises(dist.DistBackendError, match="refused its own arguments"):
                bad_call()
        for i in range(3):
            got = torch.empty(world * 2)
            dist.all_gather_into_tensor(got, torch.full((2,), float(10 * i + rank)))
            want = torch.tensor([float(10 * i + r) for r in range(world) for _ in range(2)])
            assert torch.equal(got, want), (name, i, got)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_coalesced_list_async_and_mismatch(world: int) -> None:
    run_ranks(_forms_and_failures, world)


def _world_of_one_checks(rank: int, world: int) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    # No peers to meet, but the arguments are checked as in a larger group: a list of outputs
    # shorter than the inputs used to be read past its end.
    with pytest.raises(ValueError, match="output list 0 has 1 tensor"):
        dist.all_gather_coalesced([[torch.zeros(3)]], [torch.arange(3.0), torch.arange(4.0)])
    with pytest.raises(ValueError, match="must match input 0"):
        dist.all_gather_coalesced(
            [[torch.empty(1, 3), torch.empty(2, 2)]], [torch.ones(3), torch.ones(3)]
        )
    with pytest.raises(ValueError, match="one output list per rank"):
        dist.all_gather_coalesced([[torch.empty(2)]] * 2, [torch.ones(2)])
    outputs = [[torch.empty(2), torch.empty(3)]]
    dist.all_gather_coalesced(outputs, [torch.ones(2), torch.full((3,), 2.0)])
    assert torch.equal(outputs[0][0], torch.ones(2)) and torch.equal(
        outputs[0][1], torch.full((3,), 2.0)
    )
    with pytest.raises(ValueError, match="share memory"):
        dist.all_reduce(torch.ones(1).expand(4))  # its elements share memory
    dist.destroy_process_group()


def test_world_of_one_checks_arguments() -> None:
    run_ranks(_world_of_one_checks, 1)


def _lent_memory_overlaps(rank: int, world: int) -> None:
    options = torch_xdev.Options(shm_slot_bytes=SMALL_SLOT)
    dist.init_process_group("xdev", rank=rank, world_size=world, pg_options=options)
    for n in (5, 3000):  # one window, and several (the entries' windows run in turn)
        check_lent_memory_overlaps(rank, world, None, n)
        assert torch_xdev.describe()["last_gather_scatter"][1] == "native"
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_inputs_and_outputs_that_share_memory(world: int) -> None:
    # A coalesced call's entry 1 read what entry 0 had already written (wrong on every rank).
    run_ranks(_lent_memory_overlaps, world)


def _zeros_strided(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``shape``; transposed (not contiguous) where it has two dimensions."""
    if len(shape) == 2:
        return torch.zeros(shape[::-1], dtype=dtype).t()
    return torch.zeros(shape, dtype=dtype)


def _coalesced_lists(rank: int, world: int) -> None:
    """dist.all_gather_coalesced: outputs[r][i] receives rank r's inputs[i]."""
    options = torch_xdev.Options(shm_slot_bytes=SMALL_SLOT)
    dist.init_process_group("xdev", rank=rank, world_size=world, pg_options=options)
    # One dtype per call (c10d's rule); shapes of several dims, empty, spanning windows.
    shapes = [(3, 4), (0,), (1021,), (2, 3, 5)]
    for k, dtype in enumerate((torch.float32, torch.int64, torch.bfloat16, torch.complex64)):

        def parts(r: int) -> list[torch.Tensor]:
            flat = [
                _all_gather_input(70 + 13 * k + i, r, math.prod(s), dtype)
                for i, s in enumerate(shapes)
            ]
            return [t.view(s) for t, s in zip(flat, shapes)]

        mine = parts(rank)
        # Non-contiguous outputs, written back through their views.
        outputs = [[_zeros_strided(s, dtype) for s in shapes] for _ in range(world)]
        dist.all_gather_coalesced(outputs, mine)
        for r in range(world):
            for i, (got, expected) in enumerate(zip(outputs[r], parts(r))):
                assert torch.equal(got, expected), f"{dtype}: rank {r}'s tensor {i}"
    # Async: a future whose wait completes the outputs.
    outputs = [[torch.empty(4097), torch.empty(3)] for _ in range(world)]
    future = dist.all_gather_coalesced(
        outputs, [torch.full((4097,), rank + 0.5), torch.full((3,), -rank * 1.0)], async_op=True
    )
    value = future.wait()
    for r in range(world):
        assert torch.equal(outputs[r][0], torch.full((4097,), r + 0.5))
        assert torch.equal(outputs[r][1], torch.full((3,), -r * 1.0))
    # Its value is the output lists, one per rank, as Gloo's is (it was one flat list, in
    # input-major order, so value[r][i] indexed a tensor).
    assert len(value) == world and all(len(v) == 2 for v in value), value
    for r in range(world):
        for i in range(2):
            assert value[r][i].data_ptr() == outputs[r][i].data_ptr(), (r, i)
            assert torch.equal(value[r][i], outputs[r][i]), (r, i)

    # Outputs that do not fit the inputs: a ValueError on the calling rank, no collective.
    with pytest.raises(ValueError, match="must match input 1"):
        dist.all_gather_coalesced(
            [[torch.empty(2), torch.empty(4)]] * world, [torch.ones(2), torch.ones(3)]
        )
    with pytest.raises(ValueError, match="one output list per rank"):
        dist.all_gather_coalesced([[torch.empty(2)]] * (world + 1), [torch.ones(2)])
    # Calls that differ between ranks (each consistent in itself) fail on every rank.
    n = 10 + (rank == world - 1)
    with pytest.raises(dist.DistBackendError, match="mismatched"):
        dist.all_gather_coalesced(
            [[torch.empty(5), torch.empty(n)] for _ in range(world)], [torch.ones(5), torch.ones(n)]
        )
    # The same failure through the async form's future: its error, not the unwritten outputs.
    future = dist.all_gather_coalesced(
        [[torch.empty(5), torch.empty(n)] for _ in range(world)],
        [torch.ones(5), torch.ones(n)],
        async_op=True,
    )
    with pytest.raises(Exception, match="mismatched"):
        future.wait()
    count = 2 + (rank == 0)
    with pytest.raises(dist.DistBackendError, match="mismatched"):
        dist.all_gather_coalesced(
            [[torch.empty(4)] * count for _ in range(world)], [torch.ones(4)] * count
        )
    # The group goes on.
    outputs = [[torch.empty(6, dtype=torch.int32)] for _ in range(world)]
    dist.all_gather_coalesced(outputs, [torch.full((6,), rank, dtype=torch.int32)])
    assert [int(o[0][0]) for o in outputs] == list(range(world))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_coalesced_lists(world: int) -> None:
    run_ranks(_coalesced_lists, world)


def _fallback_integer_avg(rank: int, world: int) -> None:
    # Gloo averages in floating point and cannot write the quotient into integers; xdev's
    # engine path sums there, then truncates as its native kernels do.
    options = torch_xdev.Options(algorithm="fallback")
    dist.init_process_group("xdev", rank=rank, world_size=world, pg_options=options)
    avg = dist.ReduceOp.AVG
    for dtype in (torch.int32, torch.int64, torch.uint8, torch.float32):
        n = 37
        inputs = [make_input(80, r, world * n, dtype, avg) for r in range(world)]
        mine = slice(rank * n, (rank + 1) * n)
        expected = reference(inputs, avg)[mine]
        what = f"fallback reduce_scatter AVG {dtype}"
        out = torch.full((n,), 9, dtype=dtype)
        dist.reduce_scatter_tensor(out, inputs[rank].clone(), op=avg)
        check_close(out, expected, avg, world, f"{what} (tensor)")
        listed = torch.full((n,), 9, dtype=dtype)
        dist.reduce_scatter(listed, list(inputs[rank].clone().chunk(world)), op=avg)
        check_close(listed, expected, avg, world, f"{what} (list)")
        coalesced = [torch.full((n,), 9, dtype=dtype), torch.full((1,), 9, dtype=dtype)]
        second = [make_input(81, r, world, dtype, avg) for r in range(world)]
        with _coalescing_manager(async_ops=True) as cm:
            dist.reduce_scatter_tensor(coalesced[0], inputs[rank].clone(), op=avg)
            dist.reduce_scatter_tensor(coalesced[1], second[rank].clone(), op=avg)
        cm.wait()
        check_close(coalesced[0], expected, avg, world, f"{what} (coalesced)")
        check_close(
            coalesced[1], reference(second, avg)[rank : rank + 1], avg, world, f"{what} (#2)"
        )
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_fallback_reduce_scatter_averages_integers(world: int) -> None:
    run_ranks(_fallback_integer_avg, world)


def _shapes_on_every_path(rank: int, world: int) -> None:
    # Shapes whose element counts fit, which NCCL and xdev's native paths take: the same calls
    # on the engine's path (algorithm='fallback', as across hosts), where Gloo alone refuses
    # them, give the same results.
    dist.init_process_group("xdev", rank=rank, world_size=world)
    forced = dist.new_group(pg_options=torch_xdev.Options(algorithm="fallback"))
    n = 3
    inputs = [make_input(90, r, world * n, torch.float32, dist.ReduceOp.SUM) for r in range(world)]
    summed = reference(inputs, dist.ReduceOp.SUM)[rank * n : (rank + 1) * n]
    gathered = torch.stack([x[:n] for x in inputs])  # (world, n): every rank's first n
    for group, path in ((None, "native"), (forced, "fallback")):
        out = torch.zeros(n)
        dist.reduce_scatter_tensor(out, inputs[rank].view(world, n).clone(), group=group)
        check_close(out, summed, dist.ReduceOp.SUM, world, f"{path} RS out (n,) in (world, n)")
        column = torch.zeros(n, 1)
        dist.reduce_scatter_tensor(column, inputs[rank].clone(), group=group)
        check_close(column.view(-1), summed, dist.ReduceOp.SUM, world, f"{path} RS out (n, 1)")
        listed = torch.zeros(n)
        rows = [c.view(1, n) for c in inputs[rank].clone().chunk(world)]
        dist.reduce_scatter(listed, rows, group=group)
        check_close(listed, summed, dist.ReduceOp.SUM, world, f"{path} RS list of (1, n)")
        stacked = torch.zeros(world, n)
        dist.all_gather_into_tensor(stacked, inputs[rank][:n].clone(), group=group)
        assert torch.equal(stacked, gathered), f"{path} all_gather_into_tensor (world, n)"
        for dtype in (torch.int16, torch.complex64):  # Gloo lacks them: they go as bytes
            want = (torch.arange(5) + 1).to(dtype)
            sent = want.clone() if rank == 0 else torch.zeros(5, dtype=dtype)
            dist.broadcast(sent, 0, group=group)
            assert torch.equal(sent, want), f"{path} broadcast of {dtype}"
        strided = torch.zeros(n, world).t()  # (world, n), not contiguous: Gloo refused it
        dist.all_gather_into_tensor(strided, inputs[rank][:n].clone(), group=group)
        assert torch.equal(strided, gathered), f"{path} all_gather_into_tensor, strided output"
        scalars = torch.zeros(world)
        dist.all_gather_into_tensor(scalars, inputs[rank][0].clone(), group=group)
        assert torch.equal(scalars, gathered[:, 0]), f"{path} all_gather_into_tensor of 0-dim"
        # Sizes that do not fit (every rank alike): xdev's ValueError on either path, where
        # Gloo's own check aborted the process.
        with pytest.raises(ValueError, match="element"):
            dist.reduce_scatter_tensor(torch.zeros(n), torch.ones(world * n + 1), group=group)
        with pytest.raises(ValueError, match="element"):
            dist.all_gather_into_tensor(torch.zeros(world * n + 1), torch.ones(n), group=group)
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        # Pairs of several dtypes in one coalesced call (functional collectives, FSDP2's
        # mixed-precision buffers): Gloo packed them into one buffer of one dtype.
        pairs = [(torch.float32, (n,)), (torch.float64, (2, 3)), (torch.int64, (5,))]

        def block(r: int, d: torch.dtype, s: tuple[int, ...]) -> torch.Tensor:
            return (torch.arange(math.prod(s)) + 100 * r).to(d).view(s)

        mine = [block(rank, d, s) for d, s in pairs]
        outs = [torch.zeros(world * x.shape[0], *x.shape[1:], dtype=x.dtype) for x in mine]
        pg.allgather_into_tensor_coalesced(outs, mine).wait()
        for out, (d, s) in zip(outs, pairs):
            want = torch.cat([block(r, d, s) for r in range(world)])
            assert torch.equal(out, want), f"{path} all_gather_into_tensor_coalesced of {d}"
        with pytest.raises(ValueError, match="element"):
            pg.reduce_scatter_tensor_coalesced([torch.zeros(n)], [torch.ones(world * n + 1)])
        with pytest.raises(ValueError, match="element"):  # Gloo read past a short output
            pg.allgather_into_tensor_coalesced([torch.zeros(world * n - 1)], [torch.ones(n)])
        dist.all_reduce(torch.ones(4), group=group)  # still usable
    dist.destroy_process_group()


def test_shapes_whose_counts_fit_run_on_the_engine_path_too() -> None:
    run_ranks(_shapes_on_every_path, 2)


def _dead_peer(rank: int, world: int) -> None:
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=600.0)
    )
    out = torch.empty(3)
    dist.reduce_scatter_tensor(out, torch.ones(world * 3))  # everyone has mapped the segment
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError) as info:
        dist.all_gather_into_tensor(torch.empty(world << 16), torch.ones(1 << 16))
    # Noticed by the liveness check long before the 600 s timeout.
    assert time.monotonic() - start < 30
    assert f"rank {world - 1}" in str(info.value) and "exited" in str(info.value), str(info.value)


def test_dead_peer_is_reported_not_waited_for() -> None:
    run_ranks(_dead_peer, 2, timeout=120, expect_dead=(1,))


def _debug_log(rank: int, world: int) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, torch.ones(world * 4), op=dist.ReduceOp.AVG)
    dist.all_gather_into_tensor(torch.empty(world * 4), out)
    dist.all_gather_coalesced([[torch.empty(4)] for _ in range(world)], [out])
    dist.destroy_process_group()


def test_debug_log_names_the_native_path(capfd: pytest.CaptureFixture[str]) -> None:
    run_ranks(_debug_log, 2, env={"XDEV_DEBUG": "INFO"})
    err = capfd.readouterr().err
    assert "reduce_scatter on CPU tensors -> native" in err, err
    assert "all_gather on CPU tensors -> native" in err, err
    assert "all_gather_coalesced on CPU tensors -> native" in err, err


def _single_copy(rank: int, world: int) -> bool:
    """Large single tensors: peers read each other's inputs in place; same bits as staged."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    single = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(single_copy=True))
    staged = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(single_copy=False))
    used = bool(torch_xdev.describe(single)["single_copy"])
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MIN):
            block = (300 * 1024) // torch.tensor([], dtype=dtype).element_size() + 13
            inputs = [make_input(17, r, world * block, dtype, op) for r in range(world)]
            got, again = torch.empty(block, dtype=dtype), torch.empty(block, dtype=dtype)
            dist.reduce_scatter_tensor(got, inputs[rank], op=op, group=single)
            dist.reduce_scatter_tensor(again, inputs[rank], op=op, group=staged)
            mine = slice(rank * block, (rank + 1) * block)
            check_close(got, reference(inputs, op)[mine], op, world, f"{dtype} {op}")
            assert torch.equal(got, again), f"{dtype} {op}: single copy != staged"
        parts = [make_input(3, r, 100003, dtype, dist.ReduceOp.SUM) for r in range(world)]
        out = torch.empty(world * 100003, dtype=dtype)
        dist.all_gather_into_tensor(out, parts[rank], group=single)
        assert torch.equal(out, torch.cat(parts)), f"all_gather {dtype}"
        # In place: this rank's block of the output is the input, as FSDP passes it.
        out = torch.zeros(world * 100003, dtype=dtype)
        out[rank * 100003 : (rank + 1) * 100003] = parts[rank]
        dist.all_gather_into_tensor(out, out[rank * 100003 : (rank + 1) * 100003], group=single)
        assert torch.equal(out, torch.cat(parts)), f"in-place all_gather {dtype}"
    # Overlaps at another rank's block: the input of an all-gather (or the output of a
    # reduce-scatter) is a view of another block of the other side. Peers read what this
    # rank lends while it writes: it must lend a copy, or write elsewhere first.
    n = 100003
    other = slice(((rank + 1) % world) * n, ((rank + 1) % world + 1) * n)
    parts = [make_input(5, r, n, torch.float32, dist.ReduceOp.SUM) for r in range(world)]
    out = torch.zeros(world * n)
    out[other] = parts[rank]
    dist.all_gather_into_tensor(out, out[other], group=single)
    assert torch.equal(out, torch.cat(parts)), "all_gather from another rank's block"
    inputs = [make_input(6, r, world * n, torch.float32, dist.ReduceOp.SUM) for r in range(world)]
    full = inputs[rank].clone()
    dist.reduce_scatter_tensor(full[other], full, group=single)
    mine = slice(rank * n, (rank + 1) * n)
    sum_op = dist.ReduceOp.SUM
    check_close(full[other], reference(inputs, sum_op)[mine], sum_op, world, "overlap")
    dist.destroy_process_group()
    return used


def test_single_copy_large_tensors(capfd: pytest.CaptureFixture[str]) -> None:
    used = run_ranks(_single_copy, 3, env={"XDEV_DEBUG": "INFO"})
    # Where the host forbids process_vm_readv the staged path runs instead; on the CI machines
    # (same user, no Yama) single copy must really be used.
    assert all(used)
    err = capfd.readouterr().err
    for name in ("reduce_scatter", "all_gather"):
        assert f"{name} on CPU tensors -> native (single copy" in err, err


def _fsdp2_training(rank: int, world: int, backend: str) -> list[float]:
    dist.init_process_group(backend, rank=rank, world_size=world)
    model = sharded_mlp(64, 3, world, torch.device("cpu"))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 + rank))
    losses = sgd_losses(model, x, lr=0.5, steps=4)
    dist.destroy_process_group()
    return losses


def test_fsdp2_training_runs_native_and_matches_gloo(capfd: pytest.CaptureFixture[str]) -> None:
    """FSDP2 (fully_shard) all-gathers parameters and reduce-scatters gradients with AVG."""
    reference_losses = run_ranks(_fsdp2_training, 2, "gloo")
    capfd.readouterr()
    losses = run_ranks(_fsdp2_training, 2, "xdev", env={"XDEV_DEBUG": "INFO"})
    err = capfd.readouterr().err
    assert "reduce_scatter on CPU tensors -> native" in err, err
    assert "all_gather on CPU tensors -> native" in err, err
    for mine, ref in zip(losses, reference_losses):
        assert mine == pytest.approx(ref, rel=1e-6), (losses, reference_losses)
