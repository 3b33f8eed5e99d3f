"""All-gather and reduce-scatter across hosts by the two-level plan, on one machine.

XDEV_HOSTNAME gives each rank a host name, so one box holds "hosts" of several ranks. Inputs
are small integers (as floats, or an integer dtype), so every sum is exact whatever its order:
each result must equal, bit for bit, a reference the test computes from every rank's input,
and so hold the same bits on every rank. One layout numbers its ranks host by host, as
torchrun does; the other interleaves the hosts (rank r on host r % 3), which the plan must
place through its host-major copy. Broadcasts from roots on different hosts run in two levels
too. The list forms (all_gather into a list, reduce_scatter from one, all_gather_coalesced)
run as one flat copy of the tensor forms; uneven list sizes go to the engine and say why.
Hosts of different sizes go to the engine and say why.
Last, two torchrun launchers on this machine, one per fake host, train the DDP example.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torch_xdev
from collective_cases import check_lent_memory_overlaps
from harness import free_port, run_ranks, subprocess_env

# Elements per rank. 1531 spans many 4 KiB slots; up to there what a rank sends across hosts
# rides in the exchange of calls, at 17011 (68 KB a block) it goes by Gloo.
BLOCKS = (0, 1, 7, 1531, 17011)
DTYPES = (torch.float32, torch.int32)
SMALL_SLOT = 4096
REPO = Path(__file__).resolve().parents[1]


def _input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randint(-50, 50, (numel,), generator=g, dtype=torch.int64).to(dtype)


def _reduce_reference(
    full: list[torch.Tensor], op: dist.ReduceOp.RedOpType, world: int
) -> torch.Tensor:
    """Every rank's full input summed exactly in int64, then as the dtype (AVG: divided there,
    integers truncated toward zero)."""
    total = torch.stack([t.to(torch.int64) for t in full]).sum(0).to(full[0].dtype)
    if op != dist.ReduceOp.AVG:
        return total
    return total / world if total.is_floating_point() else total.div(world, rounding_mode="trunc")


def _cases(rank: int, world: int, layout: str) -> dict[str, Any]:
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the checker's group
    group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(shm_slot_bytes=SMALL_SLOT))
    gathers: list[torch.Tensor] = []
    paths: set[str] = set()
    leader_forms: set[bool] = set()  # whether each tensor-form call ran in the leader form
    for d, dtype in enumerate(DTYPES):
        for block in BLOCKS:
            seed = d * 100 + block
            # all_gather_into_tensor: every rank's block at its rank's place.
            blocks = [_input(seed, r, block, dtype) for r in range(world)]
            out = torch.full((world * block,), 7, dtype=dtype)
            dist.all_gather_into_tensor(out, blocks[rank], group=group)
            assert torch.equal(out, torch.cat(blocks)), (layout, dtype, block)
            gathers.append(out.to(torch.float64))
            paths.add(torch_xdev.describe(group)["last_gather_scatter"][1])
            leader_forms.add("leader form" in torch_xdev.describe(group)["last_gather_scatter"][2])
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                # reduce_scatter_tensor: block `rank` of every rank's full input, reduced.
                full = [_input(seed + 1, r, world * block, dtype) for r in range(world)]
                got = torch.full((block,), 7, dtype=dtype)
                dist.reduce_scatter_tensor(got, full[rank], op=op, group=group)
                expected = _reduce_reference(full, op, world)[rank * block : (rank + 1) * block]
                assert torch.equal(got, expected), (layout, dtype, block, op)
                paths.add(torch_xdev.describe(group)["last_gather_scatter"][1])
                reason = torch_xdev.describe(group)["last_gather_scatter"][2]
                leader_forms.add("leader form" in reason)
    reason = torch_xdev.describe(group)["last_gather_scatter"][2]
    # The coalesced all-gather (FSDP2's form) with blocks of two dtypes and sizes.
    shapes = [(5, torch.float32), (300, torch.int64)]
    ins = [[_input(900 + i, r, n, dt) for i, (n, dt) in enumerate(shapes)] for r in range(world)]
    outs = [torch.empty(world * n, dtype=dt) for n, dt in shapes]
    with dist._coalescing_manager(group=group):
        for o, i in zip(outs, ins[rank]):
            dist.all_gather_into_tensor(o, i, group=group)
    for k, o in enumerate(outs):
        assert torch.equal(o, torch.cat([ins[r][k] for r in range(world)])), (layout, k)
    paths.add(torch_xdev.describe(group)["last_gather_scatter"][1])
    # In the leader form an all-gather's input that overlapped its output was read after
    # it had been overwritten.
    check_lent_memory_overlaps(rank, world, group, 1531)
    paths.add(torch_xdev.describe(group)["last_gather_scatter"][1])
    _list_forms(rank, world, group, gathers, paths)
    # Broadcast from a root on each host, of tensors of two dtypes (one strided), and one too
    # large to ride in the check across hosts (the engine's broadcast follows it).
    broadcast_paths: set[str] = set()
    for root in (0, world - 1):
        a = torch.arange(1000, dtype=torch.float64) * (root + 1)
        b = torch.arange(12, dtype=torch.int16).view(3, 4) - root
        c = torch.arange(20000, dtype=torch.float64) - root
        mine_a = a.clone() if rank == root else torch.zeros_like(a)
        mine_b = b.t().clone().t() if rank == root else torch.zeros_like(b).t().contiguous().t()
        mine_c = c.clone() if rank == root else torch.zeros_like(c)
        for mine in (mine_a, mine_b, mine_c):
            dist.broadcast(mine, src=root, group=group)
            broadcast_paths.add(torch_xdev.describe(group)["last_broadcast"][0])
        assert torch.equal(mine_a, a) and torch.equal(mine_b, b), (layout, root)
        assert torch.equal(mine_c, c), (layout, root)
    # The same bits on every rank of every host (the all-gathers' outputs).
    gathered = torch.cat(gathers)
    everyone = [torch.empty_like(gathered) for _ in range(world)]
    dist.all_gather(everyone, gathered)
    assert all(torch.equal(e, everyone[0]) for e in everyone)
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    return {
        "paths": sorted(paths),
        "reason": reason,
        "leader_forms": sorted(leader_forms),
        "broadcast_paths": sorted(broadcast_paths),
    }


def _list_forms(
    rank: int, world: int, group: Any, gathers: list[torch.Tensor], paths: set[str]
) -> None:
    """all_gather into a list, reduce_scatter from one, all_gather_coalesced: equal sizes run
    as one flat copy of the two-level tensor form; uneven ones go to the engine and say why."""
    for d, dtype in enumerate(DTYPES):
        # A 3 x 37 block per rank; the outputs are transposed views, written back in place.
        blocks = [_input(700 + d, r, 111, dtype).view(3, 37) for r in range(world)]
        outs = [torch.full((37, 3), 7, dtype=dtype).t() for _ in range(world)]
        dist.all_gather(outs, blocks[rank], group=group)
        for r in range(world):
            assert torch.equal(outs[r], blocks[r]), (dtype, r)
        gathers.append(torch.cat([o.flatten() for o in outs]).to(torch.float64))
        paths.add(torch_xdev.describe(group)["last_gather_scatter"][1])
        ops = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
        for op in ops:
            # Rank r's list: one piece of 1531 elements per rank (many 4 KiB slots).
            pieces = [
                [_input(800 + d + j, r, 1531, dtype) for j in range(world)] for r in range(world)
            ]
            got = torch.full((1531,), 7, dtype=dtype)
            dist.reduce_scatter(got, pieces[rank], op=op, group=group)
            expected = _reduce_reference([pieces[r][rank] for r in range(world)], op, world)
            assert torch.equal(got, expected), (dtype, op)
            paths.add(torch_xdev.describe(group)["last_gather_scatter"][1])
    # all_gather_coalesced (one dtype, torch asks): outputs[r][i] = rank r's input i.
    shapes = [(5,), (20, 15)]
    ins = [
        [
            _input(950 + i, r, 5 if i == 0 else 300, torch.int64).view(s)
            for i, s in enumerate(shapes)
        ]
        for r in range(world)
    ]
    coalesced = [[torch.empty_like(t) for t in ins[rank]] for _ in range(world)]
    dist.all_gather_coalesced(coalesced, ins[rank], group=group)
    for r in range(world):
        for i in range(len(shapes)):
            assert torch.equal(coalesced[r][i], ins[r][i]), (r, i)
    paths.add(torch_xdev.describe(group)["last_gather_scatter"][1])
    # Uneven sizes (rank j's entry holds j + 1 elements): the engine's, padded to one size.
    sizes = [j + 1 for j in range(world)]
    uneven = [torch.full((n,), -1, dtype=torch.int32) for n in sizes]
    mine = torch.arange(sizes[rank], dtype=torch.int32) + 10 * rank
    dist.all_gather(uneven, mine, group=group)
    for j, n in enumerate(sizes):
        assert torch.equal(uneven[j], torch.arange(n, dtype=torch.int32) + 10 * j), j
    name, path, reason = torch_xdev.describe(group)["last_gather_scatter"]
    assert (name, path) == ("all_gather", "fallback"), (name, path, reason)
    assert "uneven list sizes" in reason, reason


def _slow_network_model(tmp_path: Path, host_cores: int = 1) -> str:
    # On this 2-core machine's host model the engine's ring is predicted faster for small
    # payloads; a slow network in the cost model makes the two-level plan win at every size.
    # With one core per host a host's streams take turns, so the leader form wins where it
    # fits; with a core per rank every rank crosses hosts.
    model = tmp_path / "model.json"
    params = {"net_latency_us": 5000.0, "net_host_cores": host_cores}
    model.write_text(json.dumps({"params": params}))
    return str(model)


LAYOUTS = {
    "2x2": ["host-0", "host-0", "host-1", "host-1"],
    "3x2-interleaved": ["host-0", "host-1", "host-2"] * 2,
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_level_gather_scatter(layout: str, tmp_path: Path) -> None:
    hosts = LAYOUTS[layout]
    model = _slow_network_model(tmp_path)
    env = [{"XDEV_HOSTNAME": h, "XDEV_CPU_MODEL": model} for h in hosts]
    results = run_ranks(_cases, len(hosts), layout, per_rank_env=env, timeout=300)
    for result in results:
        assert result["paths"] == ["two_level"], result
        assert result["broadcast_paths"] == ["two_level"], result
        assert "two-level reduce_scatter" in result["reason"], result["reason"]
        # Two fake hosts' streams share this machine's cores: payloads that ride whole in the
        # exchange take the leader form, the largest blocks go by the engine from every rank.
        assert result["leader_forms"] == [False, True], result


def _uneven(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    block = 11
    full = [_input(5, r, world * block, torch.float32) for r in range(world)]
    got = torch.empty(block)
    dist.reduce_scatter_tensor(got, full[rank])
    expected = _reduce_reference(full, dist.ReduceOp.SUM, world)[rank * block : (rank + 1) * block]
    assert torch.equal(got, expected)
    out = torch.empty(world * block)
    dist.all_gather_into_tensor(out, full[rank][:block])
    assert torch.equal(out, torch.cat([f[:block] for f in full]))
    last = torch_xdev.describe()["last_gather_scatter"]
    b = torch.arange(5.0) if rank == 4 else torch.zeros(5)
    dist.broadcast(b, src=4)
    assert torch.equal(b, torch.arange(5.0))
    broadcast = torch_xdev.describe()["last_broadcast"]
    dist.destroy_process_group()
    return {"last": last, "broadcast": broadcast}


def test_hosts_of_different_sizes_take_the_engine_and_say_why() -> None:
    hosts = [{"XDEV_HOSTNAME": "host-a"}] * 3 + [{"XDEV_HOSTNAME": "host-b"}] * 2
    for result in run_ranks(_uneven, 5, per_rank_env=hosts):
        name, path, reason = result["last"]
        assert (name, path) == ("all_gather", "fallback"), result
        assert "different numbers of ranks" in reason, reason
        path, reason = result["broadcast"]
        assert path == "fallback" and "different numbers of ranks" in reason, result


def _uneven_list_refusals(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("xdev", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    sizes = [j + 1 for j in range(world)]  # rank j's entry holds j + 1 elements

    def gather(entry_sizes: list[int], numel: int) -> list[torch.Tensor]:
        out = [torch.full((n,), -1, dtype=torch.int32) for n in entry_sizes]
        dist.all_gather(out, torch.arange(numel, dtype=torch.int32) + 10 * rank)
        return out

    bad: dict[str, Any] = {
        # Rank 3's input does not match its own entry: it alone can tell.
        "own_entry": lambda: gather(sizes, sizes[rank] + (rank == 3)),
        # Rank 1 believes rank 2 sends 2 elements: the same largest entry, so the pads agree.
        "lists_differ": lambda: gather([1, 2, 2, 4] if rank == 1 else sizes, sizes[rank]),
        # Rank 2's list misses its first entry (the largest stays).
        "short_list": lambda: gather(sizes[1:] if rank == 2 else sizes, sizes[rank]),
    }
    errors: dict[str, str] = {}
    for name, call in bad.items():
        try:
            call()
            errors[name] = ""
        except (ValueError, RuntimeError) as e:
            errors[name] = str(e)
        # The group stays usable: the next (good) uneven all-gather is exact.
        got = gather(sizes, sizes[rank])
        for j, n in enumerate(sizes):
            assert torch.equal(got[j], torch.arange(n, dtype=torch.int32) + 10 * j), (name, j)
    path = torch_xdev.describe()["last_gather_scatter"][1]
    dist.destroy_process_group()
    return {"errors": errors, "path": path}


def test_uneven_list_across_hosts_refused_on_every_rank() -> None:
    """An uneven all-gather list goes to Gloo padded to its largest entry, behind a header
    every rank reads. A rank whose input or list is wrong must fail every rank, with the group
    usable, where it would leave its peers in Gloo until the timeout, or copy out the wrong
    elements (lists that differ under pads of one length)."""
    hosts = [{"XDEV_HOSTNAME": h} for h in LAYOUTS["2x2"]]
    results = run_ranks(_uneven_list_refusals, 4, per_rank_env=hosts, timeout=200)
    for rank, result in enumerate(results):
        assert result["path"] == "fallback", result
        errors = result["errors"]
        own = errors["own_entry"]
        assert ("its own tensor" if rank == 3 else "rank 3 refused the call") in own, (rank, own)
        assert "output lists differ" in errors["lists_differ"], (rank, errors["lists_differ"])
        short = errors["short_list"]
        assert ("one tensor per rank" if rank == 2 else "rank 2 refused") in short, (rank, short)


def _uneven_list_asynchronous(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("xdev", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    sizes = [j + 1 for j in range(world)]
    out = [torch.full((n,), -1, dtype=torch.int32) for n in sizes]
    mine = torch.arange(sizes[rank], dtype=torch.int32) + 10 * rank
    token = torch.tensor([7 + rank])
    # An async all-gather, then a send its peer waits for before it joins the all-gather:
    # legal, and it must not wait for the peers when it is issued.
    if rank == 0:
        work = dist.all_gather(out, mine, async_op=True)
        dist.send(token, 1)
        work.wait()
    else:
        if rank == 1:
            dist.recv(token, 0)
        dist.all_gather(out, mine)
    for j, n in enumerate(sizes):
        assert torch.equal(out[j], torch.arange(n, dtype=torch.int32) + 10 * j), j
    # Entries of one size, shaped otherwise than the input on some ranks (mixed on rank 0, all
    # alike on rank 1): the same bytes on every rank.
    by_rank: dict[int, list[tuple[int, ...]]] = {
        0: [(2, 3)] + [(6,)] * (world - 1),
        1: [(3, 2)] * world,
    }
    shapes = by_rank.get(rank, [(6,)] * world)
    same = [torch.full(s, -1, dtype=torch.int32) for s in shapes]
    dist.all_gather(same, torch.arange(6, dtype=torch.int32) + 10 * rank)
    for j in range(world):
        assert torch.equal(same[j].reshape(-1), torch.arange(6, dtype=torch.int32) + 10 * j), j
    path = torch_xdev.describe()["last_gather_scatter"][1]
    dist.destroy_process_group()
    return {"token": int(token), "path": path}


def test_uneven_list_across_hosts_stays_asynchronous() -> None:
    hosts = [{"XDEV_HOSTNAME": f"host-{r}"} for r in range(3)]  # one rank per host: the engine's
    results = run_ranks(_uneven_list_asynchronous, 3, per_rank_env=hosts, timeout=200)
    assert results[1]["token"] == 7, results
    assert all(result["path"] == "fallback" for result in results), results


@pytest.mark.slow
def test_torchrun_two_nodes_on_one_machine(tmp_path: Path) -> None:
    """`torchrun --nnodes 2`: two launchers, one per fake host, sharing a c10d rendezvous."""
    if shutil.which("torchrun") is None and not _has_module("torch.distributed.run"):
        pytest.skip("torchrun is not installed")
    env = subprocess_env()
    env["OMP_NUM_THREADS"] = "1"
    env["XDEV_CPU_MODEL"] = _slow_network_model(tmp_path)  # two levels at every size
    endpoint = f"127.0.0.1:{free_port()}"
    launchers = []
    for node in range(2):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "2",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            endpoint,
            "--rdzv_id",
            "xdev-nnodes-test",
            # Both launchers are on this machine: say which one serves the rendezvous store.
            "--rdzv_conf",
            f"is_host={'true' if node == 0 else 'false'}",
            "--local_addr",
            "127.0.0.1",
            str(REPO / "examples" / "ddp_train.py"),
            "--steps",
            "3",
            "--comm-share-steps",
            "0",
        ]
        launchers.append(
            subprocess.Popen(
                command,
                cwd=REPO,
                env={**env, "XDEV_HOSTNAME": f"node-{node}"},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for launcher in launchers:
            outputs.append(launcher.communicate(timeout=120)[0])
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.communicate()
    for launcher, output in zip(launchers, outputs):
        assert launcher.returncode == 0, output
    everything = "\n".join(outputs)
    assert "training on 4 rank(s)" in everything, everything
    # The gradient allreduce ran two levels: 2 hosts of 2 ranks.
    assert (
        "xdev gradient allreduce: two_level (flat inside each host; 2 hosts x 2 ranks: two-level"
        in everything
    ), everything


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
