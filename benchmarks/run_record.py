"""What every benchmark's JSON result says about the run besides its own settings, and how it
is written: the build that ran (run from a checkout, ``sys.path`` starts at ``benchmarks/``, so
``torch_xdev`` is the installed package unless PYTHONPATH names the checkout), the command,
the XDEV_* variables that steered it, the machine and the time."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

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


def extension_sha256() -> str:
    """The hash of the compiled extension that ran: two runs of one version string may come
    from different builds (a checkout rebuilt in place between them)."""
    digest = hashlib.sha256()
    with open(torch_xdev._C.__file__, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _git(*args: str) -> Optional[str]:
    try:
        done = subprocess.run(
            ["git", "-C", XDEV_PATH, *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def checkout_revision() -> Optional[str]:
    """``git describe --always --dirty`` of the checkout torch_xdev ran from; None for an
    installed package or without git. An installed package may sit inside some other git
    work tree (a pyenv checkout holds site-packages): only a tree whose top holds the package
    counts."""
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(XDEV_PATH).parent:
        return None
    return _git("describe", "--always", "--dirty")


def cpu_model() -> Optional[str]:
    """The CPU's model name as Linux reports it (the same VM may change CPUs between runs)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment() -> dict[str, Any]:
    """The command, the torch and torch_xdev build that ran (version, path, checkout revision,
    extension hash), with which XDEV_* variables, on which machine, when."""
    return {
        "command": [sys.executable, *sys.argv],
        "torch_version": torch.__version__,
        "torch_xdev_version": torch_xdev.__version__,
        "torch_xdev_path": XDEV_PATH,
        "torch_xdev_revision": checkout_revision(),
        "torch_xdev_extension_sha256": extension_sha256(),
        "xdev_environment": xdev_environment(),
        "python_version": platform.python_version(),
        "cpu_model": cpu_model(),
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
