"""Gather, scatter and all-to-all, which the engine (Gloo here) runs, are checked with the
host's peers first: a call unlike its peers', or one a rank refuses, fails on every rank at
once with an error that names each side, and the group stays usable.

Gloo's own gather and all-to-all check nothing across ranks: another size or dtype aborts the
process (``gloo::EnforceNotMet``), another root waits out the timeout, and a scatter into an
output of another size fills part of it and returns. All-to-all's sizes may differ between
ranks by design, so only its dtype is compared; each rank checks its own split sizes.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import torch_xdev  # noqa: F401  (registers the backend)
from harness import run_ranks
from test_delegation import _each_fails_at_once_and_the_calls_after_stay_paired

WORLD = 3


def _gather(numel: int, root: int, dtype: torch.dtype, rank: int) -> Callable[[], None]:
    def call() -> None:
        outputs = [torch.zeros(numel, dtype=dtype) for _ in range(WORLD)] if rank == root else None
        dist.gather(torch.ones(numel, dtype=dtype), outputs, dst=root)

    return call


def _scatter(numel: int, root: int, rank: int) -> Callable[[], None]:
    def call() -> None:
        inputs = [torch.ones(4) for _ in range(WORLD)] if rank == root else None
        dist.scatter(torch.zeros(numel), inputs, src=root)

    return call


def _calls_that_differ(rank: int, world: int) -> list[str]:
    dist.init_process_group("xdev", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    odd = rank == 2
    f64 = torch.float64 if odd else torch.float32
    calls: dict[str, Callable[[], Any]] = {
        "gather of another size": _gather(5 if odd else 4, 0, torch.float32, rank),
        "gather to another root": _gather(4, 1 if odd else 0, torch.float32, rank),
        "gather of another dtype": _gather(4, 0, f64, rank),
        "scatter into another size": _scatter(5 if odd else 4, 0, rank),
        "all_to_all_single of another dtype": lambda: dist.all_to_all_single(
            torch.zeros(2 * world, dtype=f64), torch.ones(2 * world, dtype=f64)
        ),
        # Refused by rank 2 alone, for its own arguments: 7 elements do not split in 3.
        "all_to_all_single that does not split": lambda: dist.all_to_all_single(
            torch.zeros(7 if odd else 6), torch.ones(7 if odd else 6)
        ),
        "all_to_all of another dtype": lambda: dist.all_to_all(
            [torch.zeros(2, dtype=f64) for _ in range(world)],
            [torch.ones(2, dtype=f64) for _ in range(world)],
        ),
    }

    def judge(name: str, error: Exception) -> Optional[str]:
        if name.endswith("does not split") and odd:
            return None if "split" in str(error) else f"{type(error).__name__}: {error}"
        if "mismatch" not in str(error) and "refused its own arguments" not in str(error):
            return f"{type(error).__name__}: {error}"
        return None

    wrong = _each_fails_at_once_and_the_calls_after_stay_paired(calls, world, judge)
    # Valid calls after them are right.
    outputs = [torch.zeros(3) for _ in range(world)] if rank == 1 else None
    dist.gather(torch.full((3,), float(rank)), outputs, dst=1)
    if outputs is not None and [o.tolist() for o in outputs] != [[r] * 3 for r in range(world)]:
        wrong.append(f"a valid gather after them gave {outputs}")
    received = torch.zeros(2 * world)
    dist.all_to_all_single(received, torch.full((2 * world,), float(rank)))
    if received.tolist() != [float(r) for r in range(world) for _ in range(2)]:
        wrong.append(f"a valid all_to_all_single after them gave {received.tolist()}")
    dist.destroy_process_group()
    return wrong


def test_engine_calls_that_differ_across_ranks_fail_at_once_and_the_group_stays_usable() -> None:
    for rank, wrong in enumerate(run_ranks(_calls_that_differ, WORLD)):
        assert not wrong, (rank, wrong)


def _root_passes_a_wrong_list(rank: int, world: int) -> list[str]:
    dist.init_process_group("xdev", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    root = rank == 0
    # The root's own list is wrong (Gloo refused it on the root alone, and the peers waited).
    calls: dict[str, Callable[[], Any]] = {
        "gather into outputs of another size": lambda: dist.gather(
            torch.ones(4), [torch.zeros(5) for _ in range(world)] if root else None, dst=0
        ),
        # (Another dtype never reaches the backend: torch refuses it on the root alone.)
        "scatter of inputs of another size": lambda: dist.scatter(
            torch.zeros(4), [torch.ones(5) for _ in range(world)] if root else None, src=0
        ),
    }

    def judge(name: str, error: Exception) -> Optional[str]:
        if root:
            ok = isinstance(error, (ValueError, TypeError)) and "this rank's own" in str(error)
            return None if ok else f"{type(error).__name__}: {error}"
        if "rank 0" not in str(error) or "refused its own arguments" not in str(error):
            return f"the peer was told {error}"
        return None

    wrong = _each_fails_at_once_and_the_calls_after_stay_paired(calls, world, judge)
    dist.destroy_process_group()
    return wrong


def test_a_root_list_the_root_refuses_fails_on_every_rank_at_once() -> None:
    for rank, wrong in enumerate(run_ranks(_root_passes_a_wrong_list, WORLD)):
        assert not wrong, (rank, wrong)


def _async_calls_return_before_the_peers_call(rank: int, world: int) -> list[str]:
    dist.init_process_group("xdev", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    store = dist.distributed_c10d._get_default_store()
    mine = torch.full((2,), float(rank))
    gathered = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
    sent = torch.arange(2.0 * world) + 100 * rank
    received = torch.zeros(2 * world)
    if rank == 0:
        # Issued before any peer can make its own (the Store key holds them back), as on Gloo:
        # the calls return at once and meet the peers on xdev's worker.
        works = [
            dist.gather(mine, gathered, dst=0, async_op=True),
            dist.all_to_all_single(received, sent, async_op=True),
        ]
        store.set("engine-calls/issued", "1")
        for work in works:
            assert work is not None
            work.wait()
    else:
        store.wait(["engine-calls/issued"])
        # The peers wait for theirs: every rank need not pass the same async_op.
        dist.gather(mine, None, dst=0)
        dist.all_to_all_single(received, sent)
    wrong = []
    if gathered is not None and [g.tolist() for g in gathered] != [[r, r] for r in range(world)]:
        wrong.append(f"gather gave {gathered}")
    expected = [100.0 * r + 2 * rank + i for r in range(world) for i in range(2)]
    if received.tolist() != expected:
        wrong.append(f"all_to_all_single gave {received.tolist()}, not {expected}")
    # Their meetings kept the ranks' turns paired: a native call after them is right.
    total = torch.ones(3)
    dist.all_reduce(total)
    if total.tolist() != [float(world)] * 3:
        wrong.append(f"the all_reduce after them gave {total.tolist()}")
    dist.destroy_process_group()
    return wrong


def test_async_engine_calls_return_before_the_peers_call_and_stay_paired() -> None:
    # With the check waiting for the peers, rank 0's asynchronous gather waited for peers that
    # wait for it: the job hung until the timeout.
    for rank, wrong in enumerate(run_ranks(_async_calls_return_before_the_peers_call, WORLD)):
        assert not wrong, (rank, wrong)
