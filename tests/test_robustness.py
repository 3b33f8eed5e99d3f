"""Failure modes: stuck and dead peers, mismatched calls, shared-memory hygiene."""

from __future__ import annotations

import os
import re
import resource
import signal
import stat
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torch_xdev
from harness import run_ranks, xdev_shm_mappings

TIMEOUT_S = 3.0


def _stuck_peer(rank: int, world: int) -> str:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(timeout=TIMEOUT_S))
    message = ""
    if rank != world - 1:  # the last rank never joins the allreduce
        start = time.monotonic()
        with pytest.raises(dist.DistBackendError) as info:
            dist.all_reduce(torch.ones(10), group=group)
        elapsed = time.monotonic() - start
        message = str(info.value)
        assert "timed out" in message and f"rank(s) {world - 1}" in message, message
        assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 10, elapsed
        # The group is poisoned now: later calls fail at once instead of hanging.
        with pytest.raises(dist.DistBackendError, match="unusable"):
            dist.all_reduce(torch.ones(10), group=group)
    dist.barrier()  # on Gloo: the stuck rank leaves only after the others saw their error
    return message


def test_stuck_peer_times_out_on_every_other_rank() -> None:
    messages = run_ranks(_stuck_peer, 3, timeout=120)
    assert all(m for m in messages[:2])


def _peer_arriving_after_the_timeout(rank: int, world: int) -> list[str]:
    """The last rank calls only after the others timed out: a call of one barrier (a few
    elements) must fail there too, not finish on the arrivals the others left behind."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    store = dist.distributed_c10d._get_default_store()
    calls = {
        "allreduce": lambda group: dist.all_reduce(torch.ones(5), group=group),
        "all_gather": lambda group: dist.all_gather_into_tensor(
            torch.empty(5 * world), torch.ones(5), group=group
        ),
    }
    messages = []
    for name, call in calls.items():
        group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(timeout=TIMEOUT_S))
        if rank == world - 1:
            store.wait([f"{name}: timed out on {peer}" for peer in range(world - 1)])
        with pytest.raises(dist.DistBackendError) as info:
            call(group)
        messages.append(str(info.value))
        if rank != world - 1:
            store.set(f"{name}: timed out on {rank}", "1")
    # The group is unusable now on every rank, for xdev's own paths; calls it hands to Gloo
    # whole go on as on Gloo, whether Gloo gets the tensor (contiguous) or xdev copies the
    # result back (transposed): the same rule for both.
    want = torch.full((4, 2), 0xFF ^ ((1 << world) - 1), dtype=torch.int32)
    for layout in ("contiguous", "transposed"):
        mine = torch.full((4, 2), 0xFF ^ (1 << rank), dtype=torch.int32)
        t = mine if layout == "contiguous" else mine.t().contiguous().t()
        dist.all_reduce(t, op=dist.ReduceOp.BAND, group=group)
        assert torch.equal(t, want), (layout, t)
    with pytest.raises(dist.DistBackendError, match="unusable"):
        dist.all_reduce(torch.ones(5), group=group)
    return messages


def test_a_peer_arriving_after_the_timeout_fails_the_call_too() -> None:
    messages = run_ranks(_peer_arriving_after_the_timeout, 3, timeout=120)
    for rank_messages in messages[:2]:
        assert all("timed out in" in m and "rank(s) 2" in m for m in rank_messages), messages
    for m, call in zip(messages[2], ["allreduce", "all_gather"]):
        assert f"timed out in {call}" in m and "before this rank arrived" in m, m


def _rank_that_never_creates_the_group(rank: int, world: int, file_store: str) -> str:
    # A FileStore's wait times out with a plain RuntimeError, a TCPStore's with DistStoreError.
    init_method = f"file://{file_store}" if file_store else None
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    store = dist.distributed_c10d._get_default_store()
    if rank == world - 1:  # alive, but never makes the group
        store.wait(["peers failed"], timedelta(seconds=120))
        dist.barrier()
        return ""
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError) as info:
        dist.new_group(backend="xdev", pg_options=torch_xdev.Options(timeout=TIMEOUT_S))
    assert time.monotonic() - start < TIMEOUT_S + 10  # the group's timeout, not the store's
    if store.add("failed", 1) == world - 1:
        store.set("peers failed", "1")
    dist.barrier()
    return str(info.value)


@pytest.mark.parametrize("store", ["tcp", "file"])
def test_a_rank_that_never_creates_the_group_is_named(store: str, tmp_path: Any) -> None:
    file_store = str(tmp_path / "store") if store == "file" else ""
    messages = run_ranks(_rank_that_never_creates_the_group, 3, file_store, timeout=120)
    for message in messages[:2]:
        assert f"creating the group timed out after {TIMEOUT_S:g} s" in message, message
        assert "waiting for rank(s) 2 of this group" in message, message


def _dead_peer(rank: int, world: int, victim: int, call: str) -> dict[str, Any]:
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=600.0)
    )
    dist.all_reduce(torch.ones(3))  # everyone has mapped the segment
    name = torch_xdev._registration.backend_of().shm_name
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError) as info:
        if call == "shared_empty":  # collective too, though it moves nothing through the channel
            torch_xdev.shared_empty(1000)
        else:
            dist.all_reduce(torch.ones(1 << 16))
    # Noticed by the liveness check long before the 600 s timeout.
    assert time.monotonic() - start < 30
    assert f"rank {victim}" in str(info.value) and "exited" in str(info.value), str(info.value)
    return {"name": name, "mapped": xdev_shm_mappings()}


@pytest.mark.parametrize("call", ["all_reduce", "shared_empty"])
def test_killed_rank_is_reported_and_leaves_no_segment(call: str) -> None:
    results = run_ranks(_dead_peer, 3, 2, call, timeout=120, expect_dead=(2,))
    name = results[0]["name"]
    assert re.fullmatch(r"/xdev-\d+-\d+-[0-9a-f]{32}", name), name
    # The name was unlinked once every rank had mapped it: nothing can leak.
    assert not os.path.exists("/dev/shm" + name)


# Kills the process argv[1] as soon as it has a segment of its own in /dev/shm.
_KILL_ONCE_IT_HAS_A_SEGMENT = """
import os, signal, sys, time
pid = int(sys.argv[1])
print("watching", flush=True)
deadline = time.monotonic() + 60
while not any(n.startswith(f"xdev-{pid}-") for n in os.listdir("/dev/shm")):
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(1e-4)
os.kill(pid, signal.SIGKILL)
"""


def _killed_inside_shared_empty(rank: int, world: int) -> list[str]:
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=TIMEOUT_S)
    )
    store = dist.distributed_c10d._get_default_store()
    victim = world - 1
    numel = 32 << 20  # 128 MB: reserving it takes the victim long enough to be caught at it
    if rank == victim:
        store.set("victim pid", str(os.getpid()))
        store.wait(["watching"])
        torch_xdev.shared_empty(numel)  # killed inside, once its part exists
        return []
    pid = int(store.get("victim pid"))
    watcher = subprocess.Popen(
        [sys.executable, "-c", _KILL_ONCE_IT_HAS_A_SEGMENT, str(pid)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert watcher.stdout is not None and watcher.stdout.readline() == "watching\n"
    store.set("watching", "1")
    with pytest.raises(RuntimeError):
        torch_xdev.shared_empty(numel)
    assert watcher.wait(timeout=60) == 0
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"xdev-{pid}-")]


def test_a_rank_killed_inside_shared_empty_leaves_no_segment() -> None:
    # Its part is linked until every rank has mapped it: the survivors remove it.
    for left in run_ranks(_killed_inside_shared_empty, 2, timeout=120, expect_dead=(1,))[:1]:
        assert left == [], left


def _mismatch(rank: int, world: int) -> None:
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=60.0)
    )
    cases = [
        torch.ones(10 + rank),  # shape
        torch.ones(10, dtype=torch.float32 if rank == 0 else torch.float64),  # dtype
        torch.ones(0 if rank == 0 else 5),  # empty on one rank only
    ]
    for t in cases:
        with pytest.raises(dist.DistBackendError, match="mismatched collectives"):
            dist.all_reduce(t)
        # The group is still usable: a matching call right after works.
        ok = torch.full((33,), float(rank + 1))
        dist.all_reduce(ok)
        assert torch.equal(ok, torch.full((33,), float(sum(range(1, world + 1)))))
    with pytest.raises(dist.DistBackendError, match="mismatched"):
        dist.all_reduce(torch.ones(8), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
    # Shapes may differ where the element counts agree, as on Gloo and NCCL.
    shape = (6,) if rank == 0 else (2, 3)
    summed = torch.arange(6.0).reshape(shape)
    dist.all_reduce(summed)
    assert torch.equal(summed.reshape(-1), torch.arange(6.0) * world)
    sent = torch.arange(6.0).reshape(shape) if rank == 0 else torch.zeros(shape)
    dist.broadcast(sent, src=0)
    assert torch.equal(sent.reshape(-1), torch.arange(6.0))
    gathered = torch.zeros((world,) + shape)
    dist.all_gather_into_tensor(gathered, torch.full(shape, float(rank)))
    for j in range(world):
        assert torch.equal(gathered[j].reshape(-1), torch.full((6,), float(j))), j
    listed = [torch.zeros(shape) for _ in range(world)]
    dist.all_gather(listed, torch.full(shape, float(rank)))
    for j, got in enumerate(listed):
        assert torch.equal(got.reshape(-1), torch.full((6,), float(j))), j
    scattered = torch.zeros(shape)
    dist.reduce_scatter_tensor(scattered, torch.ones((world,) + shape))
    assert torch.equal(scattered.reshape(-1), torch.full((6,), float(world)))
    # Coalesced lists of two dtypes on one rank, one dtype on the other: every rank stops at
    # the first dtype's collective, and none has numbered the second, so later calls still
    # line up.
    second = torch.float64 if rank == 0 else torch.float32
    with pytest.raises(dist.DistBackendError, match="mismatched collectives"):
        dist.distributed_c10d._get_default_group().allreduce_coalesced(
            [torch.ones(10), torch.ones(10, dtype=second)]
        ).wait()
    for _ in range(3):
        ok = torch.full((33,), float(rank + 1))
        dist.all_reduce(ok)
        assert torch.equal(ok, torch.full((33,), float(sum(range(1, world + 1)))))
    # Same bytes, different dtypes: the message counts bytes and says the dtypes differ.
    with pytest.raises(dist.DistBackendError, match="mismatched collectives") as info:
        dist.broadcast(torch.zeros(4, dtype=torch.int32 if rank == 1 else torch.float32), src=0)
    assert "(elements are bytes), 1 tensor(s), 16 element(s)" in str(info.value), info.value
    assert "hash of the tensors' dtypes and sizes" in str(info.value), info.value
    # One rank in a barrier, the other in an allreduce.
    with pytest.raises(dist.DistBackendError, match="mismatched"):
        if rank == 0:
            dist.barrier()
        else:
            dist.all_reduce(torch.ones(2))
    dist.barrier()
    dist.destroy_process_group()


def test_mismatched_calls_fail_everywhere_and_group_survives() -> None:
    run_ranks(_mismatch, 2, timeout=120)


def _elements_sharing_memory(rank: int, world: int) -> None:
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=TIMEOUT_S)
    )
    total = float(sum(range(1, world + 1)))

    def aliased(n: int) -> torch.Tensor:  # n elements, one memory location
        return torch.full((1,), float(rank + 1)).expand(n)

    def assert_group_sums() -> None:
        ok = torch.full((1 << 15,), float(rank + 1))
        dist.all_reduce(ok)
        assert torch.equal(ok, torch.full((1 << 15,), total))

    # Written tensors whose elements alias: a ValueError on every rank, before anything moves.
    calls = {
        "all_reduce small": lambda: dist.all_reduce(aliased(8)),
        "all_reduce of several windows": lambda: dist.all_reduce(aliased(1 << 20)),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            aliased(4 * world), torch.ones(4)
        ),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            aliased(4), torch.ones(4 * world)
        ),
        "all_gather (list)": lambda: dist.all_gather(
            [aliased(4)] + [torch.empty(4) for _ in range(world - 1)], torch.ones(4)
        ),
        "reduce_scatter (list)": lambda: dist.reduce_scatter(
            aliased(4), [torch.ones(4) for _ in range(world)]
        ),
        "broadcast": lambda: dist.broadcast(aliased(8), 0),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="share memory"):
            call()
        assert_group_sums()

    # One rank alone passes such a tensor: it refuses, and its peers fail at once at the same
    # call (not at the timeout), naming the refusal.
    with pytest.raises((ValueError, dist.DistBackendError)) as info:
        dist.all_reduce(aliased(8) if rank == 1 else torch.ones(8))
    if rank == 1:
        assert info.type is ValueError, info
    else:
        # Its refusal, not the group's timeout: no peer waited for it.
        assert "refused its own arguments" in str(info.value), info
        assert "timed out" not in str(info.value), info
    assert_group_sums()

    # PREMUL_SUM scales the tensors before the call: a rank whose tensor is aliased takes part
    # with a scaled copy, so its peers' sums are right, then raises.
    premul = dist._make_nccl_premul_sum(2.0)
    got = aliased(8) if rank == 1 else torch.full((8,), float(rank + 1))
    if rank == 1:
        with pytest.raises(ValueError, match="share memory"):
            dist.all_reduce(got, op=premul)
    else:
        dist.all_reduce(got, op=premul)
        assert torch.equal(got, torch.full((8,), 2.0 * total)), got
    assert_group_sums()

    # An aliased tensor that is only read stays fine: an all-gather's input.
    out = torch.empty(4 * world)
    dist.all_gather_into_tensor(out, aliased(4))
    assert torch.equal(out, torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(4))
    dist.destroy_process_group()


def test_written_tensors_whose_elements_share_memory_are_refused() -> None:
    run_ranks(_elements_sharing_memory, 2, timeout=120)


def _late_peer_after_timeout(rank: int, world: int) -> float:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(timeout=TIMEOUT_S))
    dist.all_reduce(torch.ones(4), group=group)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["rank 0 timed out"])  # rank 0 gave up alone and left the collective
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError) as info:
        dist.all_reduce(torch.ones(1 << 16), group=group)  # several windows
    elapsed = time.monotonic() - start
    if rank == 0:
        store.set("rank 0 timed out", "1")
    if rank == 1:
        # Rank 0 stopped at its timeout: rank 1 finds that at the call's first barrier, not
        # after a timeout of its own.
        # (A timeout of its own would name this rank's wait instead.)
        assert "rank 0 timed out in allreduce" in str(info.value), str(info.value)
        assert "before this rank arrived" in str(info.value), str(info.value)
    dist.barrier()
    return elapsed


def test_a_rank_that_timed_out_releases_its_late_peers() -> None:
    elapsed = run_ranks(_late_peer_after_timeout, 2, timeout=120)
    # Rank 0 waited its whole timeout for the peer that had not come, and no longer.
    assert TIMEOUT_S * 0.9 <= elapsed[0] < TIMEOUT_S + 5.0, elapsed


def _huge_timeout(rank: int, world: int) -> float:
    # A timedelta far beyond the clock's range, the usual way to say "never time out".
    forever = torch_xdev.Options(timeout=timedelta(days=200000))
    dist.init_process_group("xdev", rank=rank, world_size=world, pg_options=forever)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        # Rank 0 is in the call (or about to be) when rank 1 comes: it must wait, not fail
        # at a deadline that overflowed into the past. (The bound itself is a C++ unit test,
        # tests/cpp/test_shm_channel.cc.)
        store.wait(["rank0_calls"], timedelta(seconds=60))
        time.sleep(0.5)
    else:
        store.set("rank0_calls", "1")
    start = time.monotonic()
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((5,), 3.0))
    dist.destroy_process_group()
    return time.monotonic() - start


def test_a_huge_timeout_waits_instead_of_overflowing() -> None:
    waited = run_ranks(_huge_timeout, 2, timeout=120)[0]
    assert waited >= 0.4, waited  # rank 0 did wait for its peer


def _different_settings(rank: int, world: int) -> str:
    options = torch_xdev.Options(shm_slot_bytes=4096 if rank == 0 else 8192)
    with pytest.raises(ValueError) as info:
        dist.init_process_group("xdev", rank=rank, world_size=world, pg_options=options)
    return str(info.value)


def test_ranks_with_different_settings_refuse_to_start() -> None:
    # Each rank picks its plans by its settings: ranks that differ would pick differently for
    # one call and wait for each other, so the group does not start, on any rank.
    for message in run_ranks(_different_settings, 2, timeout=120):
        assert "different settings" in message, message
        assert "rank 0: shm_slot_bytes=4096, rank 1: shm_slot_bytes=8192" in message, message


def _segment_hygiene(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    group_a = dist.new_group(backend="xdev")
    group_b = dist.new_group(ranks=[0, 1], backend="xdev")
    dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4), group=group_a)
    names = {torch_xdev._registration.backend_of(g).shm_name for g in (None, group_a)}
    if rank in (0, 1):
        names.add(torch_xdev._registration.backend_of(group_b).shm_name)
    mapped = xdev_shm_mappings()
    modes = {
        path: stat.S_IMODE(os.stat(f"/proc/self/map_files/{rng}").st_mode) for rng, path in mapped
    }
    dist.destroy_process_group(group_a)
    dist.destroy_process_group(group_b) if rank in (0, 1) else None
    dist.destroy_process_group()
    return {"names": sorted(names), "modes": modes, "after_destroy": xdev_shm_mappings()}


def test_segments_private_unlinked_and_unmapped_on_destroy() -> None:
    results = run_ranks(_segment_hygiene, 3)
    for r, res in enumerate(results):
        expected_groups = 3 if r in (0, 1) else 2
        assert len(res["names"]) == expected_groups, res  # one segment per group
        for name in res["names"]:
            assert re.fullmatch(r"/xdev-\d+-\d+-[0-9a-f]{32}", name)
            assert not os.path.exists("/dev/shm" + name)
        assert res["modes"] and all(m == 0o600 for m in res["modes"].values()), res["modes"]
        assert res["after_destroy"] == [], res["after_destroy"]


def test_orphaned_segment_of_dead_creator_is_removed() -> None:
    # Segments named after a pid that cannot exist, as a creator killed between create and
    # unlink would leave them: one of this pid namespace, which goes, and one of another (a
    # container sharing /dev/shm), whose pid says nothing here, which stays.
    namespace = os.stat("/proc/self/ns/pid").st_ino
    ours = f"/dev/shm/xdev-999999999-{namespace}-" + "0" * 32
    theirs = f"/dev/shm/xdev-999999999-{namespace + 1}-" + "1" * 32
    for path in (ours, theirs):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        assert torch_xdev._C.remove_orphaned_segments() >= 1
        assert not os.path.exists(ours)
        assert os.path.exists(theirs)
    finally:
        for path in (ours, theirs):
            if os.path.exists(path):
                os.unlink(path)


def _creator_cannot_make_the_segment(rank: int, world: int) -> tuple[str, float]:
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=rank == 0)
    if rank == 0:
        # Files (the segment) past 512 KiB fail with EFBIG instead of a signal.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (512 << 10, resource.RLIM_INFINITY))
    started = time.monotonic()
    error = ""
    try:
        dist.init_process_group(
            "xdev", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
    except RuntimeError as e:
        error = str(e)
    waited = time.monotonic() - started
    # Rank 0 hosts the store: it stays until its peer has failed.
    if rank == 0:
        store.wait(["peer failed"])
    else:
        store.set("peer failed", "1")
    return error, waited


def test_a_rank_that_cannot_create_the_shared_memory_fails_its_peers_at_once() -> None:
    # The peers used to wait for its segment's name until the group's timeout (60 s here),
    # then fail with a store timeout that did not say why.
    results = run_ranks(_creator_cannot_make_the_segment, 2, timeout=120)
    (own, _), (peer, waited) = results
    assert "File too large" in own, own
    assert "could not create the shared memory" in peer and "File too large" in peer, peer
    assert waited < 30, waited


def _one_peer_gives_up_first(rank: int, world: int) -> tuple[str, float]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    store = dist.distributed_c10d._get_default_store()
    if rank == world - 1:
        # Alive, but never joins the collective: its peers wait for it.
        store.wait(["peers failed"], timedelta(seconds=120))
        store.set("released", "1")
        return "", 0.0
    started = time.monotonic()
    error = ""
    try:
        dist.all_reduce(torch.ones(16))
    except RuntimeError as e:
        error = str(e)
    waited = time.monotonic() - started
    if store.add("failed", 1) == world - 1:
        store.set("peers failed", "1")
    if rank == 0:  # its process hosts the store: it goes last
        store.wait(["released"], timedelta(seconds=120))
    return error, waited


def test_a_peer_that_times_out_first_fails_the_barrier_for_the_others_at_once() -> None:
    # Rank 0's timeout is 2 s, rank 1's 120 s: once rank 0 gives up on rank 2, the call has
    # failed on every rank, and rank 1 used to wait out its own timeout all the same.
    env = [{"XDEV_TIMEOUT": "2"}, {"XDEV_TIMEOUT": "120"}, {}]
    (first, _), (second, waited), _ = run_ranks(
        _one_peer_gives_up_first, 3, per_rank_env=env, timeout=200
    )
    assert "timed out" in first and "waiting for rank(s) 2" in first, first
    assert "waiting for rank(s) 2" in second, second
    assert "rank 0 reached its deadline first" in second, second
    assert waited < 60, waited
