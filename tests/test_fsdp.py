"""FSDP2 (``fully_shard``) and HSDP training on xdev, against the same training on Gloo.

Four ranks train one small MLP four times in the same processes, from the same initial weights
on the same per-rank data: FSDP2 over all four ranks, then HSDP on a 2 x 2 DeviceMesh, each
once over xdev groups and once over Gloo groups (the reference). FSDP2 all-gathers parameters
and reduce-scatters gradients (AVG); HSDP reduce-scatters within each replica and allreduces
across replicas. xdev's parameter shards and losses must equal Gloo's within fp32 tolerance;
every rank must hold the same bits of every full parameter (FSDP2) and the replicas the same
bits of each shard (HSDP); and the ``XDEV_DEBUG=INFO`` log must show that xdev ran the
collectives natively on every group.
"""

from __future__ import annotations

import re
from typing import Any, Optional, cast

import numpy
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import torch_xdev  # noqa: F401  (registers the "xdev" backend, in the spawned ranks too)
from harness import run_ranks

STEPS = 3
HIDDEN = 64
OUT = 37  # not a multiple of the shard count: FSDP2 pads the last layer's shards
BATCH = 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, OUT),
    )  # fmt: skip


def _train(mesh: Any, rank: int) -> dict[str, Any]:
    """STEPS of SGD on FSDP2 over ``mesh``; the losses, local shards and full parameters."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, HIDDEN, generator=gen), torch.randn(BATCH, OUT, generator=gen)
        loss = (model(x) - y).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().item())
    # As numpy arrays: pickled by value (tensors would go through shared memory, which a
    # rank that exits first takes with it).
    return {
        "losses": losses,
        "shards": [cast(DTensor, p).to_local().detach().numpy().copy() for p in model.parameters()],
        "full": [
            cast(DTensor, p).full_tensor().detach().numpy().copy() for p in model.parameters()
        ],
    }


def _on_mesh(rank: int, shape: tuple[int, ...]) -> dict[str, Any]:
    """xdev and Gloo training over a mesh of ``shape``; the group names and ranks in xdev's log."""
    from torch.distributed.device_mesh import init_device_mesh

    names: Optional[tuple[str, ...]] = ("replicate", "shard") if len(shape) == 2 else None
    gloo_everywhere: dict[int | str, Any] = {dim: "gloo" for dim in range(len(shape))}
    xdev_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    gloo_mesh = init_device_mesh(
        "cpu", shape, mesh_dim_names=names, backend_override=gloo_everywhere
    )
    groups = [xdev_mesh.get_group(d) for d in range(len(shape))]
    return {
        "xdev": _train(xdev_mesh, rank),
        "gloo": _train(gloo_mesh, rank),
        "groups": [(g.group_name, dist.get_rank(g)) for g in groups],
    }


def _fsdp_and_hsdp(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 over all four ranks, then HSDP on a 2 x 2 mesh, in the same processes."""
    dist.init_process_group("xdev", rank=rank, world_size=world)
    result = {"fsdp": _on_mesh(rank, (world,)), "hsdp": _on_mesh(rank, (2, 2))}
    dist.destroy_process_group()
    return result


def _native_lines(err: str, group: tuple[str, int]) -> str:
    """What xdev logged (XDEV_DEBUG=INFO) for one rank of one group."""
    prefix = f"[xdev] group '{group[0]}' rank {group[1]}: "
    return "\n".join(line for line in err.splitlines() if line.startswith(prefix))


def _check_against_gloo(results: list[dict[str, Any]], what: str) -> None:
    for rank, r in enumerate(results):
        assert r["xdev"]["losses"] == pytest.approx(r["gloo"]["losses"], rel=1e-5), (what, rank)
        for mine, ref in zip(r["xdev"]["shards"], r["gloo"]["shards"]):
            numpy.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-6, err_msg=what)


@pytest.mark.slow
def test_fsdp2_and_hsdp_match_gloo_natively(capfd: pytest.CaptureFixture[str]) -> None:
    results = run_ranks(_fsdp_and_hsdp, 4, env={"XDEV_DEBUG": "INFO"}, timeout=240)
    err = capfd.readouterr().err

    # FSDP2 over four ranks: every rank holds the same bits of every full parameter.
    fsdp = [r["fsdp"] for r in results]
    _check_against_gloo(fsdp, "FSDP2")
    for r in fsdp[1:]:
        for mine, first in zip(r["xdev"]["full"], fsdp[0]["xdev"]["full"]):
            assert numpy.array_equal(mine, first), "FSDP2: ranks differ"
    for r in fsdp:
        lines = _native_lines(err, r["groups"][0])
        assert "reduce_scatter on CPU tensors -> native" in lines, err
        assert "all_gather on CPU tensors -> native" in lines, err

    # HSDP, mesh [[0, 1], [2, 3]]: replicas {0, 1} and {2, 3} (the shard groups), joined by
    # the replicate groups {0, 2} and {1, 3}; ranks r and r + 2 hold the same shard.
    hsdp = [r["hsdp"] for r in results]
    _check_against_gloo(hsdp, "HSDP")
    for rank in (0, 1):
        for mine, other in zip(hsdp[rank]["xdev"]["shards"], hsdp[rank + 2]["xdev"]["shards"]):
            assert numpy.array_equal(mine, other), f"HSDP: replicas differ on shard {rank}"
    for r in hsdp:
        replicate, shard = r["groups"]
        shard_lines = _native_lines(err, shard)
        assert "reduce_scatter on CPU tensors -> native" in shard_lines, err
        assert "all_gather on CPU tensors -> native" in shard_lines, err
        assert re.search(
            r"allreduce on CPU tensors -> (?!fallback)", _native_lines(err, replicate)
        ), err
