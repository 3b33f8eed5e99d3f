"""Builds torch_xdev._C against whatever torch is installed.

With a CUDA build of torch the CUDA path (csrc/transport/*.cu and the torch glue in
csrc/backend/cuda/) is compiled too. It needs a CUDA toolkit of torch's CUDA major version, taken
from CUDA_HOME (or CUDA_PATH), else from the nvcc on PATH (following a wrapper script to the real
nvcc), else /usr/local/cuda; without one the build stops and says to set CUDA_HOME. With a CPU
build of torch the extension is CPU-only and CUDA tensors go to the fallback engines.

TORCH_CUDA_ARCH_LIST (e.g. "7.0;9.0") picks the GPU architectures. Unset, torch builds for the
GPUs it sees; when it sees none, this file picks DEFAULT_ARCHES that the toolkit accepts.
XDEV_DEBUG_BUILD=1 gives an unoptimised build with debug symbols.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import torch
from setuptools import setup

try:
    from packaging.version import Version
except ImportError:  # packaging is no dependency of torch, which carries a copy of it
    from torch.torch_version import Version

LAYERS = ("plan", "kernels", "transport", "backend")
# The standalone launches of the reduction kernels (csrc/kernels/cuda_reduce.cu) are not part of
# _C: the transport runs their device code inline (cuda_reduce.cuh), and the kernel benchmark
# builds the launches on its own.
CUDA_SOURCES = sorted(glob.glob("csrc/transport/*.cu") + glob.glob("csrc/backend/cuda/*.cc"))
# Built when TORCH_CUDA_ARCH_LIST is unset and no GPU is visible, less those the toolkit refuses
# (CUDA 13 dropped 7.0): V100, T4, A100, A10/RTX 30, L4/L40, H100, plus PTX of the newest for
# later GPUs. Nothing older: the CUDA path uses sm_70's scoped atomics.
DEFAULT_ARCHES = ("7.0", "7.5", "8.0", "8.6", "8.9", "9.0")


def run_nvcc(nvcc: str, *args: str) -> str:
    # A failure shows as output without what the caller looks for.
    out = subprocess.run([nvcc, *args], check=False, capture_output=True, text=True)
    return out.stdout + out.stderr


def is_toolkit(home: str) -> bool:
    return all(
        os.path.isfile(os.path.join(home, *part))
        for part in (("bin", "nvcc"), ("include", "cuda_runtime.h"))
    )


def find_cuda_home() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            if not is_toolkit(home):
                sys.exit(f"setup.py: {var}={home} holds no bin/nvcc and include/cuda_runtime.h")
            return home
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if is_toolkit(home):
            return home
        # A wrapper script outside the toolkit: nvcc's dry run names the directory it runs from.
        dry_run = run_nvcc(nvcc, "--dryrun", "-x", "cu", "-E", os.devnull)
        here = re.search(r"^#\$ _HERE_=(.+)$", dry_run, re.MULTILINE)
        if here is not None and is_toolkit(os.path.dirname(here.group(1).strip())):
            return os.path.dirname(here.group(1).strip())
    return "/usr/local/cuda" if is_toolkit("/usr/local/cuda") else None


def check_toolkit(home: str) -> None:
    """Stops unless the toolkit's CUDA major version is torch's (torch refuses to mix them)."""
    release = re.search(r"release (\d+\.\d+)", run_nvcc(os.path.join(home, "bin", "nvcc"), "-V"))
    found = Version(release.group(1)) if release else None
    wanted = Version(torch.version.cuda)
    if found is None or found.major != wanted.major:
        sys.exit(
            f"setup.py: torch {torch.__version__} needs a CUDA {wanted.major} toolkit, but the one "
            f"at {home} is CUDA {found}: set CUDA_HOME to a CUDA {wanted.major} toolkit"
        )


def default_arch_list(home: str) -> str:
    listed = run_nvcc(os.path.join(home, "bin", "nvcc"), "--list-gpu-arch")
    accepted = {f"{int(n) // 10}.{int(n) % 10}" for n in re.findall(r"compute_(\d+)", listed)}
    arches = [arch for arch in DEFAULT_ARCHES if arch in accepted]
    if not arches:
        sys.exit(
            f"setup.py: the toolkit at {home} builds none of {DEFAULT_ARCHES}: "
            "set TORCH_CUDA_ARCH_LIST"
        )
    return ";".join(arches) + "+PTX"


def configure_cuda() -> bool:
    """Finds the toolkit for a CUDA build of torch and puts it in CUDA_HOME; False for a CPU build.

    Runs before torch.utils.cpp_extension is imported, which reads CUDA_HOME at import.
    """
    if torch.version.cuda is None or not CUDA_SOURCES:
        return False
    home = find_cuda_home()
    if home is None and not torch.cuda.device_count():
        # Where pip's torch is a CUDA build on a machine with neither GPU nor toolkit, the CPU
        # path is all that could run anyway (CUDA tensors would go to NCCL).
        print(
            f"setup.py: torch {torch.__version__} is a CUDA build, but no CUDA toolkit was found "
            "and no GPU is visible: building the CPU path only (set CUDA_HOME to build the CUDA "
            "path too)"
        )
        return False
    if home is None:
        sys.exit(
            f"setup.py: torch {torch.__version__} is a CUDA build, but no CUDA toolkit was found "
            "(no nvcc on PATH, no /usr/local/cuda): set CUDA_HOME to the toolkit's directory"
        )
    check_toolkit(home)
    os.environ["CUDA_HOME"] = home
    return True


USE_CUDA = configure_cuda()

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension


def get_extensions() -> list[CppExtension]:
    sources: list[str] = []
    for layer in LAYERS:
        sources += sorted(glob.glob(os.path.join("csrc", layer, "*.cc")))
    debug = os.environ.get("XDEV_DEBUG_BUILD", "0") == "1"
    cxx_flags = ["-O0", "-g"] if debug else ["-O3"]
    # -G: device code without optimisation, for cuda-gdb; -lineinfo: source lines for profilers.
    nvcc_flags = (["-O0", "-g", "-G"] if debug else ["-O3", "-lineinfo"]) + ["-std=c++17"]
    cxx_flags += ["-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden"]
    if USE_CUDA:
        return [
            CUDAExtension(
                "torch_xdev._C",
                sources + CUDA_SOURCES,
                extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
                define_macros=[("XDEV_WITH_CUDA", "1")],
            )
        ]
    return [CppExtension("torch_xdev._C", sources, extra_compile_args={"cxx": cxx_flags})]


class BuildExt(BuildExtension):
    # Without a GPU torch finds no architecture to build for (and fails with an IndexError).
    # Chosen here, when compiling, rather than at every run of this file (pip runs it 2-3 times).
    def build_extensions(self) -> None:
        if (
            USE_CUDA
            and not os.environ.get("TORCH_CUDA_ARCH_LIST")
            and not torch.cuda.device_count()
        ):
            os.environ["TORCH_CUDA_ARCH_LIST"] = default_arch_list(os.environ["CUDA_HOME"])
            print(
                "setup.py: no GPU visible and TORCH_CUDA_ARCH_LIST unset: building for "
                f"{os.environ['TORCH_CUDA_ARCH_LIST']} with the toolkit at {os.environ['CUDA_HOME']}"
            )
        super().build_extensions()


# Package metadata lives in pyproject.toml; this file only describes the extension.
setup(ext_modules=get_extensions(), cmdclass={"build_ext": BuildExt})
