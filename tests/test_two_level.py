"""Allreduce across hosts by the two-level plan, on one machine made to look like several.

XDEV_HOSTNAME gives each rank a host name, so one box holds "hosts" of several ranks. The
grids compare every result with an independent reference computed in the test
(collective_cases.reference) and check that every rank of every host holds the same bits
(checksums compared through a Gloo all_gather). Hosts with different numbers of ranks take
the engine's flat allreduce and say why; a killed rank fails every other rank's call.
Calls that differ between ranks are test_two_level_mismatch.py's.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
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
                two_level = algorithm == "two_level" and "flat inside each host" in reason
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
    # What auto would choose is shown as what runs: two levels (or the engine), and the
    # model it chooses by is each host's with the network's parameters.
    for size, (path, reason) in info["cpu_allreduce_plan"].items():
        assert path == "fallback" or (path == "two_level" and "inside each host" in reason), (
            size,
            path,
            reason,
        )
    model = info["cpu_cost_model"]
    assert model is not None and model["name"] == f"cpu-{ranks_per_host[0]}", model
    given = params or {}
    assert model["net_host_cores"] == given.get("net_host_cores", info["host_cores"]), model
    assert model["net_latency_us"] == given.get("net_latency_us", model["net_latency_us"]), model


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
        # Every description of what the group lacks gives the same reason.
        assert info["ddp_shared_buckets_note"] == (
            "off: no shared memory (hosts hold different numbers of ranks)"
        )
        assert info["single_copy_note"] == "off: the group spans hosts"
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


def _nan_across_hosts(rank: int, world: int) -> list[str]:
    """MIN and MAX keep a NaN from any rank across hosts, in the sizes that ride in the
    exchange of calls and in those that cross by the engine, whichever plan the model
    predicts faster."""
    dist.init_process_group("xdev", rank=rank, world_size=world)
    plans = []
    for dtype in (torch.float32, torch.bfloat16):
        # 8 elements ride in the exchange of calls across hosts; the others go by the
        # engine. At 10240 and 16384 (a float32 reduce-scatter of 160 and 256 KiB) this
        # machine's model predicts Gloo's ring faster, which ran there and dropped NaNs.
        for numel in (8, 10_240, 16_384, 100_003):
            for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX):
                for holder in range(world):
                    inputs = [
                        (torch.arange(numel, dtype=torch.float32) * (r + 3) % 101).to(dtype)
                        for r in range(world)
                    ]
                    # Scattered NaNs, one in every 7 elements, on one rank only.
                    inputs[holder][holder::7] = float("nan")
                    stacked = torch.stack([t.float() for t in inputs])
                    want = stacked.amin(0) if op == dist.ReduceOp.MIN else stacked.amax(0)
                    what = f"{dtype} {op} n={numel} NaN on rank {holder}"
                    got = inputs[rank].clone()
                    dist.all_reduce(got, op=op)
                    plans.append(" ".join(torch_xdev.describe()["last_allreduce"]))
                    assert torch.equal(got.isnan(), want.isnan()), what
                    assert torch.equal(got.float()[~want.isnan()], want[~want.isnan()]), what
                    # The reduce-scatter of the same rows: this rank's share of the result.
                    full = torch.cat([inputs[rank]] * world)
                    out = torch.empty(numel, dtype=dtype)
                    dist.reduce_scatter_tensor(out, full, op=op)
                    plans.append(" ".join(torch_xdev.describe()["last_gather_scatter"]))
                    assert torch.equal(out.isnan(), want.isnan()), "reduce_scatter " + what
                    assert torch.equal(out.float()[~want.isnan()], want[~want.isnan()]), (
                        "reduce_scatter " + what
                    )
    dist.destroy_process_group()
    return plans


def test_min_and_max_keep_a_nan_from_any_rank_across_hosts() -> None:
    # Gloo's MIN and MAX can drop a NaN: across hosts xdev gathers the hosts' partial results
    # and reduces them with its own kernels, as inside a host.
    for plans in run_ranks(_nan_across_hosts, 4, per_rank_env=_hosts_env([2, 2])):
        assert all("two-level" in plan or "two_level" in plan for plan in plans), set(plans)


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
    assert info["two_level_note"] == "algorithm='fallback' requested"
    assert (
        info["ddp_shared_buckets_note"] == "off: no shared memory (algorithm='fallback' requested)"
    )


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


# Long enough that a rank held until the group's timeout shows: the others fail within seconds.
TIMEOUT_S = 60.0


def _killed_on_one_host(rank: int, world: int, victim: int, numel: int) -> tuple[str, float]:
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=TIMEOUT_S)
    )
    dist.all_reduce(torch.ones(1000))  # every channel and engine connection is up
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError) as info:
        dist.all_reduce(torch.ones(numel))
    seconds = time.monotonic() - start
    # Every survivor stays alive until all have failed, as a job that catches the error to save
    # a checkpoint does: a failed rank's open sockets must not hold a partner on another host
    # until the timeout.
    store = dist.distributed_c10d._get_default_store()
    if store.add("survivors_failed", 1) == world - 1:
        store.set("all_survivors_failed", "1")
    store.wait(["all_survivors_failed"], timedelta(seconds=2 * TIMEOUT_S))
    return str(info.value), seconds


@pytest.mark.parametrize("leader", [False, True], ids=["slices", "leader"])
def test_killed_rank_fails_every_rank_of_every_host(leader: bool, tmp_path: Path) -> None:
    # 256 KiB crosses in slices; 4 KiB, with one core per host, in the leader form, where the
    # victim (local rank 1 of host 1) never crosses hosts itself.
    env = _with_model(_hosts_env([2, 2]), {"net_host_cores": 1 if leader else 64}, tmp_path)
    numel = 1024 if leader else 1 << 16
    results = run_ranks(
        _killed_on_one_host, 4, 3, numel, per_rank_env=env, timeout=240, expect_dead=(3,)
    )
    messages = [m for m, _ in results[:3]]
    assert all(messages), messages
    # Its host's other rank sees it exit in the host's shared-memory barrier, and its group
    # fails; its partner across hosts, waiting for it in the engine, fails as the failed rank
    # lets go of its engine, and so on: nobody waits for the timeout.
    times = [seconds for _, seconds in results[:3]]
    assert all(t < TIMEOUT_S / 3 for t in times), list(zip(times, messages))
    assert "exited" in messages[2] and "group ranks 2, 3" in messages[2], messages[2]
    assert "rank 3 (pid" in messages[2], messages[2]  # the group's rank, not the host's index
    # Host 0's local rank 0 loses its partner across hosts in the engine's exchange of calls:
    # the engine's reason, and what keeps a rank on another host away.
    assert "exchange of calls across hosts failed (" in messages[0], messages[0]
    assert "A rank on another host has exited" in messages[0], messages[0]
    # A host-mate that failed first is named with its error, not as a rank that left the group.
    assert not any("has left the group" in m for m in messages), messages


def _broadcasts(rank: int, world: int, sizes: tuple[int, ...]) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    for numel in sizes:
        # uint32, which Gloo lacks, goes through the engine as bytes: the same bytes, the same
        # path (it used to fail there, and work on the two levels).
        for dtype in (torch.float32, torch.uint32):
            want = torch.arange(numel, dtype=torch.float32) * 3 + 1
            got = want.clone() if rank == 1 else torch.zeros(numel)
            dist.broadcast(got.view(dtype), src=1)
            assert torch.equal(got, want), (numel, dtype)
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
    choices = [line for line in err.splitlines() if "broadcast ->" in line]
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
    # hands an all-to-all to Gloo at once, the others only once their barrier is done, which
    # needs rank 0's barrier in Gloo: rank 0 must issue it there before its all-to-all, as
    # issued, or its all-to-all meets their barrier and every rank waits.
    pending = dist.all_reduce(torch.ones(1 << 22), async_op=True)
    barrier = dist.barrier(async_op=True)
    if rank != 0:
        pending.wait()
        barrier.wait()
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


def _ipv4_of(interface: str) -> Optional[str]:
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", interface.encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _listening_ipv4_addresses() -> set[str]:
    """The IPv4 addresses this process's TCP sockets listen on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    addresses = set()
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                packed = struct.pack("<I", int(fields[1].split(":")[0], 16))
                addresses.add(socket.inet_ntoa(packed))
    return addresses


def _listening_after_a_two_level_allreduce(rank: int, world: int) -> set[str]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    t = torch.full((4096,), float(rank))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4096,), float(sum(range(world)))))
    assert torch_xdev.describe()["last_allreduce"][1].count("two-level"), "no two levels ran"
    addresses = _listening_ipv4_addresses()
    dist.destroy_process_group()
    return addresses


def test_the_groups_across_hosts_use_the_interface_gloo_socket_ifname_names(
    tmp_path: Path,
) -> None:
    # Where a host's name resolves to loopback, GLOO_SOCKET_IFNAME is how Gloo reaches the
    # other hosts; the groups xdev makes across hosts used to ignore it and listen on loopback.
    named = [(i, _ipv4_of(i)) for _, i in socket.if_nameindex() if i != "lo"]
    named = [(i, a) for i, a in named if a is not None and not a.startswith("127.")]
    if not named:
        pytest.skip("no network interface with an IPv4 address besides loopback")
    interface, address = named[0]
    env = [{"XDEV_HOSTNAME": f"ifname-{r // 2}", "GLOO_SOCKET_IFNAME": interface} for r in range(4)]
    env = _with_model(env, {"net_latency_us": 5000.0}, tmp_path)
    for addresses in run_ranks(_listening_after_a_two_level_allreduce, 4, per_rank_env=env):
        assert address in addresses, (interface, address, addresses)
        assert not any(a.startswith("127.") for a in addresses), (interface, addresses)
