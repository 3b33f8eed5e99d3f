"""Options and env overrides, forced algorithms, init methods, several groups, setup files."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torch_xdev
from torch_xdev import _C
from torch_xdev.options import resolve_options
from harness import run_ranks, subprocess_env


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"num_packs": -1}, "num_packs"),
        ({"algorithm": "ring"}, "algorithm"),
        ({"agg_small_grads_max_bytes": -5}, "agg_small_grads_max_bytes"),
        ({"agg_small_grads_max_group": -1}, "agg_small_grads_max_group"),
        ({"bytes_per_pack": -1}, "bytes_per_pack"),
        ({"reduce_to_rank": -1}, "reduce_to_rank"),
        ({"timeout": -1.0}, "timeout"),
        ({"shm_slot_bytes": 100}, "shm_slot_bytes"),
        ({"cuda_slot_bytes": -1}, "cuda_slot_bytes"),
        ({"cuda_slot_bytes": 4097}, "cuda_slot_bytes"),
        # C++ keeps whole milliseconds: 0.5 ms would be a timeout of 0 (every wait fails).
        ({"timeout": 0.0005}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"timeout": -(10**400)}, "timeout"),  # past any float, but negative: not "never"
        ({"num_packs": 1 << 64}, "num_packs"),  # past int64_t: a TypeError in the binding
        # Planning time grows with the square of the pack count (65536 never finished).
        ({"num_packs": (1 << 10) + 1}, "num_packs"),
        ({"shm_slot_bytes": 1 << 63}, "shm_slot_bytes"),
        ({"shm_slot_bytes": 1 << 62}, "shm_slot_bytes"),  # 2 x 4 ranks of it wrapped: SIGSEGV
        ({"shm_slot_bytes": (1 << 30) + 4096}, "shm_slot_bytes"),
        ({"cuda_slot_bytes": 1 << 31}, "cuda_slot_bytes"),
        ({"shared_buckets": None}, "shared_buckets"),  # the binding would read False
        ({"single_copy": "no"}, "single_copy"),
        ({"single_copy": 2}, "single_copy"),
        ({"debug": "yes"}, "debug"),
        # C++ holds the pieces in an int: 2^32 + 4 ran as 4 pieces, 2^31 as the model's choice.
        ({"two_level_pieces": (1 << 32) + 4}, "two_level_pieces"),
        ({"two_level_pieces": 1 << 31}, "two_level_pieces"),
        ({"two_level_pieces": 1025}, "two_level_pieces"),
    ],
)
def test_bad_options_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        torch_xdev.Options(**kwargs)
    # A timeout past 100 years means "never": 100 years, in the group's options or its own.
    for never in (float("inf"), 1e300, 10**400, timedelta(days=999999999)):
        config = torch_xdev.options.backend_config(torch_xdev.Options(timeout=never), timedelta(1))
        assert config.timeout == timedelta(days=36500), never
        config = torch_xdev.options.backend_config(torch_xdev.Options(), timedelta(days=100000))
        assert config.timeout == timedelta(days=36500)
    flags: dict[str, Any] = {"single_copy": 1, "shared_buckets": 0}  # 0 and 1 are fine
    assert torch_xdev.Options(**flags).single_copy == 1


def _engine_calls_under_never(rank: int, world: int, through_options: bool) -> list[float]:
    # "Never" from the environment, the group's options, or init_process_group's own timeout.
    if through_options:
        dist.init_process_group(
            "xdev",
            rank=rank,
            world_size=world,
            timeout=timedelta(days=100000),
            pg_options=torch_xdev.Options(algorithm="fallback"),
        )
    else:
        dist.init_process_group("xdev", rank=rank, world_size=world)
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)  # Gloo's allreduce: its deadline overflowed at 100000 days, and it hung
    bits = torch.full((8,), rank + 1, dtype=torch.int32)
    dist.all_reduce(bits, op=dist.ReduceOp.BOR)  # Gloo's, whatever the algorithm
    if through_options:  # (XDEV_TIMEOUT would take the group's place)
        # The other end: a group timeout of zero fails every wait at once (Gloo's connect first).
        with pytest.raises(ValueError, match="group's timeout .* at least 1 ms"):
            dist.new_group(backend="xdev", timeout=timedelta(0))
    dist.destroy_process_group()
    return [t[0].item(), float(bits[0].item())]


@pytest.mark.parametrize("through_options", [False, True], ids=["environment", "options"])
def test_a_never_timeout_reaches_the_engines_bounded(through_options: bool) -> None:
    env = {} if through_options else {"XDEV_TIMEOUT": "inf", "XDEV_ALGO": "fallback"}
    results = run_ranks(_engine_calls_under_never, 2, through_options, env=env, timeout=60)
    assert results == [[3.0, 3.0], [3.0, 3.0]]


def test_env_overrides_options() -> None:
    env = {
        "XDEV_ALGO": "reduce_to_one",
        "XDEV_NUM_PACKS": "4",
        "XDEV_TIMEOUT": "2.5",
        "XDEV_DEBUG": "INFO",
        "XDEV_BYTES_PER_PACK": "0x100",
    }
    o = resolve_options(torch_xdev.Options(algorithm="flat", num_packs=2), env)
    assert (o.algorithm, o.num_packs, o.timeout_seconds(), o.debug, o.bytes_per_pack) == (
        "reduce_to_one",
        4,
        2.5,
        True,
        256,
    )
    with pytest.raises(ValueError, match="XDEV_NUM_PACKS=none"):  # says how to say "choose"
        resolve_options(None, {"XDEV_NUM_PACKS": "-2"})
    assert resolve_options(None, {"XDEV_ALGO": " FLAT "}).algorithm == "flat"  # as NCCL_ALGO
    with pytest.raises(ValueError, match="XDEV_NUM_PACKS='many' .* expected an integer"):
        resolve_options(None, {"XDEV_NUM_PACKS": "many"})
    # The README's default, None (the plan's choice), can be set back from the environment.
    assert (
        resolve_options(torch_xdev.Options(num_packs=4), {"XDEV_NUM_PACKS": "none"}).num_packs
        is None
    )
    assert resolve_options(None, {"XDEV_NUM_PACKS": "08"}).num_packs == 8  # base 0 refused it
    with pytest.raises(ValueError, match="algorithm"):
        resolve_options(None, {"XDEV_ALGO": "ring"})
    with pytest.raises(ValueError, match="torch_xdev.Options"):
        resolve_options({"algorithm": "flat"}, {})  # type: ignore[arg-type]
    # Values the variables' parsers take are checked like the fields (ValueError, not
    # OverflowError or a TypeError from the binding).
    for variable, text in [
        ("XDEV_TIMEOUT", "nan"),
        ("XDEV_TIMEOUT", "0.0001"),
        ("XDEV_NUM_PACKS", "99999999999999999999"),
        ("XDEV_DEBUG", "verbose"),  # was read as off
    ]:
        with pytest.raises(ValueError, match=variable):
            resolve_options(None, {variable: text})
    for text, debug in [
        ("INFO", True),
        ("debug", True),
        ("on", True),
        ("1", True),
        ("0", False),
        ("WARN", False),  # NCCL_DEBUG's quieter levels: nothing extra logged
        ("version", False),
    ]:
        assert resolve_options(None, {"XDEV_DEBUG": text}).debug is debug, text
    # Every knob is documented in the README.
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    for _, variable, _ in torch_xdev.ENV_KNOBS:
        assert variable in readme, variable


def _init_and_sum(rank: int, world: int, method: str, path: str) -> dict[str, Any]:
    if method == "tcp":
        dist.init_process_group(
            "xdev",
            init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
            rank=rank,
            world_size=world,
        )
    elif method == "file":
        dist.init_process_group("xdev", init_method=f"file://{path}", rank=rank, world_size=world)
    elif method == "store":
        store = dist.TCPStore(
            "127.0.0.1",
            int(os.environ["MASTER_PORT"]),
            world,
            rank == 0,
            timeout=timedelta(seconds=60),
        )
        dist.init_process_group("xdev", store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group("xdev", init_method="env://", rank=rank, world_size=world)
    t = torch.full((100,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((100,), float(sum(range(1, world + 1)))))
    info = torch_xdev.describe()
    dist.destroy_process_group()
    return info


@pytest.mark.parametrize("method", ["env", "tcp", "file", "store"])
def test_init_methods(method: str, tmp_path: Any) -> None:
    infos = run_ranks(_init_and_sum, 2, method, str(tmp_path / "rendezvous"))
    assert infos[0]["shared_memory"] and infos[0]["num_hosts"] == 1
    assert infos[0]["fallback_backend"] == "gloo"
    assert infos[0]["devices"] == ["cpu", "cuda"]  # backend="xdev" serves both
    # describe() reports every option that declares a key (backend_config.h), as set.
    keys = [f["describe_key"] for f in _C.BackendConfig.fields() if f["describe_key"]]
    assert {k: infos[0][k] for k in keys if k != "timeout_s"} == {
        "algorithm": "auto",
        "num_packs": -1,
        "agg_small_grads_max_bytes": 0,
        "agg_small_grads_max_group": 0,
        "bytes_per_pack": 0,
        "reduce_to_rank": 0,
        "shm_slot_bytes": torch_xdev.Options().shm_slot_bytes,
        "two_level_pieces": 0,
    }
    assert infos[0]["timeout_s"] == dist.default_pg_timeout.total_seconds()  # the group's
    cuda = infos[0]["cuda"]
    if not torch_xdev._C.built_with_cuda:
        # A CPU-only build says so, and CUDA tensors would go to Gloo.
        assert cuda["built"] is False and "no CUDA path" in cuda["note"]
        assert cuda["fallback_backend"] == "gloo"
    if not cuda["initialized"]:  # the keys README documents, there from the start
        assert cuda["ddp_shared_buckets"] is False and cuda["heap"] is None, cuda
    assert set(infos[0]["cuda_allreduce_plan"]) == {4 << 10, 1 << 20, 64 << 20}


def _several_groups(rank: int, world: int) -> list[str]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    pairs = [dist.new_group([0, 1], backend="xdev"), dist.new_group([2, 3], backend="xdev")]
    mine = pairs[0] if rank < 2 else pairs[1]
    packed = dist.new_group(
        backend="xdev", pg_options=torch_xdev.Options(algorithm="hierarchical_copy", num_packs=3)
    )
    names = []
    for i in range(3):  # interleave the groups
        t = torch.full((1000,), float(rank))
        dist.all_reduce(t, group=mine)
        partner_sum = float(sum(r for r in range(world) if (r < 2) == (rank < 2)))
        assert torch.equal(t, torch.full((1000,), partner_sum))
        u = torch.full((777,), float(rank + i))
        dist.all_reduce(u, group=packed)
        assert torch.equal(u, torch.full((777,), float(sum(r + i for r in range(world)))))
        v = torch.ones(5)
        dist.all_reduce(v)
        assert torch.equal(v, torch.full((5,), float(world)))
    for g in (None, mine, packed):
        names.append(torch_xdev._registration.backend_of(g).shm_name)
    assert torch_xdev.describe(packed)["algorithm"] == "hierarchical_copy"
    assert torch_xdev.describe(mine)["world_size"] == 2
    dist.destroy_process_group()
    return names


def test_several_groups_each_with_own_segment() -> None:
    names = run_ranks(_several_groups, 4)
    for per_rank in names:
        assert len(set(per_rank)) == 3


def _multi_host(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    info = torch_xdev.describe()
    for op, expected in [
        (dist.ReduceOp.SUM, 10.0),
        (dist.ReduceOp.AVG, 2.5),
        (dist.ReduceOp.MAX, 4.0),
    ]:
        t = torch.full((50,), float(rank + 1))
        dist.all_reduce(t, op=op)
        assert torch.equal(t, torch.full((50,), expected)), (op, t[:3])
    i = torch.full((9,), rank + 1, dtype=torch.int64)
    dist.all_reduce(i, op=dist.ReduceOp.AVG)  # two levels: a SUM, then a truncating division
    assert torch.equal(i, torch.full((9,), 2, dtype=torch.int64))
    last = torch_xdev.describe()["last_allreduce"]
    b = torch.arange(4.0) if rank == 3 else torch.zeros(4)
    dist.broadcast(b, src=3)
    assert torch.equal(b, torch.arange(4.0))
    dist.barrier()
    with pytest.raises(ValueError, match="hosts"):
        dist.new_group(backend="xdev", pg_options=torch_xdev.Options(algorithm="hierarchical_copy"))
    dist.destroy_process_group()
    return {"info": info, "last": last}


def test_ranks_on_two_hosts() -> None:
    hosts = [{"XDEV_HOSTNAME": "host-a"}] * 2 + [{"XDEV_HOSTNAME": "host-b"}] * 2
    results = run_ranks(_multi_host, 4, per_rank_env=hosts)
    info = results[0]["info"]
    assert info["num_hosts"] == 2 and info["local_world_size"] == 2
    assert not info["shared_memory"] and info["two_level"]  # tests/test_two_level.py runs it
    # The last allreduce, an AVG of integers, ran in two levels.
    algorithm, reason = results[0]["last"]
    assert algorithm == "two_level" and "flat inside each host" in reason, (algorithm, reason)


def _forced(rank: int, world: int, options: dict[str, Any]) -> str:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dist.new_group(backend="xdev", pg_options=torch_xdev.Options(**options))
    except ValueError as e:
        return str(e)
    finally:
        dist.destroy_process_group()
    return ""


def test_hierarchical_copy_needs_even_world() -> None:
    messages = run_ranks(_forced, 3, {"algorithm": "hierarchical_copy"})
    assert all("even number of ranks" in m for m in messages), messages


def test_reduce_to_rank_out_of_range() -> None:
    messages = run_ranks(_forced, 2, {"algorithm": "reduce_to_one", "reduce_to_rank": 2})
    assert all("reduce_to_rank" in m for m in messages), messages
    # 2^32 + 1 was cut to an int (1) before the check, and 2^32 to 0: accepted.
    for root in (1 << 32, (1 << 32) + 1):
        messages = run_ranks(_forced, 2, {"algorithm": "reduce_to_one", "reduce_to_rank": root})
        assert all(f"reduce_to_rank must be in [0, 2); got {root}" in m for m in messages), messages


def test_a_group_time_check_names_the_environment_it_applied() -> None:
    # XDEV_* variables apply to every group: an error only the group's size can find names them.
    env = [{"XDEV_NUM_PACKS": "2"}] * 3
    messages = run_ranks(_forced, 3, {"algorithm": "hierarchical_copy"}, per_rank_env=env)
    want = "got 3 (Options after applying XDEV_NUM_PACKS=2)"
    assert all(want in m for m in messages), messages


def _subgroups_under_forced_environment(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    seen: dict[str, Any] = {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for ranks in ([0, 1, 2], [rank], [0, 1], list(range(world))):
                group = dist.new_group(ranks)
                if rank not in ranks:
                    continue
                info = torch_xdev.describe(group)
                # Integers: every algorithm must give exactly the sum.
                tensor = torch.arange(1000, dtype=torch.float64) * (rank + 1)
                dist.all_reduce(tensor, group=group)
                want = torch.arange(1000, dtype=torch.float64) * sum(r + 1 for r in ranks)
                assert torch.equal(tensor, want), ranks
                last = torch_xdev.describe(group)["last_allreduce"]
                seen[str(ranks)] = (info["algorithm"], info["reduce_to_rank"], last[0])
                seen[str(ranks) + " note"] = info["options_note"]
        seen["warnings"] = [str(w.message) for w in caught if "xdev:" in str(w.message)]
    finally:
        dist.destroy_process_group()
    return seen


def test_a_forced_algorithm_from_the_environment_leaves_groups_it_cannot_run_on_to_auto() -> None:
    # XDEV_ALGO and XDEV_REDUCE_TO_RANK apply to every group the process makes: one a world of
    # 4 can run may not fit a group of 3 or 1 (DeviceMesh and new_group make such groups).
    env = {"XDEV_ALGO": "hierarchical_copy", "XDEV_REDUCE_TO_RANK": "3"}
    results = run_ranks(_subgroups_under_forced_environment, 4, env=env)
    for rank, seen in enumerate(results):
        assert seen["[0, 1, 2, 3]"] == ("hierarchical_copy", 3, "hierarchical_copy"), seen
        assert seen["[0, 1, 2, 3] note"] == "", seen
        assert seen[f"[{rank}]"][:2] == ("auto", 0), seen
        if rank < 2:
            assert seen["[0, 1]"] == ("hierarchical_copy", 0, "hierarchical_copy"), seen
            assert "XDEV_REDUCE_TO_RANK=3" in seen["[0, 1] note"], seen
        if rank < 3:
            assert seen["[0, 1, 2]"][:2] == ("auto", 0), seen
            note = seen["[0, 1, 2] note"]
            assert "XDEV_ALGO=hierarchical_copy cannot run" in note, note
            assert "even number of ranks" in note and "algorithm='auto'" in note, note
    # A group's first rank warns: rank 0 for the group of 3, every rank for its world of one.
    for rank, seen in enumerate(results):
        of_three = [w for w in seen["warnings"] if "group of 3" in w and "got 3" in w]
        assert len(of_three) == (rank == 0), seen["warnings"]
        assert any("group of 1" in w and "got 1" in w for w in seen["warnings"]), seen
    # The same settings given in pg_options fail the group (test_hierarchical_copy_needs_even_world).


def _init_with_topology(rank: int, world: int) -> str:
    try:
        dist.init_process_group("xdev", rank=rank, world_size=world)
    except ValueError as e:
        return str(e)
    dist.destroy_process_group()
    return ""


def test_bad_topology_file_fails_group_creation(tmp_path: Any) -> None:
    bad = tmp_path / "topo.json"
    bad.write_text('{"nvlink": [[0, 1], [2, 0]]}')  # not symmetric
    errors = run_ranks(_init_with_topology, 1, env={"XDEV_TOPO_FILE": str(bad)})
    assert "XDEV_TOPO_FILE" in errors[0] and "topo.json" in errors[0], errors[0]


def test_an_extension_built_for_another_torch_minor_version_is_refused_at_import(
    tmp_path: Path,
) -> None:
    assert torch_xdev._torch_mismatch(_C.built_with_torch, torch.__version__) is None
    assert torch_xdev._torch_mismatch("2.13.0", "2.13.1+cpu") is None  # one ABI per minor version
    # A torch upgraded under an installed torch_xdev: the import says what to rebuild against.
    upgraded = (
        "import torch; torch.__version__ = '2.99.0+cpu'\n"
        "try:\n    import torch_xdev\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", upgraded],
        cwd=tmp_path,  # not the checkout, whose torch_xdev has no extension when installed
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert f"built against torch {_C.built_with_torch}, but torch 2.99.0+cpu is running" in out
    assert "pip install --no-build-isolation ." in out


def test_ddp_comm_mem_default_changes_no_other_backend(tmp_path: Path) -> None:
    # Set for the user only when unset and no GPU is visible (no NCCL group can exist).
    env: dict[str, str] = {}
    assert torch_xdev.default_comm_mem(env, cuda_visible=False)
    assert env == {"DDP_DISABLE_COMM_MEM": "0", "TORCH_XDEV_SET_DDP_DISABLE_COMM_MEM": "1"}
    # A child process inherits both: where it sees a GPU, the value torch_xdev set goes.
    assert not torch_xdev.default_comm_mem(env, cuda_visible=True)
    assert env == {}
    # A value the user set after torch_xdev's (the marker left over) is the user's.
    env = {"DDP_DISABLE_COMM_MEM": "1", "TORCH_XDEV_SET_DDP_DISABLE_COMM_MEM": "1"}
    assert not torch_xdev.default_comm_mem(env, cuda_visible=False)
    assert env == {"DDP_DISABLE_COMM_MEM": "1"}
    env = {}
    assert not torch_xdev.default_comm_mem(env, cuda_visible=True)
    assert env == {}
    env = {"DDP_DISABLE_COMM_MEM": "1"}  # the user's choice stands
    assert not torch_xdev.default_comm_mem(env, cuda_visible=False)
    assert env == {"DDP_DISABLE_COMM_MEM": "1"}
    # End to end: what `import torch_xdev` leaves in a fresh process's environment.
    env = subprocess_env(drop=("DDP_DISABLE_COMM_MEM",))
    code = "import os, torch_xdev; print(os.environ.get('DDP_DISABLE_COMM_MEM'))"
    # Run outside the checkout: `python -c` puts the working directory first on sys.path, and
    # the source tree has no compiled extension.
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    expected = "None" if torch.cuda.device_count() > 0 else "0"
    assert out.stdout.strip() == expected


@pytest.mark.parametrize(
    "params, problem",
    [
        # json reads NaN and Infinity; with one in the model choosing a plan never ended, and
        # every rank hung at its first collective (or describe()).
        ('{"launch_us": NaN}', "launch_us must be a finite number >= 0"),
        ('{"memory_gbps": Infinity}', "memory_gbps must be a finite number > 0"),
        ('{"core_gbps": true}', "core_gbps must be a finite number > 0"),
        ('{"core_gbps": 1' + "0" * 400 + "}", "core_gbps must be a finite number > 0"),
        ('{"core_gbps": 0}', "core_gbps must be a finite number > 0"),
        # Finite, but every prediction became inf, and auto took the first plan it weighed.
        ('{"memory_gbps": 1e-320}', "memory_gbps must be within [1e-06, 1e+09]"),
        ('{"launch_us": 1e300}', "launch_us must be within [0, 1e+09]"),
        # A fraction used to be cut to a whole number: 0.5 became 0, "no limit on cores".
        ('{"net_host_cores": 0.5}', "net_host_cores must be a whole number of cores"),
        # A misspelt key left its parameter at the default without a word.
        ('{"core_gbs": 3, "cores": 2}', "unknown parameter(s) core_gbs; a CPU model sets"),
        ('{"gpu_launch_us": 3}', "unknown parameter(s) gpu_launch_us"),
    ],
)
def test_bad_cpu_model_file(tmp_path: Path, params: str, problem: str) -> None:
    path = tmp_path / "model.json"
    path.write_text(f'{{"params": {params}}}')
    with pytest.raises(ValueError, match="XDEV_CPU_MODEL") as exc:
        torch_xdev._registration.apply_cpu_model_file(_C.BackendConfig(), str(path))
    assert problem in str(exc.value), str(exc.value)
    config = _C.BackendConfig()
    # What calibrate.py records beside the parameters is accepted, and a file fitted on a
    # machine of another core count warns.
    here = os.cpu_count()
    assert here is not None
    for cores in (here, here + 62):
        path.write_text(
            f'{{"params": {{"launch_us": 0, "core_gbps": 3, "cores": {cores}, "window_bytes": 8}}}}'
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch_xdev._registration.apply_cpu_model_file(config, str(path))
        said = [str(w.message) for w in caught if "fitted on a machine" in str(w.message)]
        assert said == (
            []
            if cores == here
            else [
                f"xdev: XDEV_CPU_MODEL={str(path)!r} was "
                f"fitted on a machine of {cores} cores, and this one has {here}: its "
                "parameters may not hold here (benchmarks/calibrate.py --run fits this "
                "machine)"
            ]
        ), said
    assert (config.cpu_launch_us, config.cpu_core_gbps) == (0.0, 3.0)
    # calibrate_gpu.py's report has keys a CPU model has too: it used to set them silently.
    path.write_text('{"model": "shared_gpu_machine", "params": {"launch_us": 7}}')
    with pytest.raises(ValueError, match="'shared_gpu_machine' model is not a CPU cost model"):
        torch_xdev._registration.apply_cpu_model_file(_C.BackendConfig(), str(path))


def _ddp_bucket_in_heap(rank: int, world: int) -> tuple[bool, int]:
    dist.init_process_group("xdev", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    model(torch.randn(2, 16)).sum().backward()
    info = torch_xdev.describe()
    dist.destroy_process_group()
    return info["ddp_shared_buckets"], info["symmetric_heap"]["bytes_in_use"]


@pytest.mark.parametrize("switch, shared", [("0", True), ("false", True), ("1", False)])
def test_describe_reads_ddp_comm_mem_as_pytorch_does(switch: str, shared: bool) -> None:
    # c10d's Reducer leaves DDP's buckets to the backend unless the variable is "1": describe()
    # said "off" for "false" while the buckets were in the heap.
    for in_heap, bytes_in_use in run_ranks(
        _ddp_bucket_in_heap, 2, env={"DDP_DISABLE_COMM_MEM": switch}
    ):
        assert (in_heap, bytes_in_use > 0) == (shared, shared), (switch, in_heap, bytes_in_use)
