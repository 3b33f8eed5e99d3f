"""Allreduce across hosts by the two-level plan, on one machine made to look like several.

XDEV_HOSTNAME gives each rank a host name, so one box holds "hosts" of several ranks. The
grids compare every result with an independent reference computed in the test
(collective_cases.reference) and check that every rank of every host holds the same bits
(checksums compared through a Gloo all_gather). Hosts with different numbers of ranks take
the engine's flat allreduce and say why; a killed rank fails every other rank's call, and
calls whose shapes differ between hosts fail every rank with a message naming them.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import torch_xdev
from collective_cases import (
    assert_same_digests,
    ALL_DTYPES,
    FLOAT_DTYPES,
    OPS,
    check_close,
    check_coalesced,
    digest,
    make_input,
    reference,
)
from harness import run_ranks

# 10007 float64 elements span many 4 KiB slots. Up to 10007 elements every rank's slice rides
# in the exchange of calls across hosts; at 70001 the wider dtypes' slices exceed what it
# carries (64 KiB) and go by Gloo's allreduce.
SIZES = (0, 1, 7, 1021, 10007, 70001)
SMALL_SLOT = 4096


def _hosts_env(ranks_per_host: list[int]) -> list[dict[str, str]]:
    """XDEV_HOSTNAME for each rank: host 0's ranks first, then host 1's, and so on."""
    return [
        {"XDEV_HOSTNAME": f"fake-host-{h}"}
        for h, count in enumerate(ranks_per_host)
        for _ in range(count)
    ]


def _assert_sums(numel: int) -> None:
    """An allreduce of every rank's rank + 1 gives their sum on this rank (after failed calls:
    the group is still usable)."""
    t = torch.full((numel,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    total = float(sum(range(1, dist.get_world_size() + 1)))
    assert torch.equal(t, torch.full((numel,), total))


def _grid(rank: int, world: int, dtypes: tuple[torch.dtype, ...]) -> dict[str, Any]:
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the checker's group
    group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(shm_slot_bytes=SMALL_SLOT))
    info = torch_xdev.describe(group)
    digests: list[int] = []
    plans: set[str] = set()
    for d, dtype in enumerate(dtypes):
        for o, op in enumerate(OPS):
            for numel in SIZES:
                seed = (d * 7 + o) * 100003 + numel
                inputs = [make_input(seed, r, numel, dtype, op) for r in range(world)]
                what = f"{dtype} {op} n={numel}"
                got = inputs[rank].clone()
                dist.all_reduce(got, op=op, group=group)
                check_close(got, reference(inputs, op), op, world, what)
                digests.append(digest(got))
                algorithm, reason = torch_xdev.describe(group)["last_allreduce"]
                two_level = "two-level" in reason and algorithm == "flat"
                # Every native op and dtype, AVG of integers too (a SUM, then a division that
                # truncates as the kernels' does).
                assert two_level, (what, algorithm, reason)
                plans.add(reason)
    # allreduce_coalesced of several shapes: one flat payload, cut the same on every host.
    digests += check_coalesced(group, rank, world, [(5,), (0,), (3, 7), (300,), (2000,)], 500, "")
    # A strided tensor, written back in place.
    base = torch.arange(600, dtype=torch.float32).view(20, 30) * (rank + 1)
    view = base.t()
    dist.all_reduce(view, group=group)
    expected_base = torch.arange(600, dtype=torch.float32).view(20, 30) * sum(range(1, world + 1))
    assert torch.equal(base, expected_base)
    # Same bits on every rank of every host.
    assert_same_digests(digests, world)
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    return {"info": info, "plans": sorted(plans)}


# Each layout's network model (XDEV_CPU_MODEL params; None: the defaults, with this machine's
# cores shared by its fake hosts), and whether payloads that ride whole in the check across
# hosts take the leader form (None: the model's call on this machine). One core per host makes
# the two ranks' messages take turns, so the leader form wins; with a core per rank it does not
# pay. A slow network keeps the 4-rank hosts on two levels at every size.
LAYOUTS = [
    ([2, 2], ALL_DTYPES, {"net_host_cores": 1}, True),
    ([2, 2, 2, 2], (torch.float32,), None, None),
    ([4, 4], FLOAT_DTYPES, {"net_latency_us": 5000.0, "net_host_cores": 64}, False),
]


def _with_model(
    env: list[dict[str, str]], params: dict[str, float], tmp_path: Path
) -> list[dict[str, str]]:
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"params": params}))
    return [{**e, "XDEV_CPU_MODEL": str(model)} for e in env]


@pytest.mark.parametrize(
    "ranks_per_host,dtypes,params,leader",
    LAYOUTS,
    ids=["x".join(map(str, h)) for h, _, _, _ in LAYOUTS],
)
def test_two_level_grid(
    ranks_per_host: list[int],
    dtypes: tuple[torch.dtype, ...],
    params: Optional[dict[str, float]],
    leader: Optional[bool],
    tmp_path: Path,
) -> None:
    world = sum(ranks_per_host)
    env = _hosts_env(ranks_per_host)
    if params is not None:
        env = _with_model(env, params, tmp_path)
    results = run_ranks(_grid, world, dtypes, per_rank_env=env, timeout=600)
    if leader is not None:
        assert any("leader form" in p for p in results[0]["plans"]) == leader, results[0]["plans"]
    info = results[0]["info"]
    assert info["num_hosts"] == len(ranks_per_host)
    assert info["local_world_size"] == ranks_per_host[0]
    # Every fake host runs on this machine: each has its share of the cores.
    assert info["host_cores"] == max(1, (os.cpu_count() or 1) * ranks_per_host[0] // world)
    assert info["two_level"], info["two_level_note"]
    assert not info["shared_memory"]  # no channel of the whole group: it spans hosts


def _uneven(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    _assert_sums(1000)
    info = torch_xdev.describe()
    dist.destroy_process_group()
    return info


def test_hosts_of_different_sizes_take_the_engine_and_say_why() -> None:
    infos = run_ranks(_uneven, 5, per_rank_env=_hosts_env([3, 2]))
    for info in infos:
        assert not info["two_level"]
        assert info["two_level_note"] == "hosts hold different numbers of ranks"
        algorithm, reason = info["last_allreduce"]
        assert algorithm == "fallback" and "different numbers of ranks" in reason, reason


def _half_avg(rank: int, world: int) -> list[str]:
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the checker's group
    group = dist.new_group(backend="xdev")
    plans = []
    # 40000 fits float16 (up to 65504) and so does the average, but no host's sum of it does.
    # 8 elements ride in the exchange of calls across hosts; 200000 go by Gloo.
    for numel in (8, 200_000):
        expected = torch.full((numel,), 40000.0, dtype=torch.float16)
        t = expected.clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
        plans.append(" ".join(torch_xdev.describe(group)["last_allreduce"]))
        assert torch.equal(t, expected), (numel, t[:4])
        out = torch.empty(numel, dtype=torch.float16)
        full = torch.full((numel * world,), 40000.0, dtype=torch.float16)
        dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.AVG, group=group)
        plans.append(" ".join(torch_xdev.describe(group)["last_gather_scatter"]))
        assert torch.equal(out, expected), (numel, out[:4])
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    return plans


def test_float16_average_across_hosts_does_not_overflow() -> None:
    # Each host divides its partial sums by the group's size before they cross hosts, as the
    # native kernels of one host, which sum in float32, give the average that fits.
    for plans in run_ranks(_half_avg, 4, per_rank_env=_hosts_env([2, 2])):
        assert all("two-level" in plan or "two_level" in plan for plan in plans), plans


def _coalesced_dtypes(rank: int, world: int) -> list[str]:
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the checker's group
    group = dist.new_group(backend="xdev")
    plans = []
    # One host runs a coalesced allreduce of several dtypes natively; across hosts it goes to
    # Gloo, whose own coalesced allreduce takes one dtype: xdev calls it once per dtype.
    dtypes = (torch.float32, torch.int64, torch.float64, torch.float32)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        inputs = [
            [make_input(10 + i, r, 1000 + i, dtype, op) for i, dtype in enumerate(dtypes)]
            for r in range(world)
        ]
        mine = [t.clone() for t in inputs[rank]]
        # dist.all_reduce_coalesced refuses several dtypes; c10d's coalescing manager does not.
        with dist.distributed_c10d._coalescing_manager(group=group):
            for t in mine:
                dist.all_reduce(t, op=op, group=group)
        plans.append(" ".join(torch_xdev.describe(group)["last_allreduce"]))
        for i, got in enumerate(mine):
            expected = reference([inputs[r][i] for r in range(world)], op)
            check_close(got, expected, op, world, f"{op} coalesced #{i} ({dtypes[i]})")
    digests = [digest(t) for t in mine]
    assert_same_digests(digests, world)
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    return plans


def test_coalesced_allreduce_of_several_dtypes_across_hosts() -> None:
    for plans in run_ranks(_coalesced_dtypes, 4, per_rank_env=_hosts_env([2, 2])):
        assert all(plan.startswith("fallback") and "dtypes" in plan for plan in plans), plans


def _forced_fallback(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(algorithm="fallback")
    )
    t = torch.ones(10)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((10,), float(world)))
    info = torch_xdev.describe()
    dist.destroy_process_group()
    return info


def test_fallback_still_forces_the_engine() -> None:
    info = run_ranks(_forced_fallback, 4, per_rank_env=_hosts_env([2, 2]))[0]
    assert not info["two_level"] and info["last_allreduce"][0] == "fallback"


def _ddp_steps(rank: int, world: int, backend: str, bucket_cap_mb: float = 0.01) -> dict[str, Any]:
    """Five DDP steps; the parameters, and whether xdev's buckets lay in shared memory."""
    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(5):
        opt.zero_grad()
        ddp(torch.randn(16, 32, generator=g)).square().mean().backward()
        opt.step()
    info = torch_xdev.describe() if backend == "xdev" else None
    assert info is None or "two-level" in info["last_allreduce"][1], info
    dist.destroy_process_group()
    # Plain lists: a tensor would travel through shared memory its process unmaps on exit.
    return {
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "shared": None if info is None else info["ddp_shared_buckets"],
    }


def test_ddp_across_two_hosts_matches_gloo() -> None:
    env = _hosts_env([2, 2])
    xdev = run_ranks(_ddp_steps, 4, "xdev", per_rank_env=env)
    gloo = run_ranks(_ddp_steps, 4, "gloo")
    for rank in range(4):
        assert xdev[rank]["shared"] is True, "DDP's buckets are not in the host's shared memory"
        for got, ref, first in zip(xdev[rank]["params"], gloo[rank]["params"], xdev[0]["params"]):
            assert got == first, f"rank {rank} differs from rank 0"
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)


TIMEOUT_S = 20.0


def _mismatched_across_hosts(rank: int, world: int) -> list[str]:
    """Calls whose shapes differ between hosts fail on every rank, naming the problem."""
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=TIMEOUT_S)
    )
    messages = []
    start = time.monotonic()
    # Rank 3 alone passes another size: its host's channel sees it, the other host's does not.
    t = torch.ones(1000 + (rank == 3))
    with pytest.raises(dist.DistBackendError) as info:
        dist.all_reduce(t)
    messages.append(str(info.value))
    # Both ranks of host 1 agree with each other, not with host 0: only the engine's side sees it.
    t = torch.ones(1000 + 7 * (rank >= 2))
    with pytest.raises(dist.DistBackendError) as info:
        dist.all_reduce(t)
    messages.append(str(info.value))
    # A reduce-scatter, whose first step is inside the host: rank 3 differs from rank 2, so
    # host 1 sends a refusal across hosts, and host 0's ranks fail on it instead of waiting.
    block = 32 + (rank == 3)
    with pytest.raises(dist.DistBackendError) as info:
        dist.reduce_scatter_tensor(torch.empty(block), torch.ones(world * block))
    messages.append(str(info.value))
    # An all-gather, whose first step is the engine's, and a broadcast.
    block = 64 + (rank == 1)
    with pytest.raises(dist.DistBackendError) as info:
        dist.all_gather_into_tensor(torch.empty(world * block), torch.ones(block))
    messages.append(str(info.value))
    with pytest.raises(dist.DistBackendError) as info:
        dist.broadcast(torch.ones(50 if rank < 2 else 60), src=0)
    messages.append(str(info.value))
    # A broadcast whose host 1 disagrees among itself: its local rank 0 refuses across hosts.
    with pytest.raises(dist.DistBackendError) as info:
        dist.broadcast(torch.ones(70 + (rank == 3)), src=1)
    messages.append(str(info.value))
    # AVG on every host's local rank 0, SUM on its local rank 1: each local index agrees across
    # hosts, so only the check inside each host can see it, though an AVG runs as a SUM there.
    op = dist.ReduceOp.AVG if rank % 2 == 0 else dist.ReduceOp.SUM
    for numel in (8, 40000):  # carried in the check across hosts, and sent by the engine
        with pytest.raises(dist.DistBackendError) as info:
            dist.all_reduce(torch.ones(numel), op=op)
        messages.append(str(info.value))
        with pytest.raises(dist.DistBackendError) as info:
            dist.reduce_scatter_tensor(torch.empty(numel), torch.ones(world * numel), op=op)
        messages.append(str(info.value))
    # Hosts that agree among themselves and differ from each other, at a size the engine
    # sends: the check leaves once a host's ranks agree, and travels while they reduce.
    numel = 40000 + 7 * (rank >= 2)
    with pytest.raises(dist.DistBackendError) as info:
        dist.all_reduce(torch.ones(numel))
    messages.append(str(info.value))
    with pytest.raises(dist.DistBackendError) as info:
        dist.reduce_scatter_tensor(torch.empty(numel), torch.ones(world * numel))
    messages.append(str(info.value))
    # Every rank stopped with an error, none waited for the timeout, and the group goes on.
    assert time.monotonic() - start < TIMEOUT_S / 2
    _assert_sums(1000)
    assert "two-level" in torch_xdev.describe()["last_allreduce"][1]
    dist.destroy_process_group()
    return messages


@pytest.mark.parametrize("leader", [False, True], ids=["slices", "leader"])
def test_mismatch_across_hosts_fails_every_rank(leader: bool, tmp_path: Path) -> None:
    # Two levels at every size; the allreduces in the leader form or in slices.
    params = {"net_latency_us": 5000.0, "net_host_cores": 1 if leader else 64}
    env = _with_model(_hosts_env([2, 2]), params, tmp_path)
    results = run_ranks(_mismatched_across_hosts, 4, per_rank_env=env, timeout=180)
    for rank, messages in enumerate(results):
        # In the leader form only local rank 0 (ranks 0 and 2) crosses hosts; its host's other
        # rank learns of a difference through its host's check.
        crossed = not leader or rank % 2 == 0
        calls = ["allreduce", "allreduce", "reduce_scatter", "all_gather", "broadcast", "broadcast"]
        calls += ["allreduce AVG/SUM", "reduce_scatter AVG/SUM"] * 2
        calls += ["allreduce across hosts", "reduce_scatter across hosts"]
        assert len(messages) == len(calls)
        for call, message in zip(calls, messages):
            assert "mismatched collectives" in message, (rank, call, message)
            assert "timed out" not in message, (rank, call, message)
            # Every host holds both ops, so every rank's own host's check names them.
            assert "AVG/SUM" not in call or ("AVG" in message and "SUM" in message), message
        # The allreduce starts inside each host: host 1's ranks see rank 3's call differ from
        # rank 2's and say so; host 0's ranks learn of it from host 1's refusal across hosts.
        # So does the reduce-scatter.
        for first, crossing in ((messages[0], crossed), (messages[2], crossed)):
            if rank >= 2:
                assert "on different hosts" not in first, first
            elif crossing:
                assert "on different hosts" in first and "among themselves" in first, first
            else:
                assert "differs from a rank's on another host" in first, first
        assert rank < 2 or "1001 element(s)" in messages[0], messages[0]
        # Host 1 as a whole differs from host 0: every crossing rank saw both calls.
        if crossed:
            assert "on different hosts" in messages[1] and "1007 element(s)" in messages[1]
        else:
            assert "differs from a rank's on another host" in messages[1], messages[1]
        # At 40007 elements every rank crosses hosts in slices, in either parametrization.
        for message, elements in zip(messages[-2:], ("40007", "160028")):
            assert "on different hosts" in message and f"{elements} element(s)" in message, message
        # In slices the all-gather starts across hosts: local index 1 (ranks 1 and 3)
        # exchanged the differing calls; ranks 0 and 2 learn of it through their host's check.
        # In the leader form it starts inside each host, where host 0's ranks see rank 1's
        # call differ; host 1's leader (rank 2) gets host 0's refusal.
        if leader:
            if rank < 2:
                assert "on different hosts" not in messages[3], messages[3]
            elif rank == 2:
                assert "on different hosts" in messages[3] and "among themselves" in messages[3]
            else:
                assert "differs from a rank's on another host" in messages[3], messages[3]
        elif rank in (1, 3):
            assert "on different hosts" in messages[3], messages[3]
        else:
            assert "differs from a rank's on another host" in messages[3], messages[3]
        # The broadcasts cross hosts from local rank 0 of each host alone, whatever the root.
        if rank in (0, 2):
            assert "on different hosts" in messages[4], messages[4]
        else:
            assert "differs from a rank's on another host" in messages[4], messages[4]
        if rank >= 2:
            assert "284 element(s)" in messages[5], messages[5]  # bytes: 71 floats
        elif rank == 0:
            assert "on different hosts" in messages[5] and "among themselves" in messages[5]
        else:
            assert "differs from a rank's on another host" in messages[5], messages[5]


def _forms_differ_across_hosts(rank: int, world: int) -> list[str]:
    """Host 0 passes a payload small enough for the leader form, host 1 one that is not: local
    rank 1 of host 1 crosses hosts, local rank 1 of host 0 does not, yet no rank waits."""
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=TIMEOUT_S)
    )
    messages = []
    start = time.monotonic()
    large = rank >= 2
    calls = [
        (lambda: dist.all_reduce(torch.ones(100_000 if large else 1000)), "last_allreduce"),
        (
            lambda: dist.all_gather_into_tensor(
                torch.empty(world * (50_000 if large else 100)),
                torch.ones(50_000 if large else 100),
            ),
            "last_gather_scatter",
        ),
    ]
    for call, key in calls:
        with pytest.raises(dist.DistBackendError) as info:
            call()
        messages.append(str(info.value))
        plan = " ".join(torch_xdev.describe()[key])
        assert ("leader form" in plan) == (not large), plan
    assert time.monotonic() - start < TIMEOUT_S / 2
    _assert_sums(1000)
    dist.destroy_process_group()
    return messages


def test_leader_form_against_slices_fails_every_rank(tmp_path: Path) -> None:
    params = {"net_latency_us": 5000.0, "net_host_cores": 1}
    env = _with_model(_hosts_env([2, 2]), params, tmp_path)
    results = run_ranks(_forms_differ_across_hosts, 4, per_rank_env=env, timeout=180)
    for rank, messages in enumerate(results):
        for message in messages:
            assert "mismatched collectives" in message, (rank, message)
            assert "timed out" not in message, (rank, message)


# The ranks that refuse each call of _refusals_across_hosts, in order.
REFUSALS: dict[str, tuple[int, ...]] = {
    # The allreduce starts inside each host: carried across hosts, then sent by the engine.
    "all_reduce": (1,),
    "all_reduce by the engine": (2,),
    # A reduce-scatter starts inside the host; an all-gather in slices across hosts.
    "reduce_scatter": (3,),
    "all_gather": (2,),
    # Refusing ranks on different hosts at different local indices: in slices the all-gather
    # holds each one's local peer in the exchange with the other's until that one's refusal
    # has left, so a refusal waits for its host's check only once it has left.
    "all_gather by two": (0, 3),
    "all_reduce by two": (0, 3),
    "all_gather list": (0,),
    "reduce_scatter list": (1,),
    "all_gather_coalesced": (3,),
    "broadcast": (3,),
    "broadcast root": (1,),
    # Every rank makes the same mistake: each raises its own error, none a mismatch.
    "reduce_scatter everywhere": tuple(range(8)),
}


def _refusals_across_hosts(rank: int, world: int, broadcasts: bool) -> list[tuple[str, str, str]]:
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=TIMEOUT_S)
    )
    outcomes: list[tuple[str, str, str]] = []
    start = time.monotonic()
    one = {name: int(rank in ranks) for name, ranks in REFUSALS.items()}  # 1 where it refuses

    def aliased(numel: int, name: str) -> torch.Tensor:
        """Where this rank refuses, a tensor whose elements share memory (a written one must
        not)."""
        return torch.ones(1).expand(numel) if one[name] else torch.ones(numel)

    calls = {
        "all_reduce": lambda: dist.all_reduce(aliased(1000, "all_reduce")),
        "all_reduce by the engine": lambda: dist.all_reduce(
            aliased(40000, "all_reduce by the engine")
        ),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(
            torch.empty(32 + one["reduce_scatter"]), torch.ones(world * 32)
        ),
        "all_gather": lambda: dist.all_gather_into_tensor(
            torch.empty(world * 64 + one["all_gather"]), torch.ones(64)
        ),
        "all_gather by two": lambda: dist.all_gather_into_tensor(
            torch.empty(world * 64 + one["all_gather by two"]), torch.ones(64)
        ),
        "all_reduce by two": lambda: dist.all_reduce(aliased(40000, "all_reduce by two")),
        "all_gather list": lambda: dist.all_gather(
            [torch.empty(16) for _ in range(world - one["all_gather list"])], torch.ones(16)
        ),
        "reduce_scatter list": lambda: dist.reduce_scatter(
            torch.empty(16), [torch.ones(16) for _ in range(world - one["reduce_scatter list"])]
        ),
        "all_gather_coalesced": lambda: dist.all_gather_coalesced(
            [[torch.empty(8 + one["all_gather_coalesced"] * (r == 0))] for r in range(world)],
            [torch.ones(8)],
        ),
        "broadcast": lambda: dist.broadcast(aliased(1000, "broadcast"), src=0),
        "broadcast root": lambda: dist.broadcast(
            torch.ones(1000), src=world if one["broadcast root"] else 0
        ),
        "reduce_scatter everywhere": lambda: dist.reduce_scatter_tensor(
            torch.empty(33), torch.ones(world * 32)
        ),
    }
    for name, call in calls.items():
        if name.startswith("broadcast") and not broadcasts:
            continue
        try:
            call()
            outcomes.append((name, "ok", ""))
        except ValueError as e:
            outcomes.append((name, "refused", str(e)))
        except dist.DistBackendError as e:
            outcomes.append((name, "error", str(e)))
        _assert_sums(1000)  # the calls after it stay paired, on every rank
        if name.startswith("broadcast"):  # where they run in two levels, not on Gloo's tree
            assert torch_xdev.describe()["last_broadcast"][0] == "two_level"
    assert time.monotonic() - start < TIMEOUT_S / 2, "a rank waited for a peer's timeout"
    dist.destroy_process_group()
    return outcomes


@pytest.mark.parametrize(
    "hosts,leader", [(2, False), (2, True), (4, False)], ids=["2x2-slices", "2x2-leader", "4x2"]
)
def test_a_rank_refusing_its_own_arguments_fails_every_host(
    hosts: int, leader: bool, tmp_path: Path
) -> None:
    """A rank that finds its own arguments wrong still takes its part in the call's checks, in
    its host and across hosts: its peers on every host fail at that call instead of pairing
    their call with its next one, and the group stays usable."""
    params = {"net_latency_us": 5000.0, "net_host_cores": 1 if leader else 64}
    env = _with_model(_hosts_env([2] * hosts), params, tmp_path)
    # With four hosts the model sends broadcasts to Gloo's tree, which checks nothing.
    broadcasts = hosts == 2
    expected = [name for name in REFUSALS if broadcasts or not name.startswith("broadcast")]
    results = run_ranks(
        _refusals_across_hosts, 2 * hosts, broadcasts, per_rank_env=env, timeout=180
    )
    for rank, outcomes in enumerate(results):
        assert [name for name, _, _ in outcomes] == expected
        for name, outcome, message in outcomes:
            if rank in REFUSALS[name]:
                assert outcome == "refused", (rank, name, outcome, message)
                continue
            assert outcome == "error", (rank, name, outcome, message)
            assert "mismatched collectives" in message, (rank, name, message)
            assert "timed out" not in message, (rank, name, message)
            # A refusing rank's host peers meet its refusal in their host's check (with two
            # refusing, a peer may first meet the other's refusal across hosts).
            bad = REFUSALS[name]
            if len(bad) == 1 and bad[0] // 2 == rank // 2:
                assert "it refused its own arguments" in message, (rank, name, message)


def _broadcast_mismatch_then_allreduces(rank: int, world: int) -> list[str]:
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=TIMEOUT_S)
    )
    # Tensors of one element or none are contiguous whatever their stride; their bytes used
    # to be taken with view(), which refuses a stride other than 1, and the group was lost.
    for n in (1, 0):
        strided = torch.full((n, 2), float(rank + 1))[:, 1]
        gathered = torch.empty(world * n)
        dist.all_gather_into_tensor(gathered, strided)
        assert torch.equal(gathered, torch.arange(1.0, world + 1).repeat_interleave(n)), n
        dist.broadcast(strided, src=1)
        assert torch.equal(strided, torch.full((n,), 2.0)), n
    # Host 0 allreduces while host 1 broadcasts, where only one local index crosses hosts: the
    # other one's rank used to skip the exchange, leaving its partner on host 0 one exchange
    # ahead, so that later allreduces paired calls of different steps and gave wrong sums.
    messages = []
    with pytest.raises(dist.DistBackendError) as info:
        if rank < 2:
            dist.all_reduce(torch.ones(1000))
        else:
            dist.broadcast(torch.ones(1000), src=0)
    messages.append(str(info.value))
    # Hosts naming different roots: each used to cross from its root's local index, so the
    # crossing ranks waited for partners that never came until the timeout, and the group
    # was lost. Local rank 0 of every host now crosses, whatever the root.
    with pytest.raises(dist.DistBackendError) as info:
        dist.broadcast(torch.ones(1000), src=0 if rank < 2 else 3)
    messages.append(str(info.value))
    for src in (3, 1):  # roots that are not their host's local rank 0
        got = torch.full((1000,), float(rank))
        dist.broadcast(got, src=src)
        assert torch.equal(got, torch.full((1000,), float(src))), src
    for i in range(3):
        t = torch.full((1000,), float(rank + 1 + 10 * i))
        dist.all_reduce(t)
        want = float(sum(r + 1 + 10 * i for r in range(world)))
        assert torch.equal(t, torch.full((1000,), want)), (i, t[:2], want)
    dist.destroy_process_group()
    return messages


def test_broadcast_against_allreduce_across_hosts_keeps_the_group(tmp_path: Path) -> None:
    params = {"net_latency_us": 5000.0, "net_host_cores": 64}  # two levels at every size
    env = _with_model(_hosts_env([2, 2]), params, tmp_path)
    results = run_ranks(_broadcast_mismatch_then_allreduces, 4, per_rank_env=env, timeout=180)
    for rank, messages in enumerate(results):
        assert all("mismatched collectives" in m for m in messages), (rank, messages)


def _killed_on_one_host(rank: int, world: int, victim: int, numel: int) -> str:
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=TIMEOUT_S)
    )
    dist.all_reduce(torch.ones(1000))  # every channel and engine connection is up
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError) as info:
        dist.all_reduce(torch.ones(numel))
    assert time.monotonic() - start < TIMEOUT_S + 15
    return str(info.value)


@pytest.mark.parametrize("leader", [False, True], ids=["slices", "leader"])
def test_killed_rank_fails_every_rank_of_every_host(leader: bool, tmp_path: Path) -> None:
    # 256 KiB crosses in slices; 4 KiB, with one core per host, in the leader form, where the
    # victim (local rank 1 of host 1) never crosses hosts itself.
    env = _with_model(_hosts_env([2, 2]), {"net_host_cores": 1 if leader else 64}, tmp_path)
    numel = 1024 if leader else 1 << 16
    messages = run_ranks(
        _killed_on_one_host, 4, 3, numel, per_rank_env=env, timeout=180, expect_dead=(3,)
    )
    assert all(m for m in messages[:3]), messages
    # Its host's other rank sees it exit in the host's shared-memory barrier.
    assert "exited" in messages[2] and "group ranks 2, 3" in messages[2], messages[2]
    assert "rank 3 (pid" in messages[2], messages[2]  # the group's rank, not the host's index
    # Host 0's local rank 0 loses its partner across hosts in the engine's exchange of calls:
    # the engine's reason, and what keeps a rank on another host away.
    assert "exchange of calls across hosts failed (" in messages[0], messages[0]
    assert "A rank on another host has exited" in messages[0], messages[0]


def _broadcasts(rank: int, world: int, sizes: tuple[int, ...]) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    for numel in sizes:
        want = torch.arange(numel, dtype=torch.float32) * 3 + 1
        got = want.clone() if rank == 1 else torch.zeros(numel)
        dist.broadcast(got, src=1)
        assert torch.equal(got, want), numel
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "network,sizes,path",
    [
        # The engine's tree crosses a slow network in log2(4) steps, two levels once; 200,000
        # floats do not ride in the check, so the engine's broadcast among the hosts follows.
        ({"net_latency_us": 5000.0, "net_stream_gbps": 0.1}, (1, 5000, 200_000), "two_level"),
        # Sockets with next to no latency: the tree's two steps cost less than the check and
        # the step inside each host (larger payloads cross this host's memory four times
        # through sockets, so there two levels win again).
        ({"net_latency_us": 1.0, "net_stream_gbps": 1000.0}, (1, 5000), "fallback"),
    ],
    ids=["slow-network", "fast-network"],
)
def test_broadcast_across_hosts_follows_the_model(
    network: dict[str, float],
    sizes: tuple[int, ...],
    path: str,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    env = [{**e, "XDEV_DEBUG": "INFO"} for e in _with_model(_hosts_env([2, 2]), network, tmp_path)]
    run_ranks(_broadcasts, 4, sizes, per_rank_env=env)
    err = capfd.readouterr().err
    choices = [line for line in err.splitlines() if "broadcast on CPU tensors ->" in line]
    assert len(choices) == 4 * len(sizes), err  # each rank logs each size class once
    assert all(f"-> {path} (" in line for line in choices), choices


def _one_allreduce(rank: int, world: int) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    got = torch.full((5000,), float(rank))
    dist.all_reduce(got)
    assert torch.equal(got, torch.full((5000,), float(sum(range(world)))))
    dist.destroy_process_group()


def test_debug_log_says_two_levels_ran(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Across hosts the selection's algorithm is the plan inside each host: the log must not
    read as if flat had run over all ranks."""
    slow = {"net_latency_us": 5000.0, "net_stream_gbps": 0.1}
    env = [{**e, "XDEV_DEBUG": "INFO"} for e in _with_model(_hosts_env([2, 2]), slow, tmp_path)]
    run_ranks(_one_allreduce, 4, per_rank_env=env)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "allreduce on CPU tensors ->" in line]
    assert len(lines) == 4, err
    assert all("-> two_level, flat inside each host (" in line for line in lines), lines


def _async_barrier_then_engine_call(rank: int, world: int) -> list[float]:
    dist.init_process_group("xdev", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    dist.all_reduce(torch.ones(1 << 22))  # opens the two-level path's groups
    assert "two-level" in str(torch_xdev.describe()["last_allreduce"]), "the queue stays idle"
    # A two-level allreduce keeps the queue busy; the async barrier queues behind it. Rank 0
    # hands an all-to-all to Gloo at once, the others only once their queue has long passed the
    # barrier: both must meet Gloo's barrier before its all-to-all, as issued.
    pending = dist.all_reduce(torch.ones(1 << 22), async_op=True)
    barrier = dist.barrier(async_op=True)
    if rank != 0:
        time.sleep(0.5)
    out = torch.empty(world)
    dist.all_to_all_single(out, torch.arange(world, dtype=torch.float32) + 10 * rank)
    pending.wait()
    barrier.wait()
    dist.destroy_process_group()
    return out.tolist()


def test_async_barrier_and_an_engine_call_reach_gloo_in_program_order() -> None:
    results = run_ranks(_async_barrier_then_engine_call, 4, per_rank_env=_hosts_env([2, 2]))
    for rank, got in enumerate(results):
        assert got == [10.0 * r + rank for r in range(4)], (rank, got)
