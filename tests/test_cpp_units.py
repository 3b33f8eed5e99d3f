"""Builds and runs the C++ unit tests (tests/cpp) of the torch-free layers: the plan layer
(csrc/plan), the CPU reduction kernels (csrc/kernels/cpu_reduce.cc) and the shared-memory
transport (its channel and CPU executors, with threads standing in for ranks).

These layers need only a C++ compiler and the C library, so their tests run here and `pytest`
alone covers them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch_free

REPO = Path(__file__).resolve().parent.parent
FLAGS = ["-std=c++17", "-Wall", "-Wextra", "-Werror", "-I", str(REPO / "csrc")]
# The kernels are built as setup.py builds them (their ISA dispatch and vector loops are what is
# under test); everything else at -O1, which keeps the build short.
KERNEL_SOURCES = [REPO / "csrc/kernels/cpu_reduce.cc"]
TRANSPORT_SOURCES = [
    REPO / "csrc/transport" / name
    for name in (
        "shm_segment.cc",
        "shm_channel.cc",
        "shm_executor.cc",
        "gather_scatter_executor.cc",
        "single_copy_executor.cc",
        "shared_buffer.cc",
        "heap_placement.cc",
        "symmetric_heap.cc",
        "peer_watch.cc",
    )
]


def find_compiler() -> str | None:
    for name in ("c++", "g++"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout)


def optimisation(source: Path) -> str:
    return "-O3" if source in KERNEL_SOURCES else "-O1"


def test_cpp_units(tmp_path: Path) -> None:
    compiler = find_compiler()
    if compiler is None:
        pytest.skip("no C++ compiler found (looked for c++ and g++)")
    sources = (
        KERNEL_SOURCES
        + sorted(REPO.glob("csrc/plan/*.cc"))
        + TRANSPORT_SOURCES
        + sorted(REPO.glob("tests/cpp/*.cc"))
    )
    objects = [tmp_path / f"{i}_{source.stem}.o" for i, source in enumerate(sources)]

    cxx: str = compiler

    def compile_one(pair: tuple[Path, Path]) -> subprocess.CompletedProcess[str]:
        source, obj = pair
        return run([cxx, *FLAGS, optimisation(source), "-c", str(source), "-o", str(obj)], 600)

    # One compiler per source, in parallel: the sources build independently. The kernels, the
    # slowest, start first.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        builds = list(pool.map(compile_one, zip(sources, objects)))
    errors = "".join(b.stdout + b.stderr for b in builds if b.returncode != 0)
    assert not errors, f"compiling the C++ unit tests failed:\n{errors}"
    binary = tmp_path / "test_cpp_units"
    link = run([cxx, *map(str, objects), "-pthread", "-lrt", "-o", str(binary)], 600)
    assert link.returncode == 0, f"linking the C++ unit tests failed:\n{link.stdout}{link.stderr}"

    result = run([str(binary)], 300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"C++ unit tests failed (exit {result.returncode}):\n{output}"
    # Guards against a binary that exits 0 without having run any test.
    lines = result.stdout.strip().splitlines()
    summary = re.fullmatch(r"(\d+) passed, 0 failed", lines[-1] if lines else "")
    assert summary is not None and int(summary.group(1)) > 0, output
