"""What every benchmark's JSON result says about the run besides its own settings, and how it
is written: the build that ran (run from a checkout, ``sys.path`` starts at ``benchmarks/``, so
``torch_xdev`` is the installed package unless PYTHONPATH names the checkout), the XDEV_*
variables that steered it, the machine and the time."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

import torch

import torch_xdev

XDEV_PATH = str(Path(torch_xdev.__file__).resolve().parent)


def xdev_environment() -> dict[str, str]:
    """Every XDEV_* variable of this process, sorted by name. They override xdev's options
    (XDEV_ALGO, XDEV_NUM_PACKS, ...) and its cost model (XDEV_CPU_MODEL), so they change what a
    benchmark measures without a flag that says so."""
    return {name: os.environ[name] for name in sorted(os.environ) if name.startswith("XDEV_")}


def xdev_environment_line() -> str:
    """The header line that names them (``none`` where there are none)."""
    shown = " ".join(f"{name}={value}" for name, value in xdev_environment().items())
    return f"# XDEV_* in the environment: {shown or 'none'}"


def environment() -> dict[str, Any]:
    """The torch and torch_xdev that ran, with which XDEV_* variables, on which machine, when."""
    return {
        "torch_version": torch.__version__,
        "torch_xdev_version": torch_xdev.__version__,
        "torch_xdev_path": XDEV_PATH,
        "xdev_environment": xdev_environment(),
        "cpu_count": os.cpu_count(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }


def write_results(path: Path, metadata: dict[str, Any], rows: Any) -> None:
    """{"metadata": ..., "rows": ...} to ``path`` (its folder made), and says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"metadata": metadata, "rows": rows}, indent=2) + "\n")
    print(f"# wrote {path}", flush=True)
