"""The network between hosts as xdev's two-level plans use it: measure, fit the model, check.

Run it under torchrun on the hosts a job will use, one launcher per host, as the job runs::

    torchrun --nnodes H --nproc_per_node L --rdzv-backend c10d --rdzv-endpoint HOST0:PORT \\
        benchmarks/network.py [--sizes 64KiB:64MiB] [--rounds 3] [--out network_model.json]

or on one machine, its ranks split over fake hosts (``XDEV_HOSTNAME``)::

    torchrun --nproc_per_node 4 benchmarks/network.py --fake-hosts 2

For every size S (an allreduce's payload) it times, taking turns round by round (the median
over rounds of the slowest rank's mean per call), on CPU tensors:

- ``ring``: Gloo's allreduce of S over all ranks, which ``auto`` weighs two levels against;
- ``one``: Gloo's allreduce of S/L among the ranks of local index 0, one per host, the other
  ranks idle: one stream leaves each host;
- ``all``: the same among the ranks of every local index at once: L streams leave each host,
  the step across hosts of the two-level allreduce;
- ``xdev``: xdev's allreduce of S (``auto``), with the model in effect (``XDEV_CPU_MODEL``, or
  the defaults).

From ``one`` it fits the model's latency and per-stream rate (``benchmarks/network_fit.py``:
a ring of H ranks), from ``all`` the host's link where the L streams run slower than their
cores allow, and rank 0 writes them as an ``XDEV_CPU_MODEL`` file (``--out``; an existing
file keeps its other parameters). Then every rank makes an xdev group that uses the fitted
model and times it as ``xdev_fitted``: the table shows what ``auto`` picked with each model,
against Gloo's ring. Give the file to every host's ranks (``XDEV_CPU_MODEL``) to use the fit.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import network_fit
from allreduce_common import format_size, max_over_ranks, parse_sizes
from run_record import environment, write_results, xdev_environment_line
from step_common import under_torchrun

import torch_xdev

VARIANTS = ("ring", "one", "all", "xdev")
ROW_SECONDS = 0.2  # about how long one variant's calls at one size take per round
MAX_ITERS = 200


class Layout:
    """The hosts, as xdev names them, and this rank's place: ranks grouped by host in the order
    hosts first appear, each host's ranks in rank order."""

    def __init__(self, names: list[str], rank: int) -> None:
        hosts: dict[str, list[int]] = {}
        for r, name in enumerate(names):
            hosts.setdefault(name, []).append(r)
        self.names = list(hosts)
        self.ranks = list(hosts.values())
        sizes = {len(ranks) for ranks in self.ranks}
        if len(self.ranks) < 2:
            raise SystemExit(
                f"network.py: every rank is on host {self.names[0]!r}; run it on"
                " several hosts, or on fake ones with --fake-hosts N"
            )
        if len(sizes) != 1:
            counts = ", ".join(f"{n}: {len(r)}" for n, r in zip(self.names, self.ranks))
            raise SystemExit(
                f"network.py: hosts hold different numbers of ranks ({counts});"
                " xdev's two-level plans need the same number on every host"
            )
        self.num_hosts = len(self.ranks)
        self.per_host = sizes.pop()
        self.local_index = next(r.index(rank) for r in self.ranks if rank in r)

    def local_index_ranks(self, index: int) -> list[int]:
        return [ranks[index] for ranks in self.ranks]


def timed(call: Optional[Callable[[], Any]], iters: int) -> float:
    """The slowest rank's seconds per call over ``iters`` calls; a rank with no call (``one``
    on a rank of another local index) waits for the others."""
    dist.barrier()
    elapsed = 0.0
    if call is not None:
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        elapsed = (time.perf_counter() - t0) / iters
    return max_over_ranks(elapsed)


def iterations(call: Optional[Callable[[], Any]], forced: Optional[int]) -> int:
    """``forced``, or as many calls as take about ROW_SECONDS, from two timed ones, the same on
    every rank."""
    if forced is not None:
        return forced
    estimate = timed(call, 2)
    return max(3, min(MAX_ITERS, int(ROW_SECONDS / max(estimate, 1e-9))))


def check_xdev(group: dist.ProcessGroup, count: int, rank: int, name: str) -> None:
    """xdev's sum of random data against Gloo's, before it is timed; a difference on any rank
    stops every rank."""
    data = torch.randn(count, generator=torch.Generator().manual_seed(1000003 * rank + count))
    mine, reference = data.clone(), data.clone()
    dist.all_reduce(mine, group=group)
    dist.all_reduce(reference)
    if max_over_ranks(float(not torch.allclose(mine, reference, rtol=1e-5, atol=1e-5))):
        raise RuntimeError(f"{name} at {format_size(count * 4)} differs from Gloo's allreduce")


def slice_count(size: int, per_host: int) -> int:
    """Elements of float32 one rank's engine allreduces across hosts in two levels: 1/L."""
    return max(1, size // 4 // per_host)


class Runner:
    """This rank's groups (Gloo's across hosts, one per local index; xdev's over all ranks) and
    the timing of every variant, size by size."""

    def __init__(self, layout: Layout, rank: int, iters: Optional[int]) -> None:
        self.layout = layout
        self.rank = rank
        self.iters = iters
        # One Gloo group per local index (every rank makes every group, in the same order).
        self.across = [
            dist.new_group(layout.local_index_ranks(i), backend="gloo")
            for i in range(layout.per_host)
        ]
        self.xdev = dist.new_group(backend="xdev")
        self.choices: dict[tuple[str, int], tuple[str, str]] = {}  # (what ran, why)

    def calls(
        self, size: int, xdev_groups: dict[str, dist.ProcessGroup], with_gloo: bool
    ) -> dict[str, Any]:
        layout = self.layout
        full = torch.zeros(size // 4)  # zeros: sums stay finite however many calls
        part = torch.zeros(slice_count(size, layout.per_host))
        mine = self.across[layout.local_index]
        calls: dict[str, Optional[Callable[[], Any]]] = {}
        if with_gloo:
            calls["ring"] = lambda: dist.all_reduce(full)
            calls["one"] = (
                (lambda: dist.all_reduce(part, group=mine)) if layout.local_index == 0 else None
            )
            calls["all"] = lambda: dist.all_reduce(part, group=mine)
        for name, group in xdev_groups.items():
            calls[name] = functools.partial(dist.all_reduce, full, group=group)
        return calls

    def measure(
        self,
        sizes: list[int],
        rounds: int,
        xdev_groups: dict[str, dist.ProcessGroup],
        with_gloo: bool = True,
    ) -> dict[tuple[str, int], float]:
        """Median seconds per call of each xdev group and, with_gloo, of Gloo's ring and its
        calls across hosts (what the network is fitted to), interleaved round by round."""
        for name, group in xdev_groups.items():
            for size in sizes:
                check_xdev(group, size // 4, self.rank, name)
        samples: dict[tuple[str, int], list[float]] = {}
        for size in sizes:
            calls = self.calls(size, xdev_groups, with_gloo)
            names = list(calls)
            iters = {name: iterations(calls[name], self.iters) for name in names}
            for round_index in range(rounds):
                start = round_index % len(names)  # each round starts one variant later
                for name in names[start:] + names[:start]:
                    seconds = timed(calls[name], iters[name])
                    samples.setdefault((name, size), []).append(seconds)
            for name, group in xdev_groups.items():
                # What auto ran (two levels, or Gloo's ring: "fallback") and why: its predictions.
                path, reason = torch_xdev.describe(group)["last_allreduce"]
                ran = "Gloo's ring" if path == "fallback" else "two levels"
                self.choices[(name, size)] = (ran, str(reason))
        return {key: statistics.median(values) for key, values in samples.items()}


def fitted_group(
    stream: network_fit.NetworkFit, host_gbps: Optional[float]
) -> tuple[dist.ProcessGroup, dict[str, Any]]:
    """An xdev group over all ranks whose cost model is XDEV_CPU_MODEL's (where set) with the
    fitted network, and that model: each rank writes it to a private file for the group's
    creation (XDEV_CPU_MODEL is read then) and removes it."""
    previous = os.environ.get("XDEV_CPU_MODEL")
    with tempfile.TemporaryDirectory(prefix="xdev-network-") as folder:
        path = Path(folder) / "model.json"
        if previous:
            shutil.copyfile(previous, path)
        model = network_fit.write_model(path, stream, {}, host_gbps)
        os.environ["XDEV_CPU_MODEL"] = str(path)
        try:
            group = dist.new_group(backend="xdev")
            dist.all_reduce(torch.ones(1), group=group)  # made now, while the file is there
        finally:
            if previous is None:
                del os.environ["XDEV_CPU_MODEL"]
            else:
                os.environ["XDEV_CPU_MODEL"] = previous
    return group, model


def fit_stream(
    layout: Layout, sizes: list[int], times: dict[tuple[str, int], float], host_cores: int
) -> network_fit.NetworkFit:
    """Latency and per-stream rate from ``one``: a ring of H ranks, one stream per host."""
    parts = [4 * slice_count(size, layout.per_host) for size in sizes]
    one = [times[("one", size)] for size in sizes]
    return network_fit.fit_network(layout.num_hosts, 1, parts, one, host_cores)


def fit_link(
    layout: Layout,
    sizes: list[int],
    times: dict[tuple[str, int], float],
    stream: network_fit.NetworkFit,
    host_cores: int,
) -> tuple[Optional[float], str]:
    """The host link's rate from ``all`` (None: not what held the streams, or no rate seen),
    and what the header says of it."""
    parts = [4 * slice_count(size, layout.per_host) for size in sizes]
    every = [times[("all", size)] for size in sizes]
    streams = layout.per_host
    try:
        link = network_fit.fit_host_link(
            layout.num_hosts, streams, parts, every, stream["net_stream_gbps"], host_cores
        )
    except ValueError as e:
        return None, f"{streams} streams at once: {e}"
    rates = f"{streams} streams at {link['stream_gbps']:.3f} GB/s each"
    if link["link_bound"]:
        return link["net_host_gbps"], (
            f"{rates}, where their cores allow {link['expected_stream_gbps']:.3f}"
        )
    return None, f"{rates}: the link did not hold them back"


def report(
    layout: Layout,
    sizes: list[int],
    times: dict[tuple[str, int], float],
    choices: dict[tuple[str, int], tuple[str, str]],
) -> list[dict[str, Any]]:
    names = [n for n in (*VARIANTS, "xdev_fitted") if (n, sizes[0]) in times]
    xdev_names = [n for n in names if n.startswith("xdev")]
    print(
        f"{'size':>8}  "
        + "".join(f"{n + '(us)':>16}" for n in names)
        + f"  vs ring: {', '.join(xdev_names)}"
    )
    rows = []
    for size in sizes:
        ring = times[("ring", size)]
        cells = "".join(f"{times[(n, size)] * 1e6:>16.1f}" for n in names)
        ratios = " / ".join(f"{ring / times[(n, size)]:.2f}x" for n in xdev_names)
        print(f"{format_size(size):>8}  {cells}  {ratios}")
        for n in names:
            rows.append(
                {
                    "size_bytes": size,
                    "variant": n,
                    "time_us": times[(n, size)] * 1e6,
                    "vs_ring": ring / times[(n, size)],
                    "ran": choices[(n, size)][0] if (n, size) in choices else None,
                    "reason": choices[(n, size)][1] if (n, size) in choices else None,
                }
            )
    for size in sizes:
        for n in xdev_names:
            ran, reason = choices[(n, size)]
            print(f"# {n} at {format_size(size)} ran {ran}: {reason}")
    return rows


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=parse_sizes("64KiB:64MiB"),
        help="LO:HI (doubling) or a comma list (default 64KiB:64MiB)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="turns per size (default 3)")
    parser.add_argument(
        "--iters", type=int, help="timed calls per variant and round (default: about 0.2 s)"
    )
    parser.add_argument(
        "--fake-hosts",
        type=int,
        default=0,
        metavar="N",
        help="split this machine's ranks over N fake hosts, host by host",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("network_model.json"),
        help="the XDEV_CPU_MODEL file rank 0 writes (default"
        " network_model.json; an existing one keeps its other parameters)",
    )
    parser.add_argument("--json", type=Path, help="the measurements, as JSON (rank 0)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or (args.iters is not None and args.iters < 1):
        parser.error("--rounds and --iters must be at least 1")
    if min(args.sizes) < 4096:
        parser.error("--sizes: each at least 4KiB (a slice of float32 per local rank)")
    if len(set(args.sizes)) < 2:
        parser.error("--sizes needs at least two sizes to fit a line")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not under_torchrun("benchmarks/network.py"):
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.fake_hosts:
        if world % args.fake_hosts:
            raise SystemExit(f"--fake-hosts {args.fake_hosts} does not divide {world} ranks")
        os.environ["XDEV_HOSTNAME"] = f"fake-host-{rank // (world // args.fake_hosts)}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    names: list[Any] = [None] * world
    dist.all_gather_object(names, torch_xdev.host_identity())
    layout = Layout([str(n) for n in names], rank)
    say: Callable[[str], None] = print if rank == 0 else (lambda line: None)
    runner = Runner(layout, rank, args.iters)
    host_cores = int(torch_xdev.describe(runner.xdev)["host_cores"])
    say(
        f"# torch-xdev network benchmark: {layout.num_hosts} hosts x {layout.per_host} ranks"
        f" ({', '.join(layout.names)}), {host_cores} core(s) per host for its streams"
    )
    say(xdev_environment_line())
    times = runner.measure(args.sizes, args.rounds, {"xdev": runner.xdev})
    try:
        stream = fit_stream(layout, args.sizes, times, host_cores)
    except ValueError as e:  # every rank fits the same times (the slowest rank's): all stop
        if rank == 0:
            report(layout, args.sizes, times, runner.choices)
            print(
                f"network.py: no model written: {e}. Time sizes far enough apart for the"
                " network's rate to show (the default, 64KiB:64MiB), or more --rounds.",
                file=sys.stderr,
            )
        dist.destroy_process_group()
        return 1
    host_gbps, link_note = fit_link(layout, args.sizes, times, stream, host_cores)
    fitted, model = fitted_group(stream, host_gbps)
    for line in network_fit.format_fit(stream)[:3]:
        say(line)
    how = "kept  " if host_gbps is None else "fitted"
    say(f"#   net_host_gbps   {how} {model['params']['net_host_gbps']:10.3f}   ({link_note})")
    # Gloo's times stay those the fit used (the table shows what the model was fitted to).
    times.update(runner.measure(args.sizes, args.rounds, {"xdev_fitted": fitted}, with_gloo=False))
    if rank == 0:
        rows = report(layout, args.sizes, times, runner.choices)
        network_fit.write_model(
            args.out,
            stream,
            {
                "benchmark": "network.py",
                "hosts": layout.num_hosts,
                "ranks_per_host": layout.per_host,
            },
            host_gbps,
        )
        print(f"# wrote {args.out} (use it with XDEV_CPU_MODEL={args.out} on every host)")
        if args.json:
            write_results(
                args.json,
                {
                    **environment(),
                    "hosts": layout.names,
                    "ranks_per_host": layout.per_host,
                    "sizes": args.sizes,
                    "rounds": args.rounds,
                    "network_fit": stream,
                    "net_host_gbps_fitted": host_gbps,
                },
                rows,
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
