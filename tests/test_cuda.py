"""The CUDA path on real GPUs: native allreduce, stream semantics, delegation, DDP.

Every test spawns real processes (tests/harness.py, 'spawn' start method), one per rank;
rank r uses GPU ``r % torch.cuda.device_count()``, so on a one-GPU machine every rank
shares that GPU, which CUDA IPC allows and NCCL does not.

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
- ``test_stream_semantics``: a kernel queued on the current stream just before the call is
  seen; Work.wait() makes the current (side) stream wait without blocking the host;
  several allreduces in flight; get_future() and then(); the caching allocator does not
  hand out an in-flight input.
- ``test_layouts_coalesced_mixed_dtypes``: non-contiguous views, a slice at a storage
  offset (neighbours untouched), channels-last, 0-dim, allreduce_coalesced, and one
  coalesced call mixing 8 dtypes (through ProcessGroup.allreduce_coalesced: the Python
  wrapper refuses mixed dtypes).
- ``test_delegated_collectives_share_gpu``: broadcast, all_gather, barrier and an op
  without a native kernel (BAND) on CUDA tensors; with ranks sharing a GPU the engine is
  Gloo, and describe() says so.
- ``test_bad_input``: tensors on two devices in one call, and mismatched calls across
  ranks, fail on every rank; the group stays usable.
- ``test_world_of_one``: one rank, CUDA tensors: every allreduce leaves the tensor as it is.
- ``test_ddp_*``: DDP on 4 ranks sharing the GPU, xdev against Gloo on CUDA tensors and
  Gloo on the CPU (examples/ddp_train.py).

The whole module skips, with the reason, where torch sees no GPU or torch_xdev was built
without its CUDA path. Ranks that share one GPU are time-sliced by the driver, so every
GPU barrier costs about one time slice per rank: the grid keeps to a few hundred
allreduces per process.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch
import torch.distributed as dist

import torch_xdev
from collective_cases import ALL_DTYPES, OPS, check_close, digest, make_input, reference
from topologies import DGX1_V100
from harness import run_ranks


def _why_skip() -> Optional[str]:
    missing = []
    if not torch.cuda.is_available():
        missing.append(
            f"torch {torch.__version__} sees no CUDA GPU (torch.version.cuda="
            f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
    if not getattr(torch_xdev._C, "built_with_cuda", False):
        missing.append(
            "torch_xdev._C was built without its CUDA path (built_with_cuda is False: "
            "build against a CUDA build of torch with a CUDA toolkit present)"
        )
    return "; ".join(missing) if missing else None


_SKIP_REASON = _why_skip()
if _SKIP_REASON is not None:
    pytest.skip(f"CUDA tests need a GPU and a CUDA build: {_SKIP_REASON}", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
import ddp_train  # noqa: E402  (examples/ is not a package)

SLOT = 4096  # cuda_slot_bytes (and shm_slot_bytes) of the grids: many windows, cheaply
BIG = -1  # a size marker: about 2.5 slots of the dtype, so three windows
SIZES = (0, 1, 7, 1021, BIG)
SIZES_8_RANKS = (0, 1, 1021, BIG)
HIERARCHICAL = ("hierarchical_copy", "hierarchical_balanced")
NATIVE = ("hierarchical_copy", "hierarchical_balanced", "reduce_to_one", "flat", "direct")
GROUP_TIMEOUT = timedelta(seconds=300)
XDEV_TIMEOUT_S = 120.0
# torch.cuda._sleep cycles: at least half a second on a GPU clocked at 2 GHz or less. Long
# enough that the host has long returned from an allreduce queued behind it.
SLEEP_CYCLES = 1_000_000_000


# ---------------------------------------------------------------------------------------
# Helpers run inside the ranks


def _setup(rank: int, topo_file: Optional[str] = None) -> torch.device:
    """This rank's GPU; no XDEV_* variable of the caller's shell may change what a test asks."""
    warnings.filterwarnings("ignore", message=".*all_reduce_coalesced", category=FutureWarning)
    for name in [k for k in os.environ if k.startswith("XDEV_")]:
        del os.environ[name]
    if topo_file is not None:
        os.environ["XDEV_TOPO_FILE"] = topo_file
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(size: int, dtype: torch.dtype) -> int:
    return (5 * SLOT // 2) // _elem_size(dtype) + 3 if size == BIG else size


def _assert_same_on_all_ranks(digests: list[int], labels: list[str], world: int) -> None:
    """Compares every result's checksum with rank 0's (over the default group, CPU tensors)."""
    mine = torch.tensor(digests, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    for r in range(world):
        if not torch.equal(everyone[r], everyone[0]):
            bad = (everyone[r] != everyone[0]).nonzero().flatten().tolist()
            raise AssertionError(
                f"rank {r} holds different bits than rank 0 in {len(bad)} result(s), e.g. "
                + "; ".join(labels[i] for i in bad[:5])
            )


def _first_cuda_collective(device: torch.device, group: Any = None) -> dict[str, Any]:
    """Runs the group's first CUDA allreduce (its GPU rendezvous); returns describe()['cuda']."""
    warm = torch.ones(3, device=device)
    dist.all_reduce(warm, group=group)
    world = dist.get_world_size(group)
    assert torch.equal(warm.cpu(), torch.full((3,), float(world))), warm
    info = dict(torch_xdev.describe(group)["cuda"])
    assert info["built"] and info["initialized"], info
    return info


def _last(group: Any = None) -> tuple[str, str]:
    last = torch_xdev.describe(group)["last_allreduce"]
    assert last is not None, "describe() reports no allreduce"
    return str(last[0]), str(last[1])


def _assert_native(group: Any = None, expected: Optional[str] = None, what: str = "") -> None:
    algorithm, reason = _last(group)
    if expected is not None:
        assert algorithm == expected, f"{what}: ran {algorithm} ({reason}), expected {expected}"
    assert algorithm in NATIVE, f"{what}: not native: {algorithm} ({reason})"


def _expected_auto(info: dict[str, Any], world: int) -> str:
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


def _close_group(group: Any) -> None:
    # Every rank's GPU work is done before any rank frees its IPC staging buffer.
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group(group)


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
) -> Iterator[tuple[torch.dtype, dist.ReduceOp, int]]:
    if which == "coalesced":
        return
    for d, dtype in enumerate(ALL_DTYPES):
        for o, op in enumerate(OPS):
            chosen = sizes if which == "full" else (sizes[(d + o + variant_index) % len(sizes)],)
            for size in chosen:
                yield dtype, op, _numel(size, dtype)


def _grid(rank: int, world: int, algorithm: str, sizes: tuple[int, ...]) -> dict[str, Any]:
    device = _setup(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    started = time.monotonic()
    digests: list[int] = []
    labels: list[str] = []
    cases = 0
    info: dict[str, Any] = {}
    for v, (variant, which) in enumerate(_variants(algorithm, world)):
        group = dist.new_group(backend="xdev", pg_options=torch_xdev.Options(**variant))
        info = _first_cuda_collective(device, group)
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
            _assert_native(group, expected, what)
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
        _assert_native(group, expected, f"{variant} coalesced")
        for i in range(len(shapes)):
            want = reference([lists[r][i].flatten() for r in range(world)], OPS[0])
            what = f"{world} ranks {variant} coalesced #{i} {shapes[i]}"
            check_close(mine[i].cpu().flatten(), want, OPS[0], world, what)
            digests.append(digest(mine[i]))
            labels.append(what)
        _close_group(group)
    _assert_same_on_all_ranks(digests, labels, world)
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
    results = run_ranks(_grid, world, algorithm, sizes, timeout=600 if world <= 4 else 900)
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])
    assert results[0]["cases"] > 0
    cases, seconds = results[0]["cases"], results[0]["seconds"]
    print(f"{world} ranks {algorithm}: {cases} cases in {seconds:.1f} s ({_info_line(results[0])})")


# ---------------------------------------------------------------------------------------
# b. DGX-1 injected: auto runs hierarchical copy


def _dgx1(rank: int, world: int, dgx1_file: str, partial_file: str) -> dict[str, Any]:
    device = _setup(rank, topo_file=dgx1_file)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    options = torch_xdev.Options(cuda_slot_bytes=SLOT, shm_slot_bytes=SLOT, timeout=XDEV_TIMEOUT_S)
    group = dist.new_group(backend="xdev", pg_options=options)
    info = _first_cuda_collective(device, group)
    if not info["transport"]:
        dist.destroy_process_group(group)
        dist.destroy_process_group()
        return {"skip": f"no CUDA transport: {info['transport_note']}"}
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
                algorithm, reason = _last(group)
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
    assert _last(group)[0] == "hierarchical_copy"
    for i in range(len(shapes)):
        want = reference([lists[r][i].flatten() for r in range(world)], OPS[0])
        check_close(mine[i].cpu().flatten(), want, OPS[0], world, f"dgx1 coalesced #{i}")
        digests.append(digest(mine[i]))
        labels.append(f"dgx1 coalesced #{i}")
    _close_group(group)

    # One NVLink missing (0 <-> 4): not a DGX-1 any more, and without a 'reachable' matrix
    # the file says 0 and 4 cannot reach each other: auto falls back, correctly.
    os.environ["XDEV_TOPO_FILE"] = partial_file
    partial = dist.new_group(backend="xdev", pg_options=options)
    info = _first_cuda_collective(device, partial)
    assert info["topology_class"] == "partial", info
    if info["ranks_share_gpu"]:
        assert info["fallback_backend"] == "gloo", info
    seed = 4242
    inputs = [make_input(seed, r, 1021, torch.float32, OPS[0]) for r in range(world)]
    got = inputs[rank].to(device, copy=True)
    dist.all_reduce(got, group=partial)
    assert _last(partial)[0] == "fallback", _last(partial)
    check_close(got.cpu(), reference(inputs, OPS[0]), OPS[0], world, "partial topology, auto")
    _close_group(partial)
    # The transport is still on (the real GPUs reach each other): a forced plan is honoured.
    forced = dist.new_group(
        backend="xdev",
        pg_options=torch_xdev.Options(
            algorithm="hierarchical_copy", cuda_slot_bytes=SLOT, timeout=XDEV_TIMEOUT_S
        ),
    )
    _first_cuda_collective(device, forced)
    got = inputs[rank].to(device, copy=True)
    dist.all_reduce(got, group=forced)
    assert _last(forced)[0] == "hierarchical_copy", _last(forced)
    check_close(got.cpu(), reference(inputs, OPS[0]), OPS[0], world, "partial topology, forced")
    _close_group(forced)

    _assert_same_on_all_ranks(digests, labels, world)
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
    results = run_ranks(_dgx1, 8, str(dgx1), str(partial), timeout=900)
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])
    assert results[0]["cases"] > 0


# ---------------------------------------------------------------------------------------
# c. Stream semantics


def _streams(rank: int, world: int) -> dict[str, Any]:
    device = _setup(rank)
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=XDEV_TIMEOUT_S)
    )
    info = _first_cuda_collective(device)
    if not info["transport"]:
        dist.destroy_process_group()
        return {"skip": f"no CUDA transport: {info['transport_note']}"}
    total = float(sum(range(1, world + 1)))
    n = 4 << 20  # 16 MiB of float32

    # 1. A kernel queued on the current stream just before the call (here: behind a sleep,
    #    so it surely runs late) must be seen: the internal stream waits for the current one.
    #    Once with the default stream current, once with another stream current.
    for current in (torch.cuda.current_stream(device), torch.cuda.Stream(device)):
        with torch.cuda.stream(current):
            t = torch.full((n,), float(rank + 1), device=device)
            torch.cuda._sleep(SLEEP_CYCLES)
            t.mul_(2)
            dist.all_reduce(t)
            _assert_native(what="producer on the current stream")
            wrong = int((t != 2 * total).sum())  # on the current stream, after wait()
            assert wrong == 0, f"{wrong} of {n} elements missed the mul_ before the allreduce"

    # 2. Work.wait() makes the *current* stream wait (here a side stream), not the host.
    side = torch.cuda.Stream(device)
    t = torch.full((n,), float(rank + 1), device=device)
    torch.cuda.synchronize(device)
    dist.barrier()  # the ranks start together
    torch.cuda._sleep(SLEEP_CYCLES)  # the collective starts after this
    work = dist.all_reduce(t, async_op=True)
    with torch.cuda.stream(side):
        work.wait()
        pending = not work.is_completed()
        out = t.clone()  # runs on the side stream, after the collective
    side.synchronize()
    assert pending, "Work.wait() blocked the host until the GPU work was done"
    assert torch.equal(out.cpu(), torch.full((n,), total)), "side stream read a stale result"
    assert work.is_completed()

    # 3. Several allreduces in flight at once (queued behind a sleep), waited for in reverse.
    ops = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG, dist.ReduceOp.MIN)
    cases = []
    for i in range(6):
        op = ops[i % len(ops)]
        numel = 1000 * (i + 1) + 3
        inputs = [make_input(500 + i, r, numel, torch.float32, op) for r in range(world)]
        cases.append((inputs[rank].to(device, copy=True), inputs, op))
    torch.cuda._sleep(SLEEP_CYCLES // 10)
    works = [dist.all_reduce(x, op=op, async_op=True) for x, _, op in cases]
    for (x, inputs, op), w in reversed(list(zip(cases, works))):
        w.wait()
        check_close(x.cpu(), reference(inputs, op), op, world, f"in flight {op} n={x.numel()}")

    # 4. get_future(): its value is the list of result tensors (DDP's comm hooks use it).
    t = torch.full((4097,), float(rank + 1), device=device)
    fut = dist.all_reduce(t, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    value = fut.wait()
    assert isinstance(value, list) and len(value) == 1, value
    assert value[0].data_ptr() == t.data_ptr(), "the future's value is not the input tensor"
    assert torch.equal(value[0].cpu(), torch.full((4097,), total))
    assert torch.equal(doubled.wait().cpu(), torch.full((4097,), 2 * total))

    # 5. An input whose last reference goes away while the allreduce is still queued: the
    #    caching allocator must not hand its memory out (recordStream on the internal stream).
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") in ("", "0"):
        numel = (3 << 20) // 4 + 77  # an unusual size: no other block of it is free
        x = torch.full((numel,), 1.0, device=device)
        address = x.data_ptr()
        torch.cuda._sleep(SLEEP_CYCLES)
        dist.all_reduce(x, async_op=True)  # the Work is dropped at once
        del x
        y = torch.empty(numel, device=device)
        reused = y.data_ptr() == address
        torch.cuda.synchronize(device)
        assert not reused, "the memory of an in-flight allreduce input was handed out again"

    torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()
    return {}


def test_stream_semantics() -> None:
    results = run_ranks(_streams, 2, timeout=300)
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])


# ---------------------------------------------------------------------------------------
# d. Layouts, allreduce_coalesced and mixed dtypes


def _layouts(rank: int, world: int) -> dict[str, Any]:
    device = _setup(rank)
    options = torch_xdev.Options(cuda_slot_bytes=SLOT, shm_slot_bytes=SLOT, timeout=XDEV_TIMEOUT_S)
    dist.init_process_group("xdev", rank=rank, world_size=world, pg_options=options)
    info = _first_cuda_collective(device)
    if not info["transport"]:
        dist.destroy_process_group()
        return {"skip": f"no CUDA transport: {info['transport_note']}"}
    total = float(sum(range(1, world + 1)))
    digests: list[int] = []
    labels: list[str] = []

    # Transposed view: written back in place.
    base = torch.arange(600, dtype=torch.float32, device=device).view(20, 30) * (rank + 1)
    dist.all_reduce(base.t())
    _assert_native(what="transposed")
    assert torch.equal(base.cpu(), torch.arange(600, dtype=torch.float32).view(20, 30) * total)
    # Strided slice: only every third element changes.
    strided = torch.zeros(3000, dtype=torch.float64, device=device)
    strided[::3] = rank + 1
    dist.all_reduce(strided[::3])
    _assert_native(what="strided")
    host = strided.cpu()
    assert torch.equal(host[::3], torch.full((1000,), total, dtype=torch.float64))
    assert torch.equal(host[1::3], torch.zeros(1000, dtype=torch.float64))
    assert torch.equal(host[2::3], torch.zeros(1000, dtype=torch.float64))
    # A contiguous slice at a storage offset, three windows long: runs in place, and the
    # elements on either side stay untouched.
    buf = torch.full((5000,), -7.0, device=device)
    buf[1000:3501] = rank + 1
    dist.all_reduce(buf[1000:3501])
    _assert_native(what="slice at an offset")
    host = buf.cpu()
    assert torch.equal(host[1000:3501], torch.full((2501,), total))
    assert torch.equal(host[:1000], torch.full((1000,), -7.0)), "wrote before the slice"
    assert torch.equal(host[3501:], torch.full((1499,), -7.0)), "wrote after the slice"
    # Channels-last 4-D half tensor (small integers: exact in fp16).
    pattern = (torch.arange(2 * 3 * 5 * 7) % 8).view(2, 3, 5, 7).to(torch.float16)
    cl = (pattern * (rank + 1)).to(device, copy=True).contiguous(memory_format=torch.channels_last)
    dist.all_reduce(cl)
    assert torch.equal(cl.cpu(), pattern * total)
    # 0-dim.
    scalar = torch.tensor(float(rank + 1), device=device)
    dist.all_reduce(scalar, op=dist.ReduceOp.MAX)
    assert scalar.item() == float(world)

    # allreduce_coalesced of one dtype, some members non-contiguous, one empty.
    shapes = [(5,), (0,), (1,), (3, 7), (300,), (17,), (2000,)]
    lists = [
        [
            make_input(60 + i, r, int(torch.Size(s).numel()), torch.float32, OPS[0]).view(s)
            for i, s in enumerate(shapes)
        ]
        for r in range(world)
    ]
    mine = []
    for i, t in enumerate(lists[rank]):
        if t.dim() == 2:  # a transposed holder: non-contiguous
            holder = torch.empty(t.shape[::-1], device=device).t()
            holder.copy_(t)
            mine.append(holder)
        elif i == 4:  # every other element of a longer tensor
            holder = torch.zeros(2 * t.numel(), device=device)[::2]
            holder.copy_(t)
            mine.append(holder)
        else:
            mine.append(t.to(device, copy=True))
    dist.all_reduce_coalesced(mine)
    _assert_native(what="coalesced")
    for i in range(len(shapes)):
        want = reference([lists[r][i].flatten() for r in range(world)], OPS[0])
        what = f"coalesced #{i} {shapes[i]}"
        check_close(mine[i].cpu().flatten(), want, OPS[0], world, what)
        digests.append(digest(mine[i]))
        labels.append(what)

    # One call mixing dtypes (one flat buffer and one run of windows per dtype). The Python
    # wrapper refuses mixed dtypes, so this goes to the ProcessGroup directly.
    specs = [
        (torch.float32, (37,)),
        (torch.float16, (3000,)),
        (torch.int32, (5, 7)),
        (torch.float64, (1500,)),
        (torch.bfloat16, (0,)),
        (torch.int8, (4500,)),
        (torch.float32, (2100,)),
        (torch.int64, (9,)),
        (torch.uint8, (33,)),
        (torch.float16, (1,)),
    ]
    pg = dist.group.WORLD
    assert pg is not None
    for o, op in enumerate((dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX)):
        inputs = [
            [
                make_input(300 + 10 * o + i, r, int(torch.Size(shape).numel()), dtype, op).view(
                    shape
                )
                for i, (dtype, shape) in enumerate(specs)
            ]
            for r in range(world)
        ]
        tensors = []
        for t in inputs[rank]:
            if t.dim() == 2:
                holder = torch.empty(t.shape[::-1], dtype=t.dtype, device=device).t()
                holder.copy_(t)
                tensors.append(holder)
            else:
                tensors.append(t.to(device, copy=True))
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = op
        pg.allreduce_coalesced(tensors, opts).wait()
        _assert_native(what=f"mixed dtypes {op}")
        for i, (dtype, shape) in enumerate(specs):
            want = reference([inputs[r][i].flatten() for r in range(world)], op)
            what = f"mixed dtypes {op} #{i} {dtype} {shape}"
            got = tensors[i].cpu()
            assert got.dtype == dtype and tuple(got.shape) == shape, what
            check_close(got.flatten(), want, op, world, what)
            digests.append(digest(got))
            labels.append(what)

    _assert_same_on_all_ranks(digests, labels, world)
    torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()
    return {}


@pytest.mark.parametrize("world", [2, 3])
def test_layouts_coalesced_mixed_dtypes(world: int) -> None:
    results = run_ranks(_layouts, world, timeout=300)
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])


# ---------------------------------------------------------------------------------------
# e. Delegated collectives when ranks share a GPU


def _delegated(rank: int, world: int) -> dict[str, Any]:
    device = _setup(rank)
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=XDEV_TIMEOUT_S)
    )
    before = dict(torch_xdev.describe()["cuda"])
    assert before["built"] is True, before
    assert before["initialized"] is False and before["fallback_backend"] is None, before

    # The first CUDA collective is a delegated one: it must run the GPU rendezvous itself.
    for root in range(world):
        for dtype in (torch.float32, torch.int64, torch.float16):
            b = torch.arange(5000).to(dtype) * (root + 1)
            x = b.to(device, copy=True) if rank == root else torch.zeros_like(b, device=device)
            dist.broadcast(x, src=root)
            assert torch.equal(x.cpu(), b), f"broadcast from {root} {dtype}"
    after = dict(torch_xdev.describe()["cuda"])
    assert after["initialized"] is True, after
    share = bool(after["ranks_share_gpu"])
    if world > torch.cuda.device_count():
        assert share, after
    assert after["fallback_backend"] == ("gloo" if share else "nccl"), after

    mine = torch.arange(1000, dtype=torch.float32, device=device) + 1000 * rank
    outs = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(outs, mine)
    for r in range(world):
        assert torch.equal(outs[r].cpu(), torch.arange(1000, dtype=torch.float32) + 1000 * r)

    dist.barrier()

    # An op without a native kernel goes to the same engine, and is right.
    values = [torch.tensor([0b1111 ^ (1 << r), 0x7F, -1], dtype=torch.int32) for r in range(world)]
    t = values[rank].to(device, copy=True)
    dist.all_reduce(t, op=dist.ReduceOp.BAND)
    algorithm, reason = _last()
    assert algorithm == "fallback", (algorithm, reason)
    expected = values[0].clone()
    for v in values[1:]:
        expected &= v
    assert torch.equal(t.cpu(), expected)

    # And native allreduce still runs natively afterwards.
    t = torch.full((2049,), float(rank + 1), device=device)
    dist.all_reduce(t)
    if after["transport"]:
        _assert_native(what="after delegated collectives")
    assert torch.equal(t.cpu(), torch.full((2049,), float(sum(range(1, world + 1)))))
    torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()
    return {"cuda": after}


@pytest.mark.parametrize("world", [2, 3])
def test_delegated_collectives_share_gpu(world: int) -> None:
    results = run_ranks(_delegated, world, timeout=300)
    assert results[0]["cuda"]["fallback_backend"] in ("gloo", "nccl")


# ---------------------------------------------------------------------------------------
# f. Bad input


def _bad_input(rank: int, world: int) -> dict[str, Any]:
    device = _setup(rank)
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=60.0)
    )
    info = _first_cuda_collective(device)
    if not info["transport"]:
        dist.destroy_process_group()
        return {"skip": f"no CUDA transport: {info['transport_note']}"}
    total = float(sum(range(1, world + 1)))

    def still_usable() -> None:
        ok = torch.full((33,), float(rank + 1), device=device)
        dist.all_reduce(ok)
        _assert_native(what="after an error")
        assert torch.equal(ok.cpu(), torch.full((33,), total))

    # Two devices in one call: refused before any peer is involved (every rank passes the
    # same bad list here, so every rank raises).
    with pytest.raises((ValueError, RuntimeError), match="one device"):
        dist.all_reduce_coalesced([torch.ones(4, device=device), torch.ones(4)])
    still_usable()
    with pytest.raises((ValueError, RuntimeError), match="one device"):
        dist.all_reduce_coalesced([torch.ones(4), torch.ones(4, device=device)])
    still_usable()
    if torch.cuda.device_count() > 1:
        other = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
        with pytest.raises((ValueError, RuntimeError), match="one device"):
            dist.all_reduce_coalesced([torch.ones(4, device=device), torch.ones(4, device=other)])
        with pytest.raises((ValueError, RuntimeError), match="runs CUDA collectives on"):
            dist.all_reduce(torch.ones(4, device=other))
        still_usable()

    # Calls that differ across ranks: DistBackendError on every rank, then the group works.
    cases = [
        torch.ones(10 + rank, device=device),  # shape
        torch.ones(10, dtype=torch.float32 if rank == 0 else torch.float64, device=device),
        torch.ones(0 if rank == 0 else 5, device=device),  # empty on one rank only
        torch.ones(4, 5, device=device) if rank == 0 else torch.ones(5, 4, device=device),
    ]
    for t in cases:
        with pytest.raises(dist.DistBackendError, match="mismatched collectives"):
            dist.all_reduce(t)
        still_usable()
    # The same payload split differently: [4, 4] on rank 0, [8] on the others.
    with pytest.raises(dist.DistBackendError, match="mismatched collectives"):
        if rank == 0:
            dist.all_reduce_coalesced([torch.ones(4, device=device), torch.ones(4, device=device)])
        else:
            dist.all_reduce_coalesced([torch.ones(8, device=device)])
    still_usable()
    with pytest.raises(dist.DistBackendError, match="mismatched"):
        dist.all_reduce(
            torch.ones(8, device=device),
            op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX,
        )
    still_usable()
    # One rank in a barrier, the others in an allreduce of CUDA tensors.
    with pytest.raises(dist.DistBackendError, match="mismatched"):
        if rank == 0:
            dist.barrier()
        else:
            dist.all_reduce(torch.ones(2, device=device))
    still_usable()
    torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()
    return {}


def test_bad_input() -> None:
    results = run_ranks(_bad_input, 2, timeout=300)
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])


# ---------------------------------------------------------------------------------------
# A world of one (torchrun --nproc_per_node 1)


def _world_of_one(rank: int, world: int) -> dict[str, Any]:
    device = _setup(rank)
    dist.init_process_group(
        "xdev", rank=rank, world_size=world, pg_options=torch_xdev.Options(timeout=60.0)
    )
    # The first CUDA allreduce runs the GPU rendezvous; later ones must still leave the
    # tensor as it is (a world of one holds its result), whatever path they take.
    for d, dtype in enumerate((torch.float32, torch.bfloat16, torch.int64, torch.uint8)):
        for o, op in enumerate(OPS):
            x = make_input(d * 10 + o, 0, 1021, dtype, op).to(device, copy=True)
            expected = x.clone()
            dist.all_reduce(x, op=op)
            assert torch.equal(x.cpu(), expected.cpu()), f"one rank, {dtype} {op}"
    xs = [torch.full((n,), 3.0, device=device) for n in (5, 0, 4099)]
    dist.all_reduce_coalesced(xs)
    assert all(bool((x == 3.0).all()) for x in xs)
    dist.barrier()
    last = torch_xdev.describe()["last_allreduce"]
    torch.cuda.synchronize(device)
    dist.destroy_process_group()
    return {"last_allreduce": last}


def test_world_of_one() -> None:
    results = run_ranks(_world_of_one, 1, timeout=300)
    assert results[0]["last_allreduce"] is not None


# ---------------------------------------------------------------------------------------
# g. DDP on CUDA against Gloo

DDP_WORLD = 4
DDP_STEPS = 10
DDP_SEED = 3
# name -> (backend, device, TrainConfig overrides)
DDP_RUNS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gloo-cpu": ("gloo", "cpu", {}),
    "gloo-cuda": ("gloo", "cuda", {}),
    "xdev-cuda": ("xdev", "cuda", {}),
    "xdev-cuda-hierarchical_copy": ("xdev", "cuda", {"algorithm": "hierarchical_copy"}),
    "xdev-cuda-bucketview": ("xdev", "cuda", {"gradient_as_bucket_view": True}),
}
DDP_XDEV_RUNS = [name for name, (backend, _, _) in DDP_RUNS.items() if backend == "xdev"]


def _ddp(rank: int, world: int) -> dict[str, Any]:
    _setup(rank)
    os.environ["LOCAL_RANK"] = str(rank)  # ddp_train picks GPU LOCAL_RANK % device_count
    # Plain fp32 matmuls on the GPU, so only the summation order differs from the CPU run.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    timeout = timedelta(seconds=120)
    port = int(os.environ["MASTER_PORT"])
    base = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
    out: dict[str, Any] = {}
    for name, (backend, device, overrides) in DDP_RUNS.items():
        store = dist.PrefixStore(f"{name}/", base)  # a fresh key space per run
        config = ddp_train.TrainConfig(
            backend=backend,
            device=device,
            steps=DDP_STEPS,
            seed=DDP_SEED,
            timeout=timeout,
            **overrides,
        )
        result = ddp_train.train(config, rank=rank, world_size=world, store=store)
        params = torch.cat([p.detach().reshape(-1).cpu() for p in result.model.parameters()])
        out[name] = {
            # Python floats hold fp32 values exactly; no tensors through the result queue.
            "params": params.tolist(),
            "losses": result.losses,
            "mean_losses": result.mean_losses,
            "allreduce": result.allreduce,
        }
    return out


@pytest.fixture(scope="module")
def ddp_results() -> list[dict[str, Any]]:
    per_rank_env = [{"LOCAL_RANK": str(r)} for r in range(DDP_WORLD)]
    results: list[dict[str, Any]] = run_ranks(
        _ddp, DDP_WORLD, per_rank_env=per_rank_env, timeout=600
    )
    return results


def _params(results: list[dict[str, Any]], rank: int, name: str) -> torch.Tensor:
    return torch.tensor(results[rank][name]["params"], dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", DDP_XDEV_RUNS)
def test_ddp_cuda_matches_gloo(ddp_results: list[dict[str, Any]], name: str) -> None:
    for rank in range(DDP_WORLD):
        ours = _params(ddp_results, rank, name)
        # Same GPU arithmetic, only the gradient sums' order differs (see tests/test_ddp.py
        # for why 1e-5 / 1e-6 leaves ~30x headroom over ten SGD steps).
        torch.testing.assert_close(
            ours,
            _params(ddp_results, rank, "gloo-cuda"),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m: f"rank {rank}: {name} vs gloo-cuda: {m}",
        )
        # Against the CPU the matmuls round differently too: ten times looser, still orders
        # of magnitude below what a dropped rank or a missing division does (>= 1e-3).
        torch.testing.assert_close(
            ours,
            _params(ddp_results, rank, "gloo-cpu"),
            rtol=1e-4,
            atol=1e-5,
            msg=lambda m: f"rank {rank}: {name} vs gloo-cpu: {m}",
        )
        theirs = ddp_results[rank]["gloo-cuda"]["losses"]
        assert ddp_results[rank][name]["losses"] == pytest.approx(theirs, rel=1e-5, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", DDP_XDEV_RUNS)
def test_ddp_cuda_ranks_bitwise_identical(ddp_results: list[dict[str, Any]], name: str) -> None:
    reference_params = _params(ddp_results, 0, name)
    for rank in range(1, DDP_WORLD):
        params = _params(ddp_results, rank, name)
        assert torch.equal(params, reference_params), (
            f"{name}: rank {rank} differs from rank 0 in "
            f"{int((params != reference_params).sum())} of {params.numel()} parameters"
        )
        assert ddp_results[rank][name]["mean_losses"] == ddp_results[0][name]["mean_losses"]


@pytest.mark.slow
@pytest.mark.parametrize("name", DDP_XDEV_RUNS)
def test_ddp_cuda_allreduce_is_native(ddp_results: list[dict[str, Any]], name: str) -> None:
    selection = ddp_results[0][name]["allreduce"]
    assert selection is not None, f"{name}: describe() reported no allreduce"
    algorithm, reason = selection
    requested = DDP_RUNS[name][2].get("algorithm", "auto")
    if requested == "auto":
        assert algorithm in NATIVE, (algorithm, reason)
    else:
        assert algorithm == requested, (algorithm, reason)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DDP_RUNS))
def test_ddp_cuda_loss_decreases(ddp_results: list[dict[str, Any]], name: str) -> None:
    losses = ddp_results[0][name]["mean_losses"]
    assert len(losses) == DDP_STEPS
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.9 * first, f"{name}: loss did not fall: {losses}"
