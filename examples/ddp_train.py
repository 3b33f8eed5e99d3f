"""Data-parallel training of a small MLP with DistributedDataParallel on the xdev backend.

Run it as a user would::

    torchrun --nproc_per_node 4 examples/ddp_train.py
    torchrun --nproc_per_node 4 examples/ddp_train.py --backend gloo   # for comparison
    torchrun --nproc_per_node 4 examples/ddp_train.py --shared-grads   # no DDP, see below
    torchrun --nproc_per_node 2 examples/ddp_train.py --hidden 2048 --depth 4 --steps 10

The last trains a 17M-parameter model, big enough that the gradient allreduce shows: rank 0
prints steps per second and the share of the step that communication takes (the step against
the same DDP step with a no-op comm hook, timed after training). On xdev DDP's buckets live in
memory every rank maps (see the README, "DDP's buckets in shared memory", and docs/ddp_fsdp.md).

``--shared-grads`` trains the same model without the DDP wrapper: every parameter's
``.grad`` is a view into one ``torch_xdev.shared_empty`` buffer, which every rank maps, so
``backward()`` accumulates the gradients straight into it and one ``all_reduce`` of the
buffer averages them in place, with nothing staged (the contiguous gradient buffer of
Megatron-style data parallelism). DDP's own buckets are ordinary tensors.

Every rank draws its own batches of synthetic data (deterministically, from the seed, its rank
and the step), so the run is reproducible while the ranks really do see different data; the
targets come from a fixed random linear "teacher", so the loss falls. Rank 0 prints the loss of
every step (averaged over the ranks), the final loss and the allreduce algorithm xdev chose.

``train()`` is importable, so tests can run the same training without torchrun.
"""

from __future__ import annotations

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
OUT_FEATURES = 10
BACKENDS = (torch_xdev.BACKEND_NAME, "gloo", "nccl")  # nccl: with --device cuda
# The teacher does not depend on --seed: the task stays the same, only the student's
# initialisation and the data stream change with the seed.
TEACHER_SEED = 20240607


@dataclasses.dataclass
class TrainConfig:
    """What to train and how; the defaults are those of the command line, except
    ``comm_share_steps``: a program calling ``train()`` skips the timing unless it asks."""

    backend: str = "xdev"
    steps: int = 20
    batch_size: int = 32
    lr: float = 0.1
    seed: int = 0
    device: str = "cpu"
    algorithm: str = "auto"
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    avg_hook: bool = False  # DDP with torch_xdev.avg_comm_hook (AVG in the allreduce)
    shared_grads: bool = False  # no DDP: gradients in one shared_empty buffer (xdev, CPU)
    hidden: int = HIDDEN
    depth: int = 1
    comm_share_steps: int = 0  # >0: time this many steps without communication at the end
    timeout: Optional[timedelta] = None  # of the process group; None: torch's default

    def problem(self) -> Optional[str]:
        """What makes this configuration unrunnable, or None: checked before any process
        group exists, so that a bad command line fails once, with one line."""
        for name in ("steps", "batch_size", "hidden"):
            if getattr(self, name) < 1:
                return f"{name} must be >= 1; got {getattr(self, name)}"
        if self.depth < 0 or self.comm_share_steps < 0:
            return "depth and comm_share_steps must be >= 0"
        if self.backend not in BACKENDS:
            return f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}"
        if self.device not in ("cpu", "cuda"):
            return f"device must be 'cpu' or 'cuda'; got {self.device!r}"
        if self.device == "cuda" and not torch.cuda.is_available():
            return "device 'cuda' was asked for, but CUDA is not available"
        if self.backend == "nccl" and self.device != "cuda":
            return "backend 'nccl' needs device 'cuda'"
        if self.shared_grads and (self.backend != torch_xdev.BACKEND_NAME or self.device != "cpu"):
            return (
                "shared_grads needs backend 'xdev' and device 'cpu' (torch_xdev.shared_empty"
                f" makes CPU tensors of an xdev group); got backend {self.backend!r}, device"
                f" {self.device!r}"
            )
        if self.avg_hook and (self.shared_grads or self.backend == "gloo"):
            return (
                "avg_hook registers a DDP comm hook that allreduces with ReduceOp.AVG: it needs"
                " DDP (not shared_grads) and a backend with AVG (xdev, nccl; Gloo has none)"
            )
        return None


@dataclasses.dataclass
class TrainResult:
    """What ``train()`` hands back on every rank."""

    model: nn.Module  # the trained module itself, not its DDP wrapper
    losses: list[float]  # per step: this rank's loss before the update
    mean_losses: list[float]  # per step: the loss averaged over all ranks
    allreduce: Optional[tuple[str, str]]  # xdev's (algorithm, reason) for the gradients


def make_model(seed: int, hidden: int = HIDDEN, depth: int = 1) -> nn.Sequential:
    """The student: 32 -> hidden (-> hidden, ``depth`` times) -> 10 with ReLU; identical on
    every rank for one seed. The default is small; ``--hidden 2048 --depth 4`` (17M parameters)
    is a model whose gradient allreduce shows next to its computation."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(IN_FEATURES, hidden), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    layers.append(nn.Linear(hidden, OUT_FEATURES))
    return nn.Sequential(*layers)


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
    """``cpu``, or ``cuda`` meaning this process's GPU (``LOCAL_RANK``); TrainConfig.problem
    has refused other names, and ``cuda`` without a GPU."""
    if name == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


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
    problem = config.problem()
    if problem is not None:
        raise ValueError(problem)
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


def _train_loop(
    config: TrainConfig,
    device: torch.device,
    rank: int,
    world_size: int,
    say: Callable[[str], None],
) -> TrainResult:
    model = make_model(config.seed, config.hidden, config.depth).to(device)
    grads: Optional[torch.Tensor] = None
    net: nn.Module
    if config.shared_grads:
        grads = attach_shared_grads(model)
        net = model
    else:
        net = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=config.find_unused_parameters,
            gradient_as_bucket_view=config.gradient_as_bucket_view,
        )
        if config.avg_hook:
            net.register_comm_hook(None, torch_xdev.avg_comm_hook)
    optimizer = torch.optim.SGD(net.parameters(), lr=config.lr)
    teacher = make_teacher()
    losses: list[float] = []
    mean_losses: list[float] = []
    allreduce: Optional[tuple[str, str]] = None
    heap: Optional[dict[str, int]] = None
    step_seconds: list[float] = []
    for step in range(config.steps):
        started = time.perf_counter()
        x, y = make_batch(teacher, config.seed, rank, step, config.batch_size)
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=grads is None)
        # Squared error summed over the outputs, averaged over the batch (nn.MSELoss would also
        # average over the 10 outputs, and learn 10x slower at the same lr).
        loss = (net(x) - y).pow(2).sum(dim=1).mean()
        loss.backward()  # with DDP, its gradient allreduce runs (and is waited for) in here
        if grads is not None:
            dist.all_reduce(grads, op=dist.ReduceOp.AVG)  # in place: nothing staged
        optimizer.step()
        step_seconds.append(time.perf_counter() - started)
        if config.backend == torch_xdev.BACKEND_NAME and step == config.steps - 1:
            # Read now, before the loss allreduce below replaces it.
            info = torch_xdev.describe()
            allreduce = info["last_allreduce"]
            heap = info["symmetric_heap"]
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # SUM, then divide: Gloo has no AVG
        mean /= world_size
        losses.append(loss.item())
        mean_losses.append(mean.item())
        say(f"step {step:>2}  loss {mean_losses[-1]:.6f}")
    if mean_losses:
        say(f"final loss {mean_losses[-1]:.6f} (first {mean_losses[0]:.6f})")
    if len(step_seconds) > 1:
        step_s = statistics.median(step_seconds[1:])  # the first step builds DDP's buckets
        say(f"throughput: {1 / step_s:.1f} steps/s (median step {1e3 * step_s:.1f} ms)")
        if config.comm_share_steps > 0 and not config.shared_grads:
            quiet_s = _step_without_communication(config, device, rank, x, y)
            against = f"{1e3 * quiet_s:.1f} ms for the same DDP step with a no-op comm hook"
            if quiet_s < step_s:
                share = (step_s - quiet_s) / step_s
                say(
                    f"communication: {100 * share:.0f}% of the step ({1e3 * step_s:.1f} ms, "
                    f"against {against})"
                )
            else:
                # Noise larger than what communication adds: no share to report, and "0%"
                # would claim one.
                say(
                    f"communication: too small to measure ({1e3 * step_s:.1f} ms a step, not more "
                    f"than {against}; try more --comm-share-steps or a larger --hidden)"
                )
    if allreduce is not None:
        # With find_unused_parameters, DDP's last allreduce of a step is its map of the
        # parameters used, after the gradient buckets.
        what = "DDP's map of used parameters" if config.find_unused_parameters else "gradient"
        say(f"xdev {what} allreduce: {allreduce[0]} ({allreduce[1]})")
    if heap is not None and heap["in_place_collectives"] + heap["staged_collectives"] > 0:
        # What DDP's buckets in the group's symmetric heap did (see the README).
        say(
            f"xdev symmetric heap: {heap['in_place_collectives']} collective(s) ran in place, "
            f"{heap['staged_collectives']} staged"
        )
    elif config.backend != torch_xdev.BACKEND_NAME:
        say(f"gradient allreduce: backend {config.backend} (torch_xdev.describe() is for xdev)")
    return TrainResult(model=model, losses=losses, mean_losses=mean_losses, allreduce=allreduce)


# Unannotated: DDP compares a hook's annotations with dist.GradBucket and Future[Tensor]
# themselves, and this module's annotations are postponed (strings).
def _no_communication(state, bucket):  # type: ignore[no-untyped-def]
    future = torch.futures.Future()  # type: ignore[var-annotated]
    future.set_result(bucket.buffer())
    return future


def _step_without_communication(
    config: TrainConfig, device: torch.device, rank: int, x: torch.Tensor, y: torch.Tensor
) -> float:
    """The median step time of the same model under DDP whose comm hook does nothing.

    A copy of the model, so the trained one is untouched; the step minus this is what the
    gradient allreduce costs (DDP overlaps it with backward, so this is what it adds).
    """
    model = make_model(config.seed, config.hidden, config.depth).to(device)
    net = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
    )
    net.register_comm_hook(None, _no_communication)
    optimizer = torch.optim.SGD(net.parameters(), lr=config.lr)
    seconds = []
    for _ in range(config.comm_share_steps + 1):
        dist.barrier()  # start together, as the training steps did
        started = time.perf_counter()
        optimizer.zero_grad()
        (net(x) - y).pow(2).sum(dim=1).mean().backward()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=BACKENDS, default="xdev")
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
        "--avg-hook",
        action="store_true",
        help="register torch_xdev.avg_comm_hook: the average folded into the allreduce",
    )
    parser.add_argument(
        "--shared-grads",
        action="store_true",
        help="no DDP: gradients in one torch_xdev.shared_empty buffer, allreduced in place",
    )
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="hidden layer width")
    parser.add_argument("--depth", type=int, default=1, help="hidden-to-hidden layers")
    parser.add_argument(
        "--comm-share-steps",
        type=int,
        default=5,
        help="steps of the same DDP model with a no-op comm hook, timed after training to "
        "report the communication share (0: skip; not with --shared-grads, which trains "
        "without DDP)",
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
        avg_hook=args.avg_hook,
        shared_grads=args.shared_grads,
        hidden=args.hidden,
        depth=args.depth,
        comm_share_steps=args.comm_share_steps,
    )
    problem = config.problem()
    if problem is not None:  # every rank says it in one line, before any group exists
        print(f"ddp_train.py: error: {problem}", file=sys.stderr)
        return 2
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        print(
            f"training on {world_size} rank(s), backend {config.backend}, device "
            f"{config.device}, {config.steps} steps of {config.batch_size} samples per rank",
            flush=True,
        )
    result = train(config, rank=rank, world_size=world_size, log=lambda s: print(s, flush=True))
    if args.save and rank == 0:
        torch.save(result.model.state_dict(), args.save)
        print(f"saved the final state_dict to {args.save}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
