"""The native CUDA reduce-scatter and all-gather (a tensor or a list per side, over CUDA IPC).

- ``test_cuda_gather_scatter_grid``: 2, 3 and 4 ranks x 8 dtypes x 5 ops x block sizes
  (0, 1, 7, 1021, ~2.5 staging slots) with ``cuda_slot_bytes=4096``, so that blocks run in
  several windows. Each reduce-scatter is compared with an independent float64/int64
  reference and, bit for bit, with the same group's CPU reduce-scatter of the same inputs
  (both sum in rank order); each all-gather (every dtype, bool and complex too: it moves
  bytes) with the concatenated inputs. Then the forms FSDP2 uses: the coalesced forms with
  one pair, the all-gather whose input lies inside its output, a non-contiguous output,
  ``async_op`` with ``wait()`` and the list forms (``reduce_scatter``, ``all_gather``,
  strided entries).
- ``test_cuda_gather_scatter_mismatch_and_auto``: a reduce-scatter whose block differs
  between ranks fails on every rank with a clear error, and the group keeps working; with
  algorithm auto, ranks sharing a GPU (no NCCL) run the native path, and the choice is in
  ``describe()["last_gather_scatter"]``.

Rank placement and the skip rule are in cuda_ranks.py.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

import cuda_ranks
import torch_xdev
from collective_cases import ALL_DTYPES, OPS, check_close, make_input, reference
from cuda_ranks import (
    GROUP_TIMEOUT,
    SLOT,
    XDEV_TIMEOUT_S,
    close_group,
    first_cuda_collective,
    run_or_skip,
    setup_rank,
)
from harness import run_ranks
from training_cases import sgd_losses, sharded_mlp

cuda_ranks.skip_module_without_cuda()

BIG = -1  # about 2.5 slots of the dtype: three windows
SIZES = (0, 1, 7, 1021, BIG)
BYTE_DTYPES = (torch.bool, torch.complex64)  # no reduce kernel; an all-gather moves their bytes


def _numel(size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return (5 * SLOT // 2) // elem + 3 if size == BIG else size


def _gather_input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) > 0.5
    if dtype == torch.complex64:
        return torch.randn(numel, 2, generator=g).view(torch.complex64).flatten()
    return make_input(seed, rank, numel, dtype, dist.ReduceOp.SUM)


def _assert_path(group: Any, name: str, what: str) -> None:
    last = torch_xdev.describe(group)["last_gather_scatter"]
    assert last is not None and last[0] == name and last[1] == "cuda", f"{what}: ran {last}"


def _open(rank: int, world: int, algorithm: str) -> tuple[torch.device, Any, dict[str, Any]]:
    device = setup_rank(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    options = torch_xdev.Options(
        algorithm=algorithm, cuda_slot_bytes=SLOT, shm_slot_bytes=SLOT, timeout=XDEV_TIMEOUT_S
    )
    group = dist.new_group(backend="xdev", pg_options=options)
    return device, group, first_cuda_collective(device, group)


def _skip(group: Any, why: str) -> dict[str, Any]:
    close_group(group)
    dist.destroy_process_group()
    return {"skip": why}


def _grid(rank: int, world: int) -> dict[str, Any]:
    device, group, info = _open(rank, world, "flat")
    if not info["transport"]:
        return _skip(group, f"no CUDA transport: {info['transport_note']}")
    started = time.monotonic()
    cases = 0
    for dtype in ALL_DTYPES:
        for op in OPS:
            for size in SIZES:
                numel = _numel(size, dtype)
                seed = zlib.crc32(f"rs {world} {dtype} {op} {numel}".encode())
                inputs = [make_input(seed, r, world * numel, dtype, op) for r in range(world)]
                what = f"reduce_scatter {world} ranks {dtype} {op} block={numel}"
                got = torch.full((numel,), 7, dtype=dtype, device=device)
                dist.reduce_scatter_tensor(got, inputs[rank].to(device), op=op, group=group)
                _assert_path(group, "reduce_scatter", what)
                result = got.cpu()
                mine = slice(rank * numel, (rank + 1) * numel)
                check_close(result, reference(inputs, op)[mine], op, world, what)
                on_cpu = torch.full((numel,), 7, dtype=dtype)
                dist.reduce_scatter_tensor(on_cpu, inputs[rank].clone(), op=op, group=group)
                # Each rank holds its own block: what ties the ranks together is that every
                # block has the bits of the CPU path's, which sums in the same order.
                assert torch.equal(result, on_cpu), f"{what}: not the CPU path's bits"
                cases += 1
    for dtype in ALL_DTYPES + BYTE_DTYPES:
        for size in SIZES:
            numel = _numel(size, dtype)
            parts = [_gather_input(numel + 3, r, numel, dtype) for r in range(world)]
            what = f"all_gather {world} ranks {dtype} block={numel}"
            out = torch.empty(world * numel, dtype=dtype, device=device)
            dist.all_gather_into_tensor(out, parts[rank].to(device), group=group)
            _assert_path(group, "all_gather", what)
            assert torch.equal(out.cpu(), torch.cat(parts)), what
    _forms(rank, world, device, group)
    close_group(group)
    dist.destroy_process_group()
    return {"cases": cases, "seconds": time.monotonic() - started}


def _forms(rank: int, world: int, device: torch.device, group: Any) -> None:
    """The forms FSDP2 and DTensor call, async_op, in place and non-contiguous outputs."""
    n = 1000
    inputs = [make_input(41, r, world * n, torch.float32, OPS[0]) for r in range(world)]
    expected = reference(inputs, dist.ReduceOp.AVG)[rank * n : (rank + 1) * n]
    # FSDP2's reduce-scatter: AVG, asynchronous, waited on the caller's stream.
    out = torch.empty(n, device=device)
    work = dist.reduce_scatter_tensor(
        out, inputs[rank].to(device), op=dist.ReduceOp.AVG, group=group, async_op=True
    )
    work.wait()
    check_close(out.cpu(), expected, dist.ReduceOp.AVG, world, "async AVG reduce_scatter")
    # The coalesced forms with one pair. No device= (as in the CPU tests): with one, c10d asks
    # the backend's startCoalescing, which xdev, like Gloo, does not offer (supports_coalescing
    # is False); without, it calls the *_tensor_coalesced forms xdev runs.
    outs = [torch.empty(n, device=device)]
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        dist.reduce_scatter_tensor(outs[0], inputs[rank].to(device), group=group)
    cm.wait()
    _assert_path(group, "reduce_scatter", "coalesced reduce_scatter")
    check_close(
        outs[0].cpu(),
        reference(inputs, OPS[0])[rank * n : (rank + 1) * n],
        OPS[0],
        world,
        "coalesced reduce_scatter",
    )
    parts = [_gather_input(43, r, n, torch.bfloat16) for r in range(world)]
    gathered = torch.empty(world * n, dtype=torch.bfloat16, device=device)
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        dist.all_gather_into_tensor(gathered, parts[rank].to(device), group=group)
    cm.wait()
    assert torch.equal(gathered.cpu(), torch.cat(parts)), "coalesced all_gather"
    # FSDP2's all-gather: the input is this rank's block of the output itself.
    full = torch.zeros(world * n, dtype=torch.bfloat16, device=device)
    full[rank * n : (rank + 1) * n] = parts[rank].to(device)
    dist.all_gather_into_tensor(full, full[rank * n : (rank + 1) * n], group=group)
    assert torch.equal(full.cpu(), torch.cat(parts)), "all_gather with its input in its output"
    # Elsewhere in the output (across two blocks), the input is lent as a copy; a
    # reduce-scatter's output inside its input, elsewhere than its own block, is written after.
    straddle = rank * n + n // 2 if rank < world - 1 else rank * n - n // 2
    full = torch.zeros(world * n, dtype=torch.bfloat16, device=device)
    full[straddle : straddle + n] = parts[rank].to(device)
    dist.all_gather_into_tensor(full, full[straddle : straddle + n], group=group)
    assert torch.equal(full.cpu(), torch.cat(parts)), "all_gather from a view across two blocks"
    whole = inputs[rank].to(device)
    dist.reduce_scatter_tensor(whole[straddle : straddle + n], whole, group=group)
    check_close(
        whole[straddle : straddle + n].cpu(),
        reference(inputs, OPS[0])[rank * n : (rank + 1) * n],
        OPS[0],
        world,
        "reduce_scatter into its own input, across two blocks",
    )
    # A non-contiguous output (every other element of a larger tensor).
    wide = torch.zeros(2 * n, device=device)
    dist.reduce_scatter_tensor(wide[::2], inputs[rank].to(device), group=group)
    check_close(
        wide[::2].cpu(),
        reference(inputs, OPS[0])[rank * n : (rank + 1) * n],
        OPS[0],
        world,
        "non-contiguous reduce_scatter output",
    )
    assert torch.count_nonzero(wide[1::2]).item() == 0, "wrote outside the strided output"
    # The list forms: packed into one full tensor on the group's stream, unpacked after; the
    # list's entries may be strided (transposed views, written back in place).
    lists = [
        [make_input(47 + j, r, n, torch.float32, OPS[0]) for j in range(world)]
        for r in range(world)
    ]
    got = torch.full((n,), 7.0, device=device)
    dist.reduce_scatter(got, [t.to(device) for t in lists[rank]], group=group)
    _assert_path(group, "reduce_scatter", "list reduce_scatter")
    check_close(
        got.cpu(),
        reference([lists[r][rank] for r in range(world)], OPS[0]),
        OPS[0],
        world,
        "list reduce_scatter",
    )
    blocks = [_gather_input(53, r, 40, torch.int16).view(4, 10) for r in range(world)]
    outs = [torch.full((10, 4), 7, dtype=torch.int16, device=device).t() for _ in range(world)]
    dist.all_gather(outs, blocks[rank].to(device), group=group)
    _assert_path(group, "all_gather", "list all_gather")
    for r in range(world):
        assert torch.equal(outs[r].cpu(), blocks[r]), f"list all_gather, rank {r}'s entry"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cuda_gather_scatter_grid(world: int) -> None:
    results = run_or_skip(_grid, world, timeout=600)
    assert results[0]["cases"] > 0
    print(f"{world} ranks: {results[0]['cases']} cases in {results[0]['seconds']:.1f} s")


def _mismatch_and_auto(rank: int, world: int) -> dict[str, Any]:
    device, group, info = _open(rank, world, "auto")
    if not info["transport"]:
        return _skip(group, f"no CUDA transport: {info['transport_note']}")
    if not info["ranks_share_gpu"]:
        return _skip(group, "every rank has a GPU of its own: auto keeps NCCL for these")
    if info["gpu_time_sliced"]:
        return _skip(group, "the ranks share the GPU without CUDA MPS: auto leaves them to Gloo")
    n = 16 + rank  # a different block on every rank
    out = torch.empty(n, device=device)
    with pytest.raises(dist.DistBackendError, match="mismatched collectives at reduce_scatter"):
        dist.reduce_scatter_tensor(out, torch.ones(world * n, device=device), group=group)
        torch.cuda.synchronize()
    # Arguments only the last rank gets wrong (one element too many): it raises ValueError
    # before anything runs, and the others fail at the same call instead of waiting for it.
    last = rank == world - 1
    for bad_call in [
        lambda: dist.all_gather_into_tensor(
            torch.empty(world * 4 + last, device=device), torch.ones(4, device=device), group=group
        ),
        lambda: dist.reduce_scatter_tensor(
            torch.empty(4, device=device), torch.ones(world * 4 + last, device=device), group=group
        ),
    ]:
        expected: Any = ValueError if last else dist.DistBackendError
        with pytest.raises(expected, match="" if last else "refused its own arguments"):
            bad_call()
            torch.cuda.synchronize()
    # The group is still usable, and auto ran the native path (no NCCL on a shared GPU).
    out = torch.empty(16, device=device)
    dist.reduce_scatter_tensor(out, torch.ones(world * 16, device=device), group=group)
    assert torch.equal(out.cpu(), torch.full((16,), float(world))), out
    _assert_path(group, "reduce_scatter", "auto on a shared GPU")
    close_group(group)
    dist.destroy_process_group()
    return {}


def test_cuda_gather_scatter_mismatch_and_auto() -> None:
    run_or_skip(_mismatch_and_auto, 2, timeout=300)


def _fsdp2(rank: int, world: int, on_cuda: bool) -> dict[str, Any]:
    """Four FSDP2 steps of a small MLP: on CUDA over xdev (its native reduce-scatter and
    all-gather forced), or on CPU over Gloo, the reference."""
    device = setup_rank(rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        options = torch_xdev.Options(algorithm="flat", timeout=XDEV_TIMEOUT_S)
        dist.init_process_group(
            "xdev", rank=rank, world_size=world, timeout=GROUP_TIMEOUT, pg_options=options
        )
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    model = sharded_mlp(64, 3, world, device)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 + rank)).to(device)
    losses = sgd_losses(model, x, lr=0.5, steps=4)
    last = torch_xdev.describe()["last_gather_scatter"] if on_cuda else None
    if on_cuda:
        torch.cuda.synchronize()
    dist.destroy_process_group()
    return {"losses": losses, "last_gather_scatter": last}


def test_cuda_fsdp2_training_runs_native_and_matches_cpu_gloo() -> None:
    """FSDP2 all-gathers parameters and reduce-scatters gradients (AVG) on the GPU through
    xdev's native path; its losses match the same training on CPU over Gloo."""
    reference = run_ranks(_fsdp2, 2, False)
    results = run_ranks(_fsdp2, 2, True, timeout=300)
    for r, result in enumerate(results):
        assert result["last_gather_scatter"][1] == "cuda", result["last_gather_scatter"]
        for mine, ref in zip(result["losses"], reference[r]["losses"]):
            assert mine == pytest.approx(ref, rel=1e-4), (r, result["losses"], reference[r])
