"""Where fp16/bf16 allreduce sums are rounded, per plan, on 4 ranks.

Every reduction step adds its sources in fp32, in the listed order, and rounds the
result to the tensor's dtype once. Plans whose totals come from one step (direct,
reduce_to_one, flat, the in-place shared_empty path, single copy) therefore equal the
sum of all ranks' inputs rounded once. The hierarchical plans add each group's (or
each partner pair's) partial sum, already rounded to the dtype, in a second step, so
they round once per level; the references below model both exactly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import torch_xdev
from harness import run_ranks

WORLD = 4
PACKS = 4
# Above single copy's 256 KiB threshold for 2-byte dtypes, and not a multiple of PACKS.
NUMEL = 3 * (1 << 16) + 5
DTYPES = (torch.bfloat16, torch.float16)

ONCE_ROUNDED: dict[str, dict[str, Any]] = {
    "auto": {"algorithm": "auto"},
    "direct": {"algorithm": "direct"},
    "reduce_to_one": {"algorithm": "reduce_to_one"},
    "flat": {"algorithm": "flat"},
    "flat, single copy": {"algorithm": "flat", "single_copy": True},
    "reduce_to_one, single copy": {"algorithm": "reduce_to_one", "single_copy": True},
}


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    out = []
    for r in range(WORLD):
        g = torch.Generator().manual_seed(7919 + r)
        out.append(torch.randn(NUMEL, generator=g, dtype=torch.float64).to(dtype))
    return out


def _fold(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """What one reduction step computes: an fp32 left fold, rounded once to dtype."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.view(torch.int16) == b.view(torch.int16)


def _rounding(rank: int, world: int) -> None:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    for dtype in DTYPES:
        x = _inputs(dtype)
        once = _fold(x, dtype)
        # Groups are ranks {0, 1} and {2, 3}; partners are r and r + 2. With two
        # operands per add, the order of each add does not change its bits, so
        # these are exact whichever rank leads a pack.
        group_first = _fold([_fold(x[0:2], dtype), _fold(x[2:4], dtype)], dtype)
        pair_first = _fold([_fold([x[0], x[2]], dtype), _fold([x[1], x[3]], dtype)], dtype)
        # The test can tell the plans apart only if the three references differ.
        assert not _same_bits(group_first, once).all()
        assert not _same_bits(pair_first, once).all()
        assert not _same_bits(group_first, pair_first).all()

        for name, options in ONCE_ROUNDED.items():
            group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(**options))
            got = x[rank].clone()
            dist.all_reduce(got, group=group)
            assert _same_bits(got, once).all(), f"{name} {dtype}: not the once-rounded sum"
            dist.destroy_process_group(group)

        for algorithm in ("auto", "flat"):
            group = dist.new_group(
                backend="xdev", pg_options=torch_xdev.Options(algorithm=algorithm)
            )
            shared = torch_xdev.shared_empty(NUMEL, dtype=dtype, group=group)
            shared.copy_(x[rank])
            dist.all_reduce(shared, group=group)
            assert "in place" in torch_xdev.describe(group)["last_allreduce"][1]
            assert _same_bits(shared, once).all(), f"shared_empty {algorithm} {dtype}"
            del shared
            dist.destroy_process_group(group)

        for single_copy in (False, True):
            group = dist.new_group(
                backend="xdev",
                pg_options=torch_xdev.Options(
                    algorithm="hierarchical_copy", num_packs=PACKS, single_copy=single_copy
                ),
            )
            got = x[rank].clone()
            dist.all_reduce(got, group=group)
            what = f"hierarchical_copy single_copy={single_copy} {dtype}"
            assert _same_bits(got, group_first).all(), f"{what}: not rounded per level"
            dist.destroy_process_group(group)

        # The balanced plan picks group-first or pair-first pack by pack.
        group = dist.new_group(
            backend="xdev",
            pg_options=torch_xdev.Options(algorithm="hierarchical_balanced", num_packs=PACKS),
        )
        got = x[rank].clone()
        dist.all_reduce(got, group=group)
        size = NUMEL // PACKS  # the last pack takes the rest
        for p in range(PACKS):
            end = NUMEL if p == PACKS - 1 else (p + 1) * size
            part = slice(p * size, end)
            assert (
                _same_bits(got[part], group_first[part]).all()
                or _same_bits(got[part], pair_first[part]).all()
            ), f"hierarchical_balanced {dtype} pack {p}: neither per-level rounding"
        dist.destroy_process_group(group)
    dist.destroy_process_group()


def test_where_half_precision_sums_are_rounded() -> None:
    run_ranks(_rounding, WORLD)
