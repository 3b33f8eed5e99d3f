"""The GPU topology of this host: NVLink counts, peer reachability and their class.

Run as::

    python -m torch_xdev.topology [--file PATH]

It prints, as JSON, what :func:`detect` finds (with ``--file``: that topology file,
classified). The output is itself a topology file: save it, edit it, and inject it with
``XDEV_TOPO_FILE=path`` to make the backend believe in another machine.

Classes
-------
``dgx1``
    Exactly 8 ranks whose NVLinks form the DGX-1 hybrid cube-mesh (each GPU linked to
    exactly its cube-mesh peers; reachability does not matter). Hierarchical copy runs here.
``nvswitch``
    Otherwise, more than one rank and every rank's GPU has NVLinks to NVSwitches (HGX /
    DGX A100 and H100 boards).
``fully_connected``
    Otherwise, every pair of ranks is NVLinked or reachable (CUDA peer access, or the same
    GPU). One rank counts as fully connected.
``partial``
    Some pairs are, some are not.
``none``
    No pair is, or there are no GPUs at all.

Detection (:func:`detect`)
--------------------------
With ``XDEV_TOPO_FILE`` set (and not empty), the file's matrices, whose rows are the local
ranks in order; they are not checked against the visible GPUs, since several ranks may share
one GPU (that is how hierarchical copy is tested on one GPU). Otherwise one row per visible
CUDA device: its PCI bus id from ``torch.cuda.get_device_properties``, NVLink counts from NVML
(loaded at run time; without it the counts are 0), and reachability from
``torch.cuda.can_device_access_peer``. ``source`` says where the NVLink counts come from:
``nvml``, ``XDEV_TOPO_FILE=<path>``, ``file=<path>`` (``--file``), or ``none: <why>``.
Detection initialises CUDA in the calling process.

Topology file
-------------
A JSON object, the one ``python -m torch_xdev.plan --topology`` reads too::

    {
      "name": "my-dgx1",
      "nvlink": [[0, 1, 1, 2, 2, 0, 0, 0],
                 [1, 0, 2, 1, 0, 2, 0, 0],
                 [1, 2, 0, 2, 0, 0, 1, 0],
                 [2, 1, 2, 0, 0, 0, 0, 1],
                 [2, 0, 0, 0, 0, 1, 1, 2],
                 [0, 2, 0, 0, 1, 0, 2, 1],
                 [0, 0, 1, 0, 1, 2, 0, 2],
                 [0, 0, 0, 1, 2, 1, 2, 0]]
    }

``nvlink``
    Required. A square, symmetric matrix of non-negative integers: the NVLinks between
    ranks i and j (0: none, e.g. PCIe, or two ranks on one GPU). The diagonal is ignored.
``reachable``
    Optional. A square, symmetric 0/1 matrix of the same size: 1 where ranks i and j can
    access each other's memory. The diagonal is ignored (a GPU reaches itself). Without it,
    a pair is reachable exactly when it is NVLinked.
``nvswitch``
    Optional. One non-negative integer per row: the NVLinks from that rank's GPU to the
    host's NVSwitches (18 per H100 SXM, 12 per A100 SXM). ``nvlink`` counts a pair joined
    through the switches with the smaller of the two counts, on top of any direct links, as
    NVML detection writes it. Without it: no switches.
``name``
    Optional; defaults to the file's name without its extension.
``gpus``
    Optional. The ranks' PCI bus ids (strings), one per row, or an empty list.
``nvlink_gbps``, ``pcie_gbps``, ``memory_gbps``, ``compute_capability``
    Optional bandwidths in GB/s and the GPUs' compute capability (major x 10 + minor), for
    ``python -m torch_xdev.plan --topology FILE`` alone, which models the file's machine as
    it models the DGX-1s: these rates (defaults: a V100's) and the pipelined executor of
    TensorFlow's HierarchicalCopyAllReduce. A group given the file as ``XDEV_TOPO_FILE``
    takes only its links from it: its model is that of the GPUs it runs on (their detected
    compute capability, xdev's CUDA executor with a barrier per phase and its windows), as
    ``--topology hgx-h100`` and ``hgx-a100`` are built. So the plan CLI's ``*`` for a file
    is what ``auto`` would pick on the machine the file's rates describe, not necessarily
    what a group given the same file picks.
``source``, ``class``, ``note``
    Written by this CLI and ignored when read: the class is always computed afresh.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, TypedDict

import torch

from ._C import topology as _topology
from ._registration import MODEL_RANGES, _finite_float

__all__ = [
    "CLASSES",
    "ENV_TOPO_FILE",
    "Topology",
    "classify",
    "detect",
    "load_topology_file",
    "main",
    "reachable_from_links",
    "to_json",
]

ENV_TOPO_FILE = "XDEV_TOPO_FILE"
CLASSES = ("dgx1", "nvswitch", "fully_connected", "partial", "none")
BANDWIDTH_KEYS = ("nvlink_gbps", "pcie_gbps", "memory_gbps")
# The most links a pair, or a GPU to its NVSwitches, may have: LinkMatrix::kMaxLinksPerPair
# (csrc/plan/topology.h). Checked here too because a count past 64 bits (32 for 'nvswitch')
# fails in the binding with a TypeError instead of the ValueError that names the file.
MAX_LINKS = 1024
FILE_KEYS = {
    "name",
    "nvlink",
    "reachable",
    "nvswitch",
    "compute_capability",
    "gpus",
    "source",
    "class",
    "note",
    *BANDWIDTH_KEYS,
}

# "class" is a keyword, hence the functional form for the keys every topology has.
_TopologyKeys = TypedDict(
    "_TopologyKeys",
    {
        "name": str,
        "source": str,
        "class": str,
        "gpus": list[str],
        "nvlink": list[list[int]],
        "reachable": list[list[int]],
        "nvswitch": list[int],
        "note": str,
    },
)


class Topology(_TopologyKeys, total=False):
    """What :func:`detect` and :func:`load_topology_file` return (format: the module doc).

    The bandwidths are present only where a file gives them.
    """

    nvlink_gbps: float
    pcie_gbps: float
    memory_gbps: float
    compute_capability: int


# ---------------------------------------------------------------------------------------
# Files


def _gbps(data: dict[str, Any], key: str, where: str) -> float | None:
    if key not in data:
        return None
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: '{key}' must be a number, got {json.dumps(value)}")
    number = _finite_float(value)  # None for inf, nan, or an integer beyond any float
    if number is None or number <= 0:
        raise ValueError(f"{where}: '{key}' must be a finite number > 0, got {value}")
    # As for a CPU model file: a rate of 1e300 GB/s overflows to inf bytes/s in the model,
    # whose simulation then never ends.
    low, high = MODEL_RANGES["gbps"]
    if not low <= number <= high:
        raise ValueError(f"{where}: '{key}' must be within [{low:g}, {high:g}] GB/s, got {value}")
    return number


def _matrix(value: Any, key: str, where: str, zero_one: bool) -> list[list[int]]:
    """A square, symmetric matrix of non-negative integers (0/1 if ``zero_one``).

    The diagonal must hold integers but is otherwise ignored: it comes back as 1 for a 0/1
    (reachability) matrix, 0 for link counts.
    """
    kind = "0/1 matrix" if zero_one else "square matrix"
    if not isinstance(value, list):
        raise ValueError(f"{where}: '{key}' must be a list of rows (a {kind})")
    n = len(value)
    matrix: list[list[int]] = []
    for i, row in enumerate(value):
        if not isinstance(row, list):
            raise ValueError(f"{where}: '{key}' row {i} is not a list")
        if len(row) != n:
            raise ValueError(
                f"{where}: '{key}' is not a square matrix: row {i} has {len(row)} entries, "
                f"but there are {n} rows"
            )
        for j, count in enumerate(row):
            if isinstance(count, bool) or not isinstance(count, int):
                what = "0 or 1" if zero_one else "an integer link count"
                raise ValueError(
                    f"{where}: '{key}'[{i}][{j}] must be {what}, got {json.dumps(count)}"
                )
            if i == j:
                continue
            if count < 0:
                raise ValueError(f"{where}: '{key}'[{i}][{j}] is negative ({count})")
            if zero_one and count > 1:
                raise ValueError(f"{where}: '{key}'[{i}][{j}] must be 0 or 1, got {count}")
            if count > MAX_LINKS:
                raise ValueError(
                    f"{where}: '{key}'[{i}][{j}] is {count}; at most {MAX_LINKS} links per pair"
                )
        diagonal = 1 if zero_one else 0
        matrix.append([diagonal if j == i else int(c) for j, c in enumerate(row)])
    for i in range(n):
        for j in range(i + 1, n):
            if matrix[i][j] != matrix[j][i]:
                raise ValueError(
                    f"{where}: '{key}' is not symmetric: [{i}][{j}] = {matrix[i][j]} but "
                    f"[{j}][{i}] = {matrix[j][i]}"
                )
    return matrix


def reachable_from_links(nvlink: list[list[int]]) -> list[list[int]]:
    """Reachability as NVLinks imply it (csrc/plan/topology.h's ``reachable_from_links``)."""
    return [
        [1 if i == j or c > 0 else 0 for j, c in enumerate(row)] for i, row in enumerate(nvlink)
    ]


def classify(
    nvlink: list[list[int]], reachable: list[list[int]], nvswitch: list[int] | None = None
) -> str:
    """One of :data:`CLASSES` (the rule: see the module doc). Raises ValueError."""
    return _topology.classify_gpus(nvlink, reachable, nvswitch or [])


def _counts(value: Any, key: str, where: str, n: int) -> list[int]:
    """A list of n integers from 0 to MAX_LINKS (e.g. each rank's NVLinks to NVSwitches)."""
    if (
        not isinstance(value, list)
        or len(value) != n
        or not all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= MAX_LINKS for c in value
        )
    ):
        raise ValueError(
            f"{where}: '{key}' must be a list of {n} non-negative integers (at most "
            f"{MAX_LINKS}), one per 'nvlink' row; got {value!r}"
        )
    return list(value)


def _read_json(path: str | os.PathLike[str], where: str) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: cannot read the topology file ({e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None


def load_topology_file(path: str | os.PathLike[str]) -> Topology:
    """The topology a file describes, classified (format: see the module doc).

    ``source`` is ``file=<path>``. Raises ValueError naming the file and the problem.
    """
    where = str(path)
    data = _read_json(path, where)
    if not isinstance(data, dict):
        raise ValueError(f"{where}: the topology must be a JSON object with an 'nvlink' matrix")
    unknown = sorted(set(data) - FILE_KEYS)
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(sorted(FILE_KEYS))}"
        )
    if "nvlink" not in data:
        raise ValueError(f"{where}: missing 'nvlink' (a square matrix of NVLink counts)")
    nvlink = _matrix(data["nvlink"], "nvlink", where, zero_one=False)
    n = len(nvlink)
    if "reachable" in data:
        reachable = _matrix(data["reachable"], "reachable", where, zero_one=True)
        if len(reachable) != n:
            raise ValueError(
                f"{where}: 'reachable' has {len(reachable)} rows but 'nvlink' has {n}; "
                "both have one row per local rank"
            )
        note = "NVLinks and reachability from the file"
    else:
        reachable = reachable_from_links(nvlink)
        note = "NVLinks from the file; no 'reachable': a pair is reachable iff NVLinked"
    name = data.get("name", Path(path).stem)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: 'name' must be a non-empty string")
    gpus = data.get("gpus", [])
    if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
        raise ValueError(f"{where}: 'gpus' must be a list of PCI bus ids (strings)")
    if gpus and len(gpus) != n:
        raise ValueError(
            f"{where}: 'gpus' lists {len(gpus)} bus ids but 'nvlink' has {n} rows "
            "(give one per row, or none)"
        )
    for key in ("source", "class", "note"):
        if key in data and not isinstance(data[key], str):
            raise ValueError(f"{where}: '{key}' must be a string (it is ignored when read)")
    nvswitch = _counts(data["nvswitch"], "nvswitch", where, n) if "nvswitch" in data else [0] * n
    try:
        topology_class = classify(nvlink, reachable, nvswitch)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    topo: Topology = {
        "name": name,
        "class": topology_class,
        "source": f"file={where}",
        "gpus": list(gpus),
        "nvlink": nvlink,
        "reachable": reachable,
        "nvswitch": nvswitch,
        "note": note,
    }
    for key in BANDWIDTH_KEYS:
        value = _gbps(data, key, where)
        if value is not None:
            _set_bandwidth(topo, key, value)
    if "compute_capability" in data:
        cc = data["compute_capability"]
        if not isinstance(cc, int) or isinstance(cc, bool) or not 60 <= cc < 1000:
            raise ValueError(
                f"{where}: 'compute_capability' must be an integer major x 10 + minor, "
                f">= 60 (e.g. 90 for an H100); got {cc!r}"
            )
        topo["compute_capability"] = cc
    return topo


def _set_bandwidth(topo: Topology, key: str, value: float) -> None:
    # A TypedDict is indexed by literal keys only.
    if key == "nvlink_gbps":
        topo["nvlink_gbps"] = value
    elif key == "pcie_gbps":
        topo["pcie_gbps"] = value
    else:
        topo["memory_gbps"] = value


# ---------------------------------------------------------------------------------------
# Detection


def _no_cuda_reason() -> str | None:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} was built without CUDA"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no GPU visible, or no usable driver)"
    if torch.cuda.device_count() == 0:
        return "no CUDA device visible"
    return None


def _bus_id(properties: Any) -> str | None:
    """The device's PCI bus id as ``cudaDeviceGetPCIBusId`` prints it, or None.

    torch (2.11 to 2.13 at least) exposes the address as three integers, ``pci_domain_id``,
    ``pci_bus_id`` and ``pci_device_id``; a string ``pci_bus_id`` is taken as it is.
    """
    bus = getattr(properties, "pci_bus_id", None)
    if isinstance(bus, str) and bus:
        return bus.lower()
    domain = getattr(properties, "pci_domain_id", None)
    device = getattr(properties, "pci_device_id", None)
    parts = (domain, bus, device)
    if all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in parts):
        return f"{domain:04x}:{bus:02x}:{device:02x}.0"
    return None


def _can_access(i: int, j: int) -> bool:
    try:
        return bool(torch.cuda.can_device_access_peer(i, j))
    except RuntimeError:
        return False


def _no_gpus(why: str) -> Topology:
    return {
        "name": socket.gethostname() or "localhost",
        "class": classify([], []),
        "source": f"none: {why}",
        "gpus": [],
        "nvlink": [],
        "reachable": [],
        "nvswitch": [],
        "note": why,
    }


def _detect_cuda() -> Topology:
    why = _no_cuda_reason()
    if why is not None:
        return _no_gpus(why)
    n = torch.cuda.device_count()
    properties = [torch.cuda.get_device_properties(i) for i in range(n)]
    found = [_bus_id(p) for p in properties]
    gpus = [b if b is not None else f"cuda:{i}" for i, b in enumerate(found)]
    report: _topology.NvlinkReport
    if all(b is not None for b in found):
        report = _topology.probe_nvlinks(gpus)
    else:
        report = {
            "links": [[0] * n for _ in range(n)],
            "nvswitch": [0] * n,
            "available": False,
            "note": f"torch {torch.__version__} does not expose the GPUs' PCI bus ids",
        }
    # A pair is reachable when each side can map the other's memory (or it is one GPU).
    reachable = [
        [
            1 if i == j or gpus[i] == gpus[j] or (_can_access(i, j) and _can_access(j, i)) else 0
            for j in range(n)
        ]
        for i in range(n)
    ]
    models = sorted({str(p.name) for p in properties})
    return {
        "name": f"{socket.gethostname() or 'localhost'} ({n} x {' / '.join(models)})",
        "class": classify(report["links"], reachable, report["nvswitch"]),
        "source": "nvml" if report["available"] else f"none: {report['note']}",
        "gpus": gpus,
        "nvlink": report["links"],
        "reachable": reachable,
        "nvswitch": report["nvswitch"],
        "note": f"{report['note']}; reachability from torch.cuda.can_device_access_peer",
    }


def detect() -> Topology:
    """The topology the backend would use in this process (see the module doc).

    Raises ValueError if ``XDEV_TOPO_FILE`` names a file that is not a valid topology.
    """
    path = os.environ.get(ENV_TOPO_FILE, "")
    if path:
        topo = load_topology_file(path)
        topo["source"] = f"{ENV_TOPO_FILE}={path}"
        return topo
    return _detect_cuda()


# ---------------------------------------------------------------------------------------
# CLI

# The order of the printed keys: the verdict first, the matrices last but the bandwidths.
_KEY_ORDER = (
    "name",
    "class",
    "source",
    "gpus",
    "nvlink",
    "reachable",
    "nvswitch",
    "note",
    *BANDWIDTH_KEYS,
    "compute_capability",
)


def to_json(topo: Topology) -> str:
    """A topology as the CLI prints it: JSON, indent 2, one matrix row per line."""
    items = [(key, topo.get(key)) for key in _KEY_ORDER if key in topo]
    lines = ["{"]
    for k, (key, value) in enumerate(items):
        if key in ("nvlink", "reachable") and isinstance(value, list) and value:
            rows = ",\n".join(f"    {json.dumps(row)}" for row in value)
            text = f"[\n{rows}\n  ]"
        else:
            text = json.dumps(value)
        lines.append(f"  {json.dumps(key)}: {text}{',' if k + 1 < len(items) else ''}")
    lines.append("}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torch_xdev.topology",
        description="Print this host's GPU topology (NVLink counts, peer reachability, class) "
        f"as JSON, in the format {ENV_TOPO_FILE} takes.",
        epilog="File format and classes: see `pydoc torch_xdev.topology`.",
    )
    parser.add_argument(
        "--file", metavar="PATH", help="classify this topology file instead of detecting"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        topo = load_topology_file(args.file) if args.file is not None else detect()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(to_json(topo))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the process quietly
    raise SystemExit(main())
