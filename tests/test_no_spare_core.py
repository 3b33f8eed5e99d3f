"""Where the ranks lack a second core each for xdev's worker thread, avg_comm_hook waits for a
CPU bucket's allreduce instead of overlapping it with backward; where they have one, it
overlaps.

The choice follows ``describe()["worker_has_own_core"]``: every rank of the host has two cores
(this machine's, shared by the host's ranks). The test computes that from ``os.cpu_count()``
itself, runs DDP with the hook on a group of the test's ranks and on a group of one rank each,
and checks, for each, that the hook waited exactly where the ranks lack the cores (blocking
allreduces, its futures done when it returned) and overlapped elsewhere (asynchronous ones, as a
spy on ``torch.distributed.all_reduce`` sees them), and that training matches the same DDP on
Gloo with DDP's own hook.
Then it forces each of the two ways (``waits_for_cpu_buckets`` replaced), so that both run and
match Gloo whatever this machine's cores.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook checks the hook's
# annotations against dist.GradBucket and Future[Tensor] themselves, not strings.
import os
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_xdev
from harness import run_ranks
from torch_xdev.ddp import waits_for_cpu_buckets

STEPS = 3


def _train(
    group: dist.ProcessGroup, rank: int, hook: Any
) -> tuple[torch.Tensor, list[bool], list[bool]]:
    """Parameters after STEPS of DDP (buckets of about 64 KB: several per step), for each
    bucket whether the future the hook returned was done when it returned, and whether each
    allreduce the hook made was asynchronous (seen by a spy on torch.distributed.all_reduce)."""
    asynchronous: list[bool] = []
    real_all_reduce = dist.all_reduce

    def spy(*args: Any, **kwargs: Any) -> Any:
        asynchronous.append(bool(kwargs.get("async_op", False)))
        return real_all_reduce(*args, **kwargs)

    setattr(dist, "all_reduce", spy)
    try:
        params, done = _train_steps(group, rank, hook)
    finally:
        setattr(dist, "all_reduce", real_all_reduce)
    return params, done, asynchronous


def _train_steps(group: dist.ProcessGroup, rank: int, hook: Any) -> tuple[torch.Tensor, list[bool]]:
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    model = DDP(net, process_group=group, bucket_cap_mb=0.06, gradient_as_bucket_view=True)
    done_at_return: list[bool] = []
    if hook is not None:

        def recording_hook(
            state: Any, bucket: dist.GradBucket
        ) -> torch.futures.Future[torch.Tensor]:
            future = hook(state, bucket)
            done_at_return.append(future.done())
            return future

        model.register_comm_hook(group, recording_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randn(8, 64, generator=g)).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]), done_at_return


def _ranks(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cores = os.cpu_count() or 1
    groups = {
        "all ranks": (dist.new_group(backend="xdev"), world),
        "one rank": (dist.new_subgroups(group_size=1, backend="xdev")[0], 1),
    }
    gloo_groups = {
        "all ranks": dist.new_group(backend="gloo"),
        "one rank": dist.new_subgroups(group_size=1, backend="gloo")[0],
    }
    out: dict[str, Any] = {}
    for name, (group, ranks_on_host) in groups.items():
        has_core = 2 * ranks_on_host <= cores
        assert torch_xdev.describe(group)["worker_has_own_core"] == has_core, (name, cores)
        assert waits_for_cpu_buckets(group) == (not has_core), (name, cores)
        assert not waits_for_cpu_buckets(gloo_groups[name])  # never on another backend
        ours, done, asynchronous = _train(group, rank, torch_xdev.avg_comm_hook)
        theirs, _, _ = _train(gloo_groups[name], rank, None)  # DDP's own SUM of divided grads
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
        assert len(done) > STEPS, done  # several buckets a step after the first
        assert len(asynchronous) == len(done), (asynchronous, done)
        if not any(asynchronous):
            assert all(done), f"{name}: the hook returned before its allreduce was done"
        # What the hook did, as seen: waited (blocking calls) or overlapped (async ones).
        out[name] = {"waited": not any(asynchronous), "overlapped": all(asynchronous)}

    group, _ = groups["all ranks"]
    theirs, _, _ = _train(gloo_groups["all ranks"], rank, None)
    real_choice = torch_xdev.ddp.waits_for_cpu_buckets
    try:
        for forced in (True, False):

            def choice(_group: Optional[dist.ProcessGroup], forced: bool = forced) -> bool:
                return forced

            setattr(torch_xdev.ddp, "waits_for_cpu_buckets", choice)
            ours, done, asynchronous = _train(group, rank, torch_xdev.avg_comm_hook)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
            assert asynchronous == [not forced] * len(asynchronous) != [], (forced, asynchronous)
            if forced:
                assert all(done), "forced to wait, the hook returned before its allreduce"
    finally:
        setattr(torch_xdev.ddp, "waits_for_cpu_buckets", real_choice)
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_avg_comm_hook_waits_only_where_the_worker_lacks_a_core(world: int) -> None:
    results = run_ranks(_ranks, world)
    cores = os.cpu_count() or 1
    # The hook's calls as seen on each rank, against the cores the ranks have.
    for result in results:
        for name, ranks_on_host in (("all ranks", world), ("one rank", 1)):
            has_core = 2 * ranks_on_host <= cores
            assert result[name] == {"waited": not has_core, "overlapped": has_core}, (name, cores)
