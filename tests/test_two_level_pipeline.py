"""The two-level allreduce pipelined in pieces, on one machine made to look like several hosts.

A large two-level allreduce is cut into pieces; while the engine (Gloo) allreduces one piece
across hosts, each rank reduce-scatters the next and all-gathers the previous one inside its
host. The cost model keeps one piece on this 2-core machine (no core to spare for the
overlap), so these tests force the pieces with ``Options.two_level_pieces`` (a payload whose
slices ride in the exchange of calls across hosts, 64 KiB each, stays whole). Every result is
checked against an independent reference and across all ranks bitwise; on two hosts, where
each element's sum across hosts has two terms, the pieces also leave the bits of the whole
payload in one piece. Hosts given different settings (pieces, cost models) refuse to start.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torch_xdev
from collective_cases import (
    assert_same_digests,
    check_close,
    check_coalesced,
    digest,
    make_input,
    reference,
)
from harness import run_ranks
from test_two_level import TIMEOUT_S, _assert_sums, _hosts_env, _killed_on_one_host

SMALL_SLOT = 4096  # bytes per slot: the larger pieces span several windows
SIZES = (1, 2, 7, 1021, 70001)
CASES = [
    (torch.float32, dist.ReduceOp.SUM),
    (torch.float32, dist.ReduceOp.AVG),
    (torch.float64, dist.ReduceOp.MIN),
    (torch.bfloat16, dist.ReduceOp.SUM),
    (torch.int32, dist.ReduceOp.PRODUCT),
    (torch.int64, dist.ReduceOp.MAX),
]
CARRIED_BYTES = 64 * 1024  # what rides in the exchange of calls across hosts
IN_PLACE = re.compile(r"rank (\d+): two-level (reduce-scatter|all-gather) inside the host ran in")


def _network_model(tmp_path: Path, **params: float) -> str:
    """An XDEV_CPU_MODEL with these network parameters."""
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"params": params}))
    return str(model)


def _pieces_grid(rank: int, world: int, pieces: int) -> list[int]:
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the checker's group
    options = torch_xdev.Options(shm_slot_bytes=SMALL_SLOT)
    whole = dist.new_group(backend="xdev", pg_options=options)
    piped = dist.new_group(
        backend="xdev",
        pg_options=torch_xdev.Options(shm_slot_bytes=SMALL_SLOT, two_level_pieces=pieces),
    )
    backend = piped._get_backend(torch.device("cpu"))
    info = torch_xdev.describe(piped)
    two_hosts = info["num_hosts"] == 2
    local_ranks = info["local_world_size"]
    digests: list[int] = []
    for c, (dtype, op) in enumerate(CASES):
        for numel in SIZES:
            seed = c * 100003 + numel
            inputs = [make_input(seed, r, numel, dtype, op) for r in range(world)]
            what = f"{dtype} {op} n={numel}"
            got = inputs[rank].clone()
            dist.all_reduce(got, op=op, group=piped)
            check_close(got, reference(inputs, op), op, world, what)
            algorithm, reason = torch_xdev.describe(piped)["last_allreduce"]
            assert algorithm == "two_level" and "two-level" in reason, (what, reason)
            # Pieces where a local rank's slice would not ride in the exchange of calls.
            pipelined = numel * got.element_size() > local_ranks * CARRIED_BYTES
            assert (f"in {pieces} pipelined pieces" in reason) == pipelined, (what, reason)
            digests.append(digest(got))
            if two_hosts:
                one_piece = inputs[rank].clone()
                dist.all_reduce(one_piece, op=op, group=whole)
                assert torch.equal(got, one_piece), f"{what}: pieces differ from one piece"
            # A tensor of the host's heap (DDP's bucket): its pieces read in place where they
            # span several windows, with the same bits.
            heap = backend.allocate_tensor(numel, dtype=dtype, device=torch.device("cpu"))
            heap.copy_(inputs[rank])
            dist.all_reduce(heap, op=op, group=piped)
            assert torch.equal(heap, got), f"{what}: heap tensor differs"
            del heap
    # allreduce_coalesced: one flat payload, cut into pieces the same way on every host.
    digests += check_coalesced(piped, rank, world, [(5,), (0,), (30, 100), (77,)], 500, "pieces")
    assert_same_digests(digests, world)
    dist.destroy_process_group(piped)
    dist.destroy_process_group(whole)
    dist.destroy_process_group()
    return digests


# The slow network's latency dominates these sizes, so the model runs two levels only where
# they take fewer steps across hosts than Gloo's ring over all ranks: on 2 hosts of 2 ranks in
# 2 pieces (1 + 2 x 2 steps against 6), on 2 hosts of 4 in 3 (1 + 3 x 2 against 14).
@pytest.mark.parametrize("ranks_per_host,pieces", [([2, 2], 2), ([4, 4], 3)], ids=["2x2", "2x4"])
def test_pipelined_pieces_match_the_reference_on_every_rank(
    ranks_per_host: list[int], pieces: int, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = _network_model(tmp_path, net_latency_us=5000.0)
    env = [{**e, "XDEV_CPU_MODEL": model, "XDEV_DEBUG": "INFO"} for e in _hosts_env(ranks_per_host)]
    world = sum(ranks_per_host)
    run_ranks(_pieces_grid, world, pieces, per_rank_env=env, timeout=600)
    err = capfd.readouterr().err
    # Every rank read some piece of a heap tensor in place inside its host.
    assert {int(m[1]) for m in IN_PLACE.finditer(err)} == set(range(world)), err


def _init_fails(rank: int, world: int) -> str:
    with pytest.raises(ValueError) as info:
        dist.init_process_group("xdev", rank=rank, world_size=world)
    return str(info.value)


def test_hosts_with_different_cost_models_refuse_to_start(tmp_path: Path) -> None:
    # Each host calibrated on its own: with other network models the hosts would choose
    # differently (two levels on one, Gloo's ring on the other) and wait for each other until
    # the timeout. The group refuses to start instead, on every rank, naming the difference.
    (tmp_path / "slow").mkdir()
    (tmp_path / "fast").mkdir()
    slow = _network_model(tmp_path / "slow", net_latency_us=5000.0)
    fast = _network_model(tmp_path / "fast", net_latency_us=1.0)
    hosts = _hosts_env([2, 2])
    env = [{**e, "XDEV_CPU_MODEL": slow if r < 2 else fast} for r, e in enumerate(hosts)]
    for rank, message in enumerate(run_ranks(_init_fails, 4, per_rank_env=env, timeout=180)):
        assert "different settings" in message, (rank, message)
        assert "net_latency_us=5000, rank 2: net_latency_us=1" in message, (rank, message)


def test_killed_rank_mid_pipeline_fails_every_rank_of_every_host(tmp_path: Path) -> None:
    # Slow streams, so the 256 KiB allreduce after the kill runs two levels in 4 pieces.
    model = _network_model(tmp_path, net_stream_gbps=0.01)
    env = [{**e, "XDEV_CPU_MODEL": model, "XDEV_TWO_LEVEL_PIECES": "4"} for e in _hosts_env([2, 2])]
    results = run_ranks(
        _killed_on_one_host, 4, 3, 1 << 16, per_rank_env=env, timeout=240, expect_dead=(3,)
    )
    messages = [m for m, _ in results[:3]]
    assert all(messages), messages
    times = [seconds for _, seconds in results[:3]]
    assert all(t < TIMEOUT_S / 3 for t in times), list(zip(times, messages))
    # Its host's other rank sees it exit in the first piece's reduce-scatter inside the host.
    assert "exited" in messages[2] and "group ranks 2, 3" in messages[2], messages[2]


def _mismatched_in_pieces(rank: int, world: int) -> list[str]:
    """Mismatched allreduces in 4 pieces: every rank fails, and the group goes on."""
    dist.init_process_group("xdev", rank=rank, world_size=world)
    messages = []
    # Rank 3 alone differs: host 1's check fails before its ranks send their calls across
    # hosts, and they refuse instead. Then both hosts agree among themselves and differ from
    # each other: their calls leave during the first piece's reduce-scatter and differ.
    for numel in (80000 + (rank == 3), 80000 + 7 * (rank >= 2)):
        with pytest.raises(dist.DistBackendError) as info:
            dist.all_reduce(torch.ones(numel))
        messages.append(str(info.value))
    _assert_sums(80000)
    assert "4 pipelined pieces" in torch_xdev.describe()["last_allreduce"][1]
    dist.destroy_process_group()
    return messages


def test_mismatch_in_pieces_fails_every_rank_of_every_host(tmp_path: Path) -> None:
    # Slow streams: two levels at these sizes, forced into 4 pieces of 80 KB slices.
    model = _network_model(tmp_path, net_stream_gbps=0.01)
    env = [{**e, "XDEV_CPU_MODEL": model, "XDEV_TWO_LEVEL_PIECES": "4"} for e in _hosts_env([2, 2])]
    for rank, (own_host, hosts) in enumerate(
        run_ranks(_mismatched_in_pieces, 4, per_rank_env=env, timeout=180)
    ):
        assert "mismatched collectives" in own_host and "timed out" not in own_host, own_host
        # Host 0's ranks learn of rank 3's call from host 1's refusal across hosts.
        assert (rank < 2) == ("on different hosts" in own_host), (rank, own_host)
        assert "on different hosts" in hosts and "80007 element(s)" in hosts, (rank, hosts)
        assert "cut in 4 pieces" in hosts, (rank, hosts)


def _auto_pieces(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((1 << 20,), float(world)))
    info = torch_xdev.describe()
    dist.destroy_process_group()
    return info


def test_the_model_pipelines_only_with_cores_to_overlap() -> None:
    info = run_ranks(_auto_pieces, 4, per_rank_env=_hosts_env([2, 2]))[0]
    assert info["two_level_pieces"] == 0  # the model's choice
    _, reason = info["last_allreduce"]
    assert "two-level" in reason, reason
    if (os.cpu_count() or 1) <= 2:
        # Two local ranks per host on 2 cores: no core is left for the engine's stream beside
        # the steps inside the host, so pieces would only add their fixed costs.
        assert "pieces" not in reason, reason
