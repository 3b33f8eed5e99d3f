"""Where an FSDP2 step's time goes: benchmarks/fsdp_step.py's ``--profile``.

``breakdown`` times more steps of every variant with ``dist.all_gather_single`` and
``dist.reduce_scatter_single`` (what FSDP2 calls; synchronously on CPU) wrapped in timers, each
call preceded by a barrier on its group that is timed apart (``arrival``: waiting for the last
rank). ``profile_step`` runs one step under ``torch.profiler`` and gives rank 0's CPU time by
operator.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

from step_common import Batches

PROFILE_ROWS = 14  # operators profile_step lists


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class Profiled(Protocol):
    """A variant on this rank (fsdp_step.Runner): its name and one timed step."""

    @property
    def variant(self) -> _Named: ...

    def step(self, batches: Batches) -> float: ...


COLLECTIVES = ("all_gather_single", "reduce_scatter_single")
ARRIVAL = "arrival"  # the barrier before each collective: waiting for the last rank


@contextlib.contextmanager
def timed_collectives(record: dict[str, list[float]]) -> Iterator[None]:
    """Adds the wall time of every call FSDP2 makes to the collectives to ``record``.

    A barrier on the collective's group goes first, timed apart (``ARRIVAL``), so that a
    collective's time is its own and not the wait for a peer still computing. FSDP2 on CPU
    calls the collectives with async_op=False, so a call's time is the whole collective.
    """
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            dist.barrier(group=kwargs.get("group"))
            t1 = time.perf_counter()
            result = fn(*args, **kwargs)
            record[ARRIVAL].append(t1 - t0)
            record[name].append(time.perf_counter() - t1)
            return result

        return call

    for name, fn in originals.items():
        setattr(dist, name, timed(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def breakdown(
    runners: Sequence[Profiled], batches: Batches, rounds: int, steps_per_turn: int
) -> list[str]:
    """Per variant: a step's time in each collective, waiting for peers, and the rest, over
    ``rounds`` turns of ``steps_per_turn`` steps each."""
    keys = (*COLLECTIVES, ARRIVAL)
    per_step: dict[int, list[list[float]]] = {id(r): [] for r in runners}
    for _ in range(rounds):
        for runner in runners:
            dist.barrier()
            for _ in range(steps_per_turn):
                record: dict[str, list[float]] = {name: [] for name in keys}
                with timed_collectives(record):
                    seconds = runner.step(batches)
                values = [seconds] + [sum(record[name]) for name in keys]
                values += [float(len(record[name])) for name in COLLECTIVES]
                # The mean over the ranks: the parts add up to the step on every rank.
                total = torch.tensor(values, dtype=torch.float64)
                dist.all_reduce(total)
                per_step[id(runner)].append([v / dist.get_world_size() for v in total.tolist()])
    lines = [
        "# where a step goes (--profile; a barrier before each collective): ms per step,",
        "#   median over steps of the ranks' mean; collective calls per step in ()",
        f"#   {'variant':<12} {'step':>8} {'all_gather':>15} {'reduce_scatter':>15}"
        f" {'arrival':>8} {'rest':>8}",
    ]
    for runner in runners:
        steps = per_step[id(runner)]
        step, ag, rs, arrival = (statistics.median(s[i] for s in steps) * 1e3 for i in range(4))
        ag_calls, rs_calls = (round(steps[0][i]) for i in (4, 5))
        lines.append(
            f"#   {runner.variant.name:<12} {step:>8.1f} {ag:>8.1f} ({ag_calls:>3})"
            f" {rs:>8.1f} ({rs_calls:>3}) {arrival:>8.1f} {step - ag - rs - arrival:>8.1f}"
        )
    return lines


def profile_step(runner: Profiled, batches: Batches) -> list[str]:
    """One step under torch.profiler: this rank's CPU time by operator, largest first."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds = runner.step(batches)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    lines = [f"# profile of one {runner.variant.name} step ({seconds * 1e3:.1f} ms on this rank):"]
    lines.append(f"#   {'self ms':>8} {'total ms':>9} {'calls':>6}  operator")
    for e in events[:PROFILE_ROWS]:
        lines.append(
            f"#   {e.self_cpu_time_total / 1e3:>8.2f} {e.cpu_time_total / 1e3:>9.2f}"
            f" {e.count:>6}  {e.key}"
        )
    return lines
