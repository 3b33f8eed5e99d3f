"""Runs a test function on N real processes, one per rank.

``run_ranks(fn, world)`` starts ``world`` processes; each sets up MASTER_ADDR /
MASTER_PORT and calls ``fn(rank, world, *args)``. Whatever ``fn`` returns comes
back as a list indexed by rank; an exception in any rank fails the test with
every rank's traceback. Every wait is bounded: a rank that does not finish by
the deadline is killed (by PID, only our own children) and the test fails.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch.multiprocessing as mp
from multiprocessing import reduction

# Ranks fork from one server process that has imported torch already. Importing it costs each
# spawned process about 2 s of CPU, which on a 2-core machine was most of the suite's time. The
# server only imports (it starts no CUDA context), as DataLoader workers fork after importing
# torch; each rank starts from the parent's environment of the moment, as a spawned one would.
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])


def _received_fd(duplicate: Any) -> int:
    return int(duplicate.detach())


class _ParentFd:
    """One of the parent's file descriptors, handed to a rank as the same open file.

    A rank forked from the server would otherwise write to the server's stdout and stderr, not to
    what the test captures now (capfd reads the ranks' logs)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        # Pickled while the rank starts, so the fd travels with its other fds to the server.
        return (_received_fd, (reduction.DupFd(self.fd),))


def subprocess_env(drop: tuple[str, ...] = ("XDEV_",)) -> dict[str, str]:
    """This process's environment for a child process (a script, torchrun), without the
    variables whose names start with one of ``drop`` (by default xdev's options: each test sets
    its own), and with the torch_xdev this process imported (an in-place build of the source
    tree, or the installed one) first on PYTHONPATH, not whichever the child's script directory
    would find."""
    import torch_xdev

    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    package_root = str(Path(torch_xdev.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    parent_env: dict[str, str],
    parent_fds: tuple[int, int],
    env: dict[str, str],
    per_rank_env: Optional[list[dict[str, str]]],
    results: Any,
) -> None:
    for target, fd in zip((1, 2), parent_fds):
        os.dup2(fd, target)
        os.close(fd)
    # A rank that crashes (a signal, or C++'s terminate) prints where each of its Python
    # threads was, to the stderr the test captures: a rare crash is then more than an exit code.
    faulthandler.enable(all_threads=True)
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    os.environ.update(env)
    if per_rank_env is not None:
        os.environ.update(per_rank_env[rank])
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # torch.distributed read TORCH_DISTRIBUTED_DEBUG when the server imported it.
        dist.set_debug_level_from_env()
        value = fn(rank, world, *args)
        results.put((rank, True, value))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    env: Optional[dict[str, str]] = None,
    per_rank_env: Optional[list[dict[str, str]]] = None,
    timeout: float = 240.0,
    expect_dead: tuple[int, ...] = (),
) -> list[Any]:
    """Runs fn on ``world`` ranks and returns their results by rank.

    Ranks in ``expect_dead`` are allowed to die without reporting (tests that
    kill a rank on purpose); their result is None.
    """
    ctx = _CONTEXT
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(
                rank,
                world,
                port,
                fn,
                args,
                dict(os.environ),
                (_ParentFd(1), _ParentFd(2)),
                env or {},
                per_rank_env,
                results,
            ),
            daemon=True,
        )
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcomes) < world:
            alive_missing = [r for r in range(world) if r not in outcomes and procs[r].is_alive()]
            if not alive_missing and all(r in outcomes or r in expect_dead for r in range(world)):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
                outcomes[rank] = (ok, value)
            except queue.Empty:
                dead_silent = [
                    r
                    for r in range(world)
                    if r not in outcomes and r not in expect_dead and not procs[r].is_alive()
                ]
                if dead_silent:
                    # Drain what may still be in the pipe before declaring them dead.
                    try:
                        while True:
                            rank, ok, value = results.get(timeout=0.5)
                            outcomes[rank] = (ok, value)
                    except queue.Empty:
                        pass
                    still = [r for r in dead_silent if r not in outcomes]
                    if still:
                        codes = {r: procs[r].exitcode for r in still}
                        raise AssertionError(f"ranks died without a result: {codes}")
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    missing = [r for r in range(world) if r not in outcomes and r not in expect_dead]
    if missing:
        raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f}s")
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    if failures:
        raise AssertionError("\n".join(failures))
    return [outcomes[r][1] if r in outcomes else None for r in range(world)]


def xdev_shm_mappings() -> list[tuple[str, str]]:
    """(address range, path) of every xdev shared-memory segment this process maps."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            # Segments live in /dev/shm (a deleted one keeps its name plus " (deleted)").
            if len(parts) >= 6 and parts[5].startswith("/dev/shm/xdev-"):
                found.append((parts[0], parts[5]))
    return found
