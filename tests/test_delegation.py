"""Which calls xdev runs natively and which it hands to its engines (Gloo here), with what
each engine's call returns; monitored_barrier's side group."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist

import torch_xdev
from torch_xdev import _C
from harness import run_ranks


def _selection(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    seen: dict[Any, Any] = {}
    model = torch_xdev.describe()["cpu_cost_model"]
    machine = _C.plan.cpu_machine(
        world,
        os.cpu_count() or 1,
        model["core_gbps"],
        model["memory_gbps"],
        model["launch_us"],
        model["barrier_us"],
        model["window_bytes"],
        model["step_us"],
        model["sleeping_barrier_us"],
    )
    for numel in (16, 1 << 14, 1 << 17):
        dist.all_reduce(torch.ones(numel))
        algorithm, reason = torch_xdev.describe()["last_allreduce"]
        # The model predicts at the power of two at or above the payload (these are powers of two).
        best = _C.plan.choose(machine, numel * 4)["best"]
        seen[numel * 4] = (algorithm, best["algorithm"], reason)
    dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.BAND)  # no native kernel
    seen["band"] = torch_xdev.describe()["last_allreduce"]
    for _ in range(2):
        dist.broadcast(torch.ones(8), src=0)
    c = torch.ones(3, dtype=torch.complex64)
    dist.all_reduce(c)
    assert torch.equal(c, torch.full((3,), float(world), dtype=torch.complex64))
    dist.destroy_process_group()
    return seen


def test_auto_selection_and_unsupported_ops_delegate(capfd: Any) -> None:
    seen = run_ranks(_selection, 2, env={"XDEV_DEBUG": "INFO"})[0]
    for size in (64, 1 << 16, 1 << 19):
        algorithm, model_best, reason = seen[size]
        # auto runs what the cost model, evaluated here independently, predicts fastest.
        assert algorithm == model_best, (size, seen[size])
        assert "predicted" in reason and "next" in reason, reason
    assert seen["band"][0] == "fallback" and "reduce op" in seen["band"][1]
    err = capfd.readouterr().err
    # The plan is logged once per group (not once per call).
    assert err.count("[xdev] group") >= 1
    first, _, reason = seen[64]
    line = f"allreduce on CPU tensors -> {first} ({reason})"
    assert err.count(line) == 2, err  # once per rank, not once per call
    assert "fallback engine: gloo" in err
    assert "CPU allreduce: 1 B -> " in err and ", 1 GiB -> " in err, err
    # Broadcast's choice too, once per rank.
    assert err.count("broadcast -> native (one host: staged through shared memory)") == 2, err


def _delegated(rank: int, world: int) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    x = torch.full((4,), float(rank))
    out = [torch.empty(4) for _ in range(world)]
    dist.all_gather(out, x)
    assert all(torch.equal(o, torch.full((4,), float(r))) for r, o in enumerate(out))
    flat = torch.empty(4 * world)
    dist.all_gather_into_tensor(flat, x)
    assert torch.equal(flat, torch.cat([torch.full((4,), float(r)) for r in range(world)]))
    red = torch.full((3,), float(rank + 1))
    dist.reduce(red, dst=1)
    if rank == 1:
        assert torch.equal(red, torch.full((3,), float(sum(range(1, world + 1)))))
    # AVG: Gloo averages floats itself; integers it cannot write back, so xdev runs a SUM,
    # then the root truncates toward zero, as xdev's allreduce does (-11 / 3 -> -3, not -4).
    values = [-2 - r * r for r in range(world)]
    for dtype in (torch.float32, torch.int32, torch.int64):
        avg = torch.full((5,), values[rank], dtype=dtype)
        dist.reduce(avg, dst=world - 1, op=dist.ReduceOp.AVG)
        same = torch.full((5,), values[rank], dtype=dtype)
        dist.all_reduce(same, op=dist.ReduceOp.AVG)
        if rank == world - 1:
            mean = sum(values) / world
            want = torch.full((5,), mean if dtype.is_floating_point else int(mean), dtype=dtype)
            assert torch.allclose(avg, want) and torch.allclose(same, want), (dtype, avg, same)
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * world) + rank)
    assert torch.equal(rs, torch.arange(2.0 * rank, 2.0 * rank + 2) * world + sum(range(world)))
    a2a = torch.empty(world)
    dist.all_to_all_single(a2a, torch.arange(float(world)) + 10 * rank)
    assert torch.equal(a2a, torch.tensor([10.0 * r + rank for r in range(world)]))
    g = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), g, dst=0)
    if g is not None:
        assert all(torch.equal(t, torch.full((2,), float(r))) for r, t in enumerate(g))
    s = torch.empty(2)
    dist.scatter(
        s, [torch.full((2,), float(r)) for r in range(world)] if rank == 0 else None, src=0
    )
    assert torch.equal(s, torch.full((2,), float(rank)))
    if rank == 0:
        dist.send(torch.arange(3.0), dst=1)
    elif rank == 1:
        r = torch.empty(3)
        dist.recv(r, src=0)
        assert torch.equal(r, torch.arange(3.0))
    # A barrier waits for the collectives handed to Gloo before it, as Gloo's own does: their
    # futures are done, their results written. (xdev watches their futures, not the Works,
    # which it does not hold: Gloo marks the Work itself complete a moment after its future.)
    for _ in range(5):
        big_in = torch.arange(float(world * 50_000)) + rank
        big_out = torch.zeros(world * 50_000)
        work = dist.all_to_all_single(big_out, big_in, async_op=True)
        dist.barrier()
        assert work.get_future().done()
        work.wait()
        expected = torch.cat([torch.arange(50_000.0) + rank * 50_000 + r for r in range(world)])
        assert torch.equal(big_out, expected)
    # Sparse tensors (a sparse embedding's gradients under DDP) go to Gloo, which sums them.
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[rank]]), torch.tensor([float(rank + 1)]), (world,)
    )
    dist.all_reduce(sparse)
    assert torch.equal(sparse.to_dense(), torch.arange(1.0, world + 1))
    assert torch_xdev.describe()["last_allreduce"] == ("fallback", "sparse tensors")
    # c10d's list form: every tensor receives the sum of every tensor of every rank.
    pair = [torch.full((2,), float(rank + 1)), torch.full((2,), 10.0 * (rank + 1))]
    dist.distributed_c10d._get_default_group().allreduce(pair).wait()
    total = 11.0 * sum(range(1, world + 1))
    assert all(torch.equal(t, torch.full((2,), total)) for t in pair), pair
    assert torch_xdev.describe()["last_allreduce"] == (
        "fallback",
        "a list of tensors reduced into one result (c10d's list form)",
    )
    # An AVG that Gloo cannot run (its SUM refuses int16) fails that call only, before the SUM.
    with pytest.raises(TypeError, match="all_reduce of Short tensors"):
        dist.all_reduce(torch.ones(3, dtype=torch.int16), op=dist.ReduceOp.AVG)
    ok = torch.full((3,), float(rank + 1))
    dist.all_reduce(ok)
    assert torch.equal(ok, torch.full((3,), float(sum(range(1, world + 1)))))
    # One whose division has no place to go (the mean of bools is no bool) is refused first.
    with pytest.raises(TypeError, match="AVG of bool tensors"):
        dist.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.AVG)
    dist.all_reduce(ok)
    assert torch.equal(ok, torch.full((3,), float(world * sum(range(1, world + 1)))))
    # Gloo reads and writes a strided tensor as if it were contiguous (its allreduce, reduce
    # and broadcast corrupt the elements between): what xdev hands it is made contiguous.
    sums = torch.arange(30.0) * world + 100.0 * sum(range(world))
    engine_only = dist.new_group(
        backend="xdev", pg_options=torch_xdev.Options(algorithm="fallback")
    )
    for name, call, root in [
        ("all_reduce", lambda v: dist.all_reduce(v, group=engine_only), None),
        ("reduce", lambda v: dist.reduce(v, dst=1), 1),
        ("broadcast", lambda v: dist.broadcast(v, src=1, group=engine_only), 1),
    ]:
        base = torch.arange(30.0) + 100.0 * rank
        want = base.clone()
        if name == "broadcast":
            want[1::3] = (torch.arange(30.0) + 100.0)[1::3]
        elif root is None or rank == root:
            want[1::3] = sums[1::3]
        call(base[1::3])
        if name == "reduce" and rank != root:  # a reduce leaves a non-root's view undefined
            base[1::3] = want[1::3]  # but never touches the elements around it
        assert torch.equal(base, want), (name, base, want)
    # The broadcast gives the allreduce's reason, not a made-up one.
    reasons = {torch_xdev.describe(engine_only)[f"last_{c}"] for c in ("allreduce", "broadcast")}
    assert reasons == {("fallback", "algorithm='fallback' requested")}, reasons
    # Its list reduce-scatter writes a strided output as if it were contiguous too.
    columns = torch.full((4, 2), -1.0)
    pieces = [torch.arange(4.0) + 10 * r + rank for r in range(world)]
    dist.reduce_scatter(columns[:, 1], pieces, group=engine_only)
    want_column = torch.arange(4.0) * world + 10 * rank * world + sum(range(world))
    assert torch.equal(columns[:, 1], want_column), columns
    assert torch.equal(columns[:, 0], torch.full((4,), -1.0)), columns
    # What the engine runs counts in the group's sequence number, as Gloo counts it.
    backend = torch_xdev._registration.backend_of(engine_only)
    before = backend._get_sequence_number_for_group()
    dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world), group=engine_only)
    assert backend._get_sequence_number_for_group() == before + 1
    dist.destroy_process_group(engine_only)
    dist.barrier()
    dist.destroy_process_group()


def test_delegated_collectives() -> None:
    run_ranks(_delegated, 3)


def _monitored_barrier(rank: int, world: int) -> dict[str, str]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    seen: dict[str, str] = {}
    # torch 2.13 accepts monitored_barrier on Gloo groups only (a check of the backend's
    # name); torch 2.14 asks the group's CPU backend, and xdev hands it to its Gloo engine.
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
        seen["plain"] = "passed"
    except ValueError as e:
        seen["plain"] = str(e)
    # The workaround: a Gloo group over the same ranks, beside the xdev one.
    side = dist.new_group(backend="gloo")
    dist.monitored_barrier(group=side, timeout=timedelta(seconds=30), wait_all_ranks=True)
    # And it does its job: rank 1 skips this one on purpose, and rank 0 names it.
    if rank == 0:
        try:
            dist.monitored_barrier(group=side, timeout=timedelta(seconds=2))
        except RuntimeError as e:
            seen["missing"] = str(e)
    dist.barrier()  # rank 1 waits here, on xdev, while rank 0 times out
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((3,), float(sum(range(1, world + 1)))))
    dist.destroy_process_group()
    return seen


def test_monitored_barrier_needs_a_gloo_side_group() -> None:
    seen = run_ranks(_monitored_barrier, 2)
    # Whether the plain call reaches the backend depends on torch's version, not on xdev.
    refused = torch.__version__ < "2.14"  # a TorchVersion: compares as a version
    for r in range(2):
        if refused:
            assert "only implemented for GLOO" in seen[r].get("plain", ""), seen[r]
        else:
            assert seen[r].get("plain") == "passed", seen[r]
    assert "Rank 1 failed to pass monitoredBarrier" in seen[0].get("missing", ""), seen[0]
    assert "missing" not in seen[1]


def _values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    # 40000 + 40000 overflows float16 (its largest is 65504); their mean does not.
    return torch.tensor([40000.0, 1.0, 3.0, -7.25, 0.5, 1e-3] * 2, dtype=dtype) + rank


def _reduced_precision_avg(rank: int, world: int) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    forced = dist.new_group(pg_options=torch_xdev.Options(algorithm="fallback"))
    for dtype in (torch.float16, torch.bfloat16):
        # The mean of the same inputs in float64, rounded once.
        want = torch.stack([_values(r, dtype) for r in range(world)]).double().mean(0).to(dtype)
        block = want.numel() // world
        for group, path in ((None, "native"), (forced, "engine")):
            what = f"{path} AVG of {dtype}"
            summed = _values(rank, dtype)
            dist.all_reduce(summed, op=dist.ReduceOp.AVG, group=group)
            assert torch.equal(summed, want), (what, summed, want)
            scattered = torch.empty(block, dtype=dtype)
            dist.reduce_scatter_tensor(
                scattered, _values(rank, dtype), op=dist.ReduceOp.AVG, group=group
            )
            assert torch.equal(scattered, want[rank * block : (rank + 1) * block]), what
            listed = torch.empty(block, dtype=dtype)
            dist.reduce_scatter(
                listed, list(_values(rank, dtype).chunk(world)), op=dist.ReduceOp.AVG, group=group
            )
            assert torch.equal(listed, want[rank * block : (rank + 1) * block]), what
            reduced = _values(rank, dtype)
            dist.reduce(reduced, dst=0, op=dist.ReduceOp.AVG, group=group)
            if rank == 0:
                assert torch.equal(reduced, want), (what, reduced, want)
    dist.destroy_process_group()


def test_an_average_in_half_precision_is_the_same_on_every_path() -> None:
    # On the engine's path the AVG was a float16 SUM on Gloo, then a division: inf where the
    # native kernels, which add in float32, give the mean.
    run_ranks(_reduced_precision_avg, 2)


def _bool_avg(rank: int, world: int) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    flags = torch.tensor([True, False, rank == 0, rank == 1])
    before = flags.clone()
    out = torch.zeros(flags.numel() // world, dtype=torch.bool)
    calls = {
        "all_reduce": lambda: dist.all_reduce(flags, op=dist.ReduceOp.AVG),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([flags], op=dist.ReduceOp.AVG),
        "reduce": lambda: dist.reduce(flags, dst=0, op=dist.ReduceOp.AVG),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            out, flags, op=dist.ReduceOp.AVG
        ),
        "reduce_scatter": lambda: dist.reduce_scatter(
            out, list(flags.chunk(world)), op=dist.ReduceOp.AVG
        ),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match="AVG of bool tensors has no bool result"):
            call()
        assert torch.equal(flags, before) and not out.any(), name
    # The group stays usable, and MAX is the logical or the message suggests.
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    assert flags.tolist() == [True, False, True, True]
    dist.destroy_process_group()


def test_an_average_of_bool_tensors_is_refused_before_anything_changes() -> None:
    # It went to the engine as a SUM, which overwrote the tensors, and then failed in the
    # division with torch's "result type Float can't be cast to the desired output type Bool".
    run_ranks(_bool_avg, 2)


def _no_engine_for_the_dtype(rank: int, world: int) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    for dtype in (torch.int16, torch.uint32, torch.float8_e4m3fn):
        values = torch.ones(2 * world, dtype=dtype)
        out = torch.zeros(2, dtype=dtype)
        calls = {
            "all_reduce": lambda: dist.all_reduce(values),
            "reduce": lambda: dist.reduce(values, dst=0),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, values),
        }
        for name, call in calls.items():
            # Gloo's own message was "Invalid scalar type".
            with pytest.raises(TypeError, match=f"xdev: {name} of .* convert them"):
                call()
        # A broadcast moves the bytes of any dtype; the group stays usable.
        sent = (torch.arange(2 * world) * (rank + 1)).to(dtype)
        dist.broadcast(sent, src=world - 1)
        assert torch.equal(sent.float(), (torch.arange(2 * world) * world).float()), dtype
    widened = torch.full((3,), rank + 1, dtype=torch.int16).to(torch.int32)
    dist.all_reduce(widened)
    assert widened.tolist() == [sum(range(1, world + 1))] * 3
    dist.destroy_process_group()


def test_reductions_of_a_dtype_neither_xdev_nor_gloo_has_are_refused_naming_it() -> None:
    run_ranks(_no_engine_for_the_dtype, 2)


def _rows(rank: int, count: int, dtype: torch.dtype, width: int = 3) -> torch.Tensor:
    """`count` rows of `width` values that name the sender and the row, in `dtype`."""
    values = torch.arange(count * width).view(count, width) + 100 * rank
    return values.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


def _moving_dtypes_the_engine_lacks(rank: int, world: int) -> list[str]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    on_engine = dist.new_group(pg_options=torch_xdev.Options(algorithm="fallback"))
    failed: list[str] = []
    for dtype in (torch.int16, torch.uint32, torch.float8_e4m3fn, torch.complex64, torch.float32):
        entries = [torch.zeros(2, 3, dtype=dtype) for _ in range(world)]
        dist.gather(_rows(rank, 2, dtype), entries if rank == 0 else None, dst=0)
        if rank == 0 and not all(_same_bits(entries[r], _rows(r, 2, dtype)) for r in range(world)):
            failed.append(f"gather of {dtype}")
        out = torch.zeros(2, 3, dtype=dtype)
        sent = [_rows(10 + r, 2, dtype) for r in range(world)]
        dist.scatter(out, sent if rank == world - 1 else None, src=world - 1)
        if not _same_bits(out, _rows(10 + rank, 2, dtype)):
            failed.append(f"scatter of {dtype}")
        outs = [torch.zeros(1, 3, dtype=dtype) for _ in range(world)]
        dist.all_to_all(outs, [_rows(world * rank + r, 1, dtype) for r in range(world)])
        if not all(_same_bits(outs[r], _rows(world * r + rank, 1, dtype)) for r in range(world)):
            failed.append(f"all_to_all of {dtype}")
        # Rank r sends r + 1 rows to every peer: the split sizes count rows, not bytes.
        splits_in = [rank + 1] * world
        splits_out = [r + 1 for r in range(world)]
        received = torch.zeros(sum(splits_out), 3, dtype=dtype)
        dist.all_to_all_single(
            received, _rows(rank, world * (rank + 1), dtype), splits_out, splits_in
        )
        want = torch.cat(
            [
                _rows(r, world * (r + 1), dtype)[rank * (r + 1) : (rank + 1) * (r + 1)]
                for r in range(world)
            ]
        )
        if not _same_bits(received, want):
            failed.append(f"all_to_all_single of {dtype}")
        # All-gathers run natively on one host; on the engine (a group with one rank per
        # host, or forced there) they move bytes too.
        listed = [torch.zeros(2, 3, dtype=dtype) for _ in range(world)]
        dist.all_gather(listed, _rows(rank, 2, dtype), group=on_engine)
        if not all(_same_bits(listed[r], _rows(r, 2, dtype)) for r in range(world)):
            failed.append(f"all_gather on the engine of {dtype}")
        reshaped = [torch.zeros(3, 2, dtype=dtype) for _ in range(world)]  # one size, other shape
        dist.all_gather(reshaped, _rows(rank, 2, dtype), group=on_engine)
        if not all(_same_bits(reshaped[r], _rows(r, 2, dtype).view(3, 2)) for r in range(world)):
            failed.append(f"all_gather into other shapes on the engine of {dtype}")
        stacked = torch.zeros(2 * world, 3, dtype=dtype)
        dist.all_gather_into_tensor(stacked, _rows(rank, 2, dtype), group=on_engine)
        if not _same_bits(stacked, torch.cat([_rows(r, 2, dtype) for r in range(world)])):
            failed.append(f"all_gather_into_tensor on the engine of {dtype}")
        mine = [_rows(rank, 2, dtype), _rows(rank, 1, dtype, width=5)]
        lists = [[torch.zeros(2, 3, dtype=dtype), torch.zeros(1, 5, dtype=dtype)]]
        lists += [[t.clone() for t in lists[0]] for _ in range(world - 1)]
        dist.all_gather_coalesced(lists, mine, group=on_engine)
        if not all(
            _same_bits(lists[r][0], _rows(r, 2, dtype))
            and _same_bits(lists[r][1], _rows(r, 1, dtype, width=5))
            for r in range(world)
        ):
            failed.append(f"all_gather_coalesced on the engine of {dtype}")
    # Contiguous, but its size-1 dimension has stride 4: viewing it as bytes failed.
    column = (torch.arange(4) + 10 * rank).to(torch.int16).view(1, 4).t()
    gathered = [torch.zeros(4, 1, dtype=torch.int16) for _ in range(world)]
    dist.all_gather(gathered, column, group=on_engine)
    if not all(torch.equal(gathered[r].view(-1), torch.arange(4) + 10 * r) for r in range(world)):
        failed.append("all_gather on the engine of an int16 (1, 4) tensor transposed")
    # A strided output: Gloo wrote it as if it were contiguous, over its neighbours.
    grid = torch.full((4, world), -1.0)
    dist.scatter(
        grid[:, 0], [torch.arange(4.0) + 10 * r for r in range(world)] if rank == 0 else None, src=0
    )
    if not torch.equal(grid[:, 0], torch.arange(4.0) + 10 * rank) or not (grid[:, 1:] == -1).all():
        failed.append(f"scatter into a strided output: {grid.tolist()}")
    dist.all_reduce(torch.ones(3))  # still usable
    dist.destroy_process_group()
    return failed


def test_collectives_that_move_data_on_the_engine_take_every_dtype_and_strided_tensors() -> None:
    # Gather, scatter and all-to-all always run on the engine, whose Gloo said "Invalid scalar
    # type" for int16, uint32, float8 and (gather) complex, as torch's own Gloo groups do.
    for rank, failed in enumerate(run_ranks(_moving_dtypes_the_engine_lacks, 3)):
        assert not failed, (rank, failed)


def _shown(value: Any) -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    """Every tensor in a Work's result or future value, at any depth: dtype, shape, address."""
    if isinstance(value, torch.Tensor):
        return [(value.dtype, tuple(value.shape), value.data_ptr())]
    return [item for element in value for item in _shown(element)]


def _works_show_the_callers_tensors(rank: int, world: int) -> list[str]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    on_engine = dist.new_group(pg_options=torch_xdev.Options(algorithm="fallback"))
    wrong: list[str] = []
    for dtype in (torch.int16, torch.float32):  # as bytes, and as itself
        block = _rows(rank, 2, dtype)
        listed = [torch.zeros(2, 3, dtype=dtype) for _ in range(world)]
        stacked = torch.zeros(2 * world, 3, dtype=dtype)
        scattered = torch.zeros(2, 3, dtype=dtype)
        exchanged = torch.zeros(2 * world, 3, dtype=dtype)
        coalesced = [[torch.zeros(2, 3, dtype=dtype)] for _ in range(world)]
        calls = {
            # name: (the call, the tensors its Work shows, as Gloo shows its own)
            "broadcast": (lambda: dist.broadcast(block, 0, on_engine, async_op=True), [block]),
            "all_gather": (
                lambda: dist.all_gather(listed, block, on_engine, async_op=True),
                listed,
            ),
            "all_gather_into_tensor": (
                lambda: dist.all_gather_into_tensor(stacked, block, on_engine, async_op=True),
                list(stacked.chunk(world)),
            ),
            "all_gather_coalesced": (
                lambda: dist.all_gather_coalesced(coalesced, [block], on_engine, async_op=True),
                [t for entry in coalesced for t in entry],
            ),
            "scatter": (
                lambda: dist.scatter(
                    scattered, [block] * world if rank == 0 else None, 0, on_engine, True
                ),
                [scattered],
            ),
            "all_to_all_single": (
                lambda: dist.all_to_all_single(
                    exchanged, torch.cat([block] * world), group=on_engine, async_op=True
                ),
                [exchanged],
            ),
        }
        for name, (call, outputs) in calls.items():
            work = call()
            want = _shown(outputs)
            if not isinstance(work, dist.Work):  # all_gather_coalesced gives its future
                shown = [("future", work.wait())]
            else:
                assert work is not None
                work.wait()
                shown = [("result()", work.result()), ("future", work.get_future().wait())]
            for what, value in shown:
                if _shown(value) != want:
                    wrong.append(f"{name} of {dtype}: {what} shows {_shown(value)}, not {want}")
    dist.destroy_process_group()
    return wrong


def test_the_engines_works_show_the_callers_tensors_not_their_bytes() -> None:
    # A dtype Gloo lacks goes to it as bytes: result() and the future's value held those byte
    # views (and all_gather_coalesced's, of every dtype) where Gloo shows the caller's tensors.
    for rank, wrong in enumerate(run_ranks(_works_show_the_callers_tensors, 2)):
        assert not wrong, (rank, wrong)


def _wrong_scatter_of_int16(rank: int, world: int) -> str:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    with pytest.raises(ValueError) as info:
        dist.scatter(torch.zeros(3, dtype=torch.int16), [torch.zeros(4, dtype=torch.int16)], 0)
    dist.destroy_process_group()
    return str(info.value)


def test_a_wrong_scatter_of_a_dtype_the_engine_lacks_names_the_callers_sizes() -> None:
    # int16 goes to Gloo as bytes, and Gloo's refusal named the byte views' sizes, "(expected
    # (3, 2), got (4, 2))"; xdev's own check of the root's list now refuses it first.
    (message,) = run_ranks(_wrong_scatter_of_int16, 1)
    assert "input tensor 0 has sizes [4] where this rank's own has [3]" in message, message


def _each_fails_at_once_and_the_calls_after_stay_paired(
    calls: dict[str, Callable[[], Any]],
    world: int,
    judge: Callable[[str, Exception], Optional[str]],
) -> list[str]:
    """Runs each call, which must raise an error `judge` accepts (None) well before the group's
    timeout; an all_reduce after each must then pair with the peers' and sum right."""
    wrong: list[str] = []
    for name, call in calls.items():
        start = time.monotonic()
        try:
            call()
            wrong.append(f"{name}: returned")
        except (TypeError, ValueError, RuntimeError) as error:
            verdict = judge(name, error)
            if verdict is not None:
                wrong.append(f"{name}: {verdict}")
        if time.monotonic() - start > 30:  # met at the call, not at the timeout
            wrong.append(f"{name}: took {time.monotonic() - start:.0f} s")
        # A failed call must not pair with the peers' next one (both gave wrong sums).
        total = torch.full((4,), 10, dtype=torch.int32)
        dist.all_reduce(total)
        if total.tolist() != [10 * world] * 4:
            wrong.append(f"after {name}: the next all_reduce gave {total.tolist()}")
    return wrong


def _one_rank_refuses_a_reduction(rank: int, world: int) -> list[str]:
    dist.init_process_group("xdev", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    odd = rank == 0
    calls = {
        # Rank 0 alone passes what no engine reduces; its peers' call is a valid native one.
        "all_reduce of int16": lambda: dist.all_reduce(
            torch.ones(4, dtype=torch.int16 if odd else torch.int32)
        ),
        "AVG of bool": lambda: dist.all_reduce(
            torch.ones(4, dtype=torch.bool if odd else torch.float32), op=dist.ReduceOp.AVG
        ),
        "reduce_scatter_tensor of int16": lambda: dist.reduce_scatter_tensor(
            torch.zeros(2, dtype=torch.int16 if odd else torch.int32),
            torch.ones(2 * world, dtype=torch.int16 if odd else torch.int32),
        ),
        # Every rank passes it: they all refuse it, together.
        "reduce of uint32 on every rank": lambda: dist.reduce(
            torch.ones(4, dtype=torch.uint32), dst=0
        ),
    }

    def judge(name: str, error: Exception) -> Optional[str]:
        if odd or name.endswith("every rank"):
            return None if isinstance(error, TypeError) else f"{type(error).__name__}: {error}"
        if "rank 0" not in str(error) or "refused its own arguments" not in str(error):
            return f"the peer was told {error}"
        return None

    wrong = _each_fails_at_once_and_the_calls_after_stay_paired(calls, world, judge)
    dist.destroy_process_group()
    return wrong


def test_a_reduction_one_rank_refuses_fails_on_every_rank_and_later_calls_stay_paired() -> None:
    # The refusal raised on rank 0 alone and took no turn: the peers' call paired with rank 0's
    # next one, and both returned wrong sums as successes.
    for rank, wrong in enumerate(run_ranks(_one_rank_refuses_a_reduction, 3)):
        assert not wrong, (rank, wrong)


def _reduces_that_differ(rank: int, world: int) -> list[str]:
    dist.init_process_group("xdev", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    odd = rank == 0
    x = torch.arange(4, dtype=torch.float32) + rank
    calls = {
        "int16 on rank 0": lambda: dist.reduce(
            torch.ones(4, dtype=torch.int16 if odd else torch.int32), dst=0
        ),
        "SUM against MAX": lambda: dist.reduce(
            x.clone(), dst=0, op=dist.ReduceOp.SUM if odd else dist.ReduceOp.MAX
        ),
        "another size": lambda: dist.reduce(torch.ones(5 if odd else 4), dst=0),
        "another root": lambda: dist.reduce(x.clone(), dst=1 if odd else 0),
        "PREMUL_SUM against SUM": lambda: dist.reduce(
            x.clone(),
            dst=0,
            op=dist._make_nccl_premul_sum(2.0) if odd else dist.ReduceOp.SUM,
        ),
    }

    def judge(name: str, error: Exception) -> Optional[str]:
        if name == "int16 on rank 0" and odd:
            return None if isinstance(error, TypeError) else f"{type(error).__name__}: {error}"
        if "mismatch" not in str(error) and "refused its own arguments" not in str(error):
            return f"{type(error).__name__}: {error}"
        return None

    wrong = _each_fails_at_once_and_the_calls_after_stay_paired(calls, world, judge)
    root_sum = x.clone()
    dist.reduce(root_sum, dst=world - 1)
    expected = torch.stack([torch.arange(4, dtype=torch.float32) + r for r in range(world)]).sum(0)
    if rank == world - 1 and not torch.equal(root_sum, expected):
        wrong.append(f"a valid reduce after them gave {root_sum.tolist()}")
    dist.destroy_process_group()
    return wrong


def test_reduces_that_differ_across_ranks_fail_at_once_on_every_rank_and_the_group_stays_usable() -> (
    None
):
    # Gloo's reduce checks nothing across ranks: a refusal on one rank left the peers to time out
    # (and the refusing rank, which waited to meet them, too); another op or root mixed the
    # calls silently; another size aborted the process.
    for rank, wrong in enumerate(run_ranks(_reduces_that_differ, 3)):
        assert not wrong, (rank, wrong)
