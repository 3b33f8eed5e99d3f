"""DDP on xdev against DDP on Gloo: same seed, same data, same result.

One group of 4 real processes (spawned once for the module: importing torch and DDP costs
each process ~10 s of CPU on a small machine) trains every configuration in RUNS one after
another, creating and destroying the process group each time, and saves each rank's final
parameters and losses. The tests below then compare them. A last test launches the example
through torchrun exactly as a user would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_xdev

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "ddp_train.py"
sys.path.insert(0, str(EXAMPLE.parent))
import ddp_train  # noqa: E402  (examples/ is not a package)
from harness import free_port, subprocess_env  # noqa: E402

WORLD_SIZE = 4
STEPS = 10
SEED = 3
SPAWN_TIMEOUT_S = 240.0  # the whole group of processes, all runs
COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a hung collective fails instead of hanging
LAUNCH_TIMEOUT_S = 180.0

# name -> (backend, TrainConfig overrides). Every xdev run is compared with the Gloo run of
# the same DDP flags.
RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "gloo": ("gloo", {}),
    "xdev": ("xdev", {}),
    "xdev-reduce_to_one": ("xdev", {"algorithm": "reduce_to_one"}),
    "xdev-hierarchical_copy": ("xdev", {"algorithm": "hierarchical_copy"}),
    "gloo-unused": ("gloo", {"find_unused_parameters": True}),
    "xdev-unused": ("xdev", {"find_unused_parameters": True}),
    "gloo-bucketview": ("gloo", {"gradient_as_bucket_view": True}),
    "xdev-bucketview": ("xdev", {"gradient_as_bucket_view": True}),
    # torch_xdev.avg_comm_hook: AVG in the allreduce, against DDP's SUM of divided gradients.
    "xdev-avg_hook": ("xdev", {"gradient_as_bucket_view": True, "avg_hook": True}),
    # No DDP: gradients in a torch_xdev.shared_empty buffer, compared with Gloo's plain DDP.
    "xdev-shared_grads": ("xdev", {"shared_grads": True}),
}
XDEV_RUNS = [name for name, (backend, _) in RUNS.items() if backend == "xdev"]


def gloo_twin(name: str) -> str:
    """The Gloo run with the same DDP flags as the xdev run ``name``."""
    xdev_only = ("algorithm", "shared_grads", "avg_hook")
    overrides = {k: v for k, v in RUNS[name][1].items() if k not in xdev_only}
    for other, (backend, other_overrides) in RUNS.items():
        if backend == "gloo" and other_overrides == overrides:
            return other
    raise KeyError(f"no gloo run matches {name}")


def make_config(name: str) -> ddp_train.TrainConfig:
    backend, overrides = RUNS[name]
    return ddp_train.TrainConfig(
        backend=backend, steps=STEPS, seed=SEED, timeout=COLLECTIVE_TIMEOUT, **overrides
    )


def _worker(rank: int, port: int, out_dir: str) -> None:
    """One rank: trains every run in RUNS and saves what it ended with."""
    torch.set_num_threads(1)
    base = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    results: dict[str, dict[str, Any]] = {}
    for name in RUNS:
        # A fresh key space per run, so groups created one after another never see each
        # other's keys.
        store = dist.PrefixStore(f"{name}/", base)
        result = ddp_train.train(make_config(name), rank=rank, world_size=WORLD_SIZE, store=store)
        results[name] = {
            "params": torch.cat([p.detach().reshape(-1) for p in result.model.parameters()]),
            "losses": result.losses,
            "mean_losses": result.mean_losses,
            "allreduce": result.allreduce,
        }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _join_with_deadline(context: mp.ProcessContext, timeout_s: float) -> None:
    """Waits for every process; kills them all if they have not finished by the deadline."""
    deadline = time.monotonic() + timeout_s
    try:
        # join() raises ProcessRaisedException/ProcessExitedException when a process failed
        # (and terminates the others then); it returns True once all have exited cleanly.
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"DDP processes still running after {timeout_s:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    """Every rank's results, indexed [rank][run name]."""
    out_dir = tmp_path_factory.mktemp("ddp")
    # The parent hosts the store on a port the OS chose (port 0), so there is no window in
    # which another process could take the port between choosing and binding it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with pytest.MonkeyPatch.context() as mpatch:
        # Spawned children inherit the environment: one thread each (2-core machines), and
        # no XDEV_* override may change what the runs ask for.
        mpatch.setenv("OMP_NUM_THREADS", "1")
        for _, variable, _ in torch_xdev.ENV_KNOBS:
            mpatch.delenv(variable, raising=False)
        context = mp.start_processes(
            _worker,
            args=(store.port, str(out_dir)),
            nprocs=WORLD_SIZE,
            join=False,
            start_method="spawn",
        )
    _join_with_deadline(context, SPAWN_TIMEOUT_S)
    del store
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD_SIZE)]


@pytest.mark.slow
@pytest.mark.parametrize("name", XDEV_RUNS)
def test_xdev_matches_gloo(results: list[dict[str, dict[str, Any]]], name: str) -> None:
    twin = gloo_twin(name)
    for rank in range(WORLD_SIZE):
        ours, theirs = results[rank][name], results[rank][twin]
        # Both backends sum the same fp32 gradients, but in different orders (Gloo's ring vs
        # xdev's reduce-scatter/allgather, reduce-to-one or hierarchical copy), and fp32
        # addition is not associative: a step's summed gradient may differ in its last bit or
        # two, so bitwise equality with Gloo cannot be asked for. Ten SGD steps at lr 0.1 keep
        # that at rounding level: measured, the largest difference is ~3e-8 on parameters of
        # size ~0.1 (a quarter of them differ at all). atol=1e-6 covers entries near zero, where
        # a relative bound means nothing, with ~30x headroom; rtol=1e-5 is ~100 fp32 ulps. Any
        # real error (a missing division by the world size, a dropped or doubled rank, a stale
        # or misplaced bucket) moves parameters by 1e-3 or more and fails by orders of magnitude.
        torch.testing.assert_close(
            ours["params"],
            theirs["params"],
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m: f"rank {rank}: {name} vs {twin}: {m}",
        )
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", XDEV_RUNS)
def test_xdev_ranks_bitwise_identical(results: list[dict[str, dict[str, Any]]], name: str) -> None:
    # Every rank applies the same allreduced gradients to the same initial parameters, so
    # unless some rank got different allreduce results the parameters agree bit for bit.
    reference = results[0][name]["params"]
    for rank in range(1, WORLD_SIZE):
        params = results[rank][name]["params"]
        assert torch.equal(params, reference), (
            f"{name}: rank {rank} differs from rank 0 in {(params != reference).sum().item()} "
            f"of {params.numel()} parameters (max |diff| {(params - reference).abs().max():.3g})"
        )
        # The loss averaged through an allreduce must be the same everywhere too.
        assert results[rank][name]["mean_losses"] == results[0][name]["mean_losses"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_loss_decreases(results: list[dict[str, dict[str, Any]]], name: str) -> None:
    losses = results[0][name]["mean_losses"]
    assert len(losses) == STEPS
    # Single steps are noisy (each sees a fresh batch); the trend is not.
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.9 * first, f"{name}: loss did not fall: {losses}"


@pytest.mark.slow
@pytest.mark.parametrize("name", XDEV_RUNS)
def test_xdev_reports_native_allreduce(results: list[dict[str, dict[str, Any]]], name: str) -> None:
    selection: Optional[tuple[str, str]] = results[0][name]["allreduce"]
    assert selection is not None, f"{name}: describe() reported no allreduce"
    algorithm, reason = selection
    requested = make_config(name).algorithm
    if make_config(name).shared_grads:
        assert "shared buffer" in reason, (algorithm, reason)  # in place, not staged
    if requested == "auto":
        assert algorithm not in ("auto", "fallback"), (algorithm, reason)
    elif not make_config(name).find_unused_parameters:
        # With find_unused_parameters DDP's last allreduce is its int32 usage bitmap, not
        # the gradients; otherwise it must be the forced algorithm.
        assert algorithm == requested, (algorithm, reason)


@pytest.mark.slow
def test_example_under_torchrun() -> None:
    env = subprocess_env()
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(EXAMPLE),
        "--steps",
        "3",
    ]
    proc = subprocess.run(
        command,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    loss_lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(loss_lines) == 3, output  # rank 0 only, one per step
    assert all(" loss " in line for line in loss_lines), output
    assert "final loss" in proc.stdout, output
    assert "xdev gradient allreduce:" in proc.stdout, output
