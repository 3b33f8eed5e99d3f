"""Predicted allreduce, reduce-scatter and all-gather times from the plan layer's cost model.

Run as::

    python -m torch_xdev.plan --topology dgx1-v100 --sizes 4KiB:1GiB \\
        [--collective allreduce|reduce_scatter|all_gather] [--num-packs N] \\
        [--no-single-copy] [--no-in-place] [--plot out.png] [--json out.json]

For every payload size it prints, nccl-tests style, the predicted time, algbw and busbw
of every candidate plan (and of the ring reference: a ring on the machine's links
modelled with xdev's own costs, never run), and marks with ``*`` the one xdev would
choose by predicted time (``algorithm="auto"`` for the allreduce). A group chooses once per
size class (the power of two at or above the size) and keeps that choice, so at a size
between two powers of two ``*`` marks the size class's choice, which need not be the fastest
row printed for that exact size. The numbers come from
ideal hardware figures; they predict the shape of each plan's cost on that wiring, not a
measured time.

On GPU machines the allreduce's candidates include NCCL itself: one row per algorithm and
protocol NCCL would enable there (``nccl_ring/LL``, ``nccl_tree/LL128``,
``nccl_nvls/Simple``, ...), predicted by NCCL's own tuning model (NCCL 2.20.3's
``src/graph/tuning.cc``, see ``csrc/plan/nccl_model.h``). Where one of them is fastest,
auto hands the call to NCCL.

Reduce-scatter and all-gather
-----------------------------
``--collective reduce_scatter`` or ``all_gather`` predicts the forms of those collectives
instead: ``staged/<window>`` (through shared-memory slots, window by window),
``single_copy`` (peers read the input in place with ``process_vm_readv``; CPU machines
only) and ``in_place`` (peers read the input where every rank maps it: the symmetric
heap). The size is the whole tensor (all ranks' blocks), busbw is algbw x (n-1)/n, as
nccl-tests reports them. ``--no-single-copy`` and ``--no-in-place`` leave a form out of
the choice, as a group without single copy, or a tensor outside the heap, would; the
ring reference is the reduce-scatter or all-gather half of NCCL's ring. On GPU machines
NCCL's own candidates follow (its ring with each protocol, and NVLS on NVSwitch: NCCL runs
no tree for these), from the same tuning model, and ``*`` may mark one of them. On CUDA
tensors ``auto`` still hands these collectives to NCCL wherever NCCL runs, whatever the
model says, until xdev's CUDA form has been measured against NCCL; its reason quotes both
predictions.

Several hosts
-------------
``--hosts H`` (allreduce, GPU machines) predicts an allreduce of CUDA tensors over ``H``
hosts, each the machine ``--topology`` names, joined by ``--nics`` NICs per host (default:
one per GPU) of ``--nic-gbps`` GB/s each (default 50: 400 Gb/s InfiniBand); ``--amd-cpu``
gives NCCL's figures for AMD hosts. One row per algorithm and protocol NCCL would run over
all ranks (NCCL's tuning model across nodes, ``*`` on its choice: what auto runs) and a
``two_level`` row: a reduce-scatter inside each host (xdev's staged CUDA form or NCCL's,
whichever is predicted faster), NCCL across hosts among the ranks of each local index, an
all-gather inside. xdev has no two-level plan for CUDA tensors; the row shows where one
would stand, and a comment after each size gives its steps.

``--topology`` is a built-in machine (``dgx1-p100``, ``dgx1-v100``, ``hgx-h100``,
``hgx-a100``, ``nvlink-2gpu``, ``nvlink-4gpu``, ``pcie-8gpu``, ``cpu-<N>``; sources in
``docs/cost_model.md``) or the path of a topology file.

Topology file
-------------
The JSON object ``XDEV_TOPO_FILE`` reads for CUDA and ``python -m torch_xdev.topology``
writes; its format, with an example, is in ``pydoc torch_xdev.topology`` (the parser is
``torch_xdev.topology.load_topology_file``). The cost model reads:

``nvlink``
    Required. A square, symmetric matrix of non-negative integers: the number of
    NVLinks between GPUs i and j (0: the pair talks over PCIe). The diagonal is
    ignored.
``name``
    Optional; defaults to the file's name without its extension.
``nvswitch``
    Optional. Per GPU, its NVLinks to NVSwitches: the model gives each GPU a switch port
    (links x the per-link rate, each direction) and routes switched pairs over the two ports.
``nvlink_gbps``, ``pcie_gbps``, ``memory_gbps``
    Optional bandwidths in GB/s (1e9 bytes/s): per NVLink and direction (default 25,
    NVLink 2), per GPU's PCIe lane and direction (default 12) and of each GPU's memory
    (default 900).
``compute_capability``
    Optional, major x 10 + minor (default 70): which of NCCL's protocols and figures its
    candidates get (NVLS needs 90 and switches).

and ignores the other keys (``reachable``, ``gpus``, ``source``, ``class``, ``note``).

Sizes
-----
``A:B`` is every power-of-two multiple of ``A`` from ``A`` up to ``B`` (``A``, ``2A``,
``4A``, ...), ``A:B:F`` steps by a factor ``F`` instead, and ``A,B,C`` lists sizes.
Units: ``B`` (or none), ``KiB``/``K``, ``MiB``/``M``, ``GiB``/``G`` (powers of 1024).
Sizes are in bytes of float32 elements, so they must be multiples of 4.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
from typing import Sequence, TextIO, TypedDict

from . import topology as _topology
from .options import MAX_PACKS
from ._C import plan as _plan

MachineModel = _plan.MachineModel

__all__ = [
    "MachineModel",
    "Row",
    "COLLECTIVES",
    "format_table",
    "gather_scatter_rows",
    "load_topology_file",
    "machine",
    "main",
    "parse_sizes",
    "rows",
    "size_rows",
]

ELEM_BYTES = 4  # float32
COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather")
MAX_SIZES = 256
MAX_BYTES = 1 << 40

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20}
_UNITS.update({"g": 1 << 30, "gib": 1 << 30})
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")


class Row(TypedDict):
    """One line of the table (and one object of ``--json``)."""

    size: int
    label: str
    algorithm: str
    num_packs: int
    ring_reference: bool
    nccl: bool
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    chosen: bool


# ---------------------------------------------------------------------------------------
# Sizes


def parse_size(text: str) -> int:
    """``"4KiB"`` -> 4096. Raises ValueError on anything else than a count and a unit."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"'{text}' is not a size (examples: 4096, 4KiB, 64M, 1GiB)")
    unit = match.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"'{text}': unknown unit '{match.group(2)}' (use B, KiB, MiB or GiB)")
    return int(match.group(1)) * _UNITS[unit]


def _check_size(size: int, text: str) -> int:
    if size <= 0:
        raise ValueError(f"'{text}': sizes must be > 0")
    if size % ELEM_BYTES != 0:
        raise ValueError(f"'{text}' is {size} bytes, not a multiple of {ELEM_BYTES} (float32)")
    if size > MAX_BYTES:
        raise ValueError(f"'{text}' is larger than 1 TiB")
    return size


def parse_sizes(text: str) -> list[int]:
    """``A:B``, ``A:B:F`` or ``A,B,...`` as a list of byte counts (see the module doc)."""
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"'{text}': a range is A:B or A:B:F")
        lo = _check_size(parse_size(parts[0]), parts[0])
        hi = _check_size(parse_size(parts[1]), parts[1])
        factor = 2
        if len(parts) == 3:
            if not parts[2].strip().isdigit() or int(parts[2]) < 2:
                raise ValueError(f"'{text}': the factor F of A:B:F must be an integer >= 2")
            factor = int(parts[2])
        if lo > hi:
            raise ValueError(f"'{text}': the range's start is larger than its end")
        sizes = [lo]
        while sizes[-1] * factor <= hi:
            sizes.append(sizes[-1] * factor)
    else:
        sizes = [_check_size(parse_size(p), p) for p in text.split(",")]
    if len(sizes) > MAX_SIZES:
        raise ValueError(f"'{text}' gives {len(sizes)} sizes; at most {MAX_SIZES}")
    return sizes


def _sizes_arg(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def format_size(size: int) -> str:
    """4096 -> ``"4KiB"``; sizes that are not whole KiB/MiB/GiB stay in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


# ---------------------------------------------------------------------------------------
# Machines


def load_topology_file(path: str | os.PathLike[str]) -> MachineModel:
    """The GPU host a topology file describes (format: see ``torch_xdev.topology``).

    Raises ValueError naming the file and the problem.
    """
    topo = _topology.load_topology_file(path)
    where = str(path)
    if not topo["nvlink"]:
        raise ValueError(f"{where}: 'nvlink' is empty; a machine model needs at least one GPU")
    bandwidths: dict[str, float] = {}
    if "nvlink_gbps" in topo:
        bandwidths["nvlink_gbps"] = topo["nvlink_gbps"]
    if "pcie_gbps" in topo:
        bandwidths["pcie_gbps"] = topo["pcie_gbps"]
    if "memory_gbps" in topo:
        bandwidths["memory_gbps"] = topo["memory_gbps"]
    try:
        return _plan.gpu_machine(
            topo["name"],
            topo["nvlink"],
            **bandwidths,
            compute_capability=topo.get("compute_capability", 70),
            nvswitch=topo["nvswitch"],
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _looks_like_path(topology: str) -> bool:
    return topology.endswith(".json") or os.sep in topology or os.path.isfile(topology)


def machine(topology: str) -> MachineModel:
    """A built-in machine by name, or the one a topology file describes."""
    if _looks_like_path(topology):
        return load_topology_file(topology)
    try:
        return _plan.builtin_machine(topology)
    except ValueError as e:
        raise ValueError(f"--topology {topology}: not a file, and {e}") from None


# ---------------------------------------------------------------------------------------
# Predictions


def size_rows(model: MachineModel, size: int, num_packs: int = -1) -> list[Row]:
    """Every candidate's prediction for one size, the ring reference last; ``chosen`` marks
    what ``auto`` runs for a tensor of that size: the choice made for its size class."""
    choice = _plan.choose(model, size, num_packs, True)
    size_class = _plan.size_class(size)
    if size_class != size:
        choice_made = _plan.choose(model, size_class, num_packs, False)
        best = choice_made["best"]["label"]
    else:
        best = choice["best"]["label"]
    labels = [p["label"] for p in choice["predictions"]]
    if labels.count(best) != 1:  # the C++ API promises best is one of the predictions
        raise RuntimeError(f"choose({size}) chose '{best}', not once among {labels}")
    return [
        Row(
            size=size,
            label=p["label"],
            algorithm=p["algorithm"],
            num_packs=p["num_packs"],
            ring_reference=p["ring_reference"],
            nccl=p["nccl"],
            time_us=p["seconds"] * 1e6,
            algbw_gbps=p["algbw"] / 1e9,
            busbw_gbps=p["busbw"] / 1e9,
            chosen=p["label"] == best,
        )
        for p in choice["predictions"]
    ]


def rows(model: MachineModel, sizes: Sequence[int], num_packs: int = -1) -> list[Row]:
    """Every candidate's prediction (ring reference included) for every size."""
    return [r for size in sizes for r in size_rows(model, size, num_packs)]


def gather_scatter_rows(
    model: MachineModel,
    collective: str,
    size: int,
    single_copy: bool = True,
    in_place: bool = True,
) -> list[Row]:
    """Every form's prediction of a reduce-scatter or all-gather of ``size`` bytes (the whole
    tensor), then NCCL's (on a GPU machine), the ring reference last; ``chosen`` marks the
    fastest of the forms allowed and NCCL's."""
    choice = _plan.choose_gather_scatter(model, collective, size, True, True, True)
    best = choice["best"]["label"]
    size_class = _plan.size_class(size)
    if not (single_copy and in_place) or size_class != size:
        # Every form shown; the choice among those allowed, made (as auto makes it) for the
        # size class.
        allowed = _plan.choose_gather_scatter(
            model, collective, size_class, single_copy, in_place, False
        )
        best = allowed["best"]["label"]
    labels = [p["label"] for p in choice["predictions"]]
    if labels.count(best) != 1:  # the C++ API promises best is one of the predictions
        raise RuntimeError(f"choose_gather_scatter({size}) chose '{best}', not once in {labels}")
    return [
        Row(
            size=size,
            label=p["label"],
            algorithm=p["form"],
            num_packs=0,
            ring_reference=p["ring_reference"],
            nccl=p["nccl"],
            time_us=p["seconds"] * 1e6,
            algbw_gbps=p["algbw"] / 1e9,
            busbw_gbps=p["busbw"] / 1e9,
            chosen=p["label"] == best,
        )
        for p in choice["predictions"]
    ]


LABEL_WIDTH = len("hierarchical_balanced/9999")
COLUMNS = (
    f"# {'size':>10}  {'algorithm':<{LABEL_WIDTH}}  {'time(us)':>10}  "
    f"{'algbw(GB/s)':>11}  {'busbw(GB/s)':>11}  choice"
)


_WHAT = {
    "allreduce": "allreduce of float32 sums; * = the choice of algorithm=auto",
    "reduce_scatter": "reduce_scatter of float32 sums (size: the whole input); * = the model's"
    " choice",
    "all_gather": "all_gather (size: the whole output); * = the model's choice",
}


def format_header(model: MachineModel, collective: str = "allreduce") -> str:
    """The lines above the table: the machine, where its numbers come from, the columns."""
    return "\n".join(
        [
            f"# machine: {model.name} ({model.num_devices} devices)",
            f"# source: {model.source}",
            f"# predicted {_WHAT[collective]} (the ring reference is never chosen; nccl_* rows "
            "are NCCL's own tuning model)",
            *(
                []
                if collective == "allreduce" or not model.has_nccl
                else [
                    "# on CUDA tensors auto still runs NCCL wherever it runs: xdev's CUDA "
                    "form has not yet been measured against it"
                ]
            ),
            "#",
            COLUMNS,
        ]
    )


def write_json(path: str, table: Sequence[Row]) -> None:
    """``--json``: the rows as a JSON list, into a file or, for ``-``, onto stdout."""
    with (
        contextlib.nullcontext(sys.stdout) if path == "-" else open(path, "w", encoding="utf-8")
    ) as f:
        json.dump(list(table), f, indent=1)
        f.write("\n")


def table_stream(json_path: str | None) -> TextIO:
    """Where the human-readable table goes: stderr when the JSON goes to stdout."""
    return sys.stderr if json_path == "-" else sys.stdout


def format_row(r: Row) -> str:
    """One line of the table."""
    line = (
        f"  {r['size']:>10}  {r['label']:<{LABEL_WIDTH}}  {r['time_us']:>10.2f}  "
        f"{r['algbw_gbps']:>11.2f}  {r['busbw_gbps']:>11.2f}  {'*' if r['chosen'] else ''}"
    )
    return line.rstrip()


def format_table(model: MachineModel, table: Sequence[Row], collective: str = "allreduce") -> str:
    """The nccl-tests-like text the CLI prints: a blank line between sizes."""
    lines = [format_header(model, collective)]
    for i, r in enumerate(table):
        if i > 0 and r["size"] != table[i - 1]["size"]:
            lines.append("")
        lines.append(format_row(r))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# CLI


# Each NIC's GB/s per direction under --hosts when --nic-gbps is not given: 400 Gb/s.
DEFAULT_NIC_GBPS = 50.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torch_xdev.plan",
        description="Predicted allreduce, reduce-scatter or all-gather times of xdev's plans "
        "(and, on GPU machines, NCCL's own algorithms by its tuning model) on a machine model.",
        epilog="Topology file format and size syntax: see `pydoc torch_xdev.plan`.",
    )
    parser.add_argument(
        "--topology",
        required=True,
        help=f"a built-in machine ({', '.join(_plan.builtin_machine_names())}) or a JSON "
        "topology file",
    )
    parser.add_argument(
        "--sizes",
        type=_sizes_arg,
        default=_sizes_arg("4KiB:1GiB"),
        help="A:B (powers of two), A:B:F (factor F) or A,B,... with units B, KiB, MiB, GiB "
        "(default 4KiB:1GiB)",
    )
    parser.add_argument(
        "--collective",
        choices=COLLECTIVES,
        default="allreduce",
        help="the collective to predict (default allreduce)",
    )
    parser.add_argument(
        "--no-single-copy",
        action="store_true",
        help="reduce_scatter/all_gather: leave single copy out of the choice (still shown)",
    )
    parser.add_argument(
        "--no-in-place",
        action="store_true",
        help="reduce_scatter/all_gather: leave the in-place form (symmetric heap) out of the "
        "choice (still shown)",
    )
    parser.add_argument(
        "--num-packs",
        type=int,
        default=-1,
        help="allreduce: restrict the hierarchical plans to this many packs (default: try "
        "several; 0, no concat-and-split, predicts the one tensor as one pack)",
    )
    parser.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="allreduce on a GPU machine: predict for this many such hosts (default 1)",
    )
    parser.add_argument(
        "--nics", type=int, help="with --hosts: NICs per host (default: one per GPU)"
    )
    parser.add_argument(
        "--nic-gbps",
        type=float,
        help=f"with --hosts: each NIC's GB/s per direction (default {DEFAULT_NIC_GBPS:g}: "
        "400 Gb/s)",
    )
    parser.add_argument(
        "--amd-cpu", action="store_true", help="with --hosts: NCCL's figures for AMD CPUs"
    )
    parser.add_argument("--plot", metavar="PNG", help="plot busbw against size (matplotlib)")
    parser.add_argument(
        "--json",
        metavar="FILE",
        help="write the rows as a JSON list to FILE; '-' writes them to stdout (the table then "
        "goes to stderr)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not -1 <= args.num_packs <= MAX_PACKS:
        parser.error(f"--num-packs must be >= 0 and <= {MAX_PACKS} (or -1: try several)")
    gather_scatter = args.collective != "allreduce"
    if not gather_scatter and (args.no_single_copy or args.no_in_place):
        parser.error("--no-single-copy and --no-in-place apply to reduce_scatter and all_gather")
    if gather_scatter and args.num_packs != -1:
        parser.error("--num-packs applies to the allreduce only")
    if args.hosts == 1 and (args.nics is not None or args.nic_gbps is not None or args.amd_cpu):
        parser.error("--nics, --nic-gbps and --amd-cpu apply with --hosts")
    pyplot = None
    if args.plot is not None:
        from . import _plan_plot  # imports this module

        pyplot = _plan_plot.import_pyplot()
        if pyplot is None:
            print("error: install matplotlib to plot (pip install matplotlib)", file=sys.stderr)
            return 1
    try:
        model = machine(args.topology)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.hosts != 1:
        from . import _plan_hosts  # imports this module

        return _plan_hosts.main(parser, args, model)
    # Printed size by size: large payloads on a CPU model take a while to simulate.
    out = table_stream(args.json)
    print(format_header(model, args.collective), file=out, flush=True)
    table: list[Row] = []
    for i, size in enumerate(args.sizes):
        if gather_scatter:
            table_rows = gather_scatter_rows(
                model, args.collective, size, not args.no_single_copy, not args.no_in_place
            )
        else:
            table_rows = size_rows(model, size, args.num_packs)
        block = "\n".join(format_row(r) for r in table_rows)
        print(("\n" if i > 0 else "") + block, file=out, flush=True)
        table += table_rows
    try:
        if args.json is not None:
            write_json(args.json, table)
        if pyplot is not None:
            _plan_plot.plot(model, table, args.plot, pyplot, args.collective)
    except OSError as e:  # e.g. a folder that does not exist: the table is printed already
        print(f"error: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # The model runs in C++ without returning to Python between sizes, so Python's own
    # KeyboardInterrupt would wait for the whole table (minutes for cpu-999): from the command
    # line, Ctrl-C ends the process at once instead.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # A reader that stops early (`| head`) ends the process quietly, as it does any Unix tool.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    raise SystemExit(main())
