"""The benchmarks run: tiny runs of benchmarks/allreduce.py, gather_scatter.py, fsdp_step.py,
ddp_step.py and network.py, and ddp_step.py's check against Gloo fed parameters that differ.

Not timings (these runs are too short to mean anything), but the scripts themselves: each
checks xdev's results against Gloo's before timing and exits non-zero on a difference, so a
green run means the scripts work and what they time is correct. The JSON they write is
checked against what was asked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import torch_xdev
from benchmark_modules import BENCHMARKS, load_benchmark
from harness import subprocess_env

# The ranks must import the torch_xdev this process tested (an in-place build or the installed
# one); the scripts import their siblings from benchmarks/ (BENCHMARKS) of the source tree.
PACKAGE_ROOT = Path(torch_xdev.__file__).resolve().parents[1]


def run_benchmark(
    script: str,
    *args: str,
    launcher: tuple[str, ...] = (),
    timeout: float = 300,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    env = subprocess_env()
    env.update(extra_env or {})
    command = [sys.executable, *launcher, str(BENCHMARKS / script), *args]
    with subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # The ranks a script started would outlive it, waiting on each other: end its
            # whole session (it has one of its own), not the script alone.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def read_rows(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    data = json.loads(path.read_text())
    return data["metadata"], data["rows"]


# An XDEV_* variable that changes nothing measured (WARN: no plan logging, as unset) but must
# still be recorded: the header and the JSON name every XDEV_* a run had.
QUIET_DEBUG = {"XDEV_DEBUG": "WARN"}
QUIET_DEBUG_LINE = "# XDEV_* in the environment: XDEV_DEBUG=WARN"


def test_allreduce_cpu_rows(tmp_path: Path) -> None:
    out = tmp_path / "allreduce.json"
    proc = run_benchmark(
        "allreduce.py",
        *("--nproc", "2", "--sizes", "4KiB,64KiB", "--iters", "2", "--warmup", "1"),
        *("--algorithms", "auto,flat,shared_empty", "--no-deepspeed", "--json", str(out)),
        *("--rounds", "2"),  # the rounds take turns; 2 calls each, so cheap
        extra_env=QUIET_DEBUG,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta, rows = read_rows(out)
    assert meta["nproc"] == 2 and meta["sizes"] == [4096, 65536] and meta["rounds"] == 2
    assert meta["xdev_environment"] == QUIET_DEBUG and QUIET_DEBUG_LINE in proc.stdout
    assert meta["deepspeed"]["skipped"]
    backends = {(r["size_bytes"], r["backend_base"], r["algorithm"]) for r in rows}
    for size in (4096, 65536):
        for algorithm in (None, "auto", "flat", "shared_empty"):
            base = "gloo" if algorithm is None else "xdev"
            assert (size, base, algorithm) in backends
    # The rows keep their order (Gloo's first) whichever variant a round starts with.
    assert [r["backend_base"] for r in rows[:4]] == ["gloo", "xdev", "xdev", "xdev"]
    for row in rows:
        assert row["time_us"] > 0 and row["iters"] == 2
        assert row["count"] * 4 == row["size_bytes"]
        if row["backend_base"] == "gloo":
            assert row["vs_gloo"] == 1.0
        if row["algorithm"] == "auto":
            assert row["auto_picked"] in torch_xdev.ALGORITHMS, row
    assert "xdev/auto(" in proc.stdout  # the table names auto's pick


def test_allreduce_across_fake_hosts_fits_the_network(tmp_path: Path) -> None:
    out, model = tmp_path / "hosts.json", tmp_path / "net.json"
    proc = run_benchmark(
        "allreduce.py",
        *("--nproc", "4", "--hosts", "2", "--sizes", "4KiB,64KiB", "--iters", "2"),
        *("--warmup", "1", "--rounds", "1", "--json", str(out), "--net-model-out", str(model)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta, rows = read_rows(out)
    assert meta["hosts"] == 2  # the JSON says how the ranks were split, as the header does
    assert {r["backend"].split("(")[0] for r in rows} == {"gloo", "xdev/auto", "xdev/heap"}
    assert "two-level" in proc.stdout  # the traffic header, from the plans
    # Runs this short may hide the growth with size; then the fit says so and writes nothing.
    if "network fit: not written: " not in proc.stdout:
        params = json.loads(model.read_text())["params"]
        assert params["net_latency_us"] > 0 and params["net_stream_gbps"] > 0


def test_network_fits_the_model_on_fake_hosts(tmp_path: Path) -> None:
    """benchmarks/network.py under torchrun, 2 fake hosts of 2 ranks: every variant timed at
    every size, a model file xdev loads, and xdev timed again with it."""
    out, model = tmp_path / "network.json", tmp_path / "net.json"
    proc = run_benchmark(
        "network.py",
        *("--fake-hosts", "2", "--sizes", "64KiB,16MiB", "--rounds", "1", "--iters", "4"),
        *("--out", str(model), "--json", str(out)),
        launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    meta, rows = read_rows(out)
    assert meta["hosts"] == ["fake-host-0", "fake-host-1"] and meta["ranks_per_host"] == 2
    variants = ("ring", "one", "all", "xdev", "xdev_fitted")
    assert {(r["size_bytes"], r["variant"]) for r in rows} == {
        (s, v) for s in (65536, 16 << 20) for v in variants
    }
    assert all(r["time_us"] > 0 for r in rows)
    for row in rows:  # auto's choice, with the model's predictions
        assert (row["reason"] is not None) == row["variant"].startswith("xdev"), row
        assert row["ran"] in ((None,) if row["reason"] is None else ("two levels", "Gloo's ring"))
    config = torch_xdev._C.BackendConfig()
    torch_xdev._registration.apply_cpu_model_file(config, str(model))
    fit = meta["network_fit"]
    assert config.net_latency_us == fit["net_latency_us"] and config.net_stream_gbps > 0
    assert "xdev_fitted at 16MiB ran " in proc.stdout and ": 2 hosts x 2 ranks" in proc.stdout


def test_network_needs_torchrun_and_several_hosts() -> None:
    proc = run_benchmark("network.py", "--rounds", "1")
    assert proc.returncode == 2 and "run this under torchrun" in proc.stderr, proc.stderr
    proc = run_benchmark(
        "network.py",
        *("--sizes", "4KiB,8KiB"),
        launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"),
    )
    assert proc.returncode != 0 and "every rank is on host" in proc.stderr, proc.stderr[-3000:]


def test_gather_scatter_rows(tmp_path: Path) -> None:
    out = tmp_path / "gs.json"
    proc = run_benchmark(
        "gather_scatter.py", "--nproc", "2", "--sizes", "4KiB", "--rounds", "1", "--json", str(out),
        extra_env=QUIET_DEBUG,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta, rows = read_rows(out)
    assert rows and meta["xdev_environment"] == QUIET_DEBUG
    lines = proc.stdout.splitlines()
    assert QUIET_DEBUG_LINE in lines[: lines.index("#")]  # in the header, above the tables


def test_gather_scatter_float16_reduce_scatter_at_three_ranks(tmp_path: Path) -> None:
    """float16 sums of 3 ranks round in another order on xdev than on Gloo: the check before
    timing allows for it (allreduce.py's tolerance), where assert_close's defaults aborted the
    run. 96 and 100 B round to the same 48 elements: each row compares with its own Gloo row."""
    out = tmp_path / "gs_fp16.json"
    proc = run_benchmark(
        "gather_scatter.py",
        *("--nproc", "3", "--dtype", "float16", "--sizes", "4KiB,96,100"),
        *("--collectives", "reduce_scatter", "--rounds", "1", "--json", str(out)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["size_bytes"] for r in rows[::4]] == [4092, 96, 96]
    assert [r["backend"] for r in rows[:4]] == ["gloo", "xdev", "xdev_sc", "xdev_heap"]
    for i in range(0, len(rows), 4):  # one requested size: Gloo's row, then xdev's three
        gloo = rows[i]
        assert gloo["vs_baseline"] == 1.0, gloo
        for row in rows[i + 1 : i + 4]:
            assert row["vs_baseline"] == pytest.approx(gloo["time_us"] / row["time_us"]), row


def test_gather_scatter_across_hosts_rows(tmp_path: Path) -> None:
    out = tmp_path / "gs_hosts.json"
    proc = run_benchmark(
        "gather_scatter.py", "--nproc", "4", "--hosts", "2", "--sizes", "4KiB", "--rounds", "1",
        "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["collective"] for r in rows} == {"reduce_scatter", "all_gather", "broadcast"}
    broadcast = {r["backend"]: r for r in rows if r["collective"] == "broadcast"}
    # xdev's row names what the model chose (describe()["last_broadcast"]) and says why.
    (xdev,) = [name for name in broadcast if name != "gloo"]
    assert "gloo" in broadcast and xdev in ("xdev(two_level)", "xdev(fallback)"), set(broadcast)
    assert "predicted" in broadcast[xdev]["reason"], broadcast[xdev]
    assert broadcast[xdev]["busbw_gbps"] == broadcast[xdev]["algbw_gbps"]


def test_fsdp_step_rows(tmp_path: Path) -> None:
    out = tmp_path / "fsdp.json"
    proc = run_benchmark(
        "fsdp_step.py",
        *("--hidden", "64", "--layers", "2", "--rounds", "1", "--steps", "1", "--warmup", "0"),
        *("--json", str(out)),
        launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"),
    )
    # 1: parameters differ from Gloo's, or did not move.
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    meta, row_list = read_rows(out)
    assert meta["match_tolerance"] == {"rtol": 1e-5, "atol": 1e-7}
    rows = {r["variant"]: r for r in row_list}
    assert set(rows) == {"xdev", "xdev_heap", "gloo", "fsdp_alone", "fsdp_no_comm", "local"}
    for name in ("xdev", "xdev_heap", "gloo"):  # they talk: compared with Gloo, net of FSDP2
        row = rows[name]
        assert row["matches_gloo"] is True and row["net_ms"] is not None, row
        # 2 ranks add in one order: Gloo's parameters exactly.
        assert row["max_diff_vs_gloo"] == 0.0 and row["diff_vs_tolerance"] == 0.0, row
        # Trained: 2 steps move the largest parameters ~100 times the tolerance.
        assert row["trained"] is True and row["change_vs_tolerance"] > 10, row
        assert 1e-6 < row["max_change_from_initial"] < 1e-3, row
    assert rows["gloo"]["net_vs_gloo"] in (None, 1.0)  # None where Gloo's net was <= 0
    # The variant without communication is the baseline, compared with nothing.
    for name in ("fsdp_no_comm", "fsdp_alone", "local"):
        assert rows[name]["matches_gloo"] is None and rows[name]["trained"] is None, rows[name]
    assert rows["fsdp_no_comm"]["net_ms"] is None
    assert "# parameter check" in proc.stdout and "# BROKEN" not in proc.stdout
    table = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert len(table) == 7 and not [line for line in table if "BROKEN" in line], table


def test_fsdp_step_flags_a_variant_that_does_not_train(fsdp_step: ModuleType) -> None:
    """A variant whose parameters never change (as fsdp_no_comm's: its reduce-scatter leaves
    the gradients at zero) is BROKEN, though it ends within 1e-4 of a Gloo that barely moved;
    so is one whose parameters went non-finite. The checks read the models only (no groups)."""
    moved = 2e-5  # about what the tests' 2 steps of the small model move a parameter
    runners = []
    for variant in fsdp_step.VARIANTS:
        model = fsdp_step.make_model(16, 2)
        initial = [p.detach().clone() for p in model.parameters()] if variant.spans_ranks else None
        if variant.name in ("xdev", "gloo"):
            with torch.no_grad():
                for p in model.parameters():
                    p -= moved
        elif variant.name == "xdev_heap":  # non-finite, though it moved
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        runner = fsdp_step.Runner(variant, None, model, optimizer, initial=initial)
        runner.samples.append(1e-3)
        runners.append(runner)
    still = [r for r in runners if r.variant.name == "fsdp_no_comm"][0]
    still.initial = [p.detach().clone() for p in still.model.parameters()]  # compared, as if
    n = len(runners)
    rows_list = fsdp_step.summarise(
        runners, fsdp_step.local_checks(runners), [None] * n, [0.0] * n, [0.0] * n
    )
    rows = {r["variant"]: r for r in rows_list}
    lines, broken = fsdp_step.check_lines(rows_list)
    for name in ("xdev", "gloo"):
        assert rows[name]["matches_gloo"] is True and rows[name]["trained"] is True, rows[name]
    assert rows["fsdp_no_comm"]["max_diff_vs_gloo"] == pytest.approx(moved, rel=1e-2)  # < 1e-4
    assert rows["fsdp_no_comm"]["matches_gloo"] is False
    assert rows["fsdp_no_comm"]["trained"] is False
    assert rows["fsdp_no_comm"]["max_change_from_initial"] == 0.0
    assert rows["xdev_heap"]["matches_gloo"] is False and rows["xdev_heap"]["trained"] is False
    assert rows["local"]["trained"] is None and rows["fsdp_alone"]["matches_gloo"] is None
    assert broken == ["xdev_heap", "fsdp_no_comm"]
    (differ,) = [line for line in lines if "differ from Gloo's" in line]
    (not_moved,) = [line for line in lines if "did not move" in line]
    assert "fsdp_no_comm" in differ and "fsdp_no_comm" in not_moved and "xdev," not in differ
    assert "BROKEN" in "\n".join(fsdp_step.format_table(rows_list))


def test_ddp_step_rows_match_gloo(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    proc = run_benchmark(
        "ddp_step.py",
        *("--hidden", "64", "--layers", "2", "--rounds", "1", "--steps", "1", "--warmup", "0"),
        *("--json", str(out)),
        launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"),
    )
    # 1: parameters differ across ranks, or from Gloo's.
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    meta, row_list = read_rows(out)
    rows = {r["variant"]: r for r in row_list}
    assert meta["match_tolerance"]["fp32"]["atol"] < meta["match_tolerance"]["fp16_hooks"]["atol"]
    for name, row in rows.items():
        if row["ranks_equal"] is None:  # no communication: nothing to compare with
            assert row["compared_with"] is None and row["max_diff_vs_gloo"] is None, row
            continue
        reference = "gloo_fp16_hook" if name == "xdev_fp16_hook" else "gloo"
        assert row["compared_with"] == reference and row["matches_gloo"] is True, row
        assert 0 <= row["max_diff_vs_gloo"] < 1e-6, row
    assert {n for n, r in rows.items() if r["ranks_equal"] is None} == {
        "noop_hook",
        "noop_hook_view",
        "no_ddp",
    }
    assert "# Gloo check: largest |parameter - Gloo's|" in proc.stdout
    assert "BROKEN" not in proc.stdout and "NOT CHECKED" not in proc.stdout


@pytest.fixture(scope="module")
def ddp_step() -> ModuleType:
    return load_benchmark("ddp_step")


@pytest.fixture(scope="module")
def fsdp_step() -> ModuleType:
    return load_benchmark("fsdp_step")


def trained_runners(ddp_step: ModuleType, names: tuple[str, ...]) -> list[Any]:
    """One Runner per variant, every model the same (as after the same steps), no groups: the
    comparison with Gloo reads the models only."""
    runners = []
    for variant in ddp_step.VARIANTS:
        if variant.name in names:
            model = ddp_step.make_model(16, 2)
            with torch.no_grad():  # the weight shift() moves: at 0, atol alone bounds it
                next(model.parameters())[0, 0] = 0.0
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            runner = ddp_step.Runner(variant, None, model, model, optimizer)
            runner.samples.append(1e-3)
            runners.append(runner)
    return runners


def shift(runner: Any, by: float) -> None:
    """Moves one weight of the runner's model by ``by``, as a wrong reduction would."""
    with torch.no_grad():
        next(runner.model.parameters())[0, 0] += by


def checked_rows(ddp_step: ModuleType, runners: list[Any]) -> tuple[dict[str, Any], list[str]]:
    """What the run reports: rows by variant (as in the JSON) and the lines after the table.
    Every rank is taken to hold the same parameters (``ranks_equal`` True where expected)."""
    equal = [True if r.variant.communicates else None for r in runners]
    matches = ddp_step.local_differences(runners)
    rows = ddp_step.summarise(runners, equal, [{} for _ in runners], matches)
    lines, broken = ddp_step.check_lines(rows)
    assert broken == [r["variant"] for r in rows if r["matches_gloo"] is False]
    return {r["variant"]: r for r in rows}, lines


def test_ddp_step_catches_a_reduction_every_rank_gets_alike_wrong(ddp_step: ModuleType) -> None:
    runners = trained_runners(ddp_step, ddp_step.VARIANT_NAMES)
    by_name = {r.variant.name: r for r in runners}
    # 5e-6: what a broadcast of rank 0's gradients instead of their average left at the
    # benchmark's defaults; equal on every rank, so ranks_agree alone passes it.
    shift(by_name["xdev_shared_avg"], 5e-6)
    # Within fp16 rounding of the gradients, so the fp16 hook passes; an fp32 variant does not.
    shift(by_name["xdev_fp16_hook"], 5e-7)
    shift(by_name["xdev_staged"], 5e-7)
    rows, lines = checked_rows(ddp_step, runners)
    assert rows["xdev_shared_avg"]["matches_gloo"] is False
    assert rows["xdev_shared_avg"]["max_diff_vs_gloo"] == pytest.approx(5e-6, rel=1e-2)  # in fp32
    assert rows["xdev_staged"]["matches_gloo"] is False
    assert rows["xdev_fp16_hook"]["matches_gloo"] is True
    assert rows["xdev_fp16_hook"]["compared_with"] == "gloo_fp16_hook"
    for name in ("xdev_shared", "xdev_shared_view", "gloo", "gloo_fp16_hook"):
        assert rows[name]["matches_gloo"] is True and rows[name]["max_diff_vs_gloo"] == 0.0
    for name in ("noop_hook", "noop_hook_view", "no_ddp"):  # each rank trains on its own data
        assert rows[name]["compared_with"] is None and rows[name]["matches_gloo"] is None
    (broken,) = [line for line in lines if line.startswith("# BROKEN")]
    assert "from Gloo's" in broken and "xdev_shared_avg" in broken and "xdev_staged" in broken
    assert "xdev_fp16_hook" not in broken


def test_ddp_step_non_finite_parameters_never_match(ddp_step: ModuleType) -> None:
    runners = trained_runners(ddp_step, ("xdev_shared", "gloo"))
    shift(runners[0], float("nan"))  # NaN - x compares as within any bound: it must not here
    rows, _ = checked_rows(ddp_step, runners)
    assert rows["xdev_shared"]["matches_gloo"] is False
    assert rows["xdev_shared"]["max_diff_vs_gloo"] == float("inf")


def test_ddp_step_says_when_gloo_is_missing(ddp_step: ModuleType) -> None:
    """Without gloo the check cannot run: the output says so, and nothing is called BROKEN."""
    names = ("xdev_shared", "xdev_fp16_hook", "gloo_fp16_hook", "noop_hook")
    runners = trained_runners(ddp_step, names)
    shift(runners[0], 1.0)  # would fail the check, had it run
    rows, lines = checked_rows(ddp_step, runners)
    for name in ("xdev_shared", "gloo_fp16_hook"):
        assert rows[name]["compared_with"] is None and rows[name]["matches_gloo"] is None
    # The fp16 hook on xdev still has Gloo's fp16 hook to compare with.
    assert rows["xdev_fp16_hook"]["compared_with"] == "gloo_fp16_hook"
    (unchecked,) = [line for line in lines if "NOT CHECKED" in line]
    assert "xdev_shared" in unchecked and "gloo_fp16_hook" in unchecked
    assert "noop_hook" not in unchecked and "xdev_fp16_hook" not in unchecked
    assert not [line for line in lines if "BROKEN" in line]


def test_parameter_differences(ddp_step: ModuleType) -> None:
    parameter_differences = ddp_step.parameter_differences  # step_common's, shared
    ref = [torch.tensor([0.0, 1.0, -2.0]), torch.zeros(0)]
    assert parameter_differences(ref, ref, 0.0, 0.0) == (0.0, 0.0)  # 0/0 never a NaN
    mine = [torch.tensor([1e-6, 1.0, -2.0]), torch.zeros(0)]
    diff, ratio = parameter_differences(mine, ref, 1e-5, 1e-7)
    assert diff == pytest.approx(1e-6) and ratio == pytest.approx(10.0)
    # The bound grows with |reference|: 1e-5 off 2.0 is within rtol 1e-5 (2e-5 allowed).
    mine = [torch.tensor([0.0, 1.0, -2.00001]), torch.zeros(0)]
    assert parameter_differences(mine, ref, 1e-5, 1e-7)[1] < 1
    for bad in (float("inf"), float("nan")):
        mine = [torch.tensor([0.0, 1.0, bad]), torch.zeros(0)]
        assert parameter_differences(mine, ref, 1e-5, 1e-7) == (float("inf"), float("inf"))
    with pytest.raises(ValueError):
        parameter_differences(ref[:1], ref, 1e-5, 1e-7)


def test_allreduce_bad_arguments_say_why() -> None:
    proc = run_benchmark("allreduce.py", "--nproc", "2", "--algorithms", "nope")
    assert proc.returncode != 0 and "unknown algorithm 'nope'" in proc.stderr
    proc = run_benchmark("allreduce.py", "--nproc", "3", "--hosts", "2")
    assert proc.returncode != 0 and "--hosts needs CPU mode and divides --nproc" in proc.stderr
    if not torch.cuda.is_available():
        proc = run_benchmark("allreduce.py", "--device", "cuda", "--nproc", "2")
        assert proc.returncode != 0 and "torch sees no CUDA GPU" in proc.stderr
    # Refused before any rank starts, with a line that says why (not a traceback).
    for args, why in (
        (("--nproc", "4", "--hosts", "2", "--pieces", "two"), "--pieces takes piece counts >= 1"),
        (("--nproc", "4", "--hosts", "2", "--pieces", "0"), "--pieces takes piece counts >= 1"),
        (("--nproc", "2", "--hosts", "2"), "at least 2 ranks per host"),
        (("--nproc", "2", "--slot-bytes", "1"), "--slot-bytes: Options.shm_slot_bytes"),
    ):
        proc = run_benchmark("allreduce.py", *args, "--sizes", "4KiB", "--no-deepspeed")
        assert proc.returncode != 0 and why in proc.stderr, (args, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, (args, proc.stderr[-3000:])


@pytest.mark.parametrize("script", ["allreduce.py", "gather_scatter.py"])
def test_spawning_benchmarks_refuse_torchrun(script: str) -> None:
    """Under torchrun (its RANK and WORLD_SIZE set) each process would start a world of its own
    whose ranks wait forever for torchrun's store: the scripts that start their own ranks say
    so and stop before starting any."""
    proc = run_benchmark(
        script,
        *("--nproc", "2", "--sizes", "4KiB"),
        extra_env={"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"},
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{script} starts its own ranks: run it without torchrun" in proc.stderr
    assert f"python {BENCHMARKS / script} --nproc 2" in proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout  # before measuring anything


@pytest.mark.parametrize(
    "args, why",
    [
        (("--sizes", "4KB"), "bad size list '4KB'"),
        (("--sizes", "4KiB,"), "bad size list '4KiB,'"),
        (("--sizes", "4B"), "below one float32 element per rank"),  # would time 0-byte rows
        (("--rounds", "0"), "--rounds >= 1"),
        (("--dtype", "floaty"), "'floaty' is not a torch dtype"),
        (("--nproc", "1"), "--nproc must be >= 2"),
        (("--hosts", "2"), "at least 2 ranks per host"),
    ],
)
def test_gather_scatter_bad_arguments_say_why(args: tuple[str, ...], why: str) -> None:
    proc = run_benchmark("gather_scatter.py", "--nproc", "2", "--sizes", "4KiB", *args)
    assert proc.returncode == 2 and why in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_rounding_stops_when_a_rank_fails() -> None:
    """A rank that dies (here: rank 0 cannot listen on a port in use) ends the run with an
    error; its peers, waiting for it, used to keep the script waiting for 15 minutes."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        proc = run_benchmark(
            "rounding.py", "--nproc", "2", "--numel", "64", "--port", port, timeout=120
        )
    assert proc.returncode == 1 and "error: rank 0 failed" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("module", ["allreduce_cuda", "allreduce_common"])
def test_benchmark_modules_import(module: str) -> None:
    # The CUDA mode cannot run without a GPU: at least its module must import cleanly.
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        cwd=BENCHMARKS,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(BENCHMARKS), str(PACKAGE_ROOT)]),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.torch_free
def test_cpu_kernels_rows(tmp_path: Path) -> None:
    """benchmarks/cpu_kernels.py builds its torch-free binary and times every dtype and op."""
    out = tmp_path / "cpu_kernels.json"
    proc = run_benchmark("cpu_kernels.py", "--sizes", "4KiB", "--reps", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metadata, rows = read_rows(out)
    assert metadata["sources"] == 2
    timed = {(r["dtype"], r["op"]) for r in rows if r["bytes"] == 4096 and r["gbps"] > 0}
    dtypes = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8")
    ops = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
    assert timed == {(d, o) for d in dtypes for o in ops} | {("bytes", "memcpy")}
    assert "float16" in proc.stdout and "memcpy" in proc.stdout
