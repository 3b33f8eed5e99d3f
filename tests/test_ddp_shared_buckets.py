"""DDP with shared buckets: every DDP feature, with its gradient buckets in xdev's symmetric heap.

Under ``DDP_DISABLE_COMM_MEM=0`` (which ``import torch_xdev`` sets on a machine without GPUs)
DDP allocates each gradient bucket through its group's backend, and xdev places it in the
group's symmetric heap, memory every rank maps, so the bucket's allreduce runs in place. Each
case of tests/ddp_shared_bucket_cases.py trains the same model on the same data twice, on xdev
and on Gloo, and the tests here check:

- the result: xdev's parameters equal Gloo's within rounding, and are bitwise identical on
  every rank that must agree;
- that the buckets really were shared: while the models live, the heap holds exactly DDP's
  buckets (their sizes, each rounded up to the heap's 256-byte blocks) and nothing else, it
  holds nothing once the models are gone, and where the last allreduce was a bucket its
  reason names the heap; the heap counts bucket allreduces that ran in place and none that
  staged; with gradient_as_bucket_view every .grad lies in the heap's memory.

One group of 4 processes (spawned once for the module: importing torch costs each ~10 s of
CPU on a 2-core machine) runs every case, creating and destroying its process groups each
time. The leak check runs in 2 processes of its own, so that what it counts (file
descriptors, mappings) is not disturbed by the cases.
"""

from __future__ import annotations

import gc
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_xdev

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_shared_bucket_cases import (  # noqa: E402
    BUCKET_CAP_MB,
    CASES,
    COLLECTIVE_TIMEOUT,
    PAIRS,
    SEED,
    WORLD_SIZE,
    ddp_train,
    loss_of,
    mlp_batch,
    settled_heap,
    worker,
)
from ddp_shared_bucket_run import round_up_to_block  # noqa: E402
from harness import run_ranks  # noqa: E402

SPAWN_TIMEOUT_S = 240.0
MODEL_CHURN = 200  # DDP models built, stepped twice (a bucket rebuild) and dropped
GROUP_CHURN = 200  # xdev groups created, given a DDP model, and destroyed
WARMUP = 20  # iterations before the counts to compare with are taken

Results = list[dict[str, dict[str, Any]]]  # [rank][case][backend]


@pytest.fixture(scope="module")
def clean_env() -> Iterator[dict[str, str]]:
    """Environment for the ranks: no XDEV_* override, and DDP's switch as torch_xdev sets it."""
    with pytest.MonkeyPatch.context() as mpatch:
        for variable in list(os.environ):
            if variable.startswith("XDEV_"):  # options, and the host, topology and cost model
                mpatch.delenv(variable)
        yield {"DDP_DISABLE_COMM_MEM": "0"}


@pytest.fixture(scope="module")
def results(clean_env: dict[str, str]) -> Results:
    """[rank][case][backend] -> what that rank ended with, or {"error": traceback}."""
    return run_ranks(worker, WORLD_SIZE, timeout=SPAWN_TIMEOUT_S, env=clean_env)


def outcome(results: Results, rank: int, name: str, backend: str) -> dict[str, Any]:
    out: dict[str, Any] = results[rank][name][backend]
    assert "error" not in out, f"rank {rank}: {name} on {backend} failed:\n{out['error']}"
    return out


def as_tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)  # fp32 and bf16 values exactly


def compare_with_gloo(results: Results, name: str, rtol: float, atol: float) -> None:
    for rank in range(WORLD_SIZE):
        ours, theirs = outcome(results, rank, name, "xdev"), outcome(results, rank, name, "gloo")
        assert ours["params"].keys() == theirs["params"].keys()
        for part in ours["params"]:
            torch.testing.assert_close(
                as_tensor(ours["params"][part]),
                as_tensor(theirs["params"][part]),
                rtol=rtol,
                atol=atol,
                msg=lambda m: f"rank {rank}: {name} ({part}), xdev vs gloo: {m}",
            )
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=rtol, abs=atol)


COMPARED = [name for name, case in CASES.items() if case.compare]


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPARED)
def test_xdev_matches_gloo(results: Results, name: str) -> None:
    case = CASES[name]
    if case.rtol is None:
        # Gloo's ring and xdev sum the same fp32 gradients in different orders, so a summed
        # gradient may differ in its last bit or two; 6 SGD steps at lr 0.1 keep parameters
        # within ~5e-8 of each other (measured; tests/test_ddp.py finds ~3e-8 for 10 steps).
        # rtol 1e-5 is ~100 ulps, atol 1e-6 covers entries near zero. A real error (a bucket
        # not summed, a rank counted twice, a missing division) moves parameters by 1e-3 or more.
        compare_with_gloo(results, name, rtol=1e-5, atol=1e-6)
    else:
        assert case.atol is not None
        compare_with_gloo(results, name, rtol=case.rtol, atol=case.atol)


def peers_of(part: str) -> list[tuple[int, ...]]:
    """The sets of ranks that must hold the same bits of `part` (see the cases' results)."""
    peers: dict[str, list[tuple[int, ...]]] = {
        "world": [tuple(range(WORLD_SIZE))],
        "pair": list(PAIRS),
        "alone": [],
    }
    return peers[part.split(":")[0]]


@pytest.mark.slow
# A world of one has no peer to compare with (its part is "alone").
@pytest.mark.parametrize("name", [name for name in COMPARED if name != "world_of_one"])
def test_xdev_ranks_bitwise_identical(results: Results, name: str) -> None:
    # The same allreduced gradients applied to the same initial parameters: equal bits, unless
    # some rank got a different allreduce result. (Where a case's final parameters agree by
    # construction, Join's and ZeRO's, it adds a snapshot that does not: "world:...".)
    for part in outcome(results, 0, name, "xdev")["params"]:
        for peers in peers_of(part):
            reference = as_tensor(outcome(results, peers[0], name, "xdev")["params"][part])
            for rank in peers[1:]:
                params = as_tensor(outcome(results, rank, name, "xdev")["params"][part])
                assert torch.equal(params, reference), (
                    f"{name} ({part}): rank {rank} differs from rank {peers[0]} in "
                    f"{(params != reference).sum().item()} of {params.numel()} parameters "
                    f"(max |diff| {(params - reference).abs().max():.3g})"
                )


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.shared])
def test_buckets_were_shared(results: Results, name: str) -> None:
    for rank in range(WORLD_SIZE):
        out = outcome(results, rank, name, "xdev")
        assert out["snapshots"], f"{name}: no heap snapshot taken"
        for snap in out["snapshots"]:
            where = f"rank {rank}, {name}, group {snap['group']}"
            assert snap["shared"], f"{where}: {snap['note']}"
            # Exactly DDP's buckets, and nothing else, lie in the heap while the models live.
            expected = sum(round_up_to_block(b) for b in snap["bucket_bytes"])
            assert expected > 0, where
            assert snap["heap_in_use"] == expected, (where, snap)
            algorithm, reason = snap["last_allreduce"]
            if CASES[name].bucket_allreduce_last:
                assert "symmetric heap" in reason, (where, algorithm, reason)
            # What ran, not only what could: every rank allocates its buckets alike, so no
            # collective found its peers' blocks elsewhere and staged.
            assert snap["heap_staged"] == 0, (where, snap)
            assert (snap["heap_in_place"] > 0) == CASES[name].ran_in_place, (where, snap)
            if snap["grads_in_heap"] is not None:
                # gradient_as_bucket_view: every .grad is a view of a bucket, so in the heap.
                assert snap["grads_in_heap"], (where, snap)
        # Once the models are gone, so are their buckets.
        assert out["heap_after"].keys() == {s["group"] for s in out["snapshots"]}
        for group, heap in out["heap_after"].items():
            assert heap["bytes_in_use"] == 0 and heap["live_blocks"] == 0, (rank, name, group)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if not case.shared])
def test_no_shared_buckets_where_impossible(results: Results, name: str) -> None:
    # A world of one: no heap; DDP's buckets are ordinary tensors.
    for rank in range(WORLD_SIZE):
        out = outcome(results, rank, name, "xdev")
        assert out["snapshots"], f"{name}: no snapshot taken"
        for snap in out["snapshots"]:
            assert not snap["shared"], (rank, name, snap)
            assert snap["heap_in_use"] is None, (rank, name, snap)
            assert snap["note"].startswith("off:"), snap["note"]
            assert "symmetric heap" not in snap["last_allreduce"][1], snap


@pytest.mark.slow
def test_gloo_runs_learn(results: Results) -> None:
    # A check on the cases themselves, not on xdev: every Gloo run's loss falls.
    for name in COMPARED:
        losses = outcome(results, 0, name, "gloo")["losses"]
        first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
        assert last < first, f"{name}: loss did not fall: {losses}"


@pytest.mark.slow
def test_bucket_cap_ignored_after_rebuild(results: Results) -> None:
    # Rank 3 asked for other buckets, yet after DDP's rebuild every rank holds rank 0's.
    layouts = [
        outcome(results, r, "bucket_cap_differs_rebuilt", "xdev")["snapshots"][0]["bucket_bytes"]
        for r in range(WORLD_SIZE)
    ]
    assert all(layout == layouts[0] for layout in layouts), layouts
    assert len(layouts[0]) > 1, layouts  # rank 3's cap alone would make one bucket


@pytest.mark.slow
def test_bucket_sizes_differ_between_ranks(results: Results) -> None:
    """Rank 3's buckets differ from its peers' for good: an error on every rank naming sizes."""
    sizes = [results[r]["bucket_cap_differs"]["sizes"] for r in range(WORLD_SIZE)]
    assert sizes[0] is not None and sizes[0][0] != sizes[0][-1], sizes  # they do differ
    for rank in range(WORLD_SIZE):
        message = results[rank]["bucket_cap_differs"].get("error")
        assert message is not None, f"rank {rank} trained without an error"
        # Found when the ranks compared their calls, not by waiting out a timeout.
        assert "mismatched collectives" in message, message
        assert "timed out" not in message, message
        # The first bucket of each rank, by its element count.
        for first in {s[0] for s in sizes[0]}:
            assert f"{first} element(s)" in message, (sizes[0], message)


@pytest.mark.slow
def test_ddp_mixed_precision(results: Results) -> None:
    """DDP's own mixed precision (bf16 parameters and buckets), where torch runs it on CPU."""
    gloo_errors = [results[r]["mixed_precision"]["gloo"].get("error") for r in range(WORLD_SIZE)]
    xdev_errors = [results[r]["mixed_precision"]["xdev"].get("error") for r in range(WORLD_SIZE)]
    if all(e is not None for e in gloo_errors):
        # xdev must fail the same way, in torch's own code: its own error would hide here.
        for gloo_error, xdev_error in zip(gloo_errors, xdev_errors):
            assert xdev_error is not None, "DDP mixed precision ran on xdev and failed on Gloo"
            assert xdev_error.strip().splitlines()[-1] == gloo_error.strip().splitlines()[-1], (
                xdev_error,
                gloo_error,
            )
        # DDP's mixed precision is not CPU-ready in torch itself, so the Gloo reference fails
        # too: torch 2.13's forward pre-hook records a torch.Event ("cpu backend doesn't
        # support events"), and a CUDA build on a machine without a driver fails in DDP's
        # constructor at torch.Stream(). The bf16_params case trains bf16 buckets in the heap
        # without it.
        lines = gloo_errors[0].strip().splitlines()
        # The exception's own line ("torch.AcceleratorError: CUDA error: ..."), not a hint after it.
        raised = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line.strip())]
        why = (raised[-1] if raised else lines[-1]).strip()
        pytest.skip(f"DDP mixed precision fails on Gloo too in torch {torch.__version__}: {why}")
    # Unmeasured (torch 2.13 cannot run it): over 4 ranks bf16's summation order shows (see
    # case_bf16_params), so loosely, and tighten once it runs.
    compare_with_gloo(results, "mixed_precision", rtol=5e-2, atol=5e-3)


def process_counts() -> dict[str, int]:
    with open("/proc/self/maps") as maps:
        mappings = sum(1 for _ in maps)
    heap = torch_xdev.describe()["symmetric_heap"]
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "maps": mappings,
        "live_blocks": heap["live_blocks"] if heap else 0,
    }


def one_ddp_model(rank: int, group: Optional[dist.ProcessGroup]) -> None:
    model = ddp_train.make_model(SEED)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, process_group=group)
    x, y = mlp_batch(rank, 0)
    loss_of(ddp(x), y).backward()
    loss_of(ddp(x), y).backward()  # DDP rebuilds its buckets before this one


def collect_garbage(first: bool = False) -> None:
    """Frees DDP's reference cycles, and with them its buckets, now.

    A full collection walks every object torch has made (~300,000 once DDP has run: 0.1 s),
    so after the first model the survivors are frozen out of later collections, which then
    walk only what each iteration made.
    """
    gc.collect()
    if first:
        gc.freeze()


def leak_worker(rank: int, world: int) -> dict[str, Any]:
    """{phase: (counts after WARMUP iterations, counts at the end, iterations)}."""
    store = dist.TCPStore(
        "127.0.0.1",
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0,
        timeout=COLLECTIVE_TIMEOUT,
    )
    dist.init_process_group(
        "xdev", store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    phases: dict[str, Any] = {}
    try:
        for i in range(MODEL_CHURN):
            one_ddp_model(rank, None)
            collect_garbage(first=i == 0)
            settled_heap(None)
            if i == WARMUP - 1:
                warm = process_counts()
        phases["models"] = (warm, process_counts(), MODEL_CHURN)
        for i in range(GROUP_CHURN):
            group = dist.new_group(backend="xdev")
            one_ddp_model(rank, group)
            collect_garbage()
            heap = settled_heap(group)
            assert heap is not None and heap["live_blocks"] == 0, (i, heap)
            dist.destroy_process_group(group)
            del group
            if i == WARMUP - 1:
                warm = process_counts()
        phases["groups"] = (warm, process_counts(), GROUP_CHURN)
    finally:
        gc.collect()
        dist.destroy_process_group()
    return phases


@pytest.mark.slow
def test_no_leaks_when_models_and_groups_come_and_go(clean_env: dict[str, str]) -> None:
    counts = run_ranks(leak_worker, 2, timeout=SPAWN_TIMEOUT_S, env=clean_env)
    for rank, phases in enumerate(counts):
        assert phases.keys() == {"models", "groups"}
        for phase, (after_warmup, after_all, iterations) in phases.items():
            assert iterations == (MODEL_CHURN if phase == "models" else GROUP_CHURN)
            assert after_all["live_blocks"] == 0, (rank, phase, after_all)
            # Slack for what torch itself may open or map later (a lazily loaded library). A
            # group that leaked its heap would keep a descriptor (its memfd arena) and two
            # mappings (its arena and the peer's) per iteration; leaked buckets show in
            # live_blocks (they share arenas).
            for what, slack in (("fds", 2), ("maps", 8)):
                assert after_all[what] <= after_warmup[what] + slack, (
                    f"rank {rank}, {phase}: {what} grew from {after_warmup[what]} to "
                    f"{after_all[what]} over {iterations - WARMUP} iterations"
                )


class ComplexNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.weights = torch.nn.Parameter(torch.randn(6, dtype=torch.complex64))
        self.head = torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weights * x).abs().sum() + self.head(x.real).sum()


def complex_gradients(
    rank: int, group: Optional[dist.ProcessGroup], ddp: bool = True
) -> list[complex]:
    """The gradient of `rank`'s batch: averaged over the group by DDP, or this rank's own."""
    net = ComplexNet()
    model = DDP(net, process_group=group) if ddp else net
    x = torch.randn(6, dtype=torch.complex64, generator=torch.Generator().manual_seed(rank))
    model(x).backward()
    grad = net.weights.grad
    assert grad is not None
    return [complex(v) for v in grad.tolist()]


def complex_worker(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("xdev", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    gloo = dist.new_group(backend="gloo")
    ordinary = dist.new_group(pg_options=torch_xdev.Options(shared_buckets=False))
    result: dict[str, Any] = {
        "gloo": complex_gradients(rank, gloo),
        "ordinary_buckets": complex_gradients(rank, ordinary),
    }
    try:
        result["shared_buckets"] = complex_gradients(rank, None)
    except RuntimeError as e:  # PyTorch's Reducer, on a complex bucket from allocateTensor
        result["shared_buckets"] = str(e)
    dist.destroy_process_group()
    return result


def test_a_model_with_complex_parameters(
    clean_env: dict[str, str], capfd: pytest.CaptureFixture[str]
) -> None:
    results = run_ranks(complex_worker, 2, timeout=SPAWN_TIMEOUT_S, env=clean_env)
    ranks_stderr = capfd.readouterr().err
    # The mean of both ranks' gradients, from each rank's own, computed here.
    local = [complex_gradients(rank, None, ddp=False) for rank in range(2)]
    mean = [(a + b) / 2 for a, b in zip(*local)]
    for rank, result in enumerate(results):
        assert result["gloo"] == pytest.approx(mean, rel=1e-6), rank
        # Options(shared_buckets=False), the documented fix: DDP allocates its buckets.
        assert result["ordinary_buckets"] == result["gloo"], rank
        shared = result["shared_buckets"]
        if isinstance(shared, str):
            # PyTorch 2.13/2.14's Reducer fails on such a bucket; xdev's warning (C++, so on
            # the ranks' stderr) names the fix.
            assert "out of bounds" in shared, shared
            assert "XDEV_SHARED_BUCKETS=0" in ranks_stderr
        else:
            assert shared == result["gloo"], rank
