"""c10d's split_group on an xdev group: the children are xdev groups of their own.

DeviceMesh splits the default group with ``split_group`` wherever ``init_process_group`` got a
``device_id`` and an accelerator is present. Without a GPU here, the tests call the
ProcessGroup's own ``split_group`` (what ``torch.distributed.split_group`` calls), and make
``torch.distributed.split_group`` take its GPU path on CPU tensors by binding the default group
to the CPU and calling the CPU the accelerator, as a GPU host with ``device_id`` would.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, cast

import torch
import torch.distributed as dist

import torch_xdev
from harness import run_ranks


def _name(text: str) -> Any:
    return cast(Any, text)  # torch 2.13 types group names as GroupName, which others may lack


def _sum_on(group: dist.ProcessGroup, rank: int) -> float:
    t = torch.full((1000,), float(rank + 1))
    group.allreduce([t]).wait()
    return t[0].item()


def _split_by_host(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    parent = dist.group.WORLD
    assert parent is not None
    backend = parent._get_backend(torch.device("cpu"))
    result: dict[str, Any] = {"splits": backend.supports_splitting}
    # Ranks 0, 1 on one host and 2, 3 on the other; the pairs of a host, then across hosts.
    for name, mine in (
        ("host", [0, 1] if rank < 2 else [2, 3]),
        ("across", [rank % 2, rank % 2 + 2]),
    ):
        child = parent.split_group(mine, group_name=_name(f"split-{name}-{mine[0]}"))
        assert child is not None
        child_backend = torch_xdev._registration.backend_of(child)
        info = child_backend.describe()
        result[name] = {
            "rank": child.rank(),
            "size": child.size(),
            "sum": _sum_on(child, rank),
            "num_hosts": info["num_hosts"],
            "shared_memory": info["shared_memory"],
            # One child, though c10d asks each device type's backend (one XdevBackend) for it.
            "same_for_cuda": child._get_backend(torch.device("cuda")) is child_backend,
        }
    # The same ranks split again: a group of its own, not the last one's backend again.
    mine = [0, 1] if rank < 2 else [2, 3]
    first = parent.split_group(mine, group_name=_name(f"split-first-{mine[0]}"))
    second = parent.split_group(mine, group_name=_name(f"split-second-{mine[0]}"))
    assert first is not None and second is not None
    first_backend = torch_xdev._registration.backend_of(first)
    result["distinct"] = first_backend is not torch_xdev._registration.backend_of(second)
    first_backend.shutdown()
    result["second_sum"] = _sum_on(second, rank)  # the first's end leaves the second alone
    # A rank outside every listed group gets no group.
    outside = parent.split_group([0, 1], group_name=_name("split-outside"))
    result["outside"] = outside is None
    if outside is not None:
        result["outside_sum"] = _sum_on(outside, rank)
    # The parent goes on.
    result["parent_sum"] = _sum_on(parent, rank)
    dist.destroy_process_group()
    return result


def test_split_children_are_xdev_groups() -> None:
    hosts = [{"XDEV_HOSTNAME": h} for h in ("a", "a", "b", "b")]
    results = run_ranks(_split_by_host, 4, per_rank_env=hosts, timeout=120)
    for rank, r in enumerate(results):
        assert r["splits"], r
        # Rank r + 1 in its pair, summed with its peer's: 1+2 and 3+4 inside hosts.
        assert r["host"] == {
            "rank": rank % 2,
            "size": 2,
            "sum": 3.0 if rank < 2 else 7.0,
            "num_hosts": 1,
            "shared_memory": True,
            "same_for_cuda": True,
        }, (rank, r)
        # Across hosts: ranks 0 and 2 (1 + 3), 1 and 3 (2 + 4).
        assert r["across"]["rank"] == rank // 2 and r["across"]["num_hosts"] == 2, (rank, r)
        assert r["across"]["sum"] == (4.0 if rank % 2 == 0 else 6.0), (rank, r)
        assert r["distinct"] and r["second_sum"] == (3.0 if rank < 2 else 7.0), (rank, r)
        assert r["outside"] == (rank >= 2), (rank, r)
        assert r.get("outside_sum", 3.0) == 3.0, (rank, r)
        assert r["parent_sum"] == 10.0, (rank, r)


def _split_as_on_a_gpu_host(rank: int, world: int) -> dict[str, Any]:
    # The group's own timeout (50 s) is not the children's: they take the split's.
    options = torch_xdev.Options(timeout=timedelta(seconds=50))
    dist.init_process_group("xdev", rank=rank, world_size=world, pg_options=options)
    default = dist.distributed_c10d._get_default_group()
    # What init_process_group(device_id=torch.device("cuda", 0)) leaves on a GPU host.
    default.bound_device_id = torch.device("cuda", 0)
    result: dict[str, Any] = {}
    # A group of a subset first: torch asks ranks 2 and 3, outside it, to take part in a split
    # (perform_nocolor_split), and they hold one group fewer afterwards, so torch names the
    # split's children differently on them than on ranks 0 and 1.
    subset = dist.new_group([0, 1])
    # From here the CPU plays the accelerator, so that split_group splits the CPU's backend.
    default.bound_device_id = torch.device("cpu", 0)
    torch.accelerator.is_available = lambda: True  # type: ignore[assignment]
    torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")  # type: ignore
    if rank < 2:
        t = torch.full((8,), float(rank + 1))
        dist.all_reduce(t, group=subset)
        result["subset_sum"] = t[0].item()
    pairs = [[0, 1], [2, 3]]
    child: Optional[dist.ProcessGroup] = dist.split_group(
        split_ranks=pairs, timeout=timedelta(seconds=37)
    )
    assert child is not None
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t, group=child)
    result["pair_sum"] = t[0].item()
    result["backend"] = dist.get_backend(child)
    result["timeout_s"] = torch_xdev.describe(child)["timeout_s"]
    # Destroyed and split again (torch may give the new child the same name): a new group.
    dist.destroy_process_group(child)
    again = dist.split_group(split_ranks=pairs)
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t, group=again)
    result["again_sum"] = t[0].item()
    # A 2 x 2 mesh, as FSDP2's HSDP makes it: both dimensions by split_group.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for name in ("replicate", "shard"):
        t = torch.full((8,), float(rank + 1))
        dist.all_reduce(t, group=mesh.get_group(name))
        result[name] = t[0].item()
    dist.destroy_process_group()
    return result


def test_split_group_and_device_mesh_on_a_bound_default_group() -> None:
    results = run_ranks(_split_as_on_a_gpu_host, 4, timeout=120)
    for rank, r in enumerate(results):
        assert r.get("subset_sum", 3.0) == 3.0, (rank, r)
        assert r["pair_sum"] == r["again_sum"] == (3.0 if rank < 2 else 7.0), (rank, r)
        assert r["backend"] == "xdev" and r["timeout_s"] == 37.0, (rank, r)
        # Mesh rows are [0, 1] and [2, 3]: replicate joins a column, shard a row.
        assert r["shard"] == (3.0 if rank < 2 else 7.0), (rank, r)
        assert r["replicate"] == (4.0 if rank % 2 == 0 else 6.0), (rank, r)


def _mismatch_on_subgroups(rank: int, world: int) -> dict[str, str]:
    dist.init_process_group("xdev", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    parent = dist.group.WORLD
    assert parent is not None
    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
    made = low if rank < 2 else high
    split = parent.split_group(
        [0, 1] if rank < 2 else [2, 3], group_name=_name(f"pair-{rank // 2}")
    )
    assert split is not None
    messages: dict[str, str] = {}
    for name, group in (("new_group", made), ("split_group", split)):
        # Ranks 1 and 3, the second of each pair, pass another size.
        numel = 20 if rank % 2 else 10
        try:
            group.allreduce([torch.ones(numel)]).wait()  # a split is not in c10d's group map
            messages[name] = "returned"
        except RuntimeError as error:
            messages[name] = str(error)
        # The group stays usable.
        assert _sum_on(group, rank) == (3.0 if rank < 2 else 7.0)
    dist.destroy_process_group()
    return messages


def test_a_mismatch_on_a_subgroup_names_its_ranks_global_numbers_too() -> None:
    # "rank 0" alone, on the group of global ranks 2 and 3, read as global rank 0.
    results = run_ranks(_mismatch_on_subgroups, 4, timeout=120)
    for rank, messages in enumerate(results):
        for name, message in messages.items():
            assert "mismatched collectives" in message, (rank, name, message)
            if rank < 2:  # group ranks are the global ones: nothing to add
                assert "rank 0: " in message and "global rank" not in message, (rank, message)
            else:
                assert "rank 0 (global rank 2): " in message, (rank, name, message)
                assert "rank 1 (global rank 3): " in message, (rank, name, message)
