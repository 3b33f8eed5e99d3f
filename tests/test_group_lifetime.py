"""A group's lifetime on its users' threads: its last reference dropped in a callback, calls
on a group already destroyed or racing its destroy, and what the calls xdev hands to Gloo hold
once they are done."""

from __future__ import annotations

import os
import re
import threading
import time
import weakref
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torch_xdev
from torch_xdev._registration import _create_backend
from harness import run_ranks


def _last_reference_dropped_in_a_callback(rank: int, world: int, algorithm: str) -> list[float]:
    # A backend made as c10d makes it, held only here: destroy_process_group would shut it
    # down on this thread first, and the test is about its last reference going elsewhere.
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=rank == 0)
    options = SimpleNamespace(
        group_id="dropped-in-callback",
        group_rank=rank,
        group_size=world,
        global_ranks_in_group=list(range(world)),
        store=store,
        timeout=timedelta(seconds=60),
    )
    holder = [_create_backend(options, torch_xdev.Options(algorithm=algorithm))]
    t = torch.full((4,), float(rank + 1))
    ran_on: list[int] = []

    def drop_the_group(_: torch.futures.Future[Any]) -> None:
        ran_on.append(threading.get_ident())
        holder.clear()  # the group's last reference

    # Rank 1 issues its allreduce only once rank 0 has attached its callback, so rank 0's
    # allreduce finishes after that: its callback runs on the thread that completes it.
    if rank == 1:
        store.wait(["attached/0"])
    work = holder[0].allreduce([t])
    done = work.get_future().then(drop_the_group)
    store.set(f"attached/{rank}", "1")
    done.wait()
    if rank == 0:
        assert ran_on and ran_on[0] != threading.get_ident(), "the callback ran on this thread"
        # The group went on a thread of its own, which the interpreter's exit waits for. It
        # goes once the worker's task lets go of it, just after the callbacks (`done` among
        # them) have run: a moment after `done.wait()` can return.
        _eventually(
            lambda: torch_xdev._C.detached_teardowns()[0] >= 1, "the group never went elsewhere"
        )
    assert not holder
    assert torch_xdev._C.wait_for_detached_teardowns(timedelta(seconds=30))
    assert torch_xdev._C.detached_teardowns()[1] == 0
    return t.tolist()


def _calls_after_destroy(rank: int, world: int) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    group = dist.group.WORLD
    assert group is not None
    dist.all_reduce(torch.ones(4))
    dist.destroy_process_group()
    # The handle outlives the group: its calls raise (they used to crash a world of one).
    calls = {
        "allreduce": lambda: group.allreduce([torch.ones(4)]),
        "barrier": lambda: group.barrier(),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="destroyed"):
            call().wait()


@pytest.mark.parametrize("world", [1, 2])
def test_calls_on_a_destroyed_group_raise(world: int) -> None:
    run_ranks(_calls_after_destroy, world)


def _calls_while_destroyed(rank: int, world: int) -> list[str]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    store = dist.distributed_c10d._get_default_store()
    seen = []
    # Calls from another thread while this one destroys the group: each runs or raises that
    # the group is destroyed, never uses a part the destroy has freed (they crashed or
    # corrupted the heap about one time in two).
    for i in range(10):
        group = dist.new_group(backend="xdev")
        dist.all_reduce(torch.ones(4), group=group)
        errors: set[str] = set()
        calling = threading.Event()

        def call_until_refused() -> None:
            while True:
                try:
                    dist.all_reduce(torch.ones(4), group=group, async_op=True)
                    calling.set()
                except RuntimeError as e:
                    errors.add(str(e))
                    return

        caller = threading.Thread(target=call_until_refused)
        caller.start()
        calling.wait()  # the destroy meets calls under way
        dist.destroy_process_group(group)
        caller.join()
        assert errors and all("destroyed" in e for e in errors), errors
    # A callback that Gloo runs while the destroy drains it calls the group again: it must
    # find the group destroyed, not wait on the dying engine. (On rank 1, whose destroy may
    # come after the callback, the call fails as rank 0 has left; where both callbacks ran
    # before either destroy began, their calls ran.)
    group = dist.new_group(backend="xdev")
    if rank == 1:
        store.wait(["destroying"])  # rank 0's destroy waits for this all-to-all
    out = torch.empty(world)
    work = dist.all_to_all_single(out, torch.ones(world), group=group, async_op=True)
    assert work is not None

    def call_again(_: Any) -> None:
        try:
            group.allreduce([torch.ones(2)]).wait()
            seen.append("ran")
        except RuntimeError as e:
            seen.append(str(e))

    done = work.get_future().then(call_again)
    if rank == 0:
        store.set("destroying", "1")
    dist.destroy_process_group(group)
    done.wait()
    dist.destroy_process_group()
    return seen


def test_calls_racing_a_destroy_run_or_raise() -> None:
    for seen in run_ranks(_calls_while_destroyed, 2, timeout=120):
        assert len(seen) == 1, seen
        assert re.fullmatch("ran|.*(destroyed|rank 0 .* has left the group).*", seen[0]), seen


def _eventually(done: Any, what: str, seconds: float = 10.0) -> None:
    """Waits, backing off, for something another thread finishes (an engine's worker)."""
    deadline = time.monotonic() + seconds
    delay = 1e-4
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(delay)
        delay = min(2 * delay, 0.05)


def _engine_calls_let_go(rank: int, world: int) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    fallback = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(algorithm="fallback"))
    calls = {
        "all_to_all_single": lambda t: dist.all_to_all_single(torch.empty_like(t), t),
        "all_reduce BAND": lambda t: dist.all_reduce(t, op=dist.ReduceOp.BAND),
        "all_reduce on a fallback group": lambda t: dist.all_reduce(t, group=fallback),
        "async all_reduce on a fallback group": lambda t: dist.all_reduce(
            t, group=fallback, async_op=True
        ).wait(),
    }
    for name, call in calls.items():
        for i in range(3):
            t = torch.full((world * 1024,), rank + 1, dtype=torch.int32)
            alive = weakref.ref(t)  # alive while anything, Python or C++, holds the tensor
            call(t)
            del t
            # xdev remembers each call Gloo runs until it is done (its barrier waits for them),
            # and used to hold the Work, and so its tensors, until the next barrier or the 64th
            # such call. Gloo's own worker lets go a moment after the call completes.
            _eventually(lambda: alive() is None, f"{name} #{i} still holds its tensor")
    dist.destroy_process_group()


def test_calls_handed_to_gloo_hold_no_tensor_once_done() -> None:
    run_ranks(_engine_calls_let_go, 2)


@pytest.mark.parametrize("algorithm", ["fallback", "flat"])
def test_a_group_whose_last_reference_goes_in_a_callback_shuts_down(algorithm: str) -> None:
    # A Work's callbacks run on the thread that completes it: Gloo's (algorithm='fallback')
    # or the group's worker (a native plan). Shutting the group down joins both, and the
    # callback's thread must not join itself (std::terminate, as a Gloo group alone does on
    # torch 2.13).
    for values in run_ranks(_last_reference_dropped_in_a_callback, 2, algorithm, timeout=120):
        assert values == [3.0] * 4


def _heap_arenas_mapped() -> int:
    with open("/proc/self/maps") as maps:
        return sum("/memfd:xdev-heap" in line for line in maps)


def _destroyed_groups_kept(rank: int, world: int) -> tuple[int, int]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    cpu = torch.device("cpu")
    before = _heap_arenas_mapped()
    kept = []
    for _ in range(3):
        group = dist.new_group(backend="xdev")
        bucket = group._get_backend(cpu).allocate_tensor(1 << 18, dtype=torch.float32, device=cpu)
        bucket.fill_(1.0)
        dist.all_reduce(bucket, group=group)  # in place: every rank maps every rank's arena
        assert torch.equal(bucket, torch.full_like(bucket, world))
        del bucket
        dist.destroy_process_group(group)
        kept.append(group)  # a handle kept (a list of groups, a closure, a DeviceMesh)
    after = _heap_arenas_mapped()
    dist.destroy_process_group()
    return before, after


def test_a_destroyed_group_kept_by_python_holds_no_heap_arena() -> None:
    # Its heap tensors are gone: its arenas (memory every rank wrote) go with the destroy,
    # not with the last Python reference to the group.
    for rank, (before, after) in enumerate(run_ranks(_destroyed_groups_kept, 2)):
        assert after == before, (rank, before, after)
