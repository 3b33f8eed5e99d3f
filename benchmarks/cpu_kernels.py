"""Kernel benchmark of xdev's CPU reductions: every dtype and op, against memcpy of the same bytes.

Usage::

    python benchmarks/cpu_kernels.py [--sizes 256KiB,16MiB] [--sources 2] [--reps 9]
        [--out benchmarks/results/cpu_kernels.json] [--build-dir DIR]

Compiles ``benchmarks/cpu_kernels.cc`` with the kernels (``csrc/kernels/cpu_reduce.cc``) using
``$CXX`` (default ``c++``) at -O3, the flags the extension is built with; torch is not needed.
One core, one call at a time: the rate at which one rank's reduction step can fold ``--sources``
inputs into an output, which bounds every CPU plan once its data is in cache (256 KiB) and meets
the memory's limits beyond the last-level cache. Bandwidth counts the bytes a call reads and
writes, (sources + 1) x size; memcpy's counts 2 x size. A dtype or op far below its neighbours
is a kernel the compiler left scalar: that is how AVG (3-4x below SUM) and fp16 (0.4 GB/s) were
found.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from cuda_kernels import format_size, parse_size

REPO = Path(__file__).resolve().parent.parent
BENCH_SOURCE = REPO / "benchmarks" / "cpu_kernels.cc"
KERNEL_SOURCE = REPO / "csrc" / "kernels" / "cpu_reduce.cc"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "cpu_kernels.json"
OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")


def compiler() -> str:
    found = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if found is None:
        sys.exit("cpu_kernels.py: no C++ compiler (set CXX)")
    return found


def build(cxx: str, build_dir: Path) -> Path:
    binary = build_dir / "cpu_kernels"
    command = [cxx, "-O3", "-std=c++17", "-Wall", "-Wextra", f"-I{REPO / 'csrc'}"]
    command += [str(BENCH_SOURCE), str(KERNEL_SOURCE), "-o", str(binary)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"cpu_kernels.py: build failed:\n{result.stdout}{result.stderr}")
    return binary


def run_binary(binary: Path, sizes: list[int], sources: int, reps: int) -> list[dict[str, Any]]:
    command = [str(binary), *map(str, sizes), "--sources", str(sources), "--reps", str(reps)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"cpu_kernels.py: {' '.join(command)} failed:\n{result.stderr}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Per size: GB/s by dtype (rows) and op (columns), then memcpy's."""
    lines = []
    for size in sorted({r["bytes"] for r in rows}):
        at_size = [r for r in rows if r["bytes"] == size]
        memcpy = next(r["gbps"] for r in at_size if r["op"] == "memcpy")
        sources = next(r["sources"] for r in at_size if r["op"] != "memcpy")
        lines.append(
            f"# {format_size(size)} per tensor, {sources} sources: GB/s read + written"
            f" (memcpy {memcpy:.1f} GB/s)"
        )
        lines.append(f"{'dtype':>10}" + "".join(f"{op:>10}" for op in OPS))
        for dtype in dict.fromkeys(r["dtype"] for r in at_size if r["op"] != "memcpy"):
            rate = {r["op"]: r["gbps"] for r in at_size if r["dtype"] == dtype}
            lines.append(f"{dtype:>10}" + "".join(f"{rate[op]:>10.2f}" for op in OPS))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=lambda s: [parse_size(part) for part in s.split(",")],
        default=[256 << 10, 16 << 20],
        help="bytes per tensor, comma-separated (default 256KiB,16MiB)",
    )
    parser.add_argument("--sources", type=int, default=2, help="inputs per call (default 2)")
    parser.add_argument("--reps", type=int, default=9, help="timed batches per row (default 9)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output")
    parser.add_argument("--build-dir", type=Path, help="where the binary goes (default: temp)")
    args = parser.parse_args(argv)
    if args.sources < 1 or args.reps < 1:
        parser.error("--sources and --reps must be positive")
    cxx = compiler()
    with tempfile.TemporaryDirectory() as scratch:
        build_dir = args.build_dir or Path(scratch)
        build_dir.mkdir(parents=True, exist_ok=True)
        binary = build(cxx, build_dir)
        rows = run_binary(binary, args.sizes, args.sources, args.reps)
    for line in table(rows):
        print(line)
    metadata = {
        "host": socket.gethostname(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "compiler": subprocess.run(
            [cxx, "--version"], capture_output=True, text=True
        ).stdout.splitlines()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sources": args.sources,
        "reps": args.reps,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"metadata": metadata, "rows": rows}, indent=1) + "\n")
    print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
