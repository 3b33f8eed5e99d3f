"""Reduce-scatter and all-gather in place from the group's symmetric heap, on real processes.

FSDP2 with ``set_allocate_memory_from_process_group_for_comm(True)`` takes its all-gather
output (the input is this rank's block of it) and its reduce-scatter input and output from the
group's ``allocate_tensor``. Every rank makes the same allocations in the same order, so the
tensors lie at the same place of every rank's heap and the collectives read peers' tensors
where they are mapped, staging nothing. The proof that the in-place path ran is its
XDEV_DEBUG=INFO line, printed by each rank the first time it runs; tensors at different places
(or outside the heap on some rank) are staged, and the results are right either way. A tensor
that fits one staging window is staged too: in place would cost a closing barrier more.
"""

from __future__ import annotations

import re
import weakref
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import torch_xdev  # noqa: F401  (registers the backend)

from collective_cases import check_close, make_input, reference
from harness import run_ranks
from training_cases import sgd_losses

IN_PLACE = {
    name: re.compile(rf"rank (\d+): {name} ran in place from the symmetric heap")
    for name in ("reduce_scatter", "all_gather")
}
STAGED = {
    name: re.compile(rf"rank (\d+): {name}: a tensor of the symmetric heap is not at the same")
    for name in ("reduce_scatter", "all_gather")
}


# A layer's collectives (37 KB) span several staging windows, as a large model's do: one window
# is staged even from the heap (in place would add a closing barrier to save one window's copy).
SMALL_SLOTS = {"XDEV_DEBUG": "INFO", "XDEV_SHM_SLOT_BYTES": "4096"}


def _ranks_logging(pattern: re.Pattern[str], err: str) -> set[int]:
    return {int(m.group(1)) for m in pattern.finditer(err)}


def _heap_tensor(count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    world = dist.group.WORLD
    assert world is not None
    backend = world._get_backend(torch.device("cpu"))
    assert backend.supports_tensor_alloc(torch.device("cpu"))
    return backend.allocate_tensor(count, dtype=dtype, device=torch.device("cpu"))


def _collectives(rank: int, world: int, misplace: bool) -> None:
    """reduce_scatter_tensor and in-place all_gather_into_tensor on heap tensors.

    With ``misplace``, rank 1 allocates an extra block first, so its tensors lie elsewhere.
    """
    dist.init_process_group("xdev", rank=rank, world_size=world)
    held = []  # alive until the group goes: every later block of rank 1 lies past it
    if misplace and rank == 1:
        held.append(_heap_tensor(4096))
    block = 70001  # several staging windows
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        inputs = [make_input(5, r, world * block, torch.float32, op) for r in range(world)]
        full = _heap_tensor(world * block)
        full.copy_(inputs[rank])
        out = _heap_tensor(block)
        dist.reduce_scatter_tensor(out, full, op=op)
        expected = reference(inputs, op)
        mine_expected = expected[rank * block : (rank + 1) * block]
        check_close(out, mine_expected, op, world, f"reduce_scatter {op}")
        # The flat allreduce sums in the same order: its slice is the same bits.
        total = inputs[rank].clone()
        dist.all_reduce(total, op=op)
        assert torch.equal(out, total[rank * block : (rank + 1) * block]), op
        # FSDP's all-gather: the input is this rank's block of the heap output.
        gathered = _heap_tensor(world * block)
        mine = gathered.narrow(0, rank * block, block)
        mine.copy_(out)
        dist.all_gather_into_tensor(gathered, mine)
        check_close(gathered, expected, op, world, f"all_gather after {op}")
        assert torch.equal(gathered, total), op
        del full, out, gathered, mine
    held.clear()
    dist.destroy_process_group()


@pytest.mark.parametrize("misplace", [False, True], ids=["same_place", "different_places"])
def test_heap_tensors_run_in_place_only_where_every_place_agrees(
    misplace: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    run_ranks(_collectives, 2, misplace, env={"XDEV_DEBUG": "INFO"})
    err = capfd.readouterr().err
    for name in ("reduce_scatter", "all_gather"):
        assert _ranks_logging(IN_PLACE[name], err) == (set() if misplace else {0, 1}), err
        assert _ranks_logging(STAGED[name], err) == ({0, 1} if misplace else set()), err


def _fsdp2_training(
    rank: int, world: int, backend: str, alloc_from_group: bool
) -> dict[str, list[Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(4)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():  # each call sets it for that module's own parameters
        if isinstance(module, FSDPModule):
            module.set_allocate_memory_from_process_group_for_comm(alloc_from_group)
    x = torch.randn(32, 96, generator=torch.Generator().manual_seed(100 + rank))
    losses = sgd_losses(model, x, lr=0.2, steps=5)
    # Plain lists: a tensor would travel back through shared memory the exiting rank owns.
    params = [cast(DTensor, p).full_tensor().tolist() for p in model.parameters()]
    dist.destroy_process_group()
    return {"losses": losses, "params": params}


def test_fsdp2_with_group_allocated_buffers_runs_in_place_and_matches_gloo(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """FSDP2 training, buffers from the group: in place on every rank, same model as Gloo."""
    reference = run_ranks(_fsdp2_training, 2, "gloo", True)
    capfd.readouterr()
    got = run_ranks(_fsdp2_training, 2, "xdev", True, env=SMALL_SLOTS)
    err = capfd.readouterr().err
    for name in ("reduce_scatter", "all_gather"):
        assert _ranks_logging(IN_PLACE[name], err) == {0, 1}, err
        # FSDP allocates alike on every rank: no call found the places differing.
        assert _ranks_logging(STAGED[name], err) == set(), err
    for rank in range(2):
        ref, mine = reference[rank], got[rank]
        assert mine["losses"] == pytest.approx(ref["losses"], rel=1e-5), (mine, ref)
        for p, q in zip(mine["params"], ref["params"]):
            torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-5, atol=1e-6)
    # Every rank holds the same model, bit for bit.
    assert got[0]["params"] == got[1]["params"]


def test_fsdp2_without_group_allocated_buffers_stages(capfd: pytest.CaptureFixture[str]) -> None:
    """The same training with FSDP's own buffers: native, staged, never in place."""
    run_ranks(_fsdp2_training, 2, "xdev", False, env=SMALL_SLOTS)
    err = capfd.readouterr().err
    assert "reduce_scatter on CPU tensors -> native" in err, err
    assert "all_gather on CPU tensors -> native" in err, err
    for name in ("reduce_scatter", "all_gather"):
        assert _ranks_logging(IN_PLACE[name], err) == set(), err


def _use_count(t: torch.Tensor) -> int:
    """References to the tensor's C++ object (Python's one among them); torch's stubs omit it."""
    return int(t._use_count())  # type: ignore[attr-defined]


def _freed_once_waited(rank: int, world: int) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    block = 1024
    # The Work lingered on the worker about once in 50 calls: enough calls to see it.
    for i in range(400):
        out = _heap_tensor(world * block)
        lent = torch.full((block,), float(rank + i))
        lent_alive = weakref.ref(lent)  # alive while anything, Python or C++, holds the tensor
        work = dist.all_gather_into_tensor(out, lent, async_op=True)
        del lent  # the call holds its last reference now
        assert work is not None
        work.wait()
        # wait() returns once the group's worker has let go of the call's tensors. It used to
        # let go after waking the waiter, and a tensor whose Python object lives on needs the
        # GIL to go, which this thread holds once wait() returns: so what a rank dropped after
        # wait() went a moment later on one rank than on another, and its peers' next heap
        # allocations landed elsewhere.
        assert lent_alive() is None, i
        want = torch.arange(world, dtype=torch.float32).repeat_interleave(block) + i
        assert torch.equal(out, want), i
        # Nor does the worker keep the Work (whose result holds `out`): once the caller drops
        # it, `out` is this frame's alone, and freeing it returns its block at once.
        del work
        assert _use_count(out) == 1, (i, _use_count(out))
        work = dist.all_reduce(out, async_op=True)
        assert work is not None
        work.wait()
        del work
        assert _use_count(out) == 1, (i, _use_count(out))
    dist.destroy_process_group()


def test_the_worker_lets_go_of_a_calls_tensors_before_wait_returns() -> None:
    run_ranks(_freed_once_waited, 2)
