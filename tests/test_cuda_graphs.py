"""CUDA graphs on xdev groups: what a captured collective needs, and the errors that say so.

A CUDA collective captured in a graph goes to NCCL (xdev's GPU barriers count calls on the
host, which a replay would not do). Neither xdev's CUDA transport (opened by a group's first
CUDA collective) nor NCCL's communicator (made at its first collective) can be made inside a
capture; ``torch_xdev.prepare_cuda_graph_capture`` makes both beforehand.

- ``test_first_collective_during_capture_names_the_fix``: a group's first CUDA collective
  made inside a capture raises an error naming ``prepare_cuda_graph_capture`` on every rank,
  before anything is opened; the group then works.
- ``test_captured_allreduce_replays``: after ``prepare_cuda_graph_capture``, an allreduce
  captured on a side stream replays with new inputs and sums them right on every rank (one
  GPU per rank). Where the ranks share a GPU, which NCCL refuses, the preparation and the
  capture raise errors that say so, and the group still sums outside a capture.
- ``test_world_of_one_captures_many_calls``: one rank (NCCL runs it on a machine with one
  GPU) captures 70 allreduces in one graph, more than the group tracks between barriers,
  and the replays leave each tensor as it was.

The module skips, with the reason, where torch sees no GPU or torch_xdev was built without
its CUDA path (cuda_ranks.why_skip).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

import cuda_ranks
import torch_xdev
from cuda_ranks import first_cuda_collective, setup_rank
from harness import run_ranks

cuda_ranks.skip_module_without_cuda()

TIMEOUT_S = 60.0


def _init(rank: int, world: int) -> torch.device:
    device = setup_rank(rank)
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=TIMEOUT_S)
    )
    return device


def _capture(call: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, str]:
    """Captures ``call`` on a side stream; returns the graph and the error it raised ("" if none)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    error = ""
    with torch.cuda.stream(stream):
        try:
            with torch.cuda.graph(graph, stream=stream):
                call()
        except RuntimeError as e:
            error = str(e)
    torch.cuda.current_stream().wait_stream(stream)
    return graph, error


def _sum_outside_capture(rank: int, device: torch.device, n: int) -> torch.Tensor:
    """An allreduce of n elements of rank + 1 outside any capture: the group still sums."""
    y = torch.full((n,), float(rank + 1), device=device)
    dist.all_reduce(y)
    torch.cuda.synchronize(device)
    return y.cpu()


def _first_collective_during_capture(rank: int, world: int) -> dict[str, Any]:
    device = _init(rank, world)
    x = torch.full((1024,), float(rank + 1), device=device)
    _, error = _capture(lambda: dist.all_reduce(x))
    opened_in_capture = torch_xdev.describe()["cuda"]["initialized"]
    first_cuda_collective(device)  # opens the transport now, outside any capture
    y = _sum_outside_capture(rank, device, 4099)
    dist.destroy_process_group()
    return {"error": error, "opened_in_capture": opened_in_capture, "after": y}


def test_first_collective_during_capture_names_the_fix() -> None:
    world = 2
    results = run_ranks(_first_collective_during_capture, world, timeout=300)
    for rank, r in enumerate(results):
        assert "prepare_cuda_graph_capture" in r["error"], (rank, r["error"])
        assert "CUDA graph" in r["error"], (rank, r["error"])
        assert not r["opened_in_capture"], rank
        assert torch.equal(r["after"], torch.full((4099,), float(sum(range(1, world + 1))))), rank


def _captured_allreduce(rank: int, world: int) -> dict[str, Any]:
    device = _init(rank, world)
    prepare_error = ""
    try:
        torch_xdev.prepare_cuda_graph_capture()
    except RuntimeError as e:
        prepare_error = str(e)
    shares_gpu = bool(torch_xdev.describe()["cuda"]["ranks_share_gpu"])
    x = torch.zeros(40_000, device=device)
    graph, error = _capture(lambda: dist.all_reduce(x))
    sums = []
    if not error:
        for step in range(3):
            # Replays read x where the capture did: fill it in place.
            x.copy_(torch.arange(x.numel(), device=device) * (rank + 1) + step)
            graph.replay()
            torch.cuda.synchronize(device)
            sums.append(x.cpu())
    y = _sum_outside_capture(rank, device, 1021)  # whatever the capture did
    dist.destroy_process_group()
    return {
        "shares_gpu": shares_gpu,
        "prepare_error": prepare_error,
        "error": error,
        "sums": sums,
        "after": y,
    }


def test_captured_allreduce_replays() -> None:
    world = 2
    results = run_ranks(_captured_allreduce, world, timeout=300)
    ranks_total = sum(range(1, world + 1))
    for rank, r in enumerate(results):
        assert torch.equal(r["after"], torch.full((1021,), float(ranks_total))), rank
        if r["shares_gpu"]:
            # One GPU for both ranks (the CI machine): NCCL refuses them, and both the
            # preparation and the capture say so.
            for said in (r["prepare_error"], r["error"]):
                assert "share a GPU" in said and "NCCL" in said, (rank, said)
            continue
        assert r["prepare_error"] == "" and r["error"] == "", (rank, r)
        base = torch.arange(40_000, dtype=torch.float32)
        for step, got in enumerate(r["sums"]):
            expected = base * ranks_total + step * world
            assert torch.equal(got, expected), (rank, step)


def _world_of_one_captures_many_calls(rank: int, world: int) -> dict[str, Any]:
    device = _init(rank, world)
    torch_xdev.prepare_cuda_graph_capture()
    # More calls than the group keeps track of between barriers (64), in one graph.
    xs = [torch.zeros(257 + i, device=device) for i in range(70)]
    graph, error = _capture(lambda: [dist.all_reduce(x) for x in xs])
    replayed = []
    if not error:
        for step in range(2):
            for i, x in enumerate(xs):
                x.fill_(float(i + 10 * step))
            graph.replay()
            torch.cuda.synchronize(device)
            replayed.append([x.cpu() for x in xs])
    dist.barrier()
    dist.destroy_process_group()
    return {"error": error, "replayed": replayed}


def test_world_of_one_captures_many_calls() -> None:
    """One rank: NCCL runs the captured calls even on a machine with one GPU."""
    r = run_ranks(_world_of_one_captures_many_calls, 1, timeout=300)[0]
    assert r["error"] == "", r["error"]
    assert len(r["replayed"]) == 2
    for step, xs in enumerate(r["replayed"]):
        for i, x in enumerate(xs):
            assert torch.equal(x, torch.full((257 + i,), float(i + 10 * step))), (step, i)
