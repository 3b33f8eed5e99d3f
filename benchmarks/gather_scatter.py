"""Reduce-scatter and all-gather (and across hosts broadcast) benchmark, nccl-tests style: xdev
next to Gloo on CPU tensors, or with --device cuda next to NCCL on CUDA tensors.

Usage::

    PYTHONPATH=$PWD python benchmarks/gather_scatter.py --nproc 2 [--sizes 64KiB,16MiB]
        [--dtype float32] [--rounds 5] [--json out.json] [--hosts N]

Every rank runs a Gloo default group and two xdev groups: default options (``xdev``) and
``single_copy=True`` (``xdev_sc``: from 256 KiB peers read one tensor in place). ``xdev_heap``
runs the default xdev group on tensors from its ``allocate_tensor`` (the group's symmetric heap,
as FSDP2 allocates them with ``set_allocate_memory_from_process_group_for_comm(True)``): the
full tensor is at the same place on every rank, so nothing is staged. For each size
the variants take turns (interleaved rounds of back-to-back calls, each round starting one
variant later, so drift on a shared machine hits them all); a row gives the median over rounds
of the slowest rank's mean time per call, the JSON every round's, and a note follows the table
where one variant's rounds differ by more than 1.5x. Before and after timing, xdev's result on
random data is checked against Gloo's; reduce-scatter's within
allreduce.py's tolerance for the dtype (``TOLERANCES`` in allreduce_common.py), as float16 and
bfloat16 sums of 3 or more ranks round in another order than Gloo's. ``all_gather_in_place``
is the all-gather FSDP2 runs: the input is this rank's block of the output. The script starts
its ranks itself: run it with python, not torchrun.

With ``--hosts N`` the ranks name themselves N fake hosts, host by host (``XDEV_HOSTNAME``), and
the rows are reduce_scatter and all_gather by Gloo over all ranks, by xdev's ``auto``
(``xdev(two_level)`` where the model chose the two-level plan, ``xdev(fallback)`` where it left
the call to Gloo), and by ``xdev_2lvl``: an xdev group whose cost model has a very slow
network (XDEV_CPU_MODEL with ``net_latency_us`` 1e6, over the user's file if one is set), so
that it runs the two-level plan at every size, to show what the model weighed against Gloo;
``xdev_2lvl_heap`` is that group on tensors from its heap (FSDP2's buffers across hosts: the
step inside each host reads them in place). Broadcast from rank 0 runs there too (Gloo and
xdev's ``auto``, labelled with what the model chose: ``two_level`` or ``fallback``). The
header gives each plan's traffic from the plans' model: what crosses hosts per host and
from the busiest rank, the sequential steps across hosts, and what goes through sockets
between ranks of one host (on one machine every "network" byte is loopback).

With ``--device cuda`` (one host) the tensors are on the GPUs, rank r on GPU r % device_count:
``xdev`` is a group with ``algorithm="flat"``, which forces xdev's native CUDA reduce-scatter and
all-gather (``auto`` keeps NCCL for them where NCCL runs), next to NCCL where every rank has a GPU
of its own, else Gloo on the same CUDA tensors (NCCL refuses ranks that share a GPU; start MPS
for those). Each timed loop ends with ``torch.cuda.synchronize()``.

Sizes and bandwidths are those of nccl-tests: ``size`` is the whole tensor (a reduce-scatter's
input, an all-gather's output: world x the per-rank block; a broadcast's tensor); algbw = size /
time; busbw = algbw x (n-1)/n for reduce-scatter and all-gather, algbw for broadcast. A size is
rounded down to whole blocks of whole elements; each row's ``vs_gloo`` (``vs_nccl``) compares it
with the baseline's row for the same requested size, even where two sizes round alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_xdev
from allreduce_common import TOLERANCES, parse_size
from run_record import environment, write_results, xdev_environment_line
from step_common import default_json, refused_under_torchrun, round_order, spread_note

TARGET_ROUND_SECONDS = 0.1
# all_gather_in_place: the input is this rank's block of the output, as FSDP2 passes it.
COLLECTIVES = ("reduce_scatter", "all_gather", "all_gather_in_place")
# Across fake hosts single copy is one host's, and FSDP2's in-place all-gather runs as the plain
# one there.
HOSTS_COLLECTIVES = ("reduce_scatter", "all_gather", "broadcast")


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective as this rank calls it: ``count`` elements of ``dtype`` in the whole
    tensor, ``count // world`` in each rank's block."""

    collective: str
    count: int
    dtype: torch.dtype
    rank: int
    world: int

    @property
    def nbytes(self) -> int:
        return self.count * torch.tensor([], dtype=self.dtype).element_size()

    def own_block(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of ``full``: all_gather_in_place's input, as FSDP2 passes it."""
        block = self.count // self.world
        return full.narrow(0, self.rank * block, block)


def run_op(collective: str, full: torch.Tensor, block: torch.Tensor, group: Any) -> None:
    if collective == "reduce_scatter":
        dist.reduce_scatter_tensor(block, full, group=group)
    elif collective == "broadcast":
        dist.broadcast(full, src=0, group=group)
    else:
        dist.all_gather_into_tensor(full, block, group=group)


def slowest_mean(fn: Callable[[], None], iters: int) -> float:
    """Slowest rank's seconds per call over ``iters`` back-to-back calls (GPU work included)."""
    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    dist.barrier()
    if on_gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if on_gpu:
        torch.cuda.synchronize()
    seconds = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def heap_empty(group: Any, count: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor from the group's symmetric heap, as FSDP2's ProcessGroupAllocMixin gets one."""
    backend = group._get_backend(torch.device("cpu"))
    assert backend.supports_tensor_alloc(torch.device("cpu")), "this xdev group has no heap"
    return backend.allocate_tensor(count, dtype=dtype, device=torch.device("cpu"))


def make_tensors(call: Call, heap: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, block) for one call; from ``heap``'s symmetric heap unless it is None."""
    block_count = call.count // call.world
    if heap is None:
        full = torch.empty(call.count, dtype=call.dtype)
        block = torch.empty(block_count, dtype=call.dtype)
    else:
        full = heap_empty(heap, call.count, call.dtype)
        block = heap_empty(heap, block_count, call.dtype)
    if call.collective == "all_gather_in_place":
        block = call.own_block(full)
    return full, block


def heap_copies(
    call: Call, full: torch.Tensor, block: torch.Tensor, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, block) with the same contents, from ``group``'s symmetric heap."""
    heap_full, heap_block = make_tensors(call, group)
    heap_full.copy_(full)
    if call.collective != "all_gather_in_place":  # else the block is a view of full
        heap_block.copy_(block)
    return heap_full, heap_block


def check(
    call: Call,
    xdev: Any,
    heap: bool = False,
    reference: tuple[str, Any] = ("gloo", None),
    device: torch.device = torch.device("cpu"),
) -> None:
    """Runs the collective on ``xdev`` and on the reference group (name, group; None: the
    default Gloo group) with the same inputs on ``device`` and asserts equal results."""
    collective, count, dtype = call.collective, call.count, call.dtype
    g = torch.Generator().manual_seed(call.rank)
    full = torch.randn(count, generator=g).to(dtype).to(device)
    block = full[: count // call.world].clone()
    results = []
    for group in (reference[1], xdev):
        f, b = full.clone(), block.clone()
        if group is xdev and heap:
            f, b = heap_copies(call, full, block, xdev)
        if collective == "all_gather_in_place":
            b = call.own_block(f)
        run_op(collective, f, b, group)
        results.append(b if collective == "reduce_scatter" else f)
    # A reduction of 3 or more ranks may add in another order than the reference: allreduce.py's
    # tolerance for the dtype bounds that. Elsewhere (copies, and dtypes allreduce.py does not
    # run) assert_close's own per dtype (None).
    rtol: Optional[float] = None
    atol: Optional[float] = None
    if collective == "reduce_scatter":
        rtol, atol = TOLERANCES.get(str(dtype).removeprefix("torch."), (None, None))
    torch.testing.assert_close(
        results[1],
        results[0],
        rtol=rtol,
        atol=atol,
        msg=lambda why: f"{collective} {call.nbytes} ({dtype}): xdev != {reference[0]}\n{why}",
    )


def header(world: int, baseline: str) -> list[str]:
    """The lines above the table: what ran, and what a row's numbers are."""
    return [
        f"# {world} ranks, torch_xdev from {Path(torch_xdev.__file__).parent}",
        xdev_environment_line(),
        "# time = median over rounds of the slowest rank's mean per call. size/count: the whole",
        "# tensor (a reduce-scatter's input, an all-gather's output: world x the block);",
        "# algbw = size / time, busbw = algbw * (n-1)/n (broadcast: algbw) as nccl-tests;"
        f" vs_{baseline} = {baseline}'s time / this",
    ]


def format_table(rows: list[dict[str, Any]], baseline: str) -> list[str]:
    """nccl-tests' layout: size (B) and count (elements) of the whole tensor, type, redop,
    then time and bandwidths; one block per collective, a row per backend."""
    vs = f"vs_{baseline}"
    lines: list[str] = []
    columns = (
        f"{'size':>12} {'count':>12} {'type':>9} {'redop':>6} {'backend':>25} {'time':>10}"
        f" {'algbw':>8} {'busbw':>8} {vs:>8}"
    )
    units = (
        f"{'(B)':>12} {'(elements)':>12} {'':>9} {'':>6} {'':>25} {'(us)':>10}"
        f" {'(GB/s)':>8} {'(GB/s)':>8} {'':>8}"
    )
    for collective in dict.fromkeys(r["collective"] for r in rows):
        lines += ["#", f"# {collective}", "#" + columns[1:], ("#" + units[1:]).rstrip()]
        for r in rows:
            if r["collective"] != collective:
                continue
            redop = "sum" if collective == "reduce_scatter" else "none"
            lines.append(
                f"{r['size_bytes']:>12} {r['count']:>12} {r['dtype']:>9} {redop:>6}"
                f" {r['backend']:>25} {r['time_us']:>10.1f} {r['algbw_gbps']:>8.3f}"
                f" {r['busbw_gbps']:>8.3f} {r['vs_baseline']:>8.2f}"
            )
    return lines


def timed_calls(
    collective: str, variants: list[tuple[str, torch.Tensor, torch.Tensor, Any]]
) -> dict[str, Callable[[], None]]:
    """One call of the collective per (name, full, block, group)."""
    return {
        name: functools.partial(run_op, collective, f, b, group) for name, f, b, group in variants
    }


def cpu_inputs(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, block) of random data for the timed CPU calls."""
    full = torch.randn(call.count).to(call.dtype)
    block = torch.empty(call.count // call.world, dtype=call.dtype)
    if call.collective == "all_gather_in_place":
        block = call.own_block(full)
    return full, block


def one_host_checks(call: Call, groups: dict[str, Any]) -> None:
    """xdev, xdev with single copy and xdev on heap tensors against Gloo."""
    for group in (groups["xdev"], groups["xdev_sc"]):
        check(call, group)
    check(call, groups["xdev"], heap=True)


def one_host_variants(call: Call, groups: dict[str, Any]) -> dict[str, Callable[[], None]]:
    """Gloo, xdev, xdev with single copy and xdev on heap tensors, after checking each."""
    xdev, xdev_sc = groups["xdev"], groups["xdev_sc"]
    full, block = cpu_inputs(call)
    one_host_checks(call, groups)
    heap_full, heap_block = heap_copies(call, full, block, xdev)
    return timed_calls(
        call.collective,
        [
            ("gloo", full, block, None),
            ("xdev", full, block, xdev),
            ("xdev_sc", full, block, xdev_sc),
            ("xdev_heap", heap_full, heap_block, xdev),
        ],
    )


def cuda_checks(call: Call, groups: dict[str, Any]) -> None:
    """xdev's native CUDA path against the engine, on this rank's GPU."""
    device = torch.device("cuda", torch.cuda.current_device())
    check(call, groups["xdev"], reference=groups["engine"], device=device)


def cuda_variants(call: Call, groups: dict[str, Any]) -> dict[str, Callable[[], None]]:
    """The engine (NCCL, or Gloo where ranks share a GPU) and xdev's native CUDA path on the
    same CUDA tensors, after checking xdev's result against the engine's."""
    device = torch.device("cuda", torch.cuda.current_device())
    engine_name, engine = groups["engine"]
    cuda_checks(call, groups)
    full = torch.randn(call.count, device=device).to(call.dtype)
    block = torch.randn(call.count // call.world, device=device).to(call.dtype)

    def tensors() -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh copies; FSDP2's in-place all-gather takes its block from its output."""
        f = full.clone()
        if call.collective == "all_gather_in_place":
            return f, call.own_block(f)
        return f, block.clone()

    return timed_calls(
        call.collective,
        [(engine_name, *tensors(), engine), ("xdev", *tensors(), groups["xdev"])],
    )


def cuda_groups(rank: int, world: int) -> dict[str, Any]:
    """This rank's GPU; the engine group (NCCL where every rank has a GPU of its own, else the
    default Gloo group) and the xdev group forced onto its native CUDA path."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    own_gpus = torch.cuda.device_count() >= world and dist.is_nccl_available()
    engine = ("nccl", dist.new_group(backend="nccl")) if own_gpus else ("gloo", None)
    xdev = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(algorithm="flat"))
    return {"engine": engine, "xdev": xdev}


def hosts_checks(call: Call, groups: dict[str, Any]) -> None:
    """xdev's auto across the fake hosts and, but for a broadcast, the two-level group on
    ordinary and heap tensors, against Gloo."""
    check(call, groups["xdev"])
    if call.collective != "broadcast":  # timed on the default group alone
        check(call, groups["xdev_2lvl"])
        check(call, groups["xdev_2lvl"], heap=True)


def hosts_variants(call: Call, groups: dict[str, Any]) -> dict[str, Callable[[], None]]:
    """Gloo over all ranks, xdev's auto across the fake hosts and the two-level group on
    ordinary and heap tensors, after checking xdev."""
    full, block = cpu_inputs(call)
    hosts_checks(call, groups)
    if call.collective == "broadcast":
        return {
            name: functools.partial(run_op, call.collective, full, block, group)
            for name, group in (("gloo", None), ("xdev", groups["xdev"]))
        }
    two_level = groups["xdev_2lvl"]
    heap_full, heap_block = heap_copies(call, full, block, two_level)
    return timed_calls(
        call.collective,
        [
            ("gloo", full, block, None),
            ("xdev", full, block.clone(), groups["xdev"]),
            ("xdev_2lvl", full, block.clone(), two_level),
            ("xdev_2lvl_heap", heap_full, heap_block, two_level),
        ],
    )


def two_level_group(rank: int) -> Any:
    """An xdev group whose network model is so slow that it runs two levels at every size."""
    user = os.environ.get("XDEV_CPU_MODEL")
    params = json.loads(Path(user).read_text()).get("params", {}) if user else {}
    path = Path(tempfile.gettempdir()) / f"xdev_slow_network_{os.getpid()}_{rank}.json"
    path.write_text(json.dumps({"params": {**params, "net_latency_us": 1e6}}))
    os.environ["XDEV_CPU_MODEL"] = str(path)
    try:
        return dist.new_group(backend="xdev")  # reads XDEV_CPU_MODEL now
    finally:
        if user is None:
            del os.environ["XDEV_CPU_MODEL"]
        else:
            os.environ["XDEV_CPU_MODEL"] = user
        path.unlink()


def traffic_rows(
    hosts: int, world: int, sizes: list[int], esize: int, collectives: list[str]
) -> list[dict[str, Any]]:
    """Each plan's traffic per collective and size, from the plans' model."""
    per_host = world // hosts
    rows = []
    for collective in collectives:
        if collective == "broadcast":
            continue  # the plans model no broadcast: it sends H-1 copies across hosts
        for size in sizes:
            nbytes = size // esize // world * world * esize
            plans = torch_xdev._C.plan.across_hosts_traffic(hosts, per_host, nbytes, collective)
            for plan, t in plans.items():
                streams = max(1, t["inter_host_streams"])
                rows.append(
                    {
                        "collective": collective,
                        "size_bytes": nbytes,
                        "plan": plan,
                        **t,
                        # Each stream leaving a host is one rank's: its share is the busiest's.
                        "inter_host_bytes_per_rank": t["inter_host_bytes"] / streams,
                    }
                )
    return rows


def format_traffic(traffic: list[dict[str, Any]], hosts: int, world: int) -> list[str]:
    if not traffic:
        return []
    lines = [
        f"# {hosts} hosts x {world // hosts} ranks (XDEV_HOSTNAME), from the plans' model, per"
        " collective of `size` bytes: MB sent to other hosts per host / by the busiest rank,"
        " sequential steps across hosts, streams leaving a host at once, MB between ranks of"
        " one host through sockets",
    ]
    for t in traffic:
        lines.append(
            f"#   {t['collective']:>14} {t['size_bytes']:>10} B {t['plan']:>9}:"
            f" {t['inter_host_bytes'] / 1e6:8.3f} / {t['inter_host_bytes_per_rank'] / 1e6:8.3f} MB,"
            f" {t['inter_host_steps']} steps, {t['inter_host_streams']} streams,"
            f" {t['intra_host_socket_bytes'] / 1e6:8.3f} MB"
        )
    return lines


def run_rank(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.hosts > 1:  # host-contiguous: ranks 0..L-1 on the first host, and so on
        os.environ["XDEV_HOSTNAME"] = f"fake-host-{rank // (world // args.hosts)}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    baseline = "gloo"
    if args.device == "cuda":
        groups = cuda_groups(rank, world)
        baseline = groups["engine"][0]
    elif args.hosts > 1:
        groups = {"xdev": dist.new_group(backend="xdev"), "xdev_2lvl": two_level_group(rank)}
    else:
        # Single copy (off by default): peers read one large tensor in place from 256 KiB.
        groups = {
            "xdev": dist.new_group(backend="xdev"),
            "xdev_sc": dist.new_group(
                backend="xdev", pg_options=torch_xdev.Options(single_copy=True)
            ),
        }
    dtype = getattr(torch, args.dtype)
    esize = torch.tensor([], dtype=dtype).element_size()
    rows: list[dict[str, Any]] = []
    notes: list[Optional[str]] = []  # one per row: whether its rounds disagree
    for collective in args.collectives:
        for size in args.sizes:
            count = size // esize // world * world
            variants, checks = (
                (cuda_variants, cuda_checks)
                if args.device == "cuda"
                else (
                    (hosts_variants, hosts_checks)
                    if args.hosts > 1
                    else (one_host_variants, one_host_checks)
                )
            )
            call = Call(collective, count, dtype, rank, world)
            fns = variants(call, groups)
            iters = {}
            for name, fn in fns.items():
                fn()  # warm up
                estimate = slowest_mean(fn, 3)
                iters[name] = max(3, min(20000, int(TARGET_ROUND_SECONDS / max(estimate, 1e-9))))
            times: dict[str, list[float]] = {name: [] for name in fns}
            for round_index in range(args.rounds):
                for name in round_order(list(fns), round_index):
                    times[name].append(slowest_mean(fns[name], iters[name]))
            # The checks once more, after the timed calls: a fault that builds up over many
            # calls (slot sets, heap offsets) shows here rather than in a fast wrong row.
            checks(call, groups)
            # The baseline of this requested size: two sizes may round to the same bytes.
            baseline_seconds = statistics.median(times[baseline])
            for name in fns:
                seconds = statistics.median(times[name])
                algbw = count * esize / seconds / 1e9
                label, path, reason = name, None, None
                if args.hosts > 1 and name != "gloo":
                    # What the group ran (its last call was one of the timed ones) and why.
                    info = torch_xdev.describe(groups[name.removesuffix("_heap")])
                    if collective == "broadcast":
                        path, reason = info["last_broadcast"]
                    else:
                        _, path, reason = info["last_gather_scatter"]
                    label = f"{name}({path})"
                rows.append(
                    {
                        "collective": collective,
                        "size_bytes": count * esize,
                        "count": count,
                        "dtype": args.dtype,
                        "backend": label,
                        "iters": iters[name],
                        "rounds": args.rounds,
                        "time_us": seconds * 1e6,
                        "round_us": [t * 1e6 for t in times[name]],
                        "algbw_gbps": algbw,
                        "busbw_gbps": algbw
                        * (1 if collective == "broadcast" else (world - 1) / world),
                        "reason": reason,
                        "vs_baseline": baseline_seconds / seconds,
                    }
                )
                notes.append(spread_note(f"{collective} {label} at {count * esize} B", times[name]))
    if rank == 0:
        traffic = (
            traffic_rows(args.hosts, world, args.sizes, esize, args.collectives)
            if args.hosts > 1
            else []
        )
        for line in (
            header(world, baseline)
            + format_traffic(traffic, args.hosts, world)
            + format_table(rows, baseline)
            + [note for note in notes if note is not None]
        ):
            print(line)
        meta = {
            "world": world,
            "hosts": args.hosts,
            "device": args.device,
            "dtype": args.dtype,
            "sizes": args.sizes,
            "collectives": args.collectives,
            "rounds": args.rounds,
            "baseline": baseline,
            "traffic": traffic,
            **environment(),
        }
        path = Path(args.json) if args.json else default_json("gather_scatter", world)
        write_results(path, meta, rows)
    dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="It starts its ranks itself (--nproc): run it with python, not torchrun.",
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one host, xdev's native CUDA path next to NCCL (Gloo where ranks share a GPU)",
    )
    parser.add_argument("--sizes", default="64KiB,16MiB", help="comma-separated, e.g. 4KiB,1MiB")
    parser.add_argument("--dtype", default="float32", help="a torch dtype, e.g. bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--json",
        default=None,
        help="output file (default benchmarks/results/gather_scatter_<N>ranks.json)",
    )
    parser.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="split the ranks over this many fake hosts (XDEV_HOSTNAME), host by host: Gloo"
        " over all ranks against xdev's auto (two levels where the model picks them)",
    )
    parser.add_argument(
        "--collectives",
        default=None,
        help="comma-separated, of " + ", ".join(COLLECTIVES) + " (one host) or "
        + ", ".join(HOSTS_COLLECTIVES) + " (--hosts); default: all of them",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if refused_under_torchrun(sys.argv[0]):
        return 2
    if args.nproc < 2 or args.rounds < 1:
        parser.error("--nproc must be >= 2 and --rounds >= 1")
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        parser.error(f"--dtype: {args.dtype!r} is not a torch dtype")
    if args.hosts < 1 or args.nproc % args.hosts:
        parser.error("--hosts must divide --nproc")
    if args.hosts > 1 and args.nproc == args.hosts:
        # A rank alone on its host has no symmetric heap: xdev_2lvl_heap would fail mid-run.
        parser.error("--hosts needs at least 2 ranks per host (the xdev_2lvl_heap row)")
    if args.device == "cuda" and (args.hosts > 1 or not torch.cuda.is_available()):
        parser.error("--device cuda needs a GPU torch can see, and one host")
    known = HOSTS_COLLECTIVES if args.hosts > 1 else COLLECTIVES
    args.collectives = args.collectives.split(",") if args.collectives else list(known)
    unknown = [c for c in args.collectives if c not in known]
    if unknown:
        parser.error(f"unknown collective(s) {unknown}; choose from {', '.join(known)}")
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    except argparse.ArgumentTypeError:
        parser.error(f"--sizes: bad size list {args.sizes!r} (use e.g. 4KiB,1MiB,16MiB)")
    # The rows round each size down to whole blocks: a size below one element per rank is 0.
    esize = torch.empty((), dtype=dtype).element_size()
    too_small = [s for s in args.sizes if s // esize < args.nproc]
    if too_small:
        parser.error(f"--sizes {too_small}: below one {args.dtype} element per rank")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_rank, args=(args.nproc, args, port), nprocs=args.nproc, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
