"""Inputs and independent references for allreduce correctness tests.

Every rank can build every rank's input from (case seed, rank), so each rank
computes the expected result locally, in float64 (or int64, wrapping like the
target dtype), without any collective.
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any

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


def check_lent_memory_overlaps(rank: int, world: int, group: Any, n: int) -> None:
    """reduce_scatter_tensor and all_gather_into_tensor where what a rank lends its peers (the
    inputs) shares memory with what it writes (the outputs) other than at its own block: in one
    call (a view straddling two blocks) and across the entries of a coalesced call. Peers read
    the lent bytes while the rank writes, so it must lend a copy or write elsewhere first.
    Integer-valued floats: every sum is exact, whatever the order."""

    def part(seed: int, r: int, numel: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 7919 + r)
        return torch.randint(-50, 50, (numel,), generator=g).to(torch.float32)

    mine = slice(rank * n, (rank + 1) * n)
    straddle = rank * n + n // 2 if rank < world - 1 else rank * n - n // 2
    parts = [part(1, r, n) for r in range(world)]
    out = torch.full((world * n,), -1.0)
    view = out[straddle : straddle + n]
    view.copy_(parts[rank])
    dist.all_gather_into_tensor(out, view, group=group)
    assert torch.equal(out, torch.cat(parts)), "all_gather from a view straddling two blocks"
    fulls = [part(2, r, world * n) for r in range(world)]
    full = fulls[rank].clone()
    dist.reduce_scatter_tensor(full[straddle : straddle + n], full, group=group)
    assert torch.equal(
        full[straddle : straddle + n], torch.stack(fulls).sum(0)[mine]
    ), "reduce_scatter"
    # Coalesced: entry 0's output is entry 1's input (its own block); entry 1's all-gather
    # input is a view of entry 0's output (another rank's block).
    ins0, ins1 = [part(3, r, world * n) for r in range(world)], [
        part(4, r, world * n) for r in range(world)
    ]
    a, b = ins0[rank].clone(), ins1[rank].clone()
    out1 = torch.zeros(n)
    with dist._coalescing_manager(group=group):
        dist.reduce_scatter_tensor(b[mine], a, group=group)
        dist.reduce_scatter_tensor(out1, b, group=group)
    assert torch.equal(b[mine], torch.stack(ins0).sum(0)[mine]), "coalesced reduce_scatter entry 0"
    assert torch.equal(out1, torch.stack(ins1).sum(0)[mine]), "coalesced reduce_scatter entry 1"
    p0, p1 = [part(5, r, n) for r in range(world)], [part(6, r, n) for r in range(world)]
    g0, g1 = torch.zeros(world * n), torch.zeros(world * n)
    other = ((rank + 1) % world) * n
    x1 = g0[other : other + n]
    x1.copy_(p1[rank])
    with dist._coalescing_manager(group=group):
        dist.all_gather_into_tensor(g0, p0[rank], group=group)
        dist.all_gather_into_tensor(g1, x1, group=group)
    assert torch.equal(g0, torch.cat(p0)), "coalesced all_gather entry 0"
    assert torch.equal(g1, torch.cat(p1)), "coalesced all_gather entry 1"
