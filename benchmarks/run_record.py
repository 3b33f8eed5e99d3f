"""What every benchmark's JSON result says about the run besides its own settings, and how it
is written: the build that ran (run from a checkout, ``sys.path`` starts at ``benchmarks/``, so
``torch_xdev`` is the installed package unless PYTHONPATH names the checkout), the machine and
the time."""

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


def environment() -> dict[str, Any]:
    """The torch and torch_xdev that ran, on which machine, when."""
    return {
        "torch_version": torch.__version__,
        "torch_xdev_version": torch_xdev.__version__,
        "torch_xdev_path": XDEV_PATH,
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
