"""The models and data of tests/ddp_shared_bucket_cases.py: an MLP with a head some ranks skip,
a channels-last ConvNet with a transposed parameter, and per-rank batches that are the same on
every run."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import ddp_train  # noqa: E402  (examples/ is not a package)

SEED = 11
BATCH = 16


class BranchNet(nn.Module):
    """The MLP plus a head that only some ranks use on some steps (find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = ddp_train.make_model(SEED)
        self.extra = nn.Linear(ddp_train.OUT_FEATURES, ddp_train.OUT_FEATURES)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        y = self.trunk(x)
        return y + self.extra(y) if use_extra else y


class ConvNet(nn.Module):
    """Channels-last convolutions and a head stored transposed (a non-contiguous parameter)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Parameter(0.3 * torch.randn(ddp_train.OUT_FEATURES, 8).t())
        self.bias = nn.Parameter(torch.zeros(ddp_train.OUT_FEATURES))
        # Module.to takes memory_format (documented); torch's stubs lack that overload.
        self.to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return h.mean(dim=(2, 3)) @ self.head + self.bias


Batch = tuple[torch.Tensor, torch.Tensor]  # inputs, targets
TEACHER = ddp_train.make_teacher()
# The images' targets: a fixed linear map of each image's mean colour.
IMAGE_TEACHER = torch.randn(3, ddp_train.OUT_FEATURES, generator=torch.Generator().manual_seed(5))


def mlp_batch(rank: int, step: int) -> Batch:
    """The batch of `rank` at `step`: different per rank and step, the same on every run."""
    return ddp_train.make_batch(TEACHER, SEED, rank, step, BATCH)


def image_batch(rank: int, step: int) -> Batch:
    """Channels-last 6x6 RGB images, different per rank and step, the same on every run."""
    gen = torch.Generator().manual_seed((SEED * 1000 + rank) * 7919 + step)
    x = torch.randn(BATCH, 3, 6, 6, generator=gen)
    return x.contiguous(memory_format=torch.channels_last), x.mean(dim=(2, 3)) @ IMAGE_TEACHER


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).sum(dim=1).mean()


def flat_params(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).tolist()
