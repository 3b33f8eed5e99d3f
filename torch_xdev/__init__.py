"""torch-xdev: a c10d backend for data-parallel training on one host or several.

``import torch_xdev`` registers the backend name ``"xdev"``::

    import torch.distributed as dist
    import torch_xdev

    dist.init_process_group(backend="xdev")
"""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from typing import Any, Optional, SupportsIndex, Union

import torch  # (loads libtorch before the extension)
import torch.distributed as dist

try:
    from . import _C
except ImportError as e:  # typically: importing the source tree instead of the installed package
    if os.path.exists(os.path.join(os.path.dirname(__path__[0]), "setup.py")):
        # Python started in the checkout (`python -m ...` there) finds it before the install.
        hint = (
            "This is the source checkout, which holds no compiled extension: run from another "
            "directory to use the installed package (`pytest tests` works from here, `python -m "
            "pytest` does not), or build in place with `python setup.py build_ext --inplace`."
        )
    else:
        hint = "Reinstall with `pip install --no-build-isolation .` against the torch you run."
    raise ImportError(
        f"torch_xdev's C++ extension could not be loaded from {__path__[0]} ({e}). {hint}"
    ) from e


def _torch_mismatch(built_with: str, running: str) -> Optional[str]:
    """Why an extension built against torch ``built_with`` cannot run in torch ``running``.

    None when their major and minor versions agree: torch keeps its C++ ABI within a minor
    version, not across them, and an extension that still loads across them can crash later.
    """
    if built_with.split("+")[0].split(".")[:2] == running.split("+")[0].split(".")[:2]:
        return None
    return (
        f"torch_xdev was built against torch {built_with}, but torch {running} is running: a C++ "
        "extension of torch runs only with the torch minor version it was compiled against. "
        "Rebuild it against the torch you run: `pip install --no-build-isolation .` (or "
        "`python setup.py build_ext --inplace` in the checkout)."
    )


if not hasattr(_C, "built_with_torch"):  # an in-place build older than these files
    raise ImportError(
        f"torch_xdev's C++ extension in {__path__[0]} is older than its Python files: rebuild "
        "it (`python setup.py build_ext --inplace` in the checkout, or `pip install "
        "--no-build-isolation .`)."
    )
_mismatch = _torch_mismatch(_C.built_with_torch, torch.__version__)
if _mismatch is not None:
    raise ImportError(_mismatch)
from ._registration import (
    BACKEND_NAME,
    backend_of,
    backends_by_device,
    host_identity,
    register,
)
from .ddp import COMM_MEM_VARIABLE, avg_comm_hook, default_comm_mem
from .options import ALGORITHMS, ENV_KNOBS, Options

__all__ = [
    "ALGORITHMS",
    "BACKEND_NAME",
    "ENV_KNOBS",
    "Options",
    "avg_comm_hook",
    "default_comm_mem",
    "describe",
    "host_identity",
    "prepare_cuda_graph_capture",
    "shared_empty",
]
__version__ = "0.1.0"


def describe(group: Optional[dist.ProcessGroup] = None) -> dict[str, Any]:
    """What the xdev backend of ``group`` (default: the world) is and will run.

    Keys include ``algorithm``, ``num_packs``, ``options_note`` (the XDEV_* settings this
    group could not use and what it uses instead; empty when none), ``world_size``,
    ``local_world_size``,
    ``num_hosts``, ``shared_memory``, ``fallback_backend``, ``cpu_allreduce_plan``
    (algorithm and reason per payload size), ``cuda_allreduce_plan``, ``last_allreduce``,
    ``last_gather_scatter`` (the last all-gather or reduce-scatter: name, path and reason),
    ``last_broadcast`` (the last broadcast's path, ``native``, ``two_level`` or ``fallback``,
    and reason),
    ``shared_buffers`` (how many ``shared_empty`` buffers of the group are alive),
    ``ddp_shared_buckets`` (whether DDP's buckets on this group will live in its symmetric
    heap, with ``ddp_shared_buckets_note`` saying why not) and ``symmetric_heap`` (its arenas,
    bytes in use, and collectives that ran in place from it or staged; or None); ``cuda`` has the same two for CUDA buckets and ``heap``, the
    CUDA heap's bytes, blocks and in-place allreduces (None without one). ``devices`` lists
    the tensors' devices the group hands to xdev (``["cpu", "cuda"]`` for ``backend="xdev"``;
    ``["cuda"]`` for ``"cpu:gloo,cuda:xdev"``, whose CPU fields then apply to no call).
    """
    backend = backend_of(group, ("cpu", "cuda"))
    info = dict(backend.describe())
    info["devices"] = [d for d, b in backends_by_device(group).items() if b is backend]
    # DDP asks the backend for bucket memory only under PyTorch's switch (torch_xdev/ddp.py).
    # c10d's Reducer turns it off for the value "1" (its default, when unset) and for nothing
    # else: "0", "false" and "" all turn it on.
    switch = os.environ.get(COMM_MEM_VARIABLE, "1")
    cuda = info["cuda"] = dict(info["cuda"])
    for part, heap, device in ((info, "symmetric heap", "cpu"), (cuda, "CUDA heap", "cuda")):
        if part.get("ddp_shared_buckets") and device not in info["devices"]:
            part["ddp_shared_buckets"] = False
            part["ddp_shared_buckets_note"] = (
                f"off: this group hands {device.upper()} tensors to another backend"
            )
        if part.get("ddp_shared_buckets") and switch == "1":
            part["ddp_shared_buckets"] = False
            part["ddp_shared_buckets_note"] = (
                f"off: {COMM_MEM_VARIABLE} is 1 or unset; DDP allocates its buckets through the "
                f"backend only when it is set to something else, e.g. 0 (the group's {heap} is "
                f"ready)"
            )
    return info


def shared_empty(
    *size: Union[SupportsIndex, list[SupportsIndex], tuple[SupportsIndex, ...], torch.Size],
    dtype: Optional[torch.dtype] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """A CPU tensor in memory that every rank of ``group`` maps (zero-filled).

    Collective: every rank of the group calls it with the same size and dtype, in the same
    order. ``all_reduce`` of the tensor (or of a contiguous view of it at the same place on
    every rank) on ``group`` then runs in place: each rank sums its slice straight from every
    rank's copy and writes the total into all of them, with nothing staged through the
    group's slots. This applies with ``algorithm`` ``"auto"`` or ``"flat"``; other forced
    algorithms stage as usual. The memory is freed when the tensor and its views are, and
    nothing is left in /dev/shm if a process dies.

    ``size`` is given as for ``torch.empty``: ``shared_empty(4, 5)`` or
    ``shared_empty((4, 5))``. Raises ValueError if the group spans several hosts or the
    ranks ask for different sizes or dtypes, and DistBackendError, as a collective does, if a
    peer has exited, is in another collective, or has not called it within the group's timeout.
    """
    one = size[0] if len(size) == 1 else None
    # As torch.empty: one sequence, or integers (numpy's and 0-d tensors' too); not floats.
    dims: Sequence[Any] = one if isinstance(one, (list, tuple, torch.Size)) else size
    try:
        shape = [operator.index(d) for d in dims]
    except TypeError:
        raise TypeError(
            f"shared_empty: size must be integers, or one list, tuple or torch.Size of them; "
            f"got {size!r}"
        ) from None
    tensor: torch.Tensor = backend_of(group).shared_empty(shape, dtype or torch.get_default_dtype())
    return tensor


def prepare_cuda_graph_capture(group: Optional[dist.ProcessGroup] = None) -> None:
    """Opens what ``group``'s CUDA collectives need, so that they can be captured in CUDA graphs.

    Collective: every rank of the group calls it, outside any capture, on the GPU it will
    capture on (``torch.cuda.current_device()``). A CUDA collective captured in a graph goes
    to NCCL (xdev's own GPU barriers count calls on the host, which a replay would not do),
    and two things cannot be made inside a capture: xdev's CUDA transport, which the group's
    first CUDA collective opens, and NCCL's communicator, which NCCL makes at its first
    collective on the device; xdev's own calls do not reach NCCL, so warm-up steps alone may
    leave it unmade. This makes both, with a one-element allreduce each. A group's first CUDA
    collective made inside a capture raises an error naming this function.

    Raises RuntimeError where captured calls could not run: ranks that share a GPU (NCCL
    refuses them, and Gloo cannot be captured), or no NCCL; ValueError where ``group`` is
    not an xdev group or this build of torch_xdev has no CUDA path. Send and recv are not covered:
    NCCL makes a communicator per pair of ranks at their first send or recv.
    """
    backend = backend_of(group, ("cuda",))
    if not _C.built_with_cuda:
        raise ValueError(
            "prepare_cuda_graph_capture: this build of torch_xdev has no CUDA path (build it "
            "against a CUDA build of torch with a CUDA toolkit present)"
        )
    if not torch.cuda.is_available():
        raise RuntimeError("prepare_cuda_graph_capture: this process sees no GPU")
    backend.prepare_cuda_graph_capture(torch.cuda.current_device())


register()
# DDP allocates its buckets through xdev (shared buckets) only under this PyTorch switch; see
# torch_xdev/ddp.py for when it is safe to set for the user.
default_comm_mem()
