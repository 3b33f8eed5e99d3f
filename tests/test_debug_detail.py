"""backend="xdev" under TORCH_DISTRIBUTED_DEBUG=DETAIL.

With DETAIL, c10d wraps every new group's backend in its ProcessGroupWrapper, which asks the
backend for sequence numbers and, before each collective, compares the collective's
fingerprint (op, sequence number, dtypes, devices, shapes) across ranks through a helper Gloo
group. The ranks here get the variable in their environment from the start, as a user who
exports it would: torch reads it when torch.distributed is imported.
"""

from __future__ import annotations

import gc
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _ProcessGroupWrapper
from torch.nn.parallel import DistributedDataParallel

import torch_xdev
from collective_cases import check_close, make_input, reference
from harness import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import ddp_train  # noqa: E402  (examples/ is not a package)

WORLD = 2
TIMEOUT = timedelta(seconds=60)  # a hung collective fails instead of hanging
MISMATCH = "Detected mismatch between collectives on ranks"  # ProcessGroupWrapper's words


@pytest.fixture(autouse=True)
def detail_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Spawned ranks inherit it, so it is set before they import torch.
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    for _, variable, _ in torch_xdev.ENV_KNOBS:
        monkeypatch.delenv(variable, raising=False)


def _checked_group(group: Any) -> Any:
    """The XdevBackend of ``group``, after asserting that c10d wrapped it for DETAIL checks."""
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL
    wrapper = group._get_backend(torch.device("cpu"))
    assert isinstance(wrapper, _ProcessGroupWrapper), type(wrapper)
    backend = torch_xdev.backend_of(group)
    assert isinstance(backend, torch_xdev._C.XdevBackend), type(backend)
    return backend


def _collectives(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("xdev", rank=rank, world_size=world, timeout=TIMEOUT)
    world_backend = _checked_group(dist.group.WORLD)
    group = dist.new_group(backend="xdev", timeout=TIMEOUT)
    backend = _checked_group(group)
    assert backend is not world_backend
    results: dict[str, Any] = {}
    seqs = [backend._get_sequence_number_for_group()]
    # Native allreduce on both groups, against a reference every rank computes itself.
    for name, g in (("world", None), ("group", group)):
        inputs = [make_input(7, r, 1000, torch.float32, dist.ReduceOp.SUM) for r in range(world)]
        got = inputs[rank].clone()
        dist.all_reduce(got, group=g)
        check_close(got, reference(inputs, dist.ReduceOp.SUM), dist.ReduceOp.SUM, world, name)
    seqs.append(backend._get_sequence_number_for_group())
    # Native broadcast, then an all_gather (list form, native as well) and a barrier.
    sent = torch.arange(10, dtype=torch.float64) * 3
    data = sent.clone() if rank == 1 else torch.zeros(10, dtype=torch.float64)
    dist.broadcast(data, src=1, group=group)
    assert torch.equal(data, sent)
    seqs.append(backend._get_sequence_number_for_group())
    gathered = [torch.empty(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.full((3,), 10 + rank, dtype=torch.int64), group=group)
    assert [t.tolist() for t in gathered] == [[10 + r] * 3 for r in range(world)]
    dist.barrier(group=group)
    seqs.append(backend._get_sequence_number_for_group())
    results["seqs"] = seqs
    results["world_seq"] = world_backend._get_sequence_number_for_group()
    results["last_allreduce"] = torch_xdev.describe(group)["last_allreduce"]
    dist.destroy_process_group()
    return results


@pytest.mark.slow
def test_collectives_under_detail() -> None:
    results = run_ranks(_collectives, WORLD, timeout=180)
    for rank, r in enumerate(results):
        # One allreduce, broadcast, all_gather and barrier on the group; one allreduce on the
        # world. The counts are what the wrapper stamps on each rank's fingerprints.
        assert r["seqs"] == [0, 1, 2, 4], f"rank {rank}: {r['seqs']}"
        assert r["world_seq"] == 1, f"rank {rank}: {r['world_seq']}"
        # describe() reaches the backend inside the wrapper.
        assert r["last_allreduce"] is not None and r["last_allreduce"][0] != "fallback", r


def _mismatches(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("xdev", rank=rank, world_size=world, timeout=TIMEOUT)
    backend = _checked_group(dist.group.WORLD)
    errors: dict[str, str] = {}
    # Different shapes on different ranks.
    try:
        dist.all_reduce(torch.ones(4 + rank))
    except RuntimeError as e:
        errors["shape"] = str(e)
    # An allreduce on one rank against a broadcast on the other.
    try:
        t = torch.ones(6)
        if rank == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=0)
    except RuntimeError as e:
        errors["op"] = str(e)
    # The wrapper stopped both before they reached xdev: none counted, and the group works.
    seq = backend._get_sequence_number_for_group()
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((5,), float(sum(range(1, world + 1)))))
    dist.destroy_process_group()
    return {"errors": errors, "seq": seq}


@pytest.mark.slow
def test_mismatched_collectives_reported_by_wrapper() -> None:
    results = run_ranks(_mismatches, WORLD, timeout=180)
    for rank, r in enumerate(results):
        errors = r["errors"]
        assert set(errors) == {"shape", "op"}, f"rank {rank} raised only for {sorted(errors)}"
        shape = errors["shape"]
        assert MISMATCH in shape, shape
        assert "TensorShape=[4]" in shape and "TensorShape=[5]" in shape, shape
        assert "Tensor shapes" in shape, shape  # the wrapper's list of what differs
        op = errors["op"]
        assert MISMATCH in op, op
        assert "OpType=ALLREDUCE" in op and "OpType=BROADCAST" in op, op
        assert r["seq"] == 0, f"rank {rank}: {r['seq']}"


STEPS = 5
SEED = 11


def _flat(model: torch.nn.Module) -> list[float]:
    # A list, not a tensor: torch's queue hands a tensor over as shared memory that only the
    # child can pass on, and the child may have exited by the time the parent reads it.
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _ddp(rank: int, world: int) -> dict[str, Any]:
    # One store for both runs, each on its own prefix: no server rebinds the port in between.
    port = int(os.environ["MASTER_PORT"])
    base = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=TIMEOUT)
    teacher = ddp_train.make_teacher()
    out: dict[str, Any] = {}
    for backend in ("xdev", "gloo"):
        if backend == "gloo":
            # The reference runs without the checks: in torch 2.13 DDP's logger casts the
            # backend of a "gloo" group to ProcessGroupGloo, which under DETAIL is the wrapper,
            # and crashes. Same sums either way: the wrapper only adds checks.
            dist.set_debug_level(dist.DebugLevel.OFF)
        store = dist.PrefixStore(f"{backend}/", base)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=TIMEOUT)
        if backend == "xdev":
            _checked_group(dist.group.WORLD)
        model = ddp_train.make_model(SEED)
        net = DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(STEPS):
            x, y = ddp_train.make_batch(teacher, SEED, rank, step, 16)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        out[backend] = _flat(model)
        if backend == "xdev":
            out["seq"] = torch_xdev.backend_of()._get_sequence_number_for_group()
        # Free DDP while the group is registered (see examples/ddp_train.py: train()).
        del net, opt
        gc.collect()
        dist.destroy_process_group()
    out["initial"] = _flat(ddp_train.make_model(SEED))
    return out


@pytest.mark.slow
def test_ddp_under_detail_matches_gloo() -> None:
    results = run_ranks(_ddp, WORLD, timeout=240)
    for r in results:
        for key in ("xdev", "gloo", "initial"):
            r[key] = torch.tensor(r[key], dtype=torch.float32)  # float32 -> float -> exact
    for rank, r in enumerate(results):
        assert not torch.equal(r["xdev"], r["initial"]), "training changed nothing"
        # Same sums in a different order: rounding-level differences only (see test_ddp.py).
        torch.testing.assert_close(r["xdev"], r["gloo"], rtol=1e-5, atol=1e-6)
        # Each step allreduces the gradients at least once, through the wrapper's checks.
        assert r["seq"] >= STEPS, r["seq"]
        assert r["seq"] == results[0]["seq"]
        assert torch.equal(r["xdev"], results[0]["xdev"]), f"rank {rank} differs from rank 0"
