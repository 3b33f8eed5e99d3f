"""Builds and runs the C++ unit tests of the plan layer (csrc/plan, pure C++17).

The plan layer has no torch or CUDA dependency, so its tests need only a C++ compiler; they run
here so that `pytest` alone covers them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FLAGS = ["-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I", str(REPO / "csrc")]


def find_compiler() -> str | None:
    for name in ("c++", "g++"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def test_plan_cpp(tmp_path: Path) -> None:
    compiler = find_compiler()
    if compiler is None:
        pytest.skip("no C++ compiler found (looked for c++ and g++)")
    sources = sorted(REPO.glob("csrc/plan/*.cc")) + sorted(REPO.glob("tests/cpp/*.cc"))
    objects = [tmp_path / f"{i}_{source.stem}.o" for i, source in enumerate(sources)]

    # One compiler per source, in parallel: the test files dominate and build independently.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        builds = list(
            pool.map(
                lambda pair: run([compiler, *FLAGS, "-c", str(pair[0]), "-o", str(pair[1])], 600),
                zip(sources, objects),
            )
        )
    errors = "".join(b.stdout + b.stderr for b in builds if b.returncode != 0)
    assert not errors, f"compiling the plan tests failed:\n{errors}"
    binary = tmp_path / "test_plan"
    link = run([compiler, *map(str, objects), "-o", str(binary)], 600)
    assert link.returncode == 0, f"linking the plan tests failed:\n{link.stdout}{link.stderr}"

    result = run([str(binary)], 300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"plan tests failed (exit code {result.returncode}):\n{output}"
    # Guards against a binary that exits 0 without having run any test.
    lines = result.stdout.strip().splitlines()
    summary = re.fullmatch(r"(\d+) passed, 0 failed", lines[-1] if lines else "")
    assert summary is not None and int(summary.group(1)) > 0, output
