"""The training runs behind tests/test_ddp_shared_buckets.py, executed inside spawned ranks.

``worker`` runs every case of CASES twice, on xdev and on Gloo, each in process groups of its
own, and returns what each run ended with: parameters, losses and, on xdev, snapshots of the
groups' symmetric heaps (see ``Run.snapshot`` in ddp_shared_bucket_run.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import (
    ddp_zero_hook,
    default_hooks,
    powerSGD_hook,
)
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parallel.distributed import _MixedPrecision

import torch_xdev

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_case_models import (  # noqa: E402
    SEED,
    BranchNet,
    ConvNet,
    ddp_train,
    flat_params,
    image_batch,
    loss_of,
    mlp_batch,
)
from ddp_shared_bucket_run import (  # noqa: E402
    LR,
    STEPS,
    Run,
    bucket_bytes,
    one_step,
    sgd,
    train,
)

WORLD_SIZE = 4
# ~10 KB: the 27 KB of the MLP's gradients spread over several buckets.
BUCKET_CAP_MB = 0.01
CONV_BUCKET_CAP_MB = 0.001  # ~1 KB: the ConvNet's 3.6 KB in several buckets too
COLLECTIVE_TIMEOUT = timedelta(seconds=30)  # a hung collective fails instead of hanging
MISMATCH_TIMEOUT = timedelta(seconds=5)


# A body's result: {"params": {part: [...]}, "losses": [...]}. Ranks that must end with the
# same bits in a part: "world" all ranks, "pair" ranks 0-1 and 2-3, "alone" none; a part named
# "world:<what>" (another snapshot) holds for the ranks of "world".
PAIRS = ((0, 1), (2, 3))


# ---------------------------------------------------------------------------------------------
# The cases. Each body runs inside its default group (made by run_case), builds any further
# group itself, and returns {"params": {part: [...]}, "losses": [...]}.


def case_mlp(run: Run, bucket_view: bool = False, **ddp_kwargs: Any) -> dict[str, Any]:
    model = ddp_train.make_model(SEED)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=bucket_view, **ddp_kwargs)
    losses = train(run, ddp, snapshot=lambda: run.snapshot([ddp], bucket_view=bucket_view))
    return {"params": {"world": flat_params(model)}, "losses": losses}


def case_find_unused(run: Run) -> dict[str, Any]:
    model = BranchNet()
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=True)
    # Different ranks leave the extra head out on different steps.
    losses = train(
        run,
        ddp,
        forward=lambda ddp, x, s: ddp(x, use_extra=(s + run.rank) % 3 == 0),
        snapshot=lambda: run.snapshot([ddp]),
    )
    return {"params": {"world": flat_params(model)}, "losses": losses}


def case_no_sync(run: Run) -> dict[str, Any]:
    """Gradient accumulation: two micro-batches per step, the first under no_sync()."""
    model = ddp_train.make_model(SEED)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)

    def accumulating_forward(ddp: DDP, x: torch.Tensor, s: int) -> torch.Tensor:
        x0, y0 = mlp_batch(run.rank, STEPS + s)  # a second batch, used for this step only
        with ddp.no_sync():
            loss_of(ddp(x0), y0).backward()
        return ddp(x)

    losses = train(run, ddp, forward=accumulating_forward, snapshot=lambda: run.snapshot([ddp]))
    return {"params": {"world": flat_params(model)}, "losses": losses}


def case_join_uneven(run: Run) -> dict[str, Any]:
    """Rank r has STEPS - r batches; Join shadows the missing allreduces with zeros."""
    model = ddp_train.make_model(SEED)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    opt = sgd(model)
    losses = []
    first_step: list[float] = []
    with Join([ddp]):
        for s in range(STEPS - run.rank):
            losses.append(one_step(ddp, opt, mlp_batch(run.rank, s)))
            if s == 0:  # while every rank still trains
                run.snapshot([ddp])
                first_step = flat_params(model)
    # Join broadcasts the last joiner's model at the end, so ranks agree there whatever the
    # allreduces gave; after the first step they agree only if those did.
    params = {"world": flat_params(model), "world:first step": first_step}
    return {"params": params, "losses": losses}


def case_mixed_precision(run: Run) -> dict[str, Any]:
    """DDP's own mixed precision: bf16 parameters in forward and backward, bf16 buckets."""
    model = ddp_train.make_model(SEED)
    bf16 = torch.bfloat16
    precision = _MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, mixed_precision=precision)
    losses = train(run, ddp, snapshot=lambda: run.snapshot([ddp]))
    return {"params": {"world": flat_params(model)}, "losses": losses}


def case_bf16_params(run: Run) -> dict[str, Any]:
    """A bf16 model: bf16 buckets in the heap, summed in bf16 (what works of mixed precision).

    On pairs of ranks: a sum of two terms is rounded once whatever the order, so xdev and Gloo
    must agree exactly. Over 4 ranks bf16's 8 bits make the summation order show: after 6 steps
    the two differed by ~3% of how far the parameters moved, too close to what a real error
    (a rank dropped: ~25%) would do for a comparison to tell them apart.
    """
    pair, _ = dist.new_subgroups(group_size=2, pg_options=run.options())
    model = ddp_train.make_model(SEED).to(torch.bfloat16)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, process_group=pair)
    losses = train(
        run,
        ddp,
        forward=lambda ddp, x, s: ddp(x.to(torch.bfloat16)),
        snapshot=lambda: run.snapshot([ddp], group=pair, label="pair"),
    )
    return {"params": {"pair": flat_params(model)}, "losses": losses}


def case_comm_hook(
    run: Run, hook: Callable[..., Any], bucket_view: bool, state: Any = None
) -> dict[str, Any]:
    model = ddp_train.make_model(SEED)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=bucket_view)
    ddp.register_comm_hook(state, hook)
    losses = train(run, ddp, snapshot=lambda: run.snapshot([ddp], bucket_view=bucket_view))
    return {"params": {"world": flat_params(model)}, "losses": losses}


def case_avg_comm_hook(run: Run) -> dict[str, Any]:
    # Gloo has no ReduceOp.AVG: its twin is DDP's default (SUM of pre-divided gradients).
    if run.backend == "gloo":
        return case_mlp(run, bucket_view=True)
    return case_comm_hook(run, torch_xdev.avg_comm_hook, bucket_view=True)


def case_powersgd_hook(run: Run) -> dict[str, Any]:
    """PowerSGD on several buckets: each bucket's future callbacks allreduce its P and Q
    matrices, on the thread that completed the bucket's allreduce, while the backward pass
    goes on issuing the next buckets' allreduces."""
    # Compress every matrix from the third step on (the first two allreduce plainly), at a
    # rank (4) at which the loss still falls within the case's six steps.
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=4,
        start_powerSGD_iter=2,
        min_compression_rate=1,
    )
    hook: Callable[..., Any] = powerSGD_hook.powerSGD_hook
    if run.backend == "gloo":
        # Gloo pairs collectives by the order each rank issues them, which the callbacks make
        # a race (Gloo then hangs): its twin finishes each bucket before the next is issued.
        # The sums are the same.
        # (No annotations: DDP compares them with its classes, and this module's are strings.)
        def finished(state, bucket):
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(powerSGD_hook.powerSGD_hook(state, bucket).wait())
            return done

        hook = finished
    return case_comm_hook(run, hook, bucket_view=False, state=state)


ZERO_SETUP_STEPS = 2  # steps in which DDP-overlapped ZeRO learns DDP's buckets, updating nothing


def case_zero_overlap(run: Run, interleaved: bool) -> dict[str, Any]:
    """ZeroRedundancyOptimizer(overlap_with_ddp=True): DDP's comm hook runs each rank's shard
    of the optimizer step and broadcasts the updated parameters, from the last bucket's hook,
    or (interleaved) from each bucket's future callback, issuing collectives there."""
    model = ddp_train.make_model(SEED)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    if run.backend == "gloo":
        # torch refuses the overlap on Gloo (it may hang there): the twin is DDP with SGD,
        # which the overlapped ZeRO computes, from the step it starts updating.
        def step(s: int, opt: torch.optim.Optimizer) -> None:
            if s >= ZERO_SETUP_STEPS:
                opt.step()

    else:
        zero = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, lr=LR
        )
        with_zero = (
            ddp_zero_hook.hook_with_zero_step_interleaved
            if interleaved
            else ddp_zero_hook.hook_with_zero_step
        )
        ddp.register_comm_hook(None, with_zero(default_hooks.allreduce_hook, ddp, zero))

        def step(s: int, opt: torch.optim.Optimizer) -> None:
            pass  # the hook stepped

    # As many updates as the other cases make.
    steps = STEPS + ZERO_SETUP_STEPS
    losses = train(run, ddp, snapshot=lambda: run.snapshot([ddp]), step=step, steps=steps)
    # ZeRO broadcasts each parameter from the rank that owns it, so ranks agree on parameters
    # whatever the allreduces gave; the last step's gradients (the allreduced buckets) agree
    # only if those did.
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    params = {"world": flat_params(model), "world:last gradients": grads.tolist()}
    return {"params": params, "losses": losses}


def case_channels_last_conv(run: Run) -> dict[str, Any]:
    model = ConvNet()
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not model.head.is_contiguous()
    ddp = DDP(model, bucket_cap_mb=CONV_BUCKET_CAP_MB, gradient_as_bucket_view=True)
    snapshot = lambda: run.snapshot([ddp], bucket_view=True)  # noqa: E731
    losses = train(run, ddp, batch=image_batch, snapshot=snapshot)
    # The layouts survived: DDP's gradient views keep each parameter's strides.
    conv_grad, head_grad = model.conv1.weight.grad, model.head.grad
    assert conv_grad is not None and head_grad is not None
    assert conv_grad.is_contiguous(memory_format=torch.channels_last)
    assert head_grad.stride() == model.head.stride()
    return {"params": {"world": flat_params(model)}, "losses": losses}


def train_two(run: Run, first: DDP, second: DDP) -> list[float]:
    """Steps the MLP `first` and the ConvNet `second` in turns."""
    opt_first, opt_second = sgd(first.module), sgd(second.module)
    losses = []
    for s in range(STEPS):
        losses.append(one_step(first, opt_first, mlp_batch(run.rank, s)))
        losses.append(one_step(second, opt_second, image_batch(run.rank, s)))
    return losses


def case_two_models_one_group(run: Run) -> dict[str, Any]:
    mlp, conv = ddp_train.make_model(SEED), ConvNet()
    ddp_mlp = DDP(mlp, bucket_cap_mb=BUCKET_CAP_MB)
    ddp_conv = DDP(conv, bucket_cap_mb=CONV_BUCKET_CAP_MB)
    losses = train_two(run, ddp_mlp, ddp_conv)
    run.snapshot([ddp_mlp, ddp_conv])
    return {"params": {"world": flat_params(mlp) + flat_params(conv)}, "losses": losses}


def case_two_groups(run: Run) -> dict[str, Any]:
    """One model on the world, one on a pair of ranks: two xdev groups, two heaps."""
    pair, _ = dist.new_subgroups(group_size=2, pg_options=run.options())
    mlp, conv = ddp_train.make_model(SEED), ConvNet()
    ddp_mlp = DDP(mlp, bucket_cap_mb=BUCKET_CAP_MB)
    ddp_conv = DDP(conv, bucket_cap_mb=CONV_BUCKET_CAP_MB, process_group=pair)
    losses = train_two(run, ddp_mlp, ddp_conv)
    run.snapshot([ddp_mlp])
    run.snapshot([ddp_conv], group=pair, label="pair")
    return {"params": {"world": flat_params(mlp), "pair": flat_params(conv)}, "losses": losses}


def case_bucket_cap_differs_rebuilt(run: Run) -> dict[str, Any]:
    """Rank 3 asks for larger buckets; DDP's bucket rebuild adopts rank 0's on every rank.

    Without find_unused_parameters DDP's first buckets hold every gradient whatever the cap,
    and its rebuild after the first step broadcasts rank 0's layout, so every rank allocates
    the same buckets and rank 3's cap is ignored.
    """
    cap = BUCKET_CAP_MB if run.rank != run.world - 1 else 3 * BUCKET_CAP_MB
    model = ddp_train.make_model(SEED)
    ddp = DDP(model, bucket_cap_mb=cap)
    losses = train(run, ddp, snapshot=lambda: run.snapshot([ddp]))
    return {"params": {"world": flat_params(model)}, "losses": losses}


def case_world_of_one(run: Run) -> dict[str, Any]:
    alone, _ = dist.new_subgroups(group_size=1, pg_options=run.options())
    model = ddp_train.make_model(SEED)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, process_group=alone)
    snapshot = lambda: run.snapshot([ddp], group=alone, label="alone")  # noqa: E731
    losses = train(run, ddp, snapshot=snapshot)
    # The reference that needs no backend: the same steps without DDP.
    local = ddp_train.make_model(SEED)
    local_opt = sgd(local)
    for s in range(STEPS):
        one_step(local, local_opt, mlp_batch(run.rank, s))
    assert flat_params(local) == flat_params(model), "DDP in a world of one changed the training"
    return {"params": {"alone": flat_params(model)}, "losses": losses}


@dataclasses.dataclass(frozen=True)
class Case:
    body: Callable[[Run], dict[str, Any]]
    compare: bool = True  # xdev's result is compared with Gloo's
    shared: bool = True  # the buckets must lie in the heap
    bucket_allreduce_last: bool = True  # the last allreduce before the snapshot is a bucket's
    # Tolerance for the comparison with Gloo where the sums are not fp32 (None: fp32's).
    rtol: Optional[float] = None
    atol: Optional[float] = None
    hostnames: Optional[tuple[str, ...]] = None  # XDEV_HOSTNAME per rank while groups are made
    # A heap tensor gets the plan any tensor of its size would, and runs in place when that is
    # flat. These models' buckets are small, where auto picks other plans (tests/test_ddp.py
    # runs DDP under auto with shared buckets), so flat is forced to put every bucket's
    # allreduce in place.
    algorithm: str = "flat"
    # Some bucket's allreduce ran in place from the heap (the heap counts it). Not where the
    # hook allreduces a copy of the bucket, nor across hosts, where these one-window buckets
    # are staged inside each host (the closing barrier in place costs more).
    ran_in_place: bool = True


CASES: dict[str, Case] = {
    "bucket_view_false": Case(lambda run: case_mlp(run, bucket_view=False)),
    "bucket_view_true": Case(lambda run: case_mlp(run, bucket_view=True)),
    # The last allreduce of a step is DDP's int32 map of used parameters, not a bucket.
    "find_unused_parameters": Case(case_find_unused, bucket_allreduce_last=False),
    "static_graph": Case(lambda run: case_mlp(run, static_graph=True)),
    "no_sync": Case(case_no_sync),
    "join_uneven_inputs": Case(case_join_uneven),
    "bf16_params": Case(case_bf16_params, rtol=0.0, atol=0.0),  # exact: see its body
    # The hook allreduces an fp16 copy of each bucket, not the bucket: staged, not in place.
    # Both backends round the same fp16 gradients, then sum them in different orders, each
    # sum rounded to fp16's 11 bits: a summed gradient of size g may differ by ~2^-10 g, and
    # a step at lr 0.1 then moves a parameter ~1e-4 g differently (measured after 6 steps:
    # 3e-5 at most). A real error moves parameters by 1e-2 or more.
    "fp16_compress_hook": Case(
        lambda run: case_comm_hook(run, default_hooks.fp16_compress_hook, bucket_view=False),
        bucket_allreduce_last=False,
        ran_in_place=False,
        rtol=1e-3,
        atol=1e-4,
    ),
    "avg_comm_hook": Case(case_avg_comm_hook),
    # The last allreduce of a step is a Q matrix, not a bucket.
    "powerSGD_hook": Case(case_powersgd_hook, bucket_allreduce_last=False),
    "channels_last_conv": Case(case_channels_last_conv),
    "two_models_one_group": Case(case_two_models_one_group),
    "two_groups": Case(case_two_groups),
    "bucket_cap_differs_rebuilt": Case(case_bucket_cap_differs_rebuilt),
    "world_of_one": Case(case_world_of_one, shared=False),
    # Each host's ranks share a heap; the two-level allreduce reads it inside each host.
    "two_hosts": Case(
        case_mlp,
        hostnames=("host-a", "host-a", "host-b", "host-b"),
        algorithm="auto",  # a forced native plan is refused across hosts
        ran_in_place=False,
    ),
    # The last collectives of a step are ZeRO's broadcasts; its last allreduce is a bucket's.
    "zero_overlap": Case(lambda run: case_zero_overlap(run, interleaved=False)),
    "zero_overlap_interleaved": Case(lambda run: case_zero_overlap(run, interleaved=True)),
    # The callbacks' allreduces cross hosts too (through Gloo, from xdev's worker thread).
    "powerSGD_two_hosts": Case(
        case_powersgd_hook,
        bucket_allreduce_last=False,
        hostnames=("host-a", "host-a", "host-b", "host-b"),
        algorithm="auto",
        ran_in_place=False,
    ),
}
# Run like the others, but judged by a test of its own (torch may not be able to run it).
EXTRA_CASES: dict[str, Case] = {"mixed_precision": Case(case_mixed_precision, compare=False)}


@contextlib.contextmanager
def hostname(name: Optional[str]) -> Iterator[None]:
    """XDEV_HOSTNAME while the groups are made (xdev reads it at each group's creation)."""
    saved = os.environ.get("XDEV_HOSTNAME")
    if name is not None:
        os.environ["XDEV_HOSTNAME"] = name
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("XDEV_HOSTNAME", None)
        else:
            os.environ["XDEV_HOSTNAME"] = saved


def settled_heap(group: Optional[dist.ProcessGroup]) -> Optional[dict[str, int]]:
    """The heap of `group` once every collective this rank queued on it has let go of it.

    xdev's worker thread drops the task of a collective (and its hold on the tensor) only when
    it takes the next one, a moment after the collective completed. A barrier is queued behind
    them all, and runs once the thread has.
    """
    dist.barrier(group=group)
    heap = torch_xdev.describe(group)["symmetric_heap"]
    return None if heap is None else dict(heap)


def run_case(run: Run, case: Case) -> dict[str, Any]:
    with hostname(case.hostnames[run.rank] if case.hostnames else None):
        dist.init_process_group(
            run.backend,
            store=run.store,
            rank=run.rank,
            world_size=run.world,
            pg_options=run.options(),
            timeout=COLLECTIVE_TIMEOUT,
        )
        try:
            try:
                out = case.body(run)  # its models die when it returns ...
            except Exception:
                # (Handled here, so that the traceback's frames, and the models in them, are
                # gone before the groups are.)
                return {"error": traceback.format_exc()}
            gc.collect()  # ... and with them (cycles included) their buckets
            heaps = {label: settled_heap(g) for label, g in run.heap_groups.items()}
            out["heap_after"] = {label: h for label, h in heaps.items() if h is not None}
        finally:
            # Every DDP model is gone before the groups go: see examples/ddp_train.py.
            gc.collect()
            dist.destroy_process_group()
    out["snapshots"] = run.snapshots
    return out


def case_bucket_cap_differs(rank: int, world: int, store: dist.Store) -> dict[str, Any]:
    """Rank 3 asks for larger buckets than its peers, and DDP never reconciles them.

    With find_unused_parameters DDP never rebuilds its buckets, and its first ones follow each
    rank's own bucket_cap_mb: ranks 0-2 allreduce two buckets, rank 3 one of another size. xdev
    must refuse the first on every rank. Ranks 0-2's second bucket then has no partner: it
    fails at the group's timeout, which destroy_process_group waits for, so that is short.
    """
    dist.init_process_group(
        "xdev", store=store, rank=rank, world_size=world, timeout=MISMATCH_TIMEOUT
    )
    result: dict[str, Any] = {}
    try:

        def body() -> None:
            model = BranchNet()
            # find_unused_parameters: DDP never rebuilds (and so never syncs) its buckets, and
            # its first buckets follow each rank's own bucket_cap_mb.
            cap = BUCKET_CAP_MB if rank != world - 1 else 3 * BUCKET_CAP_MB
            ddp = DDP(model, bucket_cap_mb=cap, find_unused_parameters=True)
            sizes = [b // 4 for b in bucket_bytes(ddp)]
            all_sizes: list[Any] = [None] * world
            dist.all_gather_object(all_sizes, sizes)
            result["sizes"] = all_sizes
            x, y = mlp_batch(rank, 0)
            loss_of(ddp(x, use_extra=True), y).backward()

        try:
            body()
        except Exception:
            result["error"] = traceback.format_exc()
    finally:
        gc.collect()
        dist.destroy_process_group()
    return result


def worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Every case on both backends, then the bucket-size mismatch; [case][backend] -> result."""
    base = dist.TCPStore(
        "127.0.0.1",
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0,
        timeout=COLLECTIVE_TIMEOUT,
    )
    results: dict[str, dict[str, Any]] = {}
    for name, case in {**CASES, **EXTRA_CASES}.items():
        results[name] = {}
        for backend in ("gloo", "xdev"):
            # A fresh key space per run, so groups made one after another never meet.
            store = dist.PrefixStore(f"{name}/{backend}/", base)
            run = Run(rank, world, backend, store, algorithm=case.algorithm)
            try:
                results[name][backend] = run_case(run, case)
            except Exception:
                results[name][backend] = {"error": traceback.format_exc()}
    mismatch = case_bucket_cap_differs(rank, world, dist.PrefixStore("cap_differs/", base))
    results["bucket_cap_differs"] = mismatch
    return results
