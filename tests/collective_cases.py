"""Inputs and independent references for allreduce correctness tests.

Every rank can build every rank's input from (case seed, rank), so each rank
computes the expected result locally, in float64 (or int64, wrapping like the
target dtype), without any collective.
"""

from __future__ import annotations

import ctypes
import hashlib

import torch
import torch.distributed as dist

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int8, torch.uint8, torch.int32, torch.int64)
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES
OPS = (
    dist.ReduceOp.SUM,
    dist.ReduceOp.AVG,
    dist.ReduceOp.MIN,
    dist.ReduceOp.MAX,
    dist.ReduceOp.PRODUCT,
)


def make_input(
    seed: int, rank: int, numel: int, dtype: torch.dtype, op: dist.ReduceOp.RedOpType
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        x = torch.randn(numel, generator=g, dtype=torch.float64)
        if op == dist.ReduceOp.PRODUCT:
            x = 1.0 + 0.1 * x  # keeps products of 8 factors well inside fp16 range
        return x.to(dtype)
    low, high = (0, 4) if dtype == torch.uint8 else (-3, 4)
    return torch.randint(low, high, (numel,), generator=g, dtype=torch.int64).to(dtype)


def reference(inputs: list[torch.Tensor], op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    dtype = inputs[0].dtype
    if dtype.is_floating_point:
        stack = torch.stack([t.to(torch.float64) for t in inputs])
        if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            out = stack.sum(0)
            if op == dist.ReduceOp.AVG:
                out = out / len(inputs)
        elif op == dist.ReduceOp.PRODUCT:
            out = stack.prod(0)
        elif op == dist.ReduceOp.MIN:
            out = stack.min(0).values
        else:
            out = stack.max(0).values
        return out
    # Integers: exact in int64, then wrap to the dtype as the kernels do.
    stack = torch.stack([t.to(torch.int64) for t in inputs])
    if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        out = stack.sum(0).to(dtype)
        if op == dist.ReduceOp.AVG:
            out = torch.div(out.to(torch.int64), len(inputs), rounding_mode="trunc").to(dtype)
        return out
    if op == dist.ReduceOp.PRODUCT:
        return stack.prod(0).to(dtype)
    if op == dist.ReduceOp.MIN:
        return stack.min(0).values.to(dtype)
    return stack.max(0).values.to(dtype)


def check_close(
    result: torch.Tensor, expected: torch.Tensor, op: dist.ReduceOp.RedOpType, world: int, what: str
) -> None:
    """Exact for integers and MIN/MAX; rounding-aware tolerances for float sums/products."""
    if not result.dtype.is_floating_point or op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX):
        assert torch.equal(result, expected.to(result.dtype)), f"{what}: not exact"
        return
    # A few roundings of the result dtype per element (one per tree level).
    eps = {
        torch.float32: 1.2e-7,
        torch.float64: 2.3e-16,
        torch.float16: 9.8e-4,
        torch.bfloat16: 7.9e-3,
    }
    e = eps[result.dtype]
    got = result.to(torch.float64)
    scale = expected.abs() + 1.0
    err = (got - expected).abs() / scale
    bound = 4 * e * world
    assert bool(
        torch.all(err <= bound)
    ), f"{what}: max rel err {float(err.max()):.3g} > {bound:.3g}"


def digest(t: torch.Tensor) -> int:
    """A hash of a tensor's bytes (CPU or CUDA), to compare results bitwise across ranks."""
    c = t.detach().cpu().contiguous()
    # Raw bytes without numpy (not a torch dependency).
    raw = ctypes.string_at(c.data_ptr(), c.numel() * c.element_size()) if c.numel() else b""
    return int.from_bytes(hashlib.sha1(raw).digest()[:7], "little")


def assert_same_digests(digests: list[int], world: int) -> None:
    """Every rank holds the same digests as rank 0 (gathered over the default group)."""
    mine = torch.tensor(digests, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    for r in range(world):
        assert torch.equal(everyone[r], everyone[0]), f"rank {r} holds different bits than rank 0"


def check_coalesced(
    group: object, rank: int, world: int, shapes: list[tuple[int, ...]], seed: int, what: str
) -> list[int]:
    """allreduce_coalesced of one float32 tensor per shape (packing across tensors, empty ones
    included) against the reference; returns the results' digests."""
    inputs = [
        [
            make_input(
                seed + i, r, int(torch.Size(s).numel()), torch.float32, dist.ReduceOp.SUM
            ).view(s)
            for i, s in enumerate(shapes)
        ]
        for r in range(world)
    ]
    mine = [t.clone() for t in inputs[rank]]
    dist.all_reduce_coalesced(mine, group=group)
    for i in range(len(shapes)):
        expected = reference([inputs[r][i].flatten() for r in range(world)], dist.ReduceOp.SUM)
        check_close(mine[i].flatten(), expected, dist.ReduceOp.SUM, world, f"{what} coalesced #{i}")
    return [digest(t) for t in mine]
