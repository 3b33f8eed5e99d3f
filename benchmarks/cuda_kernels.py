"""Kernel benchmark of xdev's CUDA reductions against the GPU's device-to-device copy bandwidth.

Usage::

    python benchmarks/cuda_kernels.py [--sizes 1MiB:1GiB] [--warmup N] [--reps N]
        [--out benchmarks/results/cuda_kernels.json] [--arch sm_90] [--build-dir DIR]
    python benchmarks/cuda_kernels.py --check

Compiles ``benchmarks/cuda_kernels.cu`` with the kernels (``csrc/kernels/cuda_reduce.cu``) and the
CPU reference (``csrc/kernels/cpu_reduce.cc``) with nvcc; torch is not needed. The binary times
``cudaMemcpyAsync`` device to device, ``launch_copy`` and ``launch_reduce`` SUM (float32, bfloat16,
float16; 2 and 8 sources) per size, each row the median of ``--reps`` batches timed with CUDA
events. Bandwidth counts the bytes a kernel moves: (n + 1) x size for a reduce of n sources, 2 x size
for a copy. The issue's target: at 64 MiB and above a reduce reaches 85% of the copy bandwidth
measured with cudaMemcpyAsync at the same size (PASS/FAIL per row).

``--check`` instead runs the binary's bitwise comparison of the GPU kernels with the CPU kernels
(every dtype and op, odd sizes, misaligned and in-place buffers) and exits with its status.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH_SOURCE = REPO / "benchmarks" / "cuda_kernels.cu"
KERNEL_SOURCE = REPO / "csrc" / "kernels" / "cuda_reduce.cu"
CPU_SOURCE = REPO / "csrc" / "kernels" / "cpu_reduce.cc"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "cuda_kernels.json"
FALLBACK_ARCH = "sm_90"  # the H100 the project's GPU runs use
UNITS = {"B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
TARGET_BYTES = 64 << 20
TARGET_RATIO = 0.85
NO_DEVICE_EXIT = 2  # the binary's status when there is no CUDA device


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    unit = (match.group(2).upper() or "B") if match else ""
    if match is None or unit not in UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 4096, 64KiB, 1MiB, 1GiB)")
    return int(match.group(1)) * UNITS[unit]


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    first = parse_size(low)
    last = parse_size(high) if high else first
    if first <= 0 or last < first:
        raise argparse.ArgumentTypeError(f"bad size range {text!r} (want MIN:MAX, MIN <= MAX)")
    return first, last


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def find_nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        candidate = Path(home) / "bin" / "nvcc"
        if candidate.exists():
            nvcc = str(candidate)
    if nvcc is None:
        sys.exit("cuda_kernels.py: nvcc not found (put it on PATH or set CUDA_HOME)")
    return nvcc


def detect_arch() -> str:
    """sm_XY of the first GPU from nvidia-smi; sm_90 when that cannot be read."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return FALLBACK_ARCH
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    match = re.fullmatch(r"(\d+)\.(\d+)", lines[0].strip()) if lines else None
    return f"sm_{match.group(1)}{match.group(2)}" if match else FALLBACK_ARCH


def build(nvcc: str, arch: str, build_dir: Path) -> Path:
    """Compiles the three sources in parallel and links them; returns the binary."""
    build_dir.mkdir(parents=True, exist_ok=True)
    flags = ["-std=c++17", "-O3", f"-arch={arch}", "-I", str(REPO / "csrc")]
    sources = [BENCH_SOURCE, KERNEL_SOURCE, CPU_SOURCE]
    objects = [build_dir / f"{source.stem}.o" for source in sources]

    def compile_one(pair: tuple[Path, Path]) -> subprocess.CompletedProcess[str]:
        command = [nvcc, *flags, "-c", str(pair[0]), "-o", str(pair[1])]
        return subprocess.run(command, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=len(sources)) as pool:
        results = list(pool.map(compile_one, zip(sources, objects)))
    for source, result in zip(sources, results):
        if result.returncode != 0:
            sys.exit(
                f"compiling {source.relative_to(REPO)} failed:\n{result.stdout}{result.stderr}"
            )
    binary = build_dir / "cuda_kernels"
    link = subprocess.run(
        [nvcc, f"-arch={arch}", *map(str, objects), "-o", str(binary)],
        capture_output=True,
        text=True,
    )
    if link.returncode != 0:
        sys.exit(f"linking cuda_kernels failed:\n{link.stdout}{link.stderr}")
    return binary


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
    match = re.search(r"release (\S+),", out.stdout)
    return match.group(1) if match else "unknown"


def run_benchmark(binary: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    command = [str(binary), "--min-bytes", str(args.sizes[0]), "--max-bytes", str(args.sizes[1])]
    command += ["--warmup", str(args.warmup), "--reps", str(args.reps)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode == NO_DEVICE_EXIT:
        sys.exit(f"cuda_kernels.py: {result.stderr.strip()}")
    if result.returncode != 0:
        sys.exit(f"cuda_kernels failed (exit {result.returncode}):\n{result.stderr}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def print_table(device: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(
        f"# xdev CUDA reduction kernels on {device['name']} ({device['sm_count']} SMs, "
        f"compute capability {device['compute_capability']})"
    )
    print("# bandwidth = bytes moved / time: (n+1) x size for a reduce of n sources, 2 x size for")
    print(
        f"# a copy; vs-copy = bandwidth / cudaMemcpyAsync D2D bandwidth at the same size; target: "
        f"reduce >= {TARGET_RATIO:.0%} of it from {format_size(TARGET_BYTES)}"
    )
    print("#")
    header = (
        f"{'size':>10} {'kernel':>8} {'dtype':>9} {'n':>3} {'time(us)':>11} {'moved(B)':>12} "
        f"{'GB/s':>9} {'vs-copy':>8} {'target':>7}"
    )
    print(header)
    for row in rows:
        print(
            f"{row['bytes']:>10} {row['kernel']:>8} {row['dtype'] or '-':>9} {row['sources']:>3} "
            f"{row['time_us']:>11.2f} {row['moved_bytes']:>12} {row['gbps']:>9.1f} "
            f"{row['vs_copy']:>8.3f} {row['target'] or '':>7}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_range, default=(1 << 20, 1 << 30), metavar="MIN:MAX")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--arch", help="nvcc -arch (default: from nvidia-smi, else sm_90)")
    parser.add_argument("--build-dir", type=Path, help="keep the build here (default: a temp dir)")
    parser.add_argument("--check", action="store_true", help="run the bitwise check instead")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target row fails")
    args = parser.parse_args()
    if args.warmup < 1 or args.reps < 1:
        parser.error("--warmup and --reps must be positive")

    nvcc = find_nvcc()
    arch = args.arch or detect_arch()
    with tempfile.TemporaryDirectory(prefix="xdev_cuda_kernels_") as tmp:
        build_dir: Path = args.build_dir or Path(tmp)
        print(f"# building with {nvcc} -arch={arch} in {build_dir}", flush=True)
        binary = build(nvcc, arch, build_dir)
        if args.check:
            return subprocess.run([str(binary), "--check"]).returncode
        records = run_benchmark(binary, args)

    device = next((r for r in records if r["record"] == "device"), None)
    if device is None:
        sys.exit("cuda_kernels.py: the binary printed no results")
    rows = [r for r in records if r["record"] == "result"]
    print_table(device, rows)
    judged = [r for r in rows if r["target"] is not None]
    failed = [r for r in judged if r["target"] == "FAIL"]
    print(f"# target rows: {len(judged) - len(failed)} of {len(judged)} PASS")

    results: dict[str, Any] = {
        "metadata": {
            "benchmark": "cuda_kernels",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "device": {k: v for k, v in device.items() if k != "record"},
            "arch": arch,
            "nvcc": nvcc_version(nvcc),
            "sizes": list(args.sizes),
            "warmup": args.warmup,
            "reps": args.reps,
            "target": {"min_bytes": TARGET_BYTES, "ratio_to_memcpy": TARGET_RATIO},
            "passed": len(judged) - len(failed),
            "failed": len(failed),
        },
        "rows": [{k: v for k, v in r.items() if k != "record"} for r in rows],
    }
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"# saved {out}")
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
