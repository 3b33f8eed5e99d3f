"""The CUDA path on real GPUs: the native allreduce's correctness grid and the DGX-1 plan.

- ``test_cuda_allreduce_grid``: 2, 4 and 8 ranks x algorithm (auto and every forced native
  plan) x 8 dtypes x 5 ops x sizes (0, 1, 7, 1021, ~2.5 staging slots) x packing variants,
  with ``cuda_slot_bytes=4096`` so that payloads run in several windows. Each result is
  compared with an independent float64/int64 reference (collective_cases), with the xdev
  CPU path running the same plan on the same inputs (bit for bit: the kernels promise the
  CPU kernels' bits), and across ranks (checksums gathered over a CPU Gloo group).
  ``describe()["last_allreduce"]`` must name the native plan, never "fallback".
- ``test_dgx1_topology_runs_hierarchical_copy``: 8 ranks with the DGX-1 NVLink matrix
  injected (XDEV_TOPO_FILE): class "dgx1", auto runs hierarchical_copy, results correct;
  with one NVLink removed the class is "partial", auto falls back (correctly) and a forced
  plan is still honoured.

Stream semantics, layouts, delegation and bad input are in test_cuda_semantics.py, DDP in
test_cuda_ddp.py; rank placement and the skip rule in cuda_ranks.py. Ranks that share one GPU
are time-sliced by the driver, so every GPU barrier costs about one time slice per rank: the
grid keeps to a few hundred allreduces per process.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

import cuda_ranks
import torch_xdev
from collective_cases import ALL_DTYPES, OPS, check_close, digest, make_input, reference
from cuda_ranks import (
    GROUP_TIMEOUT,
    NATIVE,
    SLOT,
    XDEV_TIMEOUT_S,
    assert_ran,
    assert_same_on_all_ranks,
    close_group,
    first_cuda_collective,
    last_allreduce,
    run_or_skip,
    setup_rank,
)
from topologies import DGX1_V100

cuda_ranks.skip_module_without_cuda()

BIG = -1  # a size marker: about 2.5 slots of the dtype, so three windows
SIZES = (0, 1, 7, 1021, BIG)
SIZES_8_RANKS = (0, 1, 1021, BIG)
HIERARCHICAL = ("hierarchical_copy", "hierarchical_balanced")


def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(size: int, dtype: torch.dtype) -> int:
    return (5 * SLOT // 2) // _elem_size(dtype) + 3 if size == BIG else size


def _expected_auto(info: dict[str, Any], world: int) -> str:
    if info["gpu_time_sliced"]:  # ranks share the GPU without MPS: auto leaves it to Gloo
        return "fallback"
    cls = info["topology_class"]
    if cls == "dgx1" and world == 8:
        return "hierarchical_copy"
    if cls == "fully_connected":
        return "reduce_to_one"
    raise AssertionError(f"auto has no native plan on topology {cls!r}: {info}")


def _info_line(result: dict[str, Any]) -> str:
    cuda = result.get("cuda") or {}
    keys = ("topology_class", "ranks_share_gpu", "transport_note", "fallback_backend")
    return ", ".join(f"{k}={cuda.get(k)}" for k in keys)


# ---------------------------------------------------------------------------------------
# a. The correctness grid


def _variants(algorithm: str, world: int) -> list[tuple[dict[str, Any], str]]:
    """(Options fields, which cases) per process group. Cases: "full" (every dtype x op x
    size), "rotating" (every dtype x op at one size, rotating, so each size still meets
    every dtype and every op) or "coalesced" (only the allreduce_coalesced list: small-tensor
    aggregation changes nothing for a single tensor)."""
    base: dict[str, Any] = {
        "algorithm": algorithm,
        "cuda_slot_bytes": SLOT,
        "shm_slot_bytes": SLOT,  # the CPU cross-check runs the very same windows
        "timeout": XDEV_TIMEOUT_S,
    }
    wide = {"cuda_slot_bytes": 1 << 16, "shm_slot_bytes": 1 << 16}
    if algorithm in HIERARCHICAL:
        return [
            (base, "full"),  # num_packs = world size
            ({**base, "num_packs": 3 * world + 1}, "rotating"),  # more packs than ranks, uneven
            ({**base, "bytes_per_pack": 1024, **wide}, "rotating"),  # packs by size, one window
            (
                {
                    **base,
                    "num_packs": 0,
                    "agg_small_grads_max_bytes": 64,
                    "agg_small_grads_max_group": 3,
                },
                "coalesced",
            ),
        ]
    if algorithm == "reduce_to_one":
        return [(base, "full"), ({**base, "reduce_to_rank": world - 1}, "rotating")]
    if algorithm == "auto":
        return [(base, "full")]
    return [(base, "full"), ({**base, **wide}, "rotating")]


def _cases(
    variant_index: int, which: str, sizes: tuple[int, ...]
) -> Iterator[tuple[torch.dtype, dist.ReduceOp.RedOpType, int]]:
    if which == "coalesced":
        return
    for d, dtype in enumerate(ALL_DTYPES):
        for o, op in enumerate(OPS):
            chosen = sizes if which == "full" else (sizes[(d + o + variant_index) % len(sizes)],)
            for size in chosen:
                yield dtype, op, _numel(size, dtype)


def _grid(rank: int, world: int, algorithm: str, sizes: tuple[int, ...]) -> dict[str, Any]:
    device = setup_rank(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    started = time.monotonic()
    digests: list[int] = []
    labels: list[str] = []
    cases = 0
    info: dict[str, Any] = {}
    for v, (variant, which) in enumerate(_variants(algorithm, world)):
        group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(**variant))
        info = first_cuda_collective(device, group)
        if not info["transport"]:
            dist.destroy_process_group(group)
            dist.destroy_process_group()
            return {"skip": f"no CUDA transport: {info['transport_note']}", "cuda": info}
        expected = algorithm if algorithm != "auto" else _expected_auto(info, world)
        # The CPU path of the same group runs the same plan (forced algorithms only: auto
        # picks CPU plans by a cost model), and the CUDA kernels promise the CPU's bits.
        cross_check = algorithm != "auto"
        for dtype, op, numel in _cases(v, which, sizes):
            seed = zlib.crc32(f"{world} {algorithm} {v} {dtype} {op} {numel}".encode())
            inputs = [make_input(seed, r, numel, dtype, op) for r in range(world)]
            what = f"{world} ranks {variant} {dtype} {op} n={numel}"
            got = inputs[rank].to(device, copy=True)
            dist.all_reduce(got, op=op, group=group)
            assert_ran(group, expected, what)
            result = got.cpu()
            check_close(result, reference(inputs, op), op, world, what)
            if cross_check:
                on_cpu = inputs[rank].clone()
                dist.all_reduce(on_cpu, op=op, group=group)
                assert torch.equal(result, on_cpu), (
                    f"{what}: the CUDA result differs from the CPU path's result of the same "
                    f"plan in {int((result != on_cpu).sum())} of {numel} elements"
                )
            digests.append(digest(result))
            labels.append(what)
            cases += 1
        # A list through allreduce_coalesced: packing across tensors, one flat buffer.
        shapes = [(5,), (0,), (1,), (3, 7), (300,), (17,), (2000,)]
        lists = [
            [
                make_input(7000 + i, r, int(torch.Size(s).numel()), torch.float32, OPS[0]).view(s)
                for i, s in enumerate(shapes)
            ]
            for r in range(world)
        ]
        mine = [t.to(device, copy=True) for t in lists[rank]]
        dist.all_reduce_coalesced(mine, group=group)
        assert_ran(group, expected, f"{variant} coalesced")
        for i in range(len(shapes)):
            want = reference([lists[r][i].flatten() for r in range(world)], OPS[0])
            what = f"{world} ranks {variant} coalesced #{i} {shapes[i]}"
            check_close(mine[i].cpu().flatten(), want, OPS[0], world, what)
            digests.append(digest(mine[i]))
            labels.append(what)
        close_group(group)
    assert_same_on_all_ranks(digests, labels, world)
    dist.destroy_process_group()
    return {"cases": cases, "cuda": info, "seconds": time.monotonic() - started}


# 8 ranks on one GPU are the slow ones (each GPU barrier waits for 8 time slices): "slow".
GRID = [
    pytest.param(w, a, id=f"{w}ranks-{a}", marks=[pytest.mark.slow] if w == 8 else [])
    for w in (2, 4, 8)
    for a in ("auto",) + NATIVE
]


@pytest.mark.parametrize("world,algorithm", GRID)
def test_cuda_allreduce_grid(world: int, algorithm: str) -> None:
    sizes = SIZES if world <= 4 else SIZES_8_RANKS
    results = run_or_skip(_grid, world, algorithm, sizes, timeout=600 if world <= 4 else 900)
    assert results[0]["cases"] > 0
    cases, seconds = results[0]["cases"], results[0]["seconds"]
    print(f"{world} ranks {algorithm}: {cases} cases in {seconds:.1f} s ({_info_line(results[0])})")


# ---------------------------------------------------------------------------------------
# b. DGX-1 injected: auto runs hierarchical copy


def _dgx1(rank: int, world: int, dgx1_file: str, partial_file: str) -> dict[str, Any]:
    device = setup_rank(rank, topo_file=dgx1_file)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    options = torch_xdev.Options(cuda_slot_bytes=SLOT, shm_slot_bytes=SLOT, timeout=XDEV_TIMEOUT_S)
    group = dist.new_group(backend="xdev", pg_options=options)
    info = first_cuda_collective(device, group)
    if not info["transport"]:
        dist.destroy_process_group(group)
        dist.destroy_process_group()
        return {"skip": f"no CUDA transport: {info['transport_note']}"}
    if info["gpu_time_sliced"]:
        close_group(group)
        dist.destroy_process_group()
        return {"skip": "the ranks share the GPU without CUDA MPS: auto leaves them to Gloo"}
    assert info["topology_class"] == "dgx1", info
    assert info["topology_source"] == f"XDEV_TOPO_FILE={dgx1_file}", info
    assert info["nvlink"] == DGX1_V100, info["nvlink"]
    for size, (algorithm, reason) in torch_xdev.describe(group)["cuda_allreduce_plan"].items():
        assert algorithm == "hierarchical_copy", (size, algorithm, reason)

    digests: list[int] = []
    labels: list[str] = []
    dtypes = (torch.float32, torch.bfloat16, torch.float64, torch.int32)
    ops = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX)
    for dtype in dtypes:
        for op in ops:
            for size in (1, 1021, BIG):
                numel = _numel(size, dtype)
                seed = zlib.crc32(f"dgx1 {dtype} {op} {numel}".encode())
                inputs = [make_input(seed, r, numel, dtype, op) for r in range(world)]
                what = f"dgx1 {dtype} {op} n={numel}"
                got = inputs[rank].to(device, copy=True)
                dist.all_reduce(got, op=op, group=group)
                algorithm, reason = last_allreduce(group)
                assert algorithm == "hierarchical_copy" and "DGX-1" in reason, (what, reason)
                check_close(got.cpu(), reference(inputs, op), op, world, what)
                digests.append(digest(got))
                labels.append(what)
    shapes = [(3,), (1000,), (0,), (40, 25), (1,), (4099,)]
    lists = [
        [
            make_input(90 + i, r, int(torch.Size(s).numel()), torch.float32, OPS[0]).view(s)
            for i, s in enumerate(shapes)
        ]
        for r in range(world)
    ]
    mine = [t.to(device, copy=True) for t in lists[rank]]
    dist.all_reduce_coalesced(mine, group=group)
    assert last_allreduce(group)[0] == "hierarchical_copy"
    for i in range(len(shapes)):
        want = reference([lists[r][i].flatten() for r in range(world)], OPS[0])
        check_close(mine[i].cpu().flatten(), want, OPS[0], world, f"dgx1 coalesced #{i}")
        digests.append(digest(mine[i]))
        labels.append(f"dgx1 coalesced #{i}")
    close_group(group)

    # One NVLink missing (0 <-> 4): not a DGX-1 any more, and without a 'reachable' matrix
    # the file says 0 and 4 cannot reach each other: auto falls back, correctly.
    os.environ["XDEV_TOPO_FILE"] = partial_file
    partial = dist.new_group(backend="xdev", pg_options=options)
    info = first_cuda_collective(device, partial)
    assert info["topology_class"] == "partial", info
    if info["ranks_share_gpu"]:
        assert info["fallback_backend"] == "gloo", info
    seed = 4242
    inputs = [make_input(seed, r, 1021, torch.float32, OPS[0]) for r in range(world)]
    got = inputs[rank].to(device, copy=True)
    dist.all_reduce(got, group=partial)
    assert last_allreduce(partial)[0] == "fallback", last_allreduce(partial)
    check_close(got.cpu(), reference(inputs, OPS[0]), OPS[0], world, "partial topology, auto")
    close_group(partial)
    # The transport is still on (the real GPUs reach each other): a forced plan is honoured.
    forced = dist.new_group(
        backend="xdev",
        pg_options=torch_xdev.Options(
            algorithm="hierarchical_copy", cuda_slot_bytes=SLOT, timeout=XDEV_TIMEOUT_S
        ),
    )
    first_cuda_collective(device, forced)
    got = inputs[rank].to(device, copy=True)
    dist.all_reduce(got, group=forced)
    assert last_allreduce(forced)[0] == "hierarchical_copy", last_allreduce(forced)
    check_close(got.cpu(), reference(inputs, OPS[0]), OPS[0], world, "partial topology, forced")
    close_group(forced)

    assert_same_on_all_ranks(digests, labels, world)
    dist.destroy_process_group()
    return {"cases": len(digests)}


@pytest.mark.slow
def test_dgx1_topology_runs_hierarchical_copy(tmp_path: Path) -> None:
    dgx1 = tmp_path / "dgx1.json"
    dgx1.write_text(json.dumps({"name": "dgx1-v100", "nvlink": DGX1_V100}))
    broken = [row[:] for row in DGX1_V100]
    broken[0][4] = broken[4][0] = 0
    partial = tmp_path / "dgx1-minus-link.json"
    partial.write_text(json.dumps({"name": "dgx1-minus-0-4", "nvlink": broken}))
    results = run_or_skip(_dgx1, 8, str(dgx1), str(partial), timeout=900)
    assert results[0]["cases"] > 0
