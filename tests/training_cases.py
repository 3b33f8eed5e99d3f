"""Small models and training loops that the multi-rank training tests share."""

from __future__ import annotations

from typing import Any

import torch


def sharded_mlp(
    width: int, layers: int, world: int, device: torch.device, mesh: Any = None
) -> torch.nn.Module:
    """``layers`` Linear(width, width) on ``device`` (seeded: the same on every rank), each
    sharded by FSDP2 over ``mesh`` (default: all ``world`` ranks of the default group), then
    the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model = model.to(device)
    if mesh is None:
        mesh = init_device_mesh(device.type, (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sgd_losses(model: Any, x: torch.Tensor, lr: float, steps: int) -> list[float]:
    """The loss of each of ``steps`` SGD steps minimising the mean square of model(x)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses
