"""DistributedDataParallel on xdev: shared gradient buckets and a one-pass averaging hook.

Shared buckets. PyTorch's DDP Reducer allocates each gradient bucket through its process
group's backend (``Backend::allocateTensor``) when the environment variable
``DDP_DISABLE_COMM_MEM`` is anything but ``1``, its default (e.g. ``0``), and the backend says
it can (``supportsTensorAlloc``). xdev can for CPU buckets: it places them in the group's
symmetric heap, memory every rank maps, so each bucket's allreduce reads the peers' buckets and
writes the totals straight into them, with nothing staged (on several hosts each host's ranks
share a heap, and the two-level allreduce reads it inside each host). It can for CUDA buckets
once the group's CUDA IPC transport is open: they come from its CUDA heap, device memory every
rank maps through CUDA IPC. PyTorch reads the variable process-wide, for every backend, so
``import torch_xdev`` sets it to ``0`` only where that changes no other backend: when the user
has not set it and the process sees no CUDA device (NCCL, the one other backend that answers
``supportsTensorAlloc``, needs one), marking it as its own so that a child process, which
inherits it, decides again. Elsewhere set ``DDP_DISABLE_COMM_MEM=0`` yourself;
``Options(shared_buckets=False)`` (``XDEV_SHARED_BUCKETS=0``) turns it off for xdev groups.

Averaging. Without a comm hook DDP divides every gradient by the world size before its SUM
allreduce (fused into the copy into the bucket, or a separate pass over the gradient with
``gradient_as_bucket_view=True``). ``avg_comm_hook`` asks for ``ReduceOp.AVG`` instead, which
xdev's kernels fold into the reduction: one pass, and no division anywhere else. DDP takes one
hook per model and refuses a second, so torch_xdev does not register it for you::

    model = DistributedDataParallel(net, gradient_as_bucket_view=True)
    model.register_comm_hook(None, torch_xdev.avg_comm_hook)  # None: the default group
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and Future[Tensor] themselves, not with strings.
import os
from typing import Optional

import torch
import torch.distributed as dist

from . import _C
from ._registration import backends_by_device

# PyTorch's own switch (read by c10d's Reducer each time it allocates buckets).
COMM_MEM_VARIABLE = "DDP_DISABLE_COMM_MEM"
# Set beside it when torch_xdev set it: a child process inherits both, and decides again (it
# may see a GPU its parent did not) instead of taking the value for the user's.
COMM_MEM_SET_BY_XDEV = "TORCH_XDEV_SET_DDP_DISABLE_COMM_MEM"


def default_comm_mem(
    environ: Optional[dict[str, str]] = None, cuda_visible: Optional[bool] = None
) -> bool:
    """Sets ``DDP_DISABLE_COMM_MEM=0`` in ``environ`` if that changes no other backend.

    Returns whether it did. Leaves a value the user set alone. ``cuda_visible`` defaults to
    whether this process sees a GPU (asked of NVML, which does not initialise CUDA; a ROCm
    build's ``torch.cuda`` counts AMD GPUs, whose RCCL groups read the same variable).
    """
    env = os.environ if environ is None else environ
    if cuda_visible is None:
        gpu_build = torch.version.cuda is not None or torch.version.hip is not None
        cuda_visible = gpu_build and torch.cuda.device_count() > 0
    if env.get(COMM_MEM_SET_BY_XDEV) == "1" and env.get(COMM_MEM_VARIABLE) == "0":
        # Set by torch_xdev in a parent process, not by the user: decided again here.
        del env[COMM_MEM_VARIABLE]
    env.pop(COMM_MEM_SET_BY_XDEV, None)
    if COMM_MEM_VARIABLE in env or cuda_visible:
        return False
    env[COMM_MEM_VARIABLE] = "0"
    env[COMM_MEM_SET_BY_XDEV] = "1"
    return True


def avg_comm_hook(
    process_group: Optional[dist.ProcessGroup], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: allreduce each bucket with ``ReduceOp.AVG`` (one pass on xdev).

    Register with ``model.register_comm_hook(state, torch_xdev.avg_comm_hook)``, where
    ``state`` is the process group DDP was built on, or ``None`` for the default group. Works on
    any backend that supports AVG; results equal DDP's default hook within floating-point
    rounding (the sum is divided once instead of every term), except under
    ``Join(..., divide_by_initial_world_size=False)``: DDP's default hook then divides by the
    ranks still training, this one (as PyTorch's ``allreduce_hook``) by the group's size.
    """
    buffer = bucket.buffer()
    if not buffer.is_cuda and waits_for_cpu_buckets(process_group):
        # A blocking call, not an async one waited for: xdev then knows its caller waits, and
        # its worker may spin briefly at barriers on the core the caller leaves it.
        dist.all_reduce(buffer, op=dist.ReduceOp.AVG, group=process_group)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done
    work = dist.all_reduce(buffer, op=dist.ReduceOp.AVG, group=process_group, async_op=True)
    assert work is not None  # async_op=True always returns a Work
    return work.get_future().then(lambda fut: fut.value()[0])


def waits_for_cpu_buckets(process_group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``avg_comm_hook`` waits for a CPU bucket's allreduce before backward goes on.

    True on an xdev group whose ranks have fewer than two cores each on their host
    (``describe()["worker_has_own_core"]`` is False). The allreduce runs on the group's worker
    thread; without a core of its own it takes turns with backward on the rank's core, and a
    rank's worker may be off its core while a peer's waits for it at a barrier. (DDP's own hook
    stays asynchronous: the backend does not block an async call.) Measured with 2 ranks on 2
    cores (``benchmarks/ddp_step.py``, 67 MB of gradients, see docs/performance.md): a step's
    communication cost 8.4 ms overlapped with backward, 3.5 ms waited for, in one run; 5.1-5.7
    ms against 9.0-10.4 ms in later ones. With a core to spare the overlap pays and the hook
    does not wait.
    """
    backend = backends_by_device(process_group).get("cpu")
    return isinstance(backend, _C.XdevBackend) and not backend.worker_has_own_core
