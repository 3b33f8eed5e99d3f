"""Builds torch_xdev._C against whatever torch is installed.

CUDA sources (csrc/*/*.cu, and the torch-CUDA glue in csrc/backend/cuda/) are
compiled only when the installed torch was built with CUDA and a CUDA toolkit is
found; otherwise the extension is CPU-only and CUDA tensors go to the fallback
engines. (CI compiles the CUDA sources with nvcc on its own: tests/test_cuda_build.py.)
Set XDEV_DEBUG_BUILD=1 for an unoptimised build with debug symbols.
"""

from __future__ import annotations

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

import torch

LAYERS = ("plan", "kernels", "transport", "backend")


def _sources(pattern: str) -> list[str]:
    found: list[str] = []
    for layer in LAYERS:
        found += glob.glob(os.path.join("csrc", layer, pattern))
    return sorted(found)


def get_extensions() -> list[CppExtension]:
    debug = os.environ.get("XDEV_DEBUG_BUILD", "0") == "1"
    cxx_flags = ["-O0", "-g"] if debug else ["-O3"]
    cxx_flags += ["-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden"]
    sources = _sources("*.cc")
    cuda_sources = _sources("*.cu") + sorted(
        glob.glob(os.path.join("csrc", "backend", "cuda", "*.cc"))
    )
    use_cuda = bool(cuda_sources) and torch.version.cuda is not None and CUDA_HOME is not None
    if use_cuda:
        return [
            CUDAExtension(
                "torch_xdev._C",
                sources + cuda_sources,
                extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo", "-std=c++17"]},
                define_macros=[("XDEV_WITH_CUDA", "1")],
            )
        ]
    return [CppExtension("torch_xdev._C", sources, extra_compile_args={"cxx": cxx_flags})]


# Package metadata lives in pyproject.toml; this file only describes the extension.
setup(ext_modules=get_extensions(), cmdclass={"build_ext": BuildExtension})
