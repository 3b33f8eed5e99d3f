"""Groups made again on a store that still holds the keys of the groups before them.

- torchrun's restarts (``--max-restarts``) on one host: a rank dies, torchrun starts every
  worker again, and the new attempt trains on xdev as if it were the first. torchrun keeps its
  store across attempts, so the failed attempt's keys are still there. The workers train a
  small DDP model; in the first attempt rank 1 exits at step 2. The second attempt's
  parameters must equal a reference computed here, on every rank, and no shared memory is
  left.
- The same processes destroying and making the default group again, several times, on one
  store they keep: each round's DDP step must give the reference's gradients.

- A group name that comes back after a destroy with other members (c10d numbers subgroups
  from 1 again).

xdev names its keys after the attempt, the group's members and how many backends of that name
and membership the process has made (``store_of_this_backend``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torch_xdev  # noqa: F401  (registers "xdev" for the ranks run_ranks starts)
from harness import free_port, run_ranks, subprocess_env

STEPS = 5
WIDTH = 16
LAUNCH_TIMEOUT_S = 240.0

WORKER = textwrap.dedent(f"""
    import os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    import torch_xdev

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("xdev", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear({WIDTH}, {WIDTH}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range({STEPS}):
        x = torch.randn(4, {WIDTH}, generator=torch.Generator().manual_seed(step)) + rank
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if attempt == 0 and step == 2 and rank == 1:
            os._exit(3)  # dies without a word, as a killed worker does
    weight = model.module.weight.detach()
    torch.save(weight, os.path.join(sys.argv[1], f"attempt{{attempt}}_rank{{rank}}.pt"))
    dist.destroy_process_group()
    """)


def _reference_weight(world: int) -> torch.Tensor:
    """The weight after STEPS steps of SGD on the mean of every rank's gradient."""
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, WIDTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(world):
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step)) + rank
            (model(x).square().mean() / world).backward()
        optimizer.step()
    return model.weight.detach()


def _xdev_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("xdev-")}


@pytest.mark.slow
@pytest.mark.parametrize("rendezvous", ["static", "standalone"])
def test_a_restarted_attempt_trains_as_the_first_would(tmp_path: Path, rendezvous: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = subprocess_env(drop=("XDEV_", "TORCHELASTIC_"))
    env["OMP_NUM_THREADS"] = "1"
    # "static": torchrun's own store at a given port, its classic form; "standalone": the c10d
    # rendezvous on a free port. Each keeps one store for all attempts.
    where = (
        ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        if rendezvous == "static"
        else ["--standalone"]
    )
    segments_before = _xdev_segments()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        + ["--max-restarts", "1", *where, str(script), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "exitcode: 3" in output, output  # the first attempt did fail
    assert not list(tmp_path.glob("attempt0_*")), output
    expected = _reference_weight(2)
    weights = [torch.load(tmp_path / f"attempt1_rank{rank}.pt") for rank in range(2)]
    assert torch.equal(weights[0], weights[1])
    torch.testing.assert_close(weights[0], expected, rtol=1e-5, atol=1e-6)
    assert _xdev_segments() <= segments_before


def _rounds_on_one_store(rank: int, world: int, port: int) -> list[float]:
    """Three rounds of init, one DDP step, destroy, on one TCPStore that outlives them."""
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    sums = []
    for _ in range(3):
        dist.init_process_group("xdev", store=store, rank=rank, world_size=world)
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(WIDTH, WIDTH))
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0)) + rank
        model(x).square().mean().backward()
        sums.append(model.module.weight.grad.sum().item())
        dist.destroy_process_group()
    return sums


def test_groups_made_again_on_the_same_store() -> None:
    # Each round read the last round's keys (setup verdicts, Gloo addresses, segment names):
    # the second failed at once on a peer's closed port or its unlinked segment.
    results = run_ranks(_rounds_on_one_store, 2, free_port(), timeout=180)
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, WIDTH)
    for rank in range(2):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0)) + rank
        (model(x).square().mean() / 2).backward()
    assert model.weight.grad is not None
    expected = model.weight.grad.sum().item()
    for sums in results:
        assert sums == pytest.approx([expected] * 3, rel=1e-5), (sums, expected)


def _a_group_name_back_with_other_members(rank: int, world: int, directory: str) -> list[float]:
    """Two rounds on fresh stores; c10d names each round's first subgroup "1", with members
    [0, 1] and then [1, 2]: rank 1 has made a backend of that name before, rank 2 has not."""
    sums = []
    for round_, members in enumerate(([0, 1], [1, 2])):
        store = dist.FileStore(os.path.join(directory, f"round{round_}"), world)
        dist.init_process_group("xdev", store=store, rank=rank, world_size=world)
        group = dist.new_group(members, timeout=timedelta(seconds=20))
        if rank in members:
            summed = torch.full((4,), float(rank + 1))
            dist.all_reduce(summed, group=group)
            sums.append(summed[0].item())
        dist.barrier()
        dist.destroy_process_group()
    return sums


def test_a_group_name_that_comes_back_with_other_members(tmp_path: Path) -> None:
    # The keys were named after the backends each process had made for the name: ranks 1
    # and 2 waited for each other under different keys until the timeout.
    results = run_ranks(_a_group_name_back_with_other_members, 3, str(tmp_path), timeout=120)
    assert results == [[3.0], [3.0, 5.0], [5.0]], results
