"""ReduceOp.PREMUL_SUM on CPU tensors: NCCL's premultiplied sum, which Gloo lacks.

FSDP2 asks for it in its gradient reduce-scatter after ``set_gradient_divide_factor`` (a
factor other than the shard group's size, such as 1.0 for a sum). xdev multiplies every input
by the factor and runs a SUM on whatever path the call takes (native, two levels, or Gloo).

Each form (all_reduce, all_reduce_coalesced, reduce_scatter_tensor, its coalesced form, the list
reduce_scatter, reduce to every root) is checked against a reference computed here (every rank's
input times the factor, summed in float64) and bitwise against xdev's own SUM of inputs the test
scaled itself: the same sums in the same order. Inputs that must stay unchanged do. A float factor and a tensor factor both work; integer tensors
get a ValueError that names the fix, and the group goes on; where only one rank's tensors are
refused, every rank fails at that call, whatever path its SUM takes. FSDP2 with a divide factor of 1.0
and the learning rate divided by the world size trains as FSDP2 on Gloo does with its default
average.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager
from torch.distributed.tensor import DTensor

import torch_xdev
from collective_cases import check_close, make_input, reference
from harness import run_ranks
from training_cases import sgd_losses, sharded_mlp

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
FACTOR = 0.375  # exact in every float dtype, so the factor itself adds no rounding
NUMEL = 1021  # a block per rank; odd, and past one 4 KiB staging window in float64
SMALL_SLOT = 4096


def _premul(factor: Any) -> Any:
    return dist._make_nccl_premul_sum(factor)


def _scaled(inputs: list[torch.Tensor], factor: float) -> list[torch.Tensor]:
    return [t * factor for t in inputs]


def _forms(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group(
        "xdev",
        rank=rank,
        world_size=world,
        pg_options=torch_xdev.Options(shm_slot_bytes=SMALL_SLOT),
    )
    sum_op = dist.ReduceOp.SUM
    cases = 0
    paths: set[str] = set()  # where the PREMUL_SUMs ran: "allreduce: <plan and reason>", ...
    for d, dtype in enumerate(DTYPES):
        for factor_kind in ("float", "tensor"):
            op = _premul(FACTOR if factor_kind == "float" else torch.tensor(FACTOR, dtype=dtype))
            seed = 100 * d + (factor_kind == "tensor")
            inputs = [make_input(seed, r, world * NUMEL, dtype, sum_op) for r in range(world)]
            scaled = _scaled(inputs, FACTOR)
            expected = reference(scaled, sum_op)
            mine = slice(rank * NUMEL, (rank + 1) * NUMEL)
            what = f"{dtype} factor as {factor_kind}"

            got = inputs[rank].clone()
            dist.all_reduce(got, op=op)
            paths.add("allreduce: " + " ".join(torch_xdev.describe()["last_allreduce"]))
            check_close(got, expected, sum_op, world, f"all_reduce {what}")
            own_sum = scaled[rank].clone()
            dist.all_reduce(own_sum, op=sum_op)
            assert torch.equal(got, own_sum), f"all_reduce {what}: not xdev's SUM of scaled inputs"

            pair = [inputs[rank][:NUMEL].clone(), inputs[rank][NUMEL:].clone()]
            with _coalescing_manager(async_ops=True) as cm:
                for t in pair:
                    dist.all_reduce(t, op=op)
            cm.wait()
            assert torch.equal(torch.cat(pair), got), f"all_reduce coalesced {what}"

            block = torch.empty(NUMEL, dtype=dtype)
            before = inputs[rank].clone()
            dist.reduce_scatter_tensor(block, before, op=op)
            paths.add("reduce_scatter: " + torch_xdev.describe()["last_gather_scatter"][1])
            assert torch.equal(before, inputs[rank]), f"reduce_scatter {what}: input changed"
            check_close(block, expected[mine], sum_op, world, f"reduce_scatter {what}")
            own_block = torch.empty(NUMEL, dtype=dtype)
            dist.reduce_scatter_tensor(own_block, scaled[rank].clone(), op=sum_op)
            assert torch.equal(block, own_block), f"reduce_scatter {what}: not xdev's SUM"

            blocks = [torch.empty(NUMEL, dtype=dtype) for _ in range(2)]
            with _coalescing_manager(async_ops=True) as cm:
                for b in blocks:
                    dist.reduce_scatter_tensor(b, inputs[rank].clone(), op=op)
            cm.wait()
            for b in blocks:
                assert torch.equal(b, block), f"reduce_scatter coalesced {what}"

            for root in range(world):
                reduced, own_reduced = inputs[rank].clone(), scaled[rank].clone()
                dist.reduce(reduced, dst=root, op=op)
                dist.reduce(own_reduced, dst=root, op=sum_op)  # Gloo's: its order of sums
                if rank == root:
                    check_close(reduced, expected, sum_op, world, f"reduce to {root} {what}")
                    assert torch.equal(reduced, own_reduced), f"reduce {what}: not the SUM"
                else:
                    assert torch.equal(reduced, inputs[rank]), f"reduce {what}: input changed"

            listed = torch.empty(NUMEL, dtype=dtype)
            dist.reduce_scatter(listed, list(inputs[rank].clone().chunk(world)), op=op)
            assert torch.equal(listed, block), f"reduce_scatter list {what}"
            cases += 7

    # A factor of 1.0 (FSDP2's divide factor for a sum) is a plain SUM, input unchanged.
    x = make_input(7, rank, world * NUMEL, torch.float32, sum_op)
    summed, ones = x.clone(), x.clone()
    dist.all_reduce(summed)
    dist.all_reduce(ones, op=_premul(1.0))
    assert torch.equal(ones, summed), "PREMUL_SUM(1.0) all_reduce is not the SUM"
    block, sum_block, before = torch.empty(NUMEL), torch.empty(NUMEL), x.clone()
    dist.reduce_scatter_tensor(block, before, op=_premul(1.0))
    dist.reduce_scatter_tensor(sum_block, x.clone())
    assert torch.equal(block, sum_block) and torch.equal(before, x), "PREMUL_SUM(1.0) RS"

    ints = torch.ones(4 * world, dtype=torch.int32)
    with pytest.raises(ValueError, match="floating-point tensors"):
        dist.all_reduce(ints, op=_premul(2.0))
    with pytest.raises(ValueError, match="floating-point tensors"):
        dist.reduce_scatter_tensor(torch.empty(4, dtype=torch.int32), ints, op=_premul(2.0))
    # float8 has no sum on any path (xdev's kernels, Gloo): refused before it is scaled.
    f8 = torch.ones(4 * world).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="Float8_e4m3fn tensors: neither xdev nor Gloo"):
        dist.all_reduce(f8, op=_premul(2.0))
    assert torch.equal(f8.float(), torch.ones(4 * world)), "a refused PREMUL_SUM scaled float8"
    # A coalesced call checks every tensor before it scales any.
    first, bad = torch.ones(8), torch.ones(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="floating-point tensors"):
        with _coalescing_manager():
            dist.all_reduce(first, op=_premul(2.0))
            dist.all_reduce(bad, op=_premul(2.0))
    assert torch.equal(first, torch.ones(8)), "a refused coalesced PREMUL_SUM scaled a tensor"
    after = torch.ones(8) * (rank + 1)
    dist.all_reduce(after)  # the group goes on
    assert torch.equal(after, torch.full((8,), float(world * (world + 1) // 2)))
    dist.destroy_process_group()
    return {"cases": cases, "paths": sorted(paths)}


@pytest.mark.parametrize("world", [2, 3])
def test_premul_sum_forms(world: int) -> None:
    for result in run_ranks(_forms, world):
        assert result["cases"] == len(DTYPES) * 2 * 7, result
        assert all("fallback" not in path for path in result["paths"]), result


def _refused_on_one_rank(rank: int, world: int) -> None:
    # Rank 0's tensor is not floating point, its peers' are: every rank fails at this call,
    # rather than the peers' SUM pairing with rank 0's next call, whatever path the SUM takes.
    dist.init_process_group("xdev", rank=rank, world_size=world)
    for form in ("all_reduce", "reduce_scatter_tensor", "reduce"):
        last_allreduce = torch_xdev.describe()["last_allreduce"]
        lopsided = torch.ones(4 * world, dtype=torch.int64 if rank == 0 else torch.float32)
        with pytest.raises(ValueError) as refused:
            if form == "all_reduce":
                dist.all_reduce(lopsided, op=_premul(2.0))
            elif form == "reduce":
                dist.reduce(lopsided, dst=world - 1, op=_premul(2.0))
            else:
                out = torch.empty(4, dtype=lopsided.dtype)
                dist.reduce_scatter_tensor(out, lopsided, op=_premul(2.0))
        want = "floating-point tensors" if rank == 0 else "refused by another rank"
        assert want in str(refused.value), (form, refused.value)
        # Not the ranks' vote on the refusal (a MAX of one int): the caller's last allreduce.
        assert torch_xdev.describe()["last_allreduce"] == last_allreduce, form
        after = torch.ones(8) * (rank + 1)
        dist.all_reduce(after)  # the group goes on, its calls paired as they should be
        assert torch.equal(after, torch.full((8,), float(world * (world + 1) // 2))), form
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["one host", "fallback", "2x2 fast network", "3+1 hosts"])
def test_a_premul_sum_refused_on_one_rank_fails_every_rank(layout: str, tmp_path: Path) -> None:
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps({"params": {"net_latency_us": 1.0, "net_stream_gbps": 1000.0}}))
    env: list[dict[str, str]] = [{} for _ in range(4)]
    for r in range(4):
        if layout == "fallback":
            env[r]["XDEV_ALGO"] = "fallback"
        elif layout == "2x2 fast network":  # the peers' SUM goes to Gloo's ring
            env[r] |= {"XDEV_HOSTNAME": f"refusal-{r // 2}", "XDEV_CPU_MODEL": str(fast)}
        elif layout == "3+1 hosts":  # no two levels
            env[r]["XDEV_HOSTNAME"] = f"refusal-{int(r == 3)}"
    run_ranks(_refused_on_one_rank, 4, per_rank_env=env, timeout=180)


def test_premul_sum_across_hosts(tmp_path: Path) -> None:
    """Two fake hosts of two ranks: the two-level paths and their Gloo steps run a SUM of the
    premultiplied inputs."""
    # A slow network in the cost model: two levels win at every size on this machine.
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"params": {"net_latency_us": 5000.0}}))
    hosts = [
        {"XDEV_HOSTNAME": f"premul-host-{r // 2}", "XDEV_CPU_MODEL": str(model)} for r in range(4)
    ]
    for result in run_ranks(_forms, 4, per_rank_env=hosts):
        assert result["cases"] == len(DTYPES) * 2 * 7, result
        assert "reduce_scatter: two_level" in result["paths"], result
        allreduces = [p for p in result["paths"] if p.startswith("allreduce")]
        assert allreduces and all("two-level" in p or "two_level" in p for p in allreduces), result


def _fsdp(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    dist.init_process_group("xdev", rank=rank, world_size=world)
    lr, width, layers, steps = 0.05, 24, 3, 4
    gloo_mesh = init_device_mesh("cpu", (world,), backend_override={0: "gloo"})
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(8, width, generator=gen)

    summed = sharded_mlp(width, layers, world, torch.device("cpu"))  # fully_shard over the world
    for module in summed.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # gradients summed: PREMUL_SUM(1.0)
    summed_losses = sgd_losses(summed, x, lr / world, steps)

    averaged = sharded_mlp(width, layers, world, torch.device("cpu"), mesh=gloo_mesh)
    averaged_losses = sgd_losses(averaged, x, lr, steps)
    out = {
        "losses": (summed_losses, averaged_losses),
        "max_diff": max(
            (cast(DTensor, a).to_local() - cast(DTensor, b).to_local()).abs().max().item()
            for a, b in zip(summed.parameters(), averaged.parameters())
        ),
    }
    dist.destroy_process_group()
    return out


def test_fsdp2_gradient_divide_factor() -> None:
    """FSDP2 with set_gradient_divide_factor(1.0) reduce-scatters with PREMUL_SUM(1.0), which
    Gloo refuses; on xdev, with lr / world, it trains as Gloo's default average with lr."""
    for result in run_ranks(_fsdp, 2):
        summed, averaged = result["losses"]
        assert summed == pytest.approx(averaged, rel=1e-5, abs=1e-6)
        assert result["max_diff"] < 1e-5
