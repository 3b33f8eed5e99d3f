"""Data-parallel training of a small MLP with DistributedDataParallel on the xdev backend.

Run it as a user would::

    torchrun --nproc_per_node 4 examples/ddp_train.py
    torchrun --nproc_per_node 4 examples/ddp_train.py --backend gloo   # for comparison
    torchrun --nproc_per_node 4 examples/ddp_train.py --shared-grads   # no DDP, see below
    torchrun --nproc_per_node 2 examples/ddp_train.py --hidden 2048 --layers 4

``--shared-grads`` trains the same model without the DDP wrapper: every parameter's
``.grad`` is a view into one ``torch_xdev.shared_empty`` buffer, which every rank maps, so
``backward()`` accumulates the gradients straight into it and one ``all_reduce`` of the
buffer averages them in place, with nothing staged (the contiguous gradient buffer of
Megatron-style data parallelism). DDP's own buckets are ordinary tensors.

Every rank draws its own batches of synthetic data (deterministically, from the seed, its rank
and the step), so the run is reproducible while the ranks really do see different data; the
targets come from a fixed random linear "teacher", so the loss falls. Rank 0 prints the loss of
every step (averaged over the ranks), the final loss and the allreduce algorithm xdev chose.

The default model (32 -> 64 -> 64 -> 10) trains in moments, and communication hardly shows in
it. ``--hidden 2048 --layers 4`` (12.7M parameters, 51 MB of fp32 gradients) is big enough that
the gradient allreduce is a large part of a step. At the end rank 0 prints the training steps
per second and the communication share of a step, measured in a short extra phase: two fresh
copies of the model, one in the training's configuration and one with a DDP comm hook that
returns each bucket unchanged (without DDP: without the ``all_reduce``), take
``--comm-share-steps`` timed steps each, alternately, so that drift on the machine hits both
alike; the share is 1 - (median step without communication) / (median step with it).

``train()`` is importable, so tests can run the same training without torchrun.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares a hook's
# annotations with dist.GradBucket and Future[Tensor] themselves, not with strings.
import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_xdev

IN_FEATURES = 32
HIDDEN = 64
HIDDEN_LAYERS = 2
OUT_FEATURES = 10
# The teacher does not depend on --seed: the task stays the same, only the student's
# initialisation and the data stream change with the seed.
TEACHER_SEED = 20240607


@dataclasses.dataclass
class TrainConfig:
    """What to train and how; the defaults are those of the command line."""

    backend: str = "xdev"
    steps: int = 20
    batch_size: int = 32
    lr: float = 0.1
    seed: int = 0
    device: str = "cpu"
    algorithm: str = "auto"
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    shared_grads: bool = False  # no DDP: gradients in one shared_empty buffer (xdev, CPU)
    timeout: Optional[timedelta] = None  # of the process group; None: torch's default
    hidden: int = HIDDEN  # width of the hidden layers
    layers: int = HIDDEN_LAYERS  # hidden layers (Linear + ReLU each)
    # Timed steps with and without gradient communication, alternately, after training, to
    # measure its share of a step (0: none); on models of their own, after two warm-up steps.
    comm_share_steps: int = 5


@dataclasses.dataclass
class TrainResult:
    """What ``train()`` hands back on every rank."""

    model: nn.Module  # the trained module itself, not its DDP wrapper
    losses: list[float]  # per step: this rank's loss before the update
    mean_losses: list[float]  # per step: the loss averaged over all ranks
    allreduce: Optional[tuple[str, str]]  # xdev's (algorithm, reason) for the gradients
    # This rank's wall time of each training step (zero_grad to optimizer.step, the gradient
    # communication included, the logging of the loss not); then of the extra phase's steps
    # with and without gradient communication (empty when comm_share_steps is 0).
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    comm_step_seconds: list[float] = dataclasses.field(default_factory=list)
    no_comm_step_seconds: list[float] = dataclasses.field(default_factory=list)


def make_model(seed: int, hidden: int = HIDDEN, layers: int = HIDDEN_LAYERS) -> nn.Sequential:
    """The student: 32 -> hidden (x layers) -> 10 with ReLU; the same on every rank for one seed.

    The defaults give 32 -> 64 -> 64 -> 10.
    """
    if hidden < 1 or layers < 1:
        raise ValueError(f"hidden and layers must be >= 1; got {hidden}, {layers}")
    torch.manual_seed(seed)
    modules: list[nn.Module] = [nn.Linear(IN_FEATURES, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        modules += [nn.Linear(hidden, hidden), nn.ReLU()]
    modules.append(nn.Linear(hidden, OUT_FEATURES))
    return nn.Sequential(*modules)


def make_teacher() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random linear map whose outputs have about unit variance."""
    gen = torch.Generator().manual_seed(TEACHER_SEED)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen) / IN_FEATURES**0.5
    bias = 0.1 * torch.randn(OUT_FEATURES, generator=gen)
    return weight, bias


def make_batch(
    teacher: tuple[torch.Tensor, torch.Tensor], seed: int, rank: int, step: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` at ``step``: different per rank and step, the same on every run."""
    if not 0 <= rank < 1000:
        raise ValueError(f"rank must be in [0, 1000) for the data seeding; got {rank}")
    gen = torch.Generator().manual_seed((seed * 1000 + rank) * 1_000_003 + step)
    weight, bias = teacher
    x = torch.randn(batch_size, IN_FEATURES, generator=gen)
    noise = 0.01 * torch.randn(batch_size, OUT_FEATURES, generator=gen)
    return x, x @ weight.T + bias + noise


def resolve_device(name: str) -> torch.device:
    """``cpu``, or ``cuda`` meaning this process's GPU (``LOCAL_RANK``) when there is one."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but CUDA is not available")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    raise ValueError(f"device must be 'cpu' or 'cuda'; got {name!r}")


def train(
    config: TrainConfig,
    *,
    rank: int,
    world_size: int,
    store: Optional[dist.Store] = None,
    log: Optional[Callable[[str], None]] = None,
) -> TrainResult:
    """Trains on ``world_size`` ranks, of which this process is ``rank``.

    Creates the default process group (from ``store`` when given, otherwise from the
    ``MASTER_ADDR``/``MASTER_PORT`` environment, as under torchrun) and destroys it before
    returning. ``log`` receives rank 0's progress lines; other ranks print nothing.
    """
    if config.shared_grads and (
        config.backend != torch_xdev.BACKEND_NAME or config.device != "cpu"
    ):
        raise ValueError(
            "shared_grads needs backend 'xdev' and device 'cpu' (torch_xdev.shared_empty makes"
            f" CPU tensors of an xdev group); got backend {config.backend!r}, device"
            f" {config.device!r}"
        )
    device = resolve_device(config.device)
    pg_options = None
    if config.backend == torch_xdev.BACKEND_NAME:
        pg_options = torch_xdev.Options(algorithm=config.algorithm)
    dist.init_process_group(
        config.backend,
        store=store,
        rank=rank,
        world_size=world_size,
        pg_options=pg_options,
        timeout=config.timeout,
    )
    say = log if (log is not None and rank == 0) else (lambda line: None)
    try:
        return _train_loop(config, device, rank, world_size, say)
    finally:
        # The DDP wrapper died with _train_loop's frame (gc.collect() breaks the reference
        # cycles DDP makes) while the process group was still registered, so the group's last
        # reference goes away inside destroy_process_group(), whose destructor releases the GIL.
        # Freeing DDP after destroy_process_group() instead lets its Reducer drop that last
        # reference with the GIL held, and ~ProcessGroupGloo (also xdev's fallback engine) then
        # joins a worker thread that may need the GIL to release a finished work's tensors: a
        # deadlock (seen with plain backend="gloo" in torch 2.13).
        gc.collect()
        dist.destroy_process_group()


def attach_shared_grads(model: nn.Module) -> torch.Tensor:
    """Makes every parameter's ``.grad`` a view into one ``torch_xdev.shared_empty`` buffer.

    ``backward()`` adds into an existing ``.grad`` in place, so afterwards the buffer holds
    this rank's gradients, ready for one in-place ``all_reduce``. Clear them with
    ``zero_grad(set_to_none=False)``, which keeps the views. Collective over the default group.
    """
    params = list(model.parameters())
    flat = torch_xdev.shared_empty(sum(p.numel() for p in params), dtype=params[0].dtype)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def no_comm_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that communicates nothing: each bucket comes back as it went in."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _wrap(
    model: nn.Module, config: TrainConfig, device: torch.device, communicate: bool = True
) -> tuple[nn.Module, Optional[torch.Tensor]]:
    """What forward runs (DDP, or the model itself) and the shared gradient buffer if any.

    ``communicate=False`` gives the same configuration without gradient communication: DDP
    with ``no_comm_hook``, or with ``shared_grads`` ordinary gradients and no buffer.
    """
    if config.shared_grads:
        return model, (attach_shared_grads(model) if communicate else None)
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=config.find_unused_parameters,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
    )
    if not communicate:
        ddp.register_comm_hook(None, no_comm_hook)
    return ddp, None


def _step(
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    grads: Optional[torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
) -> tuple[torch.Tensor, float]:
    """One training step: (the loss before the update, this rank's wall time in seconds)."""
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=grads is None)
    # Squared error summed over the outputs, averaged over the batch (nn.MSELoss would also
    # average over the 10 outputs, and learn 10x slower at the same lr).
    loss = (net(x) - y).pow(2).sum(dim=1).mean()
    loss.backward()  # with DDP, its gradient allreduce runs (and is waited for) in here
    if grads is not None:
        dist.all_reduce(grads, op=dist.ReduceOp.AVG)  # in place: nothing staged
    optimizer.step()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return loss, time.perf_counter() - started


def _train_loop(
    config: TrainConfig,
    device: torch.device,
    rank: int,
    world_size: int,
    say: Callable[[str], None],
) -> TrainResult:
    model = make_model(config.seed, config.hidden, config.layers).to(device)
    net, grads = _wrap(model, config, device)
    optimizer = torch.optim.SGD(net.parameters(), lr=config.lr)
    teacher = make_teacher()
    result = TrainResult(model=model, losses=[], mean_losses=[], allreduce=None)
    for step in range(config.steps):
        x, y = make_batch(teacher, config.seed, rank, step, config.batch_size)
        loss, seconds = _step(net, optimizer, grads, x.to(device), y.to(device))
        result.step_seconds.append(seconds)
        if config.backend == torch_xdev.BACKEND_NAME:
            # Read now, before the loss allreduce below replaces it.
            result.allreduce = torch_xdev.describe()["last_allreduce"]
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # SUM, then divide: Gloo has no AVG
        mean /= world_size
        result.losses.append(loss.item())
        result.mean_losses.append(mean.item())
        say(f"step {step:>2}  loss {result.mean_losses[-1]:.6f}")
    if result.mean_losses:
        say(f"final loss {result.mean_losses[-1]:.6f} (first {result.mean_losses[0]:.6f})")
    if result.allreduce is not None:
        say(f"xdev gradient allreduce: {result.allreduce[0]} ({result.allreduce[1]})")
    elif config.backend != torch_xdev.BACKEND_NAME:
        say(f"gradient allreduce: backend {config.backend} (torch_xdev.describe() is for xdev)")
    if config.comm_share_steps > 0:
        result.comm_step_seconds, result.no_comm_step_seconds = _time_communication(
            config, device, rank, teacher
        )
    _report_speed(result, config, device, say)
    return result


# Steps before timing: DDP fills one bucket in the first backward, which records the order
# gradients come in, and rebuilds its buckets in that order in the second forward.
WARMUP_STEPS = 2


def _time_communication(
    config: TrainConfig,
    device: torch.device,
    rank: int,
    teacher: tuple[torch.Tensor, torch.Tensor],
) -> tuple[list[float], list[float]]:
    """This rank's step times with and without gradient communication, taken alternately.

    Two fresh models (the trained one is left alone), one wrapped as in training and one
    without communication, step on the training's first batches; after WARMUP_STEPS each,
    ``comm_share_steps`` steps of each are timed, one of each in turn.
    """
    runs = []
    for communicate in (True, False):
        model = make_model(config.seed, config.hidden, config.layers).to(device)
        net, grads = _wrap(model, config, device, communicate=communicate)
        runs.append((net, torch.optim.SGD(net.parameters(), lr=config.lr), grads))
    seconds: tuple[list[float], list[float]] = ([], [])
    for step in range(WARMUP_STEPS + config.comm_share_steps):
        x, y = make_batch(teacher, config.seed, rank, step, config.batch_size)
        x, y = x.to(device), y.to(device)
        for (net, optimizer, grads), times in zip(runs, seconds):
            _, elapsed = _step(net, optimizer, grads, x, y)
            if step >= WARMUP_STEPS:
                times.append(elapsed)
    return seconds


def _slowest_rank(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds`` (collective over the default group)."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _report_speed(
    result: TrainResult, config: TrainConfig, device: torch.device, say: Callable[[str], None]
) -> None:
    """Says steps per second and the communication share of a step (collective)."""
    timed = result.step_seconds[WARMUP_STEPS:]
    if timed:
        step = _slowest_rank(statistics.median(timed), device)
        gradients_mb = sum(p.numel() * p.element_size() for p in result.model.parameters()) / 1e6
        say(
            f"speed: {1 / step:.1f} steps/s (median training step {step * 1e3:.2f} ms over steps"
            f" {WARMUP_STEPS}-{len(result.step_seconds) - 1}, slowest rank; {gradients_mb:.3g} MB"
            " of gradients per step)"
        )
    if result.comm_step_seconds:
        with_comm = _slowest_rank(statistics.median(result.comm_step_seconds), device)
        without = _slowest_rank(statistics.median(result.no_comm_step_seconds), device)
        what = "without the all_reduce" if config.shared_grads else "with a no-op DDP comm hook"
        say(
            f"communication: {100 * (1 - without / with_comm):.0f}% of a step on {config.backend}"
            f" (median step {with_comm * 1e3:.2f} ms; {without * 1e3:.2f} ms {what}; extra"
            f" phase, {len(result.comm_step_seconds)} steps each, alternately, slowest rank)"
        )


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="xdev", help="xdev (default) or gloo")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--algorithm",
        choices=torch_xdev.ALGORITHMS,
        default="auto",
        help="xdev allreduce algorithm (ignored by other backends)",
    )
    parser.add_argument("--find-unused-parameters", action="store_true")
    parser.add_argument("--gradient-as-bucket-view", action="store_true")
    parser.add_argument(
        "--shared-grads",
        action="store_true",
        help="no DDP: gradients in one torch_xdev.shared_empty buffer, allreduced in place",
    )
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="width of the hidden layers")
    parser.add_argument("--layers", type=int, default=HIDDEN_LAYERS, help="hidden layers")
    parser.add_argument(
        "--comm-share-steps",
        type=int,
        default=5,
        help="after training, time this many steps with and without gradient communication,"
        " alternately, to measure its share of a step (0: skip)",
    )
    parser.add_argument("--save", metavar="PATH", help="rank 0 saves the final state_dict here")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(
            "run this under torchrun, e.g. torchrun --nproc_per_node 4 examples/ddp_train.py",
            file=sys.stderr,
        )
        return 2
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = TrainConfig(
        backend=args.backend,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        device=args.device,
        algorithm=args.algorithm,
        find_unused_parameters=args.find_unused_parameters,
        gradient_as_bucket_view=args.gradient_as_bucket_view,
        shared_grads=args.shared_grads,
        hidden=args.hidden,
        layers=args.layers,
        comm_share_steps=args.comm_share_steps,
    )
    if rank == 0:
        print(
            f"training on {world_size} rank(s), backend {config.backend}, device "
            f"{config.device}, {config.steps} steps of {config.batch_size} samples per rank, "
            f"{config.layers} hidden layer(s) of {config.hidden}",
            flush=True,
        )
    result = train(config, rank=rank, world_size=world_size, log=lambda s: print(s, flush=True))
    if args.save and rank == 0:
        torch.save(result.model.state_dict(), args.save)
        print(f"saved the final state_dict to {args.save}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
