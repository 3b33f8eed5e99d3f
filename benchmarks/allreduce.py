"""Allreduce benchmark: xdev's algorithms beside Gloo (CPU) or NCCL (CUDA), nccl-tests style.

Usage::

    python benchmarks/allreduce.py --nproc 2 [--sizes 4KiB:64MiB] [--dtype float32]
        [--algorithms auto,shared_empty,direct,flat,reduce_to_one,hierarchical_copy,...]
        [--iters N] [--warmup N] [--rounds N] [--json out.json] [--slot-bytes B]
        [--arrival back-to-back|skewed] [--no-deepspeed] [--hosts H [--pieces N,...]]
    python benchmarks/allreduce.py --device cuda --nproc 8 [--sizes 4KiB:256MiB]
        [--cuda-slot-bytes B] [--topo-file dgx1.json] [--host-overhead-calls N] ...

CPU mode (the default): every rank runs one Gloo default group plus one xdev group per
algorithm; each row is the slowest rank's mean time per ``all_reduce`` (the median over
``--rounds``). The pseudo-algorithm ``shared_empty`` is ``auto`` on a tensor from
``torch_xdev.shared_empty``, which every rank maps, so the allreduce runs in place; ``heap``
is ``auto`` on a tensor from the group's symmetric heap (``allocate_tensor``), where DDP takes
its buckets; the other rows reduce ordinary tensors. ``--hosts`` runs ``auto`` and ``heap``
(and with ``--pieces N``, ``piecesN``: ``auto`` with the two-level allreduce pipelined in N
pieces). Before timing an xdev algorithm its result on random data is checked against Gloo's.
The parent process also measures single-core ``copy_`` bandwidth so each row can be compared
to memcpy.

Where ``deepspeed`` is importable, CPU mode adds a ``deepspeed_shm`` row per size: DeepSpeed's
shared-memory allreduce (``deepspeed.comm.inference_all_reduce``) in the same processes,
checked against Gloo like the xdev rows (``benchmarks/deepspeed_shm.py``; ``--no-deepspeed``
leaves it out). Where it cannot run, the header says why and the JSON records it.

``--arrival skewed`` puts a Gloo barrier before every timed call and times the call alone:
ranks then reach each call tens to hundreds of microseconds apart, as they do after
unequal work, and a row measures how well the backend waits (the default, back-to-back
calls, keeps the ranks in step). ``--rounds N`` (default 3) times every row N times, the
backends of one size taking turns, each round starting one backend later, and reports the
median over the rounds: on a noisy machine the rows then share its slow spells, and none is
always timed first (after the checks) or right after the same neighbour.

The script starts its ranks itself (``--nproc``): run it with python, not torchrun, which would
start one world per process, each waiting forever for torchrun's store.

CUDA mode (``--device cuda``): rank r uses GPU ``r % device_count``. xdev's algorithms run
on CUDA tensors next to NCCL where NCCL can run (every rank on its own GPU); when ranks
share a GPU NCCL refuses to run, so the reference is Gloo on the same CUDA tensors instead
(the table says which). Times come from CUDA events around back-to-back calls after a
warmup (slowest rank's mean per call); xdev is checked against the reference first. Rank 0
also measures the GPU's device-to-device ``copy_`` bandwidth (algbw/copy compares each row
with it), and every backend's host overhead: the mean wall time of one
``all_reduce(t, async_op=True)`` call on a 4 KiB tensor. ``--topo-file`` passes a GPU link
matrix to xdev (``XDEV_TOPO_FILE``), e.g. a DGX-1 matrix to make ``auto`` run
hierarchical_copy on ranks sharing one GPU. Ranks sharing a GPU are time-sliced by the
driver, so their xdev times measure that, not the algorithms, unless an MPS daemon runs
(``nvidia-cuda-mps-control -d``), which lets their kernels run at once. The reduction kernels alone,
against the copy bandwidth, are benchmarked by ``benchmarks/cuda_kernels.py``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deepspeed_shm
import network_fit
import torch_xdev
from run_record import XDEV_PATH, environment, write_results, xdev_environment_line
from step_common import refused_under_torchrun, round_order, spread_note
from allreduce_common import (
    DTYPES,
    Config,
    parse_size,
    parse_sizes,
    format_size,
    random_input,
    check_result,
    choose_iters,
    max_over_ranks,
    group_allreduce,
    timing_row,
    table_columns,
    table_row,
    make_config,
    iters_text,
    sizes_text,
    settings_metadata,
    init_rank,
)
from allreduce_cuda import (
    run_rank_cuda,
    make_cuda_config,
)

DEFAULT_ALGORITHMS = (
    "auto,shared_empty,direct,flat,reduce_to_one,hierarchical_copy,hierarchical_balanced"
)
# Not Options.algorithms (CPU only): "auto" on a torch_xdev.shared_empty tensor, and "auto" on a
# tensor from the group's symmetric heap (its allocate_tensor, where DDP takes its buckets).
SHARED_EMPTY = "shared_empty"
HEAP = "heap"
IN_SHARED_MEMORY = (SHARED_EMPTY, HEAP)
# --hosts --pieces N: a row "piecesN", auto on ordinary tensors with Options.two_level_pieces=N.
PIECES = "pieces"
MEMCPY_BYTES = 256 << 20
DEFAULT_ROUNDS = 3  # CPU mode
DEFAULT_SIZES = {"cpu": "4KiB:64MiB", "cuda": "4KiB:256MiB"}
KERNEL_BENCHMARK = "benchmarks/cuda_kernels.py"
COLUMNS = table_columns("gloo", "memcpy")


def best_copy_seconds(nbytes: int, min_reps: int = 5, budget_s: float = 0.05) -> float:
    """Best single-threaded ``dst.copy_(src)`` time for ``nbytes`` bytes."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = math.inf
    reps = 0
    started = time.perf_counter()
    while reps < min_reps or (time.perf_counter() - started < budget_s and reps < 10000):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best


def measure_memcpy(sizes: list[int]) -> tuple[float, dict[int, float]]:
    """Returns (GB/s of a 256 MiB copy, {row size: best copy time in us}), on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gbps = MEMCPY_BYTES / best_copy_seconds(MEMCPY_BYTES, min_reps=10, budget_s=0.0) / 1e9
        per_size = {size: best_copy_seconds(size) * 1e6 for size in sizes}
    finally:
        torch.set_num_threads(threads)
    return gbps, per_size


def timed_loop(
    tensor: torch.Tensor, allreduce: Callable[[torch.Tensor], Any], iters: int, skewed: bool
) -> float:
    """Slowest rank's seconds per allreduce over ``iters`` calls.

    Back to back, or with ``skewed`` each call after a Gloo barrier (the default group),
    which releases the ranks some microseconds apart; then only the calls are timed.
    """
    dist.barrier()
    if not skewed:
        t0 = time.perf_counter()
        for _ in range(iters):
            allreduce(tensor)
        return max_over_ranks((time.perf_counter() - t0) / iters)
    elapsed = 0.0
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        allreduce(tensor)
        elapsed += time.perf_counter() - t0
    return max_over_ranks(elapsed / iters)


def format_row(row: dict[str, Any]) -> str:
    return table_row(row, "vs_gloo", "algbw_vs_memcpy", "memcpy_us")


def heap_tensor(group: Any, count: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor from the group's symmetric heap, as DDP allocates its buckets."""
    backend = group._get_backend(torch.device("cpu"))
    if not backend.supports_tensor_alloc(torch.device("cpu")):
        note = torch_xdev.describe(group)["ddp_shared_buckets_note"]
        raise SystemExit(f"the heap row needs the group's symmetric heap, which is {note}")
    return backend.allocate_tensor(count, dtype=dtype, device=torch.device("cpu"))


def run_rank(rank: int, cfg: Config) -> None:
    if cfg.device == "cuda":
        run_rank_cuda(rank, cfg)
        return
    init_rank(rank, cfg)
    # (row name, allreduce, its group: None for DeepSpeed, which has its own channel)
    variants: list[tuple[str, Callable[[torch.Tensor], Any], Any]] = [
        ("gloo", group_allreduce(dist.group.WORLD), dist.group.WORLD)
    ]
    for algorithm in cfg.algorithms:
        settings: dict[str, Any] = {"algorithm": algorithm}
        if algorithm in IN_SHARED_MEMORY:
            settings["algorithm"] = "auto"
        elif algorithm.startswith(PIECES):
            settings = {"algorithm": "auto", "two_level_pieces": int(algorithm[len(PIECES) :])}
        if cfg.slot_bytes is not None:
            settings["shm_slot_bytes"] = cfg.slot_bytes
        group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(**settings))
        variants.append((f"xdev/{algorithm}", group_allreduce(group), group))
    deepspeed_skipped = cfg.deepspeed_skipped
    if deepspeed_skipped is None:
        ds_allreduce, deepspeed_skipped = deepspeed_shm.start(rank, cfg.nproc, cfg.dtype)
        if ds_allreduce is not None:
            variants.append((deepspeed_shm.LABEL, ds_allreduce, None))
    if rank == 0:
        if deepspeed_skipped:
            print(f"# {deepspeed_shm.LABEL}: skipped: {deepspeed_skipped}")
        else:
            print(
                f"# {deepspeed_shm.LABEL}: DeepSpeed {deepspeed_shm.version()} SHM allreduce"
                " (deepspeed.comm.inference_all_reduce; its waits spin, never sleep)"
            )
        print(COLUMNS, flush=True)

    dtype = DTYPES[cfg.dtype]
    element_size = torch.empty((), dtype=dtype).element_size()
    skewed = cfg.arrival == "skewed"
    rows: list[dict[str, Any]] = []
    for size_index, size in enumerate(cfg.sizes):
        count = size // element_size
        data = random_input(count, dtype, rank, size_index)
        expected = data.clone()
        dist.all_reduce(expected)
        tensor = torch.zeros(count, dtype=dtype)  # stays zero: no overflow, no denormals
        timed: dict[str, torch.Tensor] = {}
        shared_of: dict[str, Optional[torch.Tensor]] = {}  # the checks' tensor, where not new
        iters: dict[str, int] = {}
        for name, allreduce, group in variants:
            # Every rank allocates it in the same order (shared_empty is collective).
            shared = None
            if name == f"xdev/{SHARED_EMPTY}":
                shared = torch_xdev.shared_empty(count, dtype=dtype, group=group)
            elif name == f"xdev/{HEAP}":
                shared = heap_tensor(group, count, dtype)
            shared_of[name] = shared
            if name != "gloo":
                check_result(cfg, name, allreduce, data, expected, "gloo", into=shared)
            timed[name] = tensor if shared is None else shared.zero_()
            for _ in range(cfg.warmup):
                allreduce(timed[name])
            loop = functools.partial(timed_loop, timed[name], allreduce, skewed=skewed)
            iters[name] = choose_iters(cfg, loop)
        seconds: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        for round_index in range(cfg.rounds):
            for name, allreduce, _ in round_order(variants, round_index):
                seconds[name].append(timed_loop(timed[name], allreduce, iters[name], skewed))
        # Again after the timed calls: a fault that builds up over many calls (slot sets,
        # heap offsets, sequence numbers) shows here rather than in a fast wrong row.
        for name, allreduce, _ in variants:
            if name != "gloo":
                check_result(cfg, name, allreduce, data, expected, "gloo", into=shared_of[name])
        del timed, shared_of
        gloo_time = statistics.median(seconds["gloo"])
        for name, _, group in variants:
            per_call = statistics.median(seconds[name])  # of the rounds' means per call
            label, picked = name, None
            if name == "xdev/auto":
                last = torch_xdev.describe(group)["last_allreduce"]
                picked = None if last is None else str(last[0])
                label = f"{name}({picked})"
            row = timing_row(cfg, size, count, name, label, iters[name], per_call)
            row |= {
                "round_us": [s * 1e6 for s in seconds[name]],
                "auto_picked": picked,
                "vs_gloo": gloo_time / per_call,
                "algbw_vs_memcpy": row["algbw_gbps"] / cfg.memcpy_gbps,
                "memcpy_us": cfg.memcpy_us[size],
            }
            rows.append(row)
            if rank == 0:
                print(format_row(row), flush=True)
                note = spread_note(f"{label} at {format_size(size)}", seconds[name])
                if note is not None:
                    print(note, flush=True)
        del data, expected, tensor

    if rank == 0:
        write_json(cfg, rows, deepspeed_skipped)
        if cfg.hosts > 1:
            fit_and_write_network(cfg, rows)
    dist.barrier()
    dist.destroy_process_group()


def write_json(cfg: Config, rows: list[dict[str, Any]], deepspeed_skipped: str) -> None:
    meta = {
        **settings_metadata(cfg),
        "rounds": cfg.rounds,
        "arrival": cfg.arrival,
        "hosts": cfg.hosts,  # the header's fake hosts; the file name alone may not say
        "deepspeed": {
            "row": deepspeed_shm.LABEL,
            "version": deepspeed_shm.version(),
            "skipped": deepspeed_skipped or None,
        },
        "slot_bytes": cfg.slot_bytes,
        "memcpy_gbps": cfg.memcpy_gbps,
        "memcpy_bytes": MEMCPY_BYTES,
        "memcpy_us_per_size": {str(k): v for k, v in cfg.memcpy_us.items()},
        **environment(),
    }
    write_results(Path(cfg.json_path), meta, rows)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "--device cuda runs xdev's CUDA path next to NCCL (or Gloo on CUDA tensors where"
            " ranks share a GPU) and reports the GPU's copy_ bandwidth and each backend's host"
            f" overhead per call. The reduction kernels alone are benchmarked by {KERNEL_BENCHMARK}"
            " (against the same device-to-device copy bandwidth). The script starts its ranks"
            " itself (--nproc): run it with python, not torchrun."
        ),
    )
    parser.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (default): CPU tensors, xdev vs Gloo; cuda: rank r on GPU r %% device_count,"
        " xdev vs NCCL",
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=None,
        help="LO:HI (doubling) or a comma list; units B, KiB, MiB, GiB (default 4KiB:64MiB;"
        " with --device cuda 4KiB:256MiB)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--algorithms", default=DEFAULT_ALGORITHMS, help="xdev algorithms")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default: auto)")
    parser.add_argument("--warmup", type=int, default=3, help="warmup iterations (default 3)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="CPU mode: time every row this many times, the backends of a size taking turns,"
        " each round starting one backend later, and report the median over the rounds"
        f" (default {DEFAULT_ROUNDS})",
    )
    parser.add_argument(
        "--arrival",
        choices=("back-to-back", "skewed"),
        default="back-to-back",
        help="CPU mode: back-to-back calls (default), or skewed: a Gloo barrier before every"
        " timed call, so ranks arrive apart; only the calls are timed",
    )
    parser.add_argument(
        "--no-deepspeed",
        action="store_true",
        help="CPU mode: leave out the DeepSpeed SHM allreduce row (added where deepspeed is"
        " importable)",
    )
    parser.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="CPU mode: split the ranks over this many hosts as xdev sees them (XDEV_HOSTNAME),"
        " host by host; xdev runs auto (the two-level plan across hosts) on ordinary tensors and"
        " on tensors of each host's symmetric heap (heap, as DDP's buckets) next to Gloo, and the"
        " header gives each plan's traffic per host from the plans; after the run the network"
        " model's latency and per-stream rate are fitted to Gloo's times (default 1)",
    )
    parser.add_argument(
        "--pieces",
        default="",
        metavar="N[,M...]",
        help="--hosts: add a row per count, auto on ordinary tensors with the two-level"
        " allreduce pipelined in that many pieces (Options.two_level_pieces), to compare with"
        " the model's choice",
    )
    parser.add_argument(
        "--net-model-out",
        default=None,
        metavar="PATH",
        help="--hosts: where the network model fitted to Gloo's times goes, an XDEV_CPU_MODEL"
        " file; an existing file keeps its other parameters (default"
        " benchmarks/results/network_model_<N>hosts.json)",
    )
    parser.add_argument("--json", default=None, help="output file (default benchmarks/results/)")
    parser.add_argument("--slot-bytes", type=parse_size, default=None, help="xdev shm_slot_bytes")
    parser.add_argument(
        "--cuda-slot-bytes",
        type=parse_size,
        default=None,
        help="xdev cuda_slot_bytes (--device cuda; default: xdev's, 32MiB)",
    )
    parser.add_argument(
        "--topo-file",
        default=None,
        metavar="PATH",
        help="GPU link matrix for xdev (sets XDEV_TOPO_FILE in the ranks; --device cuda), e.g."
        " a DGX-1 matrix so that auto runs hierarchical_copy; format: torch_xdev/topology.py",
    )
    parser.add_argument(
        "--host-overhead-calls",
        type=int,
        default=200,
        help="async all_reduce calls timed for the host overhead (--device cuda; default 200)",
    )
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if refused_under_torchrun(sys.argv[0]):
        return 2
    if args.sizes is None:
        args.sizes = parse_sizes(DEFAULT_SIZES[args.device])
    if args.nproc < 1:
        sys.exit("--nproc must be >= 1")
    if args.device == "cuda" and (args.arrival != "back-to-back" or args.rounds not in (None, 1)):
        sys.exit("--arrival and --rounds apply to CPU mode only")
    if args.rounds is None:
        args.rounds = DEFAULT_ROUNDS if args.device == "cpu" else 1
    if args.iters is not None and args.iters < 1 or args.warmup < 0 or args.rounds < 1:
        sys.exit("--iters and --rounds must be >= 1 and --warmup >= 0")
    element_size = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    bad_sizes = [s for s in args.sizes if s % element_size]
    if bad_sizes:
        sys.exit(f"sizes {bad_sizes} are not multiples of the {args.dtype} element size")
    algorithms: list[str] = []
    for algorithm in (a.strip() for a in args.algorithms.split(",") if a.strip()):
        if algorithm in IN_SHARED_MEMORY and args.device == "cuda":
            continue  # CPU tensors only; the default list has shared_empty
        if algorithm not in torch_xdev.ALGORITHMS and algorithm not in IN_SHARED_MEMORY:
            choices = (*torch_xdev.ALGORITHMS, *IN_SHARED_MEMORY)
            sys.exit(f"unknown algorithm {algorithm!r}; choose from {choices}")
        if algorithm.startswith("hierarchical") and args.nproc % 2:
            print(f"# note: skipping {algorithm} (needs an even nproc, got {args.nproc})")
            continue
        if algorithm not in algorithms:
            algorithms.append(algorithm)
    if args.slot_bytes is not None:
        try:
            torch_xdev.Options(shm_slot_bytes=args.slot_bytes)  # validates early
        except ValueError as e:
            sys.exit(f"--slot-bytes: {e}")
    if args.hosts != 1:
        if args.device != "cpu" or args.hosts < 1 or args.nproc % args.hosts:
            sys.exit("--hosts needs CPU mode and divides --nproc")
        if args.nproc == args.hosts:
            # A rank alone on its host has no symmetric heap: the heap row would fail mid-run.
            sys.exit("--hosts needs at least 2 ranks per host (the heap row)")
        # The forced native plans need one host; the heap row is a DDP bucket's allreduce.
        algorithms = ["auto", HEAP]
        pieces = [n.strip() for n in args.pieces.split(",") if n.strip()]
        # 0 pieces would be the model's choice, the auto row again, not a forced count.
        if not all(n.isdigit() and int(n) >= 1 for n in pieces):
            sys.exit(f"--pieces takes piece counts >= 1, e.g. 2,4; got {args.pieces!r}")
        # Each count once: a repeated one would time two groups under one row's name.
        algorithms += [f"{PIECES}{n}" for n in dict.fromkeys(int(n) for n in pieces)]
        args.no_deepspeed = True
    elif args.pieces:
        sys.exit("--pieces needs --hosts")

    if args.device == "cuda":
        cfg = make_cuda_config(args, algorithms)
    else:
        cfg = make_cpu_config(args, algorithms)
    return launch(cfg)


def make_cpu_config(args: argparse.Namespace, algorithms: list[str]) -> Config:
    memcpy_gbps, memcpy_us = measure_memcpy(args.sizes)
    deepspeed_skipped = (
        "left out by --no-deepspeed or --hosts"
        if args.no_deepspeed
        else deepspeed_shm.unavailable_reason("cpu", args.dtype)
    )
    # Skewed rows are not for benchmarks/calibrate.py, which reads allreduce_*ranks.json.
    suffix = "_skewed" if args.arrival == "skewed" else ""
    if args.hosts > 1:
        suffix += f"_{args.hosts}hosts"
    cfg = make_config(
        args,
        algorithms,
        f"allreduce_{args.nproc}ranks{suffix}.json",
        memcpy_gbps=memcpy_gbps,
        memcpy_us=memcpy_us,
        arrival=args.arrival,
        rounds=args.rounds,
        deepspeed_skipped=deepspeed_skipped,
        hosts=args.hosts,
        net_model_path=str(
            args.net_model_out
            or Path(__file__).resolve().parent / "results" / f"network_model_{args.hosts}hosts.json"
        ),
    )
    print(f"# torch-xdev allreduce benchmark  nproc={cfg.nproc}  dtype={cfg.dtype}")
    if cfg.hosts > 1:
        print_traffic(cfg)
    print(
        f"# torch {torch.__version__}  torch_xdev {torch_xdev.__version__}  cpus {os.cpu_count()}"
    )
    print(f"# torch_xdev from {XDEV_PATH}")
    print(xdev_environment_line())
    print(f"# single-core memcpy ({format_size(MEMCPY_BYTES)} copy_): {memcpy_gbps:.2f} GB/s")
    print(
        f"# iters {iters_text(cfg)}  warmup {cfg.warmup}  rounds {cfg.rounds}  slot_bytes"
        f" {cfg.slot_bytes or 'default'}  sizes {sizes_text(cfg)}"
    )
    arrival = (
        "skewed: a Gloo barrier before every call, the call alone timed"
        if cfg.arrival == "skewed"
        else "back-to-back calls"
    )
    print(f"# arrival: {arrival}")
    print(
        "# time = median over rounds of the slowest rank's mean per call; busbw = algbw*2(n-1)/n;"
        " vs_gloo = speedup"
    )
    return cfg


def print_traffic(cfg: Config) -> None:
    """Where each plan's bytes go, per host, from the plans (loopback hides it here)."""
    per_host = cfg.nproc // cfg.hosts
    print(
        f"# {cfg.hosts} hosts x {per_host} ranks (XDEV_HOSTNAME); per host, from the plans:"
        " MB sent to other hosts / sequential steps across hosts / streams leaving at once /"
        " MB between ranks of one host through sockets"
    )
    for size in cfg.sizes:
        plans = torch_xdev._C.plan.across_hosts_traffic(cfg.hosts, per_host, size)
        cells = [
            f"{name} {t['inter_host_bytes'] / 1e6:.3f} / {t['inter_host_steps']} /"
            f" {t['inter_host_streams']} / {t['intra_host_socket_bytes'] / 1e6:.3f}"
            for name, t in (("two-level", plans["two_level"]), ("gloo ring", plans["flat_ring"]))
        ]
        print(f"#   {format_size(size):>8}: " + ";  ".join(cells))


def fit_and_write_network(cfg: Config, rows: list[dict[str, Any]]) -> None:
    """Fits the network model to Gloo's ring over all ranks across the hosts, prints it next to
    the defaults and writes it as an XDEV_CPU_MODEL file (benchmarks/network_fit.py)."""
    gloo = [r for r in rows if r["backend"] == "gloo"]
    if len(gloo) < 2:
        print("# network fit: needs at least two sizes")
        return
    per_host = cfg.nproc // cfg.hosts
    sizes = [r["size_bytes"] for r in gloo]
    seconds = [r["time_us"] * 1e-6 for r in gloo]
    # Every fake host runs on this machine: each gets its share of the cores, as xdev counts.
    host_cores = max(1, (os.cpu_count() or 1) * per_host // cfg.nproc)
    try:
        fit = network_fit.fit_network(cfg.hosts, per_host, sizes, seconds, host_cores)
    except ValueError as e:  # e.g. noise hid the growth with size: the rows still stand
        print(f"# network fit: not written: {e}")
        return
    for line in network_fit.format_fit(fit):
        print(line)
    for size, t in zip(sizes, seconds):
        fitted = network_fit.model_ring_s(
            cfg.hosts, per_host, size, fit["net_latency_us"], fit["net_stream_gbps"], host_cores
        )
        default = network_fit.model_ring_s(
            cfg.hosts,
            per_host,
            size,
            network_fit.DEFAULT_LATENCY_US,
            network_fit.DEFAULT_STREAM_GBPS,
            host_cores,
        )
        print(
            f"#   {format_size(size):>8}: Gloo measured {t * 1e6:10.1f} us, fitted model"
            f" {fitted * 1e6:10.1f} us, default model {default * 1e6:10.1f} us"
        )
    assert cfg.net_model_path is not None
    source = {"benchmark": cfg.json_path, "hosts": cfg.hosts, "ranks_per_host": per_host}
    network_fit.write_model(Path(cfg.net_model_path), fit, source)
    print(f"# wrote {cfg.net_model_path} (use it with XDEV_CPU_MODEL={cfg.net_model_path})")


def launch(cfg: Config) -> int:
    sys.stdout.flush()
    try:
        mp.spawn(run_rank, args=(cfg,), nprocs=cfg.nproc, join=True)
    except mp.ProcessRaisedException as e:
        message = str(e).strip().splitlines()[-1]
        print(f"error: a rank failed: {message}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"error: a rank exited abnormally: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
