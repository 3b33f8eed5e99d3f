"""Two-level collectives across hosts when the ranks' calls differ, on one machine made to look
like several (XDEV_HOSTNAME per rank).

Calls whose shapes, ops or collectives differ between hosts or inside one, forms that differ
between hosts (the leader form against slices), and a rank that refuses its own arguments must
fail every rank of every host at that call with an error that names the calls, none waiting
for the timeout, and leave the group usable: the calls after them stay paired.
"""

from __future__ import annotations

import time
from typing import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torch_xdev
from harness import run_ranks
from test_two_level import TIMEOUT_S, _assert_sums, _hosts_env, _with_model


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
            # Each host's call, without an op number: the hosts' counts of calls may differ.
            host_lines = [line for line in message.splitlines() if line.startswith("  host ")]
            assert host_lines and not any("(op #" in line for line in host_lines), message
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


def _path_of(call: Callable[[int], None], blocks: int) -> str:
    call(blocks)
    return str(torch_xdev.describe()["last_gather_scatter"][1])


def _refusal_where_auto_changes_path(rank: int, world: int) -> list[tuple[str, int, str]]:
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=TIMEOUT_S)
    )

    # Rank 0 passes a tensor one element too long where `wrong` says: the full tensor, or its
    # own block (the all-gather's input, the reduce-scatter's output): its own mistake.
    def reduce_scatter(block: int, wrong: str = "") -> None:
        extra_full, extra_block = int(wrong == "full"), int(wrong == "block")
        out = torch.empty(block + extra_block)
        dist.reduce_scatter_tensor(out, torch.ones(world * block + extra_full))

    def all_gather(block: int, wrong: str = "") -> None:
        extra_full, extra_block = int(wrong == "full"), int(wrong == "block")
        dist.all_gather_into_tensor(
            torch.empty(world * block + extra_full), torch.ones(block + extra_block)
        )

    outcomes = []
    for name, call in (("reduce_scatter", reduce_scatter), ("all_gather", all_gather)):
        # Valid calls of 4 KiB to 4 MiB, float32: where auto's path differs from one size class
        # to the next, a tensor one element past the smaller class lies in the larger.
        blocks = [(1 << k) // 4 // world for k in range(12, 23)]
        paths = [_path_of(call, b) for b in blocks]
        changes = [i for i in range(len(paths) - 1) if paths[i] != paths[i + 1]]
        if not changes:
            outcomes.append((name, -1, " ".join(paths)))
            continue
        block = blocks[changes[0]]
        for wrong in ("full", "block"):
            start = time.monotonic()
            try:
                call(block, wrong if rank == 0 else "")
                outcome = "no error"
            except ValueError as e:
                outcome = f"ValueError: {e}"
            except dist.DistBackendError as e:
                outcome = f"DistBackendError: {e}"
            assert time.monotonic() - start < TIMEOUT_S / 2, (name, wrong, outcome)
            outcomes.append((f"{name} ({wrong} wrong)", block, outcome))
            _assert_sums(1000)  # the calls after it stay paired
    dist.destroy_process_group()
    return outcomes


def test_a_refusal_near_a_change_of_path_stays_paired() -> None:
    """A rank whose full tensor or block is one element off chooses as its peers do.

    Chosen by the full tensor's size, it crossed into the next size class, where auto (default
    model) hands a reduce-scatter to Gloo: that rank failed in Gloo alone (Gloo's check aborts
    the process), and its peers' two-level call paired with its next call. Chosen by its block,
    a wrong block did the same; where the two sizes choose differently, the native path, whose
    check refuses the call with the peers, is taken."""
    results = run_ranks(_refusal_where_auto_changes_path, 4, per_rank_env=_hosts_env([2, 2]))
    changed = [(name, block) for name, block, _ in results[0] if block >= 0]
    assert changed, f"auto never changes path from 4 KiB to 4 MiB here: {results[0]}"
    for rank, outcomes in enumerate(results):
        for name, block, outcome in outcomes:
            if block < 0:
                continue
            if rank == 0:
                assert outcome.startswith("ValueError"), (name, outcome)
            else:
                assert outcome.startswith("DistBackendError"), (name, outcome)
                assert "mismatched collectives" in outcome, (rank, name, outcome)
                assert "timed out" not in outcome, (rank, name, outcome)
