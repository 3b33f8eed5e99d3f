"""Two-level collectives of tensors from each host's symmetric heap, on fake hosts: DDP's buckets
(allreduce) and FSDP2's all-gather outputs and reduce-scatter inputs.

On several hosts each host's ranks share a symmetric heap, so ``allocateTensor`` (what DDP
calls for its gradient buckets) works there too, and the reduce-scatter and all-gather inside
a host read the local peers' tensors in place instead of staging them, where staging would
take two windows or more. The sums are taken in the same order either way, so a heap tensor's
result must be bitwise the result of an ordinary tensor with the same inputs, and right
against an independent reference. A rank whose tensor lies elsewhere in its heap (it
allocated in another order) makes every rank of its host stage, with the right result. The
same holds for reduce_scatter_tensor and all_gather_into_tensor across hosts, and FSDP2
training with its buffers from the group trains the model FSDP2 on Gloo trains.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torch_xdev
from collective_cases import assert_same_digests, check_close, digest, make_input, reference
from harness import run_ranks
from test_fsdp_in_place import _fsdp2_training
from test_two_level import _ddp_steps, _hosts_env
from test_two_level_gather_scatter import _input, _reduce_reference, _slow_network_model

SMALL_SLOT = 4096  # bytes per slot: 70001 elements span many windows, 101 fit in one
SIZES = (101, 70001)
CASES = [
    (torch.float32, dist.ReduceOp.SUM),
    (torch.float32, dist.ReduceOp.AVG),
    (torch.float64, dist.ReduceOp.MAX),
    (torch.int32, dist.ReduceOp.SUM),
]
IN_PLACE = re.compile(r"rank (\d+): two-level (reduce-scatter|all-gather) inside the host ran in")
STAGED = re.compile(r"rank (\d+): two-level (reduce-scatter|all-gather): a tensor of the host's")
GS_IN_PLACE = re.compile(
    r"rank (\d+): two-level (reduce_scatter|all_gather) inside the host ran in"
)
GS_STAGED = re.compile(r"rank (\d+): two-level (reduce_scatter|all_gather): a tensor of the host's")


def _check_steps_by_host(
    err: str, in_place_line: re.Pattern[str], staged_line: re.Pattern[str], misplace: bool
) -> None:
    """Which ranks logged both steps inside the host (group 2 of each pattern) in place, and
    which staged: every rank in place, or with `misplace` rank 1's host (ranks 0 and 1) staged
    and the other host still in place."""
    in_place = {(int(m[1]), m[2]) for m in in_place_line.finditer(err)}
    staged = {(int(m[1]), m[2]) for m in staged_line.finditer(err)}
    steps = {m[2] for m in in_place_line.finditer(err)} | {m[2] for m in staged_line.finditer(err)}
    assert len(steps) == 2, err
    if misplace:
        assert staged == {(r, s) for r in (0, 1) for s in steps}, err
        assert in_place == {(r, s) for r in (2, 3) for s in steps}, err
    else:
        assert in_place == {(r, s) for r in range(4) for s in steps}, err
        assert not staged, err


def _heap_allreduce(rank: int, world: int, misplace: bool) -> list[int]:
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the checker's group
    group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(shm_slot_bytes=SMALL_SLOT))
    info = torch_xdev.describe(group)
    assert info["num_hosts"] == 2 and info["ddp_shared_buckets"], info
    backend = group._get_backend(torch.device("cpu"))
    assert backend.supports_tensor_alloc(torch.device("cpu"))
    cpu = torch.device("cpu")
    keep = []
    if misplace and rank == 1:  # every later block of rank 1 lies past this one
        keep.append(backend.allocate_tensor(4096, dtype=torch.uint8, device=cpu))
    digests = []
    for c, (dtype, op) in enumerate(CASES):
        for numel in SIZES:
            seed = c * 1000 + numel
            inputs = [make_input(seed, r, numel, dtype, op) for r in range(world)]
            heap = backend.allocate_tensor(numel, dtype=dtype, device=cpu)
            heap.copy_(inputs[rank])
            ordinary = inputs[rank].clone()
            dist.all_reduce(heap, op=op, group=group)
            dist.all_reduce(ordinary, op=op, group=group)
            what = f"{dtype} {op} n={numel}"
            assert "two-level" in torch_xdev.describe(group)["last_allreduce"][1], what
            check_close(heap, reference(inputs, op), op, world, what)
            assert torch.equal(heap, ordinary), f"{what}: heap result differs from staged"
            digests.append(digest(heap))
            del heap
    assert_same_digests(digests, world)
    # The heap counts both steps inside the host of each multi-window allreduce (one window
    # is staged without an offer): in place, or staged on the host whose places differ.
    counts = torch_xdev.describe(group)["symmetric_heap"]
    offered = 2 * len(CASES)
    staged = misplace and rank in (0, 1)
    expected = (0, offered) if staged else (offered, 0)
    assert (counts["in_place_collectives"], counts["staged_collectives"]) == expected, counts
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    return digests


@pytest.mark.parametrize("misplace", [False, True], ids=["same-place", "rank1-elsewhere"])
def test_heap_tensors_reduce_in_place_inside_each_host(
    misplace: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    env = [dict(e, XDEV_DEBUG="INFO") for e in _hosts_env([2, 2])]
    run_ranks(_heap_allreduce, 4, misplace, per_rank_env=env)
    _check_steps_by_host(capfd.readouterr().err, IN_PLACE, STAGED, misplace)


def test_ddp_buckets_in_each_hosts_heap_match_gloo(capfd: pytest.CaptureFixture[str]) -> None:
    # Small slots: DDP's 20 KB buckets then take several windows, so they run in place.
    env = [dict(e, XDEV_DEBUG="INFO", XDEV_SHM_SLOT_BYTES="4096") for e in _hosts_env([2, 2])]
    xdev = run_ranks(_ddp_steps, 4, "xdev", 0.02, per_rank_env=env)
    err = capfd.readouterr().err
    gloo = run_ranks(_ddp_steps, 4, "gloo", 0.02)
    assert all(result["shared"] for result in xdev), [result["shared"] for result in xdev]
    assert "allocateTensor" in err, err  # DDP took its buckets from the heap
    assert {int(m[1]) for m in IN_PLACE.finditer(err)} == {0, 1, 2, 3}, err
    for rank in range(4):
        for got, ref, first in zip(xdev[rank]["params"], gloo[rank]["params"], xdev[0]["params"]):
            assert got == first, f"rank {rank} differs from rank 0"
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)


# Elements per rank's block: 1531 spans several 4 KiB slots and rides in the exchange of calls
# across hosts; 17011 goes by Gloo; 7 fits one slot, so it is staged even from the heap.
GS_BLOCKS = (7, 1531, 17011)
GS_CASES = [
    (torch.float32, dist.ReduceOp.SUM),
    (torch.float32, dist.ReduceOp.AVG),
    (torch.int32, dist.ReduceOp.SUM),
]


def _heap_gather_scatter(rank: int, world: int, misplace: bool) -> None:
    """FSDP2's pattern across hosts: reduce_scatter_tensor from a heap input into a heap output,
    then all_gather_into_tensor into a heap output whose block `rank` is the input."""
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the checker's group
    group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(shm_slot_bytes=SMALL_SLOT))
    backend = group._get_backend(torch.device("cpu"))
    cpu = torch.device("cpu")
    keep = []
    if misplace and rank == 1:  # every later block of rank 1 lies past this one
        keep.append(backend.allocate_tensor(4096, dtype=torch.uint8, device=cpu))
    digests = []
    for block in GS_BLOCKS:
        for c, (dtype, op) in enumerate(GS_CASES):
            what = f"{dtype} {op} block={block}"
            full = [_input(c * 100 + block, r, world * block, dtype) for r in range(world)]
            expected = _reduce_reference(full, op, world)
            heap_in = backend.allocate_tensor(world * block, dtype=dtype, device=cpu)
            heap_in.copy_(full[rank])
            heap_out = backend.allocate_tensor(block, dtype=dtype, device=cpu)
            dist.reduce_scatter_tensor(heap_out, heap_in, op=op, group=group)
            assert torch_xdev.describe(group)["last_gather_scatter"][1] == "two_level", what
            mine = expected[rank * block : (rank + 1) * block]
            assert torch.equal(heap_out, mine), f"{what}: reduce_scatter"
            ordinary = torch.empty(block, dtype=dtype)
            dist.reduce_scatter_tensor(ordinary, full[rank].clone(), op=op, group=group)
            assert torch.equal(heap_out, ordinary), f"{what}: heap result differs from staged"
            gathered = backend.allocate_tensor(world * block, dtype=dtype, device=cpu)
            gathered.fill_(-7)
            own = gathered.narrow(0, rank * block, block)
            own.copy_(heap_out)
            dist.all_gather_into_tensor(gathered, own, group=group)
            assert torch.equal(gathered, expected), f"{what}: all_gather"
            digests.append(digest(gathered))
            del heap_in, heap_out, gathered, own
    assert_same_digests(digests, world)
    dist.destroy_process_group(group)
    dist.destroy_process_group()


@pytest.mark.parametrize("misplace", [False, True], ids=["same-place", "rank1-elsewhere"])
def test_heap_gather_scatter_in_place_inside_each_host(
    misplace: bool, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = _slow_network_model(tmp_path)  # two levels at every size
    env = [dict(e, XDEV_DEBUG="INFO", XDEV_CPU_MODEL=model) for e in _hosts_env([2, 2])]
    run_ranks(_heap_gather_scatter, 4, misplace, per_rank_env=env, timeout=300)
    _check_steps_by_host(capfd.readouterr().err, GS_IN_PLACE, GS_STAGED, misplace)


def test_fsdp2_across_hosts_with_group_allocated_buffers_matches_gloo(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """FSDP2 over 2 fake hosts x 2 ranks, its buffers from the group: two levels, in place inside
    each host, the same model as FSDP2 on Gloo and the same bits on every rank."""
    reference = run_ranks(_fsdp2_training, 4, "gloo", True)
    capfd.readouterr()
    # Two levels at every size, every rank crossing hosts (the leader form, which would take
    # these 37 KB collectives, stages them). Small slots: a layer's collectives then take
    # several windows, so they run in place.
    model = _slow_network_model(tmp_path, host_cores=64)
    env = [
        dict(e, XDEV_DEBUG="INFO", XDEV_CPU_MODEL=model, XDEV_SHM_SLOT_BYTES="4096")
        for e in _hosts_env([2, 2])
    ]
    got = run_ranks(_fsdp2_training, 4, "xdev", True, per_rank_env=env, timeout=300)
    _check_steps_by_host(capfd.readouterr().err, GS_IN_PLACE, GS_STAGED, misplace=False)
    for rank in range(4):
        ref, mine = reference[rank], got[rank]
        assert mine["losses"] == pytest.approx(ref["losses"], rel=1e-5), (mine, ref)
        for p, q in zip(mine["params"], ref["params"]):
            torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-5, atol=1e-6)
        assert mine["params"] == got[0]["params"], f"rank {rank} differs from rank 0"
