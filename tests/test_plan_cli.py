"""The cost-model CLI, `python -m torch_xdev.plan`.

Its code: torch_xdev/plan.py and csrc/backend/plan_bindings.cc.

Sizes stay at or below 1 MiB: the simulation of large payloads is slower.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import torch_xdev
from torch_xdev import plan
from harness import subprocess_env
from topologies import DGX1_V100

# The directory holding the torch_xdev this process tested: the source tree for an in-place build.
PACKAGE_ROOT = Path(torch_xdev.__file__).resolve().parents[1]


ROW = re.compile(
    r"^\s*(?P<size>\d+)\s+(?P<label>\S+(?: \(reference\))?)\s+(?P<time>[\d.]+)\s+"
    r"(?P<algbw>[\d.]+)\s+(?P<busbw>[\d.]+)\s*(?P<choice>\*?)$"
)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = subprocess_env()
    return subprocess.run(
        [sys.executable, "-m", "torch_xdev.plan", *args],
        cwd=PACKAGE_ROOT,  # the repository root for an in-place build
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def json_rows(tmp_path: Path, *argv: str) -> list[dict[str, Any]]:
    """The rows `plan.main(argv)` writes with --json."""
    out = tmp_path / "rows.json"
    assert plan.main([*argv, "--json", str(out)]) == 0
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    return rows


def test_table_marks_the_fastest_runnable_plan() -> None:
    # x4 steps: each size costs about a second of simulation (the 384-pack balanced plan).
    proc = run_cli("--topology", "dgx1-v100", "--sizes", "4KiB:1MiB:4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# machine: dgx1-v100 (8 devices)\n# source: DGX-1"), proc.stdout
    by_size: dict[int, list[re.Match[str]]] = {}
    for line in proc.stdout.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = ROW.match(line)
        assert match is not None, f"unparsed line {line!r} in\n{proc.stdout}"
        by_size.setdefault(int(match["size"]), []).append(match)
    assert sorted(by_size) == [4096 << k for k in range(0, 9, 2)], proc.stdout
    for size, matches in by_size.items():
        chosen = [m for m in matches if m["choice"] == "*"]
        assert len(chosen) == 1, (size, proc.stdout)
        runnable = [m for m in matches if "reference" not in m["label"]]
        assert [m["label"] for m in matches if m not in runnable] == ["ring (reference)"]
        assert chosen[0] in runnable
        # Rounding to 0.01 us is monotone, so the fastest stays the smallest.
        assert float(chosen[0]["time"]) == min(float(m["time"]) for m in runnable), size
        for m in matches:
            algbw, busbw = float(m["algbw"]), float(m["busbw"])
            assert busbw == pytest.approx(algbw * 2 * (8 - 1) / 8, abs=0.015), m.group(0)


def test_between_powers_of_two_the_mark_is_what_auto_runs() -> None:
    # A group chooses once per size class (the power of two at or above the size). On an HGX
    # H100 the model predicts flat fastest at exactly 5 MiB and NVLS at 8 MiB: auto runs NVLS
    # for every size above 4 MiB up to 8 MiB, and the mark at 5 MiB said flat.
    model = plan.machine("hgx-h100")
    marked = {
        size: [r["label"] for r in plan.size_rows(model, size) if r["chosen"]]
        for size in (5 << 20, 8 << 20)
    }
    assert marked[5 << 20] == marked[8 << 20] == ["nccl_nvls/Simple"], marked
    at_5mib = {r["label"]: r["time_us"] for r in plan.size_rows(model, 5 << 20)}
    assert at_5mib["flat"] < at_5mib["nccl_nvls/Simple"], at_5mib  # the case the test is about


def test_sizes_past_what_the_model_takes_are_refused() -> None:
    # Were a segfault (an all-gather's window count overflowed) or an endless loop.
    cpu2 = plan.machine("cpu-2")
    with pytest.raises(ValueError, match="at most 2"):
        torch_xdev._C.plan.choose_gather_scatter(cpu2, "all_gather", 6148914691236517208)
    with pytest.raises(ValueError, match="at most 2"):
        torch_xdev._C.plan.size_class(1 << 62)


def test_topology_file_matches_builtin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = tmp_path / "v100.json"
    topo.write_text(json.dumps({"name": "my-dgx1", "nvlink": DGX1_V100}))
    model = plan.load_topology_file(topo)
    builtin = plan.machine("dgx1-v100")
    assert model.name == "my-dgx1"
    assert model.links() == builtin.links() == DGX1_V100
    assert torch_xdev._C.plan.classify(DGX1_V100) == "dgx1"

    out_file, out_builtin = tmp_path / "file.json", tmp_path / "builtin.json"
    assert plan.main(["--topology", str(topo), "--sizes", "256KiB", "--json", str(out_file)]) == 0
    assert "# machine: my-dgx1 (8 devices)" in capsys.readouterr().out
    assert (
        plan.main(["--topology", "dgx1-v100", "--sizes", "256KiB", "--json", str(out_builtin)]) == 0
    )
    from_file = json.loads(out_file.read_text())
    from_builtin = json.loads(out_builtin.read_text())
    assert len(from_file) == len(from_builtin) > 3
    for a, b in zip(from_file, from_builtin):
        assert a["size"] == 256 << 10
        assert (a["label"], a["chosen"]) == (b["label"], b["chosen"])
        for key in ("time_us", "algbw_gbps", "busbw_gbps"):
            assert a[key] == pytest.approx(b[key], rel=1e-12), (a, b)


@pytest.mark.parametrize(
    "nvlink, problem",
    [
        ([[0, 1, 1], [1, 0, 1]], "not a square matrix: row 0 has 3 entries, but there are 2 rows"),
        ([[0, 1], [2, 0]], "not symmetric: [0][1] = 1 but [1][0] = 2"),
        ([[0, -1], [-1, 0]], "'nvlink'[0][1] is negative"),
        ([[0, 1.5], [1.5, 0]], "must be an integer link count"),
    ],
)
def test_bad_topology_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], nvlink: object, problem: str
) -> None:
    topo = tmp_path / "bad.json"
    topo.write_text(json.dumps({"nvlink": nvlink}))
    assert plan.main(["--topology", str(topo), "--sizes", "4KiB"]) != 0
    err = capsys.readouterr().err
    assert str(topo) in err and problem in err, err


def test_bad_topology_file_cli(tmp_path: Path) -> None:
    topo = tmp_path / "bad.json"
    topo.write_text(json.dumps({"name": "bad", "nvlink": [[0, 1, 1], [1, 0, 1]]}))
    proc = run_cli("--topology", str(topo), "--sizes", "4KiB")
    assert proc.returncode != 0
    assert f"{topo}: 'nvlink' is not a square matrix" in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_unknown_topology(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["--topology", "dgx2", "--sizes", "4KiB"]) != 0
    err = capsys.readouterr().err
    assert "dgx2" in err and "dgx1-v100" in err, err
    # cpu-<N> takes 1 to 999 ranks: the refusal of 1024 says so rather than list cpu-<N> alone.
    assert plan.main(["--topology", "cpu-1024", "--sizes", "4KiB"]) != 0
    err = capsys.readouterr().err
    assert "unknown machine 'cpu-1024'" in err and "cpu-<N> (N ranks, 1 to 999)" in err, err


@pytest.mark.parametrize(
    "sizes, problem",
    [
        ("1KiB:bogus", "'bogus' is not a size"),
        ("1KiB:1MiB:1", "factor F of A:B:F must be an integer >= 2"),
        ("1MiB:1KiB", "start is larger than its end"),
        ("4XiB", "unknown unit 'XiB'"),
        ("6", "not a multiple of 4"),
    ],
)
def test_bad_sizes(capsys: pytest.CaptureFixture[str], sizes: str, problem: str) -> None:
    with pytest.raises(SystemExit) as exc:
        plan.main(["--topology", "dgx1-v100", "--sizes", sizes])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --sizes" in err and problem in err, err


def test_parse_sizes() -> None:
    assert plan.parse_sizes("4KiB:1MiB") == [4096 << k for k in range(9)]
    assert plan.parse_sizes("4K:64M:16") == [4 << 10, 64 << 10, 1 << 20, 16 << 20]
    assert plan.parse_sizes("8,1K, 2MiB,1G") == [8, 1024, 2 << 20, 1 << 30]
    assert plan.parse_sizes("4kib:12KiB") == [4096, 8192]


def parse_rows(stdout: str) -> dict[int, list[re.Match[str]]]:
    by_size: dict[int, list[re.Match[str]]] = {}
    for line in stdout.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = ROW.match(line)
        assert match is not None, f"unparsed line {line!r} in\n{stdout}"
        by_size.setdefault(int(match["size"]), []).append(match)
    return by_size


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_gather_scatter_table_marks_the_fastest_form(collective: str) -> None:
    # Four ranks on a two-core host: staged wins small payloads (one barrier fewer, and
    # barriers sleep there), reading in place from the heap wins large ones.
    proc = run_cli("--topology", "cpu-4", "--collective", collective, "--sizes", "4KiB,16MiB")
    assert proc.returncode == 0, proc.stderr
    assert f"# predicted {collective}" in proc.stdout, proc.stdout
    by_size = parse_rows(proc.stdout)
    assert sorted(by_size) == [4096, 16 << 20], proc.stdout
    for size, matches in by_size.items():
        labels = [m["label"] for m in matches]
        assert labels == ["staged/256KiB", "single_copy", "in_place", "ring (reference)"], labels
        chosen = [m for m in matches if m["choice"] == "*"]
        assert len(chosen) == 1 and chosen[0]["label"] != "ring (reference)", proc.stdout
        runnable = [float(m["time"]) for m in matches if "reference" not in m["label"]]
        assert float(chosen[0]["time"]) == min(runnable), size
        for m in matches:
            algbw, busbw = float(m["algbw"]), float(m["busbw"])
            assert busbw == pytest.approx(algbw * (4 - 1) / 4, abs=0.015), m.group(0)
            assert algbw == pytest.approx(size / float(m["time"]) / 1e3, abs=0.006), m.group(0)
    assert [m["label"] for m in by_size[4096] if m["choice"]] == ["staged/256KiB"]
    assert [m["label"] for m in by_size[16 << 20] if m["choice"]] == ["in_place"]
    # Larger payloads take longer in every form.
    for small, large in zip(by_size[4096], by_size[16 << 20]):
        assert float(small["time"]) < float(large["time"])


def test_gather_scatter_json_rows_and_forms_left_out(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = ["--topology", "cpu-2", "--collective", "all_gather", "--sizes", "1MiB"]
    assert plan.main([*argv, "--no-in-place", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    # The allreduce's row format, the form in "algorithm".
    assert set(rows[0]) == set(plan.Row.__annotations__)
    assert [(r["label"], r["algorithm"]) for r in rows] == [
        ("staged/256KiB", "staged"),
        ("single_copy", "single_copy"),
        ("in_place", "in_place"),
        ("ring (reference)", "ring"),
    ]
    # in_place is still predicted, but cannot be chosen.
    assert [r["label"] for r in rows if r["chosen"]] != ["in_place"]
    chosen = [r for r in rows if r["chosen"]]
    allowed = [r for r in rows if r["label"] in ("staged/256KiB", "single_copy")]
    assert len(chosen) == 1 and chosen[0]["time_us"] == min(r["time_us"] for r in allowed)
    assert plan.main([*argv, "--no-in-place", "--no-single-copy", "--json", str(out)]) == 0
    assert [r["label"] for r in json.loads(out.read_text()) if r["chosen"]] == ["staged/256KiB"]


def test_collective_default_is_the_allreduce(tmp_path: Path) -> None:
    explicit, default = tmp_path / "explicit.json", tmp_path / "default.json"
    argv = ["--topology", "cpu-2", "--sizes", "64KiB"]
    assert plan.main([*argv, "--collective", "allreduce", "--json", str(explicit)]) == 0
    assert plan.main([*argv, "--json", str(default)]) == 0
    assert json.loads(explicit.read_text()) == json.loads(default.read_text())
    assert "flat" in [r["label"] for r in json.loads(default.read_text())]


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--collective", "allreduce", "--no-in-place"], "apply to reduce_scatter and all_gather"),
        (["--collective", "all_gather", "--num-packs", "8"], "applies to the allreduce only"),
        (["--collective", "broadcast"], "invalid choice: 'broadcast'"),
    ],
)
def test_gather_scatter_bad_arguments(
    capsys: pytest.CaptureFixture[str], args: list[str], problem: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        plan.main(["--topology", "cpu-2", "--sizes", "4KiB", *args])
    assert exc.value.code == 2
    assert problem in capsys.readouterr().err


def test_gpu_machines_list_nccl_candidates_and_auto_takes_the_fastest(tmp_path: Path) -> None:
    # 16 MiB, not larger: NVLS already wins there, and simulating xdev's plans slows with size.
    rows = json_rows(tmp_path, "--topology", "hgx-h100", "--sizes", "4KiB,16MiB")
    for size in (4 << 10, 16 << 20):
        at_size = [r for r in rows if r["size"] == size]
        nccl = [r for r in at_size if r["nccl"]]
        assert {r["label"] for r in nccl} >= {"nccl_ring/LL", "nccl_tree/LL128", "nccl_nvls/Simple"}
        assert all(r["label"].startswith("nccl_") and r["algorithm"] == "nccl" for r in nccl)
        (chosen,) = [r for r in at_size if r["chosen"]]
        eligible = [r for r in at_size if not r["ring_reference"]]
        assert chosen["time_us"] == min(r["time_us"] for r in eligible)
        # xdev's one-shot wins small; NVLS (the switch reduces) wins large.
        assert chosen["nccl"] == (size == 16 << 20)
    # CPU machines have no NCCL rows.
    assert not any(r["nccl"] for r in plan.rows(plan.machine("cpu-4"), [1 << 20]))


def test_gpu_machines_list_nccl_gather_scatter_candidates(tmp_path: Path) -> None:
    argv = ["--topology", "hgx-h100", "--collective", "all_gather", "--sizes", "4KiB,256MiB"]
    rows = json_rows(tmp_path, *argv)
    for size in (4 << 10, 256 << 20):
        at_size = [r for r in rows if r["size"] == size]
        nccl = [r for r in at_size if r["nccl"]]
        # NCCL's ring with each protocol and NVLS, never a tree, after xdev's forms.
        assert [r["label"] for r in nccl] == [
            "nccl_ring/LL",
            "nccl_ring/LL128",
            "nccl_ring/Simple",
            "nccl_nvls/Simple",
        ]
        assert all(r["algorithm"] == "nccl" for r in nccl)
        (chosen,) = [r for r in at_size if r["chosen"]]
        eligible = [r for r in at_size if not r["ring_reference"]]
        assert chosen["time_us"] == min(r["time_us"] for r in eligible)
    # The header says what auto runs on CUDA tensors whatever the model marks.
    proc = run_cli(*argv)
    assert "auto still runs NCCL" in proc.stdout, proc.stdout
    # CPU machines: no NCCL rows, no such line.
    proc = run_cli("--topology", "cpu-2", "--collective", "all_gather", "--sizes", "4KiB")
    labels = [m["label"] for matches in parse_rows(proc.stdout).values() for m in matches]
    assert not any(label.startswith("nccl_") for label in labels), labels
    assert "auto still runs NCCL" not in proc.stdout, proc.stdout


def test_several_gpu_hosts_weigh_nccl_across_nodes_against_two_levels(tmp_path: Path) -> None:
    argv = ["--topology", "hgx-h100", "--hosts", "2", "--sizes", "4KiB,256MiB"]
    rows = json_rows(tmp_path, *argv)
    for size in (4 << 10, 256 << 20):
        at_size = [r for r in rows if r["size"] == size]
        # NVLS becomes NVLS tree across nodes; the two-level row comes last and is never chosen.
        assert [r["label"] for r in at_size][-2:] == ["nccl_nvls_tree/Simple", "two_level"]
        (chosen,) = [r for r in at_size if r["chosen"]]
        assert chosen["nccl"]
        assert chosen["time_us"] == min(r["time_us"] for r in at_size if r["nccl"])
    # NCCL 2.20.3's ring Simple over 2 x 8 H100s at 4 KiB, worked by hand: 8.4 us, 26 steps
    # inside a node of 3.4 us and 4 across of 14 us; the bus is 16 channels of 23.175 GB/s
    # (NVLink, under 8 NICs of 50 GB/s), algbw busbw x 16 / 30.
    (ring,) = [r for r in rows if r["size"] == 4 << 10 and r["label"] == "nccl_ring/Simple"]
    expected_s = (8.4 + 26 * 3.4 + 4 * 14.0) * 1e-6 + 4096 / (370.8e9 * 16 / 30)
    assert ring["time_us"] == pytest.approx(expected_s * 1e6)
    # At 256 MiB NCCL's NVLS tree is predicted about twice as fast as two levels: the network
    # time is alike, and two levels add a reduce-scatter and an all-gather inside each host.
    large = {r["label"]: r for r in rows if r["size"] == 256 << 20}
    assert large["nccl_nvls_tree/Simple"]["chosen"]
    assert large["two_level"]["time_us"] > 1.5 * large["nccl_nvls_tree/Simple"]["time_us"]
    # The table gives each size the two-level plan's steps.
    proc = run_cli(*argv)
    assert proc.returncode == 0, proc.stderr
    assert "# 2 hosts x 8 GPUs: NCCL over all ranks (nccl_tree/LL)" in proc.stdout, proc.stdout
    assert "8 NICs x 50 GB/s per host" in proc.stdout


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--topology", "cpu-4", "--hosts", "2"], "on a GPU machine"),
        # One GPU a host: NCCL's model across nodes needs two (was a traceback).
        (["--topology", "ONE_GPU", "--hosts", "2"], "2+ GPUs"),
        (["--topology", "hgx-h100", "--hosts", "2", "--num-packs", "7"], "--num-packs do not"),
        (["--topology", "hgx-h100", "--hosts", "2", "--collective", "all_gather"], "allreduce"),
        (["--topology", "hgx-h100", "--hosts", "0"], "--hosts must be >= 2"),
        (["--topology", "hgx-h100", "--hosts", "2", "--nics", "0"], "--nics must be in 1.."),
        # Past a C++ int (ranks = hosts x GPUs), or not finite: were tracebacks.
        (["--topology", "hgx-h100", "--hosts", str(1 << 31)], "--hosts must be >= 2 and <="),
        (["--topology", "hgx-h100", "--hosts", str(1 << 28)], "--hosts must be >= 2 and <="),
        (["--topology", "hgx-h100", "--hosts", "2", "--nics", str(1 << 31)], "--nics must be"),
        (["--topology", "hgx-h100", "--hosts", "2", "--nic-gbps", "inf"], "--nic-gbps in"),
        # Within a C++ int, but NCCL's ring steps (twice the ranks) were not: a time wrapped.
        (["--topology", "hgx-h100", "--hosts", "268435455"], "--hosts must be >= 2 and <="),
        # So slow that every time was inf, and the JSON not JSON.
        (["--topology", "hgx-h100", "--hosts", "2", "--nic-gbps", "1e-320"], "--nic-gbps in"),
        # Ignored without --hosts (a negative rate too), where the help says they apply.
        (["--topology", "hgx-h100", "--nics", "3"], "apply with --hosts"),
        (["--topology", "hgx-h100", "--nic-gbps", "-5"], "apply with --hosts"),
        (["--topology", "hgx-h100", "--nic-gbps", "50"], "apply with --hosts"),  # the default
        (["--topology", "hgx-h100", "--amd-cpu"], "apply with --hosts"),
    ],
)
def test_several_hosts_bad_arguments(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], problem: str
) -> None:
    one_gpu = tmp_path / "one_gpu.json"
    one_gpu.write_text('{"nvlink": [[0]]}')
    args = [str(one_gpu) if a == "ONE_GPU" else a for a in args]
    with pytest.raises(SystemExit) as exc:
        plan.main([*args, "--sizes", "4KiB"])
    assert exc.value.code == 2
    assert problem in capsys.readouterr().err


@pytest.mark.parametrize("packs", [str(1 << 63), str(1 << 31)])
def test_num_packs_out_of_range(capsys: pytest.CaptureFixture[str], packs: str) -> None:
    # 2**63 was a TypeError from the binding; 2**31 built 17 GB of packs before failing.
    with pytest.raises(SystemExit) as exc:
        plan.main(["--topology", "dgx1-v100", "--sizes", "4KiB", "--num-packs", packs])
    assert exc.value.code == 2
    assert "--num-packs must be >= 0 and <= 1024" in capsys.readouterr().err


@pytest.mark.parametrize("hosts", ["1", "2"])
def test_json_to_a_missing_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hosts: str
) -> None:
    out = tmp_path / "missing" / "rows.json"
    argv = ["--topology", "hgx-h100", "--sizes", "4KiB", "--hosts", hosts, "--json", str(out)]
    assert plan.main(argv) == 1  # not a traceback
    captured = capsys.readouterr()
    assert "4096" in captured.out  # the table came first
    assert f"error: cannot write {out}: No such file or directory" in captured.err


@pytest.mark.parametrize("hosts", ["1", "2"])
def test_json_to_stdout_leaves_the_table_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hosts: str
) -> None:
    argv = ["--topology", "hgx-h100", "--sizes", "4KiB,64KiB", "--hosts", hosts]
    assert plan.main([*argv, "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == json_rows(tmp_path, *argv)  # stdout is the JSON alone
    assert "65536" in captured.err and "nccl_ring" in captured.err
