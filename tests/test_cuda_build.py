"""Compiles the CUDA path on machines without a GPU, so a compile error fails CI.

The extension builds its CUDA sources only against a CUDA build of torch (CI's second run), so
with a CPU build (CI's first run) nothing else compiles them. This test compiles them on its own:
the torch-free transport (``csrc/transport/*.cu``) with nvcc and ``-Wall -Wextra``, and the thin
torch glue (``csrc/backend/cuda/*.cc``, plus the backend with ``XDEV_WITH_CUDA``) syntax-checked
against the installed torch's headers and the CUDA toolkit's.
The reduction kernels and their benchmark are compiled by ``test_cuda_kernels_build.py``.

Without nvcc the test skips, except under CI (``CI`` set), where nvcc is expected.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from test_cuda_kernels_build import find_nvcc

REPO = Path(__file__).resolve().parent.parent
ARCH = "sm_90"  # the H100 the GPU tests run on; one arch keeps the test quick


def cuda_include(nvcc: str, tmp_path: Path) -> Path:
    # nvcc may be a wrapper script; its dry run says where its toolkit lives.
    empty = tmp_path / "empty.cu"
    empty.write_text("")
    command = [nvcc, "--dryrun", "-c", str(empty), "-o", str(tmp_path / "empty.o")]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    for line in (out.stdout + out.stderr).splitlines():
        if "TOP=" in line:
            top = line.split("TOP=", 1)[1].strip()
            if (Path(top) / "include" / "cuda_runtime.h").exists():
                return Path(top) / "include"
    from torch.utils.cpp_extension import CUDA_HOME

    return Path(CUDA_HOME or "/usr/local/cuda") / "include"


def run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def assert_clean(builds: list[tuple[Path, subprocess.CompletedProcess[str]]]) -> None:
    problems = []
    for source, build in builds:
        output = build.stdout + build.stderr
        # Warnings in our own files count; torch's headers are not ours to fix.
        ours = [ln for ln in output.splitlines() if str(REPO / "csrc") in ln and "warning" in ln]
        if build.returncode != 0 or ours:
            problems.append(f"--- {source.relative_to(REPO)}\n{output}")
    assert not problems, "\n".join(problems)


@pytest.mark.torch_free
def test_cuda_transport_compiles_with_nvcc(tmp_path: Path) -> None:
    nvcc = find_nvcc()
    sources = sorted(REPO.glob("csrc/transport/*.cu"))
    assert sources, "no CUDA transport sources found"
    flags = ["-std=c++17", "-O2", f"-arch={ARCH}", "-Xcompiler", "-Wall,-Wextra"]

    def build(source: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
        obj = tmp_path / f"{source.stem}.o"
        return source, run(
            [nvcc, *flags, "-I", str(REPO / "csrc"), "-c", str(source), "-o", str(obj)]
        )

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        assert_clean(list(pool.map(build, sources)))


def test_cuda_glue_compiles_against_torch_headers(tmp_path: Path) -> None:
    nvcc = find_nvcc()
    torch_file = __import__("torch").__file__
    assert torch_file is not None, "torch is a namespace package here: no headers to find"
    torch_include = Path(torch_file).parent / "include"
    # A CPU build of torch ships the c10/cuda headers but not the one CMake generates for CUDA
    # builds; an empty stand-in is enough to check our code.
    shim = tmp_path / "shim" / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    if not (torch_include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        (shim / "cuda_cmake_macros.h").write_text("#pragma once\n")
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler found")
    includes = [
        tmp_path / "shim",
        torch_include,
        torch_include / "torch" / "csrc" / "api" / "include",
        cuda_include(nvcc, tmp_path),
        Path(sysconfig.get_paths()["include"]),
    ]
    flags = ["-fsyntax-only", "-std=c++20", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    flags += ["-DXDEV_WITH_CUDA"] + [f"-I{p}" for p in includes]
    sources = sorted(REPO.glob("csrc/backend/cuda/*.cc")) + [REPO / "csrc/backend/xdev_backend.cc"]

    def build(source: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
        return source, run([compiler, *flags, str(source)])

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        assert_clean(list(pool.map(build, sources)))
