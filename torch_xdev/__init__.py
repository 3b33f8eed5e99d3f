"""torch-xdev: a c10d backend for single-host data parallel training.

``import torch_xdev`` registers the backend name ``"xdev"``::

    import torch.distributed as dist
    import torch_xdev

    dist.init_process_group(backend="xdev")
"""

from __future__ import annotations

from typing import Any, Optional

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed as dist

try:
    from . import _C
except ImportError as e:  # typically: importing the source tree instead of the installed package
    raise ImportError(
        f"torch_xdev's C++ extension could not be loaded from {__path__[0]} ({e}). "
        "Install with `pip install --no-build-isolation .` and run from outside the source "
        "tree (e.g. `pytest tests`), or build in place with `python setup.py build_ext --inplace`."
    ) from e
from ._registration import BACKEND_NAME, backend_of, host_identity, register
from .options import ALGORITHMS, ENV_KNOBS, Options

__all__ = ["ALGORITHMS", "BACKEND_NAME", "ENV_KNOBS", "Options", "describe", "host_identity"]
__version__ = "0.1.0"


def describe(group: Optional[dist.ProcessGroup] = None) -> dict[str, Any]:
    """What the xdev backend of ``group`` (default: the world) is and will run.

    Keys include ``algorithm``, ``num_packs``, ``world_size``, ``local_world_size``,
    ``num_hosts``, ``shared_memory``, ``fallback_backend``, ``cpu_allreduce_plan``
    (algorithm and reason per payload size), ``cuda_allreduce_plan`` and
    ``last_allreduce``.
    """
    return dict(backend_of(group).describe())


register()
