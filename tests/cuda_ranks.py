"""What the CUDA test modules share: why they skip, and helpers run inside the ranks.

Every CUDA test runs real processes, one per rank (tests/harness.py: forked from a server that
imported torch and never touched CUDA); rank r uses GPU ``r % torch.cuda.device_count()``, so on
a one-GPU machine every rank shares that GPU, which CUDA IPC allows and NCCL does not.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist

import torch_xdev
from harness import run_ranks

SLOT = 4096  # cuda_slot_bytes (and shm_slot_bytes) of the grids: many windows, cheaply
NATIVE = ("hierarchical_copy", "hierarchical_balanced", "reduce_to_one", "flat", "direct")
GROUP_TIMEOUT = timedelta(seconds=300)
XDEV_TIMEOUT_S = 120.0
# What auto runs where ranks share one GPU under CUDA MPS (the fixed rule on a GPU that
# reaches itself). Tests of the native path's semantics force it, so that they test that path
# with or without MPS: without it auto leaves ranks sharing a GPU to Gloo.
SHARED_GPU_PLAN = "reduce_to_one"


def skip_or_fail(reason: str, allow_module_level: bool = False) -> None:
    """Skips with the reason; fails instead where XDEV_TEST_REQUIRE_CUDA=1 (.ci/gpu_check on a
    GPU machine), so that a change that turns the CUDA path or its transport off is red
    there rather than a row of skips."""
    if os.environ.get("XDEV_TEST_REQUIRE_CUDA") == "1":
        pytest.fail(f"XDEV_TEST_REQUIRE_CUDA=1, but: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)


def skip_module_without_cuda() -> None:
    """Skips the calling test module, with the reason, where the CUDA tests cannot run."""
    reason = why_skip()
    if reason is not None:
        skip_or_fail(f"CUDA tests need a GPU and a CUDA build: {reason}", allow_module_level=True)


def why_skip() -> Optional[str]:
    """Why the CUDA tests cannot run here, or None when they can."""
    missing = []
    if not torch.cuda.is_available():
        missing.append(
            f"torch {torch.__version__} sees no CUDA GPU (torch.version.cuda="
            f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
    if not getattr(torch_xdev._C, "built_with_cuda", False):
        missing.append(
            "torch_xdev._C was built without its CUDA path (built_with_cuda is False: "
            "build against a CUDA build of torch with a CUDA toolkit present)"
        )
    return "; ".join(missing) if missing else None


def run_or_skip(fn: Callable[..., Any], world: int, *args: Any, timeout: float) -> list[Any]:
    """run_ranks, then skips the test with the ranks' reason where rank 0 returned
    ``{"skip": why}`` (no CUDA transport there, or a case this machine cannot make)."""
    results = run_ranks(fn, world, *args, timeout=timeout)
    if "skip" in results[0]:
        skip_or_fail(results[0]["skip"])
    return results


def setup_rank(rank: int, topo_file: Optional[str] = None) -> torch.device:
    """This rank's GPU; no XDEV_* variable of the caller's shell may change what a test asks."""
    warnings.filterwarnings("ignore", message=".*all_reduce_coalesced", category=FutureWarning)
    for name in [k for k in os.environ if k.startswith("XDEV_")]:
        del os.environ[name]
    if topo_file is not None:
        os.environ["XDEV_TOPO_FILE"] = topo_file
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def assert_same_on_all_ranks(digests: list[int], labels: list[str], world: int) -> None:
    """Compares every result's checksum with rank 0's (over the default group, CPU tensors)."""
    mine = torch.tensor(digests, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    for r in range(world):
        if not torch.equal(everyone[r], everyone[0]):
            bad = (everyone[r] != everyone[0]).nonzero().flatten().tolist()
            raise AssertionError(
                f"rank {r} holds different bits than rank 0 in {len(bad)} result(s), e.g. "
                + "; ".join(labels[i] for i in bad[:5])
            )


def first_cuda_collective(device: torch.device, group: Any = None) -> dict[str, Any]:
    """Runs the group's first CUDA allreduce (its GPU rendezvous); returns describe()['cuda']."""
    warm = torch.ones(3, device=device)
    dist.all_reduce(warm, group=group)
    world = dist.get_world_size(group)
    assert torch.equal(warm.cpu(), torch.full((3,), float(world))), warm
    info = dict(torch_xdev.describe(group)["cuda"])
    assert info["built"] and info["initialized"], info
    return info


def last_allreduce(group: Any = None) -> tuple[str, str]:
    last = torch_xdev.describe(group)["last_allreduce"]
    assert last is not None, "describe() reports no allreduce"
    return str(last[0]), str(last[1])


def assert_native(group: Any = None, expected: Optional[str] = None, what: str = "") -> None:
    algorithm, reason = last_allreduce(group)
    if expected is not None:
        assert algorithm == expected, f"{what}: ran {algorithm} ({reason}), expected {expected}"
    assert algorithm in NATIVE, f"{what}: not native: {algorithm} ({reason})"


def assert_ran(group: Any, expected: str, what: str = "") -> None:
    """assert_native, except where ``expected`` is "fallback": auto on ranks that share a GPU
    without CUDA MPS, which leaves the call to the engine and says why."""
    if expected != "fallback":
        assert_native(group, expected, what)
        return
    algorithm, reason = last_allreduce(group)
    assert algorithm == "fallback" and "without CUDA MPS" in reason, (what, algorithm, reason)


def close_group(group: Any) -> None:
    # Every rank's GPU work is done before any rank frees its IPC staging buffer.
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group(group)
