"""Tensor parallelism and functional collectives on an xdev group (CPU tensors).

PyTorch's tensor parallelism (``parallelize_module``), DTensor's redistribution and the
functional collectives (``torch.distributed._functional_collectives``, what compiled code
and DTensor call) reach the backend through c10d's ``_c10d_functional`` ops, not through
``dist.all_reduce``. These tests check that those calls run xdev's native collectives and
give the right numbers:

- ``test_functional_collectives_native_and_exact``: all_reduce (SUM, AVG), all_gather_tensor
  and reduce_scatter_tensor against references every rank computes from every rank's input,
  with ``describe()`` naming a native path (not the fallback engine) after each call.
- ``test_dtensor_redistribute_uneven_shards``: a DTensor sharded unevenly over 3 ranks
  (10 rows: 4, 4, 2) gathered back to a replica, and resharded on the other dimension.
- ``test_tensor_parallel_training_matches_gloo``: a Colwise/Rowwise MLP trained for a few
  SGD steps on xdev and on Gloo: the same losses and the same full parameters within fp32
  tolerance, on every rank.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

import torch_xdev
from harness import run_ranks
from training_cases import sgd_losses

ROWS, COLS = 10, 6  # 10 rows over 3 ranks: shards of 4, 4 and 2


def _input(rank: int, numel: int) -> torch.Tensor:
    """Rank r's input: distinct per rank and per element, exact in fp32 sums."""
    return torch.arange(numel, dtype=torch.float32) * (rank + 1) + 100 * rank


def _assert_native(kind: str) -> None:
    info = torch_xdev.describe()
    if kind == "allreduce":
        algorithm, reason = info["last_allreduce"]
        assert algorithm != "fallback", f"allreduce went to the engine: {reason}"
    else:
        name, path, reason = info["last_gather_scatter"]
        assert name == kind, (name, path, reason)
        assert path != "fallback", f"{kind} went to the engine: {reason}"


def _functional(rank: int, world: int) -> None:
    import torch.distributed._functional_collectives as funcol

    dist.init_process_group("xdev", rank=rank, world_size=world)
    group = dist.group.WORLD
    assert group is not None
    numel = 4 * world + 3
    inputs = [_input(r, numel) for r in range(world)]
    total = torch.stack(inputs).sum(0)

    got = funcol.all_reduce(inputs[rank], "sum", group)
    assert torch.equal(got, total), (got, total)
    _assert_native("allreduce")
    got = funcol.all_reduce(inputs[rank], "avg", group)
    torch.testing.assert_close(got, total / world, rtol=1e-6, atol=0)
    _assert_native("allreduce")

    gathered = funcol.all_gather_tensor(inputs[rank], 0, group)
    assert torch.equal(gathered, torch.cat(inputs)), gathered
    _assert_native("all_gather")

    block = numel  # each rank's input holds `world` blocks of `block` elements
    full = [_input(r, world * block) for r in range(world)]
    scattered = funcol.reduce_scatter_tensor(full[rank], "sum", 0, group)
    want = torch.stack(full).sum(0)[rank * block : (rank + 1) * block]
    assert torch.equal(scattered, want), (scattered, want)
    _assert_native("reduce_scatter")
    dist.destroy_process_group()


def test_functional_collectives_native_and_exact() -> None:
    for world in (2, 3):
        run_ranks(_functional, world)


def _redistribute(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("xdev", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    whole = _input(0, ROWS * COLS).reshape(ROWS, COLS)
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    assert sharded.to_local().shape[0] == [4, 4, 2][rank], sharded.to_local().shape
    assert torch.equal(sharded.redistribute(mesh, [Replicate()]).to_local(), whole)
    by_column = sharded.redistribute(mesh, [Shard(1)])
    assert torch.equal(by_column.full_tensor(), whole)
    dist.destroy_process_group()


def test_dtensor_redistribute_uneven_shards() -> None:
    run_ranks(_redistribute, 3)


def _tp_training(rank: int, world: int, backend: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dist.init_process_group(backend, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 8 * world), torch.nn.ReLU(), torch.nn.Linear(8 * world, 16)
    )
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(7))  # the same on every rank
    losses = sgd_losses(model, x, lr=0.05, steps=4)
    # DTensors: parallelize_module replaced the parameters.
    params = {name: cast(DTensor, p).full_tensor().tolist() for name, p in model.named_parameters()}
    dist.destroy_process_group()
    return {"losses": losses, "params": params}


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_training_matches_gloo(world: int) -> None:
    reference = run_ranks(_tp_training, world, "gloo")
    results = run_ranks(_tp_training, world, "xdev")
    for rank in range(world):
        assert results[rank]["losses"] == pytest.approx(reference[rank]["losses"], rel=1e-5)
        for name, values in reference[rank]["params"].items():
            torch.testing.assert_close(
                torch.tensor(results[rank]["params"][name]),
                torch.tensor(values),
                rtol=1e-5,
                atol=1e-6,
                msg=f"rank {rank} parameter {name}",
            )
    # Every rank holds the same full parameters.
    for rank in range(1, world):
        assert results[rank]["params"] == results[0]["params"], f"rank {rank} differs from rank 0"
