"""GPU topology: classification, topology files, XDEV_TOPO_FILE and the CLI.

torch_xdev/topology.py, csrc/backend/topology_bindings.cc and classify_gpus in
csrc/plan/topology.cc. Everything here runs without a GPU: topologies are injected as files.
The NVML probe is tested in test_nvml_probe.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import torch_xdev
from torch_xdev import plan, topology
from torch_xdev._C import topology as _topology
from harness import subprocess_env
from topologies import DGX1_V100, zeros

# The directory holding the torch_xdev this process tested: the source tree for an in-place build.
PACKAGE_ROOT = Path(torch_xdev.__file__).resolve().parents[1]

Matrix = list[list[int]]


def full(n: int, value: int = 1) -> Matrix:
    return [[0 if i == j else value for j in range(n)] for i in range(n)]


def without(m: Matrix, a: int, b: int) -> Matrix:
    out = [row[:] for row in m]
    out[a][b] = out[b][a] = 0
    return out


def islands(n: int, size: int) -> Matrix:
    """Peer access within blocks of `size` ranks (GPUs behind one PCIe switch)."""
    return [[1 if i // size == j // size else 0 for j in range(n)] for i in range(n)]


# name -> (file contents, expected class). Rows are local ranks.
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "dgx1": ({"nvlink": DGX1_V100}, "dgx1"),
    "dgx1_all_reachable": ({"nvlink": DGX1_V100, "reachable": full(8)}, "dgx1"),
    "dgx1_minus_one_link": ({"nvlink": without(DGX1_V100, 0, 3)}, "partial"),
    "dgx1_minus_one_link_peer_access": (
        {"nvlink": without(DGX1_V100, 0, 3), "reachable": full(8)},
        "fully_connected",
    ),
    "fully_connected_8": ({"nvlink": full(8, 12)}, "fully_connected"),
    "four_gpus_nvlinked": ({"nvlink": full(4, 4)}, "fully_connected"),
    "pcie_only": ({"nvlink": zeros(8)}, "none"),
    "pcie_only_no_peer_access": ({"nvlink": zeros(8), "reachable": zeros(8)}, "none"),
    "pcie_peer_access": ({"nvlink": zeros(8), "reachable": full(8)}, "fully_connected"),
    "pcie_two_switches": ({"nvlink": zeros(8), "reachable": islands(8, 4)}, "partial"),
    # Two ranks on one GPU: no NVLink between them, the same memory.
    "two_ranks_one_gpu": (
        {"nvlink": zeros(2), "reachable": full(2), "gpus": ["0000:07:00.0"] * 2},
        "fully_connected",
    ),
    # A DGX-1 injected for 8 ranks sharing one GPU: the file wins (hierarchical copy tests).
    "dgx1_on_one_gpu": (
        {"nvlink": DGX1_V100, "reachable": full(8), "gpus": ["0000:07:00.0"] * 8},
        "dgx1",
    ),
    # Four ranks on two GPUs without peer access: only the ranks of one GPU reach each other.
    "four_ranks_two_gpus": ({"nvlink": zeros(4), "reachable": islands(4, 2)}, "partial"),
}


def clean_env(**extra: str) -> dict[str, str]:
    env = subprocess_env()
    env.update(extra)
    return env


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch_xdev.topology", *args],
        cwd=PACKAGE_ROOT,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def write(tmp_path: Path, name: str, data: Any) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.fixture(autouse=True)
def _no_injected_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(topology.ENV_TOPO_FILE, raising=False)


# ---------------------------------------------------------------------------------------
# Classification


@pytest.mark.parametrize("case", sorted(CASES))
def test_classify_gpus(case: str) -> None:
    data, expected = CASES[case]
    nvlink = data["nvlink"]
    reachable = data.get("reachable", topology.reachable_from_links(nvlink))
    assert _topology.classify_gpus(nvlink, reachable) == expected


def test_classify_gpus_every_single_missing_link() -> None:
    for a in range(8):
        for b in range(a + 1, 8):
            if DGX1_V100[a][b]:
                links = without(DGX1_V100, a, b)
                assert topology.classify(links, topology.reachable_from_links(links)) == "partial"
                assert topology.classify(links, [[1] * 8] * 8) == "fully_connected"


def test_classify_gpus_edge_cases() -> None:
    assert _topology.classify_gpus([], []) == "none"
    assert _topology.classify_gpus([[0]], [[1]]) == "fully_connected"
    # The diagonal is ignored in both matrices.
    assert _topology.classify_gpus([[5, 0], [0, 7]], [[0, 0], [0, 0]]) == "none"


@pytest.mark.parametrize(
    "nvlink, reachable, problem",
    [
        (DGX1_V100, full(4), "the NVLink matrix has 8 ranks but the reachability matrix has 4"),
        ([[0, 1, 1], [1, 0, 1]], full(2), "the NVLink matrix is not square"),
        ([[0, 1], [2, 0]], full(2), "the NVLink matrix is not symmetric"),
        ([[0, -1], [-1, 0]], full(2), "the NVLink matrix has -1 at [0][1]"),
        (zeros(2), [[0, 2], [2, 0]], "the reachability matrix has 2 at [0][1], expected 0..1"),
    ],
)
def test_classify_gpus_rejects_bad_matrices(
    nvlink: Matrix, reachable: Matrix, problem: str
) -> None:
    with pytest.raises(ValueError) as exc:
        _topology.classify_gpus(nvlink, reachable)
    assert problem in str(exc.value)


# ---------------------------------------------------------------------------------------
# Topology files and XDEV_TOPO_FILE


@pytest.mark.parametrize("case", sorted(CASES))
def test_injected_file(
    case: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data, expected = CASES[case]
    path = write(tmp_path, case, data)
    loaded = topology.load_topology_file(path)
    assert loaded["class"] == expected
    assert loaded["name"] == case
    assert loaded["source"] == f"file={path}"
    assert loaded["nvlink"] == data["nvlink"]
    n = len(data["nvlink"])
    # The loader ignores the file's diagonal: a GPU always reaches itself.
    reachable = data.get("reachable", data["nvlink"])
    assert loaded["reachable"] == [
        [1 if i == j or reachable[i][j] else 0 for j in range(n)] for i in range(n)
    ]
    assert loaded["gpus"] == data.get("gpus", [])

    monkeypatch.setenv(topology.ENV_TOPO_FILE, str(path))
    detected = topology.detect()
    assert detected["class"] == expected
    assert detected["source"] == f"XDEV_TOPO_FILE={path}"

    # The CLI's code, in this process; the output is a topology file of the same class.
    assert topology.main([]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == dict(detected)
    again = topology.load_topology_file(write(tmp_path, "again", printed))
    assert (again["class"], again["nvlink"], again["reachable"]) == (
        expected,
        loaded["nvlink"],
        loaded["reachable"],
    )
    assert topology.main(["--file", str(path)]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert from_file == dict(loaded) and from_file["class"] == expected
    # The cost model's CLI reads the same files.
    assert plan.load_topology_file(path).links() == data["nvlink"]


def test_cli_injection_subprocess(tmp_path: Path) -> None:
    """XDEV_TOPO_FILE through `python -m torch_xdev.topology`, one process per file."""
    cases = ["dgx1", "dgx1_minus_one_link", "fully_connected_8", "four_gpus_nvlinked", "pcie_only"]
    paths = [write(tmp_path, case, CASES[case][0]) for case in cases]
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda p: run_cli(XDEV_TOPO_FILE=str(p)), paths))
    for case, path, proc in zip(cases, paths, procs):
        assert proc.returncode == 0, (case, proc.stderr)
        out = json.loads(proc.stdout)
        assert out["class"] == CASES[case][1], (case, out)
        assert out["source"] == f"XDEV_TOPO_FILE={path}"
        assert out["nvlink"] == CASES[case][0]["nvlink"]
    # One matrix row per line, so a DGX-1 dump stays readable.
    assert "\n    [0, 1, 1, 2, 2, 0, 0, 0],\n" in procs[0].stdout, procs[0].stdout


def test_cli_without_gpus(tmp_path: Path) -> None:
    """On this machine (or with no GPU visible), the CLI reports no GPUs, and round-trips."""
    proc = run_cli(CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["class"] == "none"
    assert out["gpus"] == [] and out["nvlink"] == [] and out["reachable"] == []
    assert out["nvswitch"] == []
    assert out["source"].startswith("none: ") and len(out["source"]) > len("none: ")
    assert set(out) == {
        "name",
        "class",
        "source",
        "gpus",
        "nvlink",
        "nvswitch",
        "reachable",
        "note",
    }

    path = write(tmp_path, "detected", proc.stdout)
    again = run_cli(XDEV_TOPO_FILE=str(path))
    assert again.returncode == 0, again.stderr
    fed_back = json.loads(again.stdout)
    assert fed_back["class"] == out["class"]
    assert fed_back["source"] == f"XDEV_TOPO_FILE={path}"
    assert (fed_back["name"], fed_back["nvlink"]) == (out["name"], out["nvlink"])


@pytest.mark.parametrize(
    "contents, problem",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object with an 'nvlink' matrix"),
        ({"name": "x"}, "missing 'nvlink'"),
        ({"nvlink": "dgx1"}, "'nvlink' must be a list of rows"),
        ({"nvlink": [[0, 1, 1], [1, 0, 1]]}, "'nvlink' is not a square matrix: row 0 has 3"),
        ({"nvlink": [[0, 1], [2, 0]]}, "'nvlink' is not symmetric: [0][1] = 1 but [1][0] = 2"),
        ({"nvlink": [[0, -1], [-1, 0]]}, "'nvlink'[0][1] is negative"),
        ({"nvlink": [[0, 1.5], [1.5, 0]]}, "'nvlink'[0][1] must be an integer link count"),
        ({"nvlink": [[0, True], [True, 0]]}, "must be an integer link count, got true"),
        ({"nvlink": zeros(2), "reachable": [[1, 2], [2, 1]]}, "'reachable'[0][1] must be 0 or 1"),
        ({"nvlink": zeros(2), "reachable": [[1, 1], [0, 1]]}, "'reachable' is not symmetric"),
        ({"nvlink": zeros(3), "reachable": full(2)}, "'reachable' has 2 rows but 'nvlink' has 3"),
        ({"nvlink": zeros(2), "gpus": ["0000:07:00.0"]}, "'gpus' lists 1 bus ids"),
        ({"nvlink": zeros(2), "gpus": [7, 8]}, "'gpus' must be a list of PCI bus ids"),
        ({"nvlink": zeros(2), "name": ""}, "'name' must be a non-empty string"),
        ({"nvlink": zeros(2), "class": 3}, "'class' must be a string"),
        (
            {"nvlink": zeros(2), "links": []},
            "unknown key(s) 'links'; allowed: class, compute_capability, gpus,",
        ),
        ({"nvlink": zeros(2), "pcie_gbps": -1}, "'pcie_gbps' must be a finite number > 0"),
        # An integer past any float was an OverflowError traceback; 1e400 reads as inf.
        ({"nvlink": zeros(2), "pcie_gbps": 10**400}, "'pcie_gbps' must be a finite number > 0"),
        # Finite, but inf bytes/s in the model, whose simulation then never ended.
        ({"nvlink": zeros(2), "memory_gbps": 1e300}, "'memory_gbps' must be within [1e-06, 1e+09]"),
        (
            {"nvlink": zeros(2), "nvlink_gbps": 1e-300},
            "'nvlink_gbps' must be within [1e-06, 1e+09]",
        ),
        ({"nvlink": zeros(2), "nvswitch": [18]}, "'nvswitch' must be a list of 2 non-negative"),
        ({"nvlink": zeros(2), "nvswitch": [18, -1]}, "'nvswitch' must be a list of 2"),
        ({"nvlink": zeros(2), "nvswitch": [True, 1]}, "'nvswitch' must be a list of 2"),
        ({"nvlink": zeros(2), "compute_capability": 9.0}, "'compute_capability' must be an int"),
        # Past what the binding converts (int64, int for 'nvswitch'): was a TypeError.
        ({"nvlink": full(2, 1 << 63)}, "'nvlink'[0][1] is 9223372036854775808; at most 1024"),
        ({"nvlink": full(2, 1025)}, "'nvlink'[0][1] is 1025; at most 1024 links per pair"),
        ({"nvlink": zeros(2), "nvswitch": [1 << 31, 1 << 31]}, "'nvswitch' must be a list of 2"),
    ],
)
def test_bad_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, contents: Any, problem: str
) -> None:
    path = write(tmp_path, "bad", contents)
    with pytest.raises(ValueError) as exc:
        topology.load_topology_file(path)
    assert str(exc.value).startswith(f"{path}: ") and problem in str(exc.value), str(exc.value)
    monkeypatch.setenv(topology.ENV_TOPO_FILE, str(path))
    with pytest.raises(ValueError, match="bad.json"):
        topology.detect()


def test_bad_file_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.json"
    assert topology.main(["--file", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"error: {missing}: cannot read the topology file" in captured.err

    bad = write(tmp_path, "bad", {"nvlink": [[0, 1], [2, 0]]})
    proc = run_cli(XDEV_TOPO_FILE=str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"error: {bad}: 'nvlink' is not symmetric" in proc.stderr, proc.stderr


def test_cli_prints_no_warning(tmp_path: Path) -> None:
    # `import torch_xdev` used to import torch_xdev.topology, and runpy warned that the module
    # it was about to run was imported already.
    path = write(tmp_path, "dgx1", CASES["dgx1"][0])
    proc = run_cli("--file", str(path))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_plan_rejects_an_empty_machine(tmp_path: Path) -> None:
    path = write(tmp_path, "empty", {"nvlink": []})
    assert topology.load_topology_file(path)["class"] == "none"
    with pytest.raises(ValueError, match="'nvlink' is empty"):
        plan.load_topology_file(path)


def test_bus_id_from_device_properties() -> None:
    class Ints:
        pci_domain_id, pci_bus_id, pci_device_id = 0, 0x3B, 0

    class Text:
        pci_bus_id = "0000:3B:00.0"

    class Nothing:
        pass

    assert topology._bus_id(Ints()) == "0000:3b:00.0"
    assert topology._bus_id(Text()) == "0000:3b:00.0"
    assert topology._bus_id(Nothing()) is None


def test_nvswitch_file_classifies_and_models_the_switch(tmp_path: Path) -> None:
    # An HGX H100 as detection writes it: every pair joined through the switches (18 each).
    switched = [[0 if a == b else 18 for b in range(8)] for a in range(8)]
    path = write(
        tmp_path,
        "hgx",
        {
            "nvlink": switched,
            "nvswitch": [18] * 8,
            "nvlink_gbps": 20.6,
            "memory_gbps": 3350,
            "compute_capability": 90,
        },
    )
    topo = topology.load_topology_file(path)
    assert topo["class"] == "nvswitch" and topo["nvswitch"] == [18] * 8
    assert json.loads(topology.to_json(topo))["nvswitch"] == [18] * 8
    # The cost model sees the same NCCL as on the built-in HGX H100 (NVLS included), which it
    # would not without the switch counts (NCCL's rings would take 7 x 18 links).
    # (1 MiB: NCCL's rows are the same formulas at every size; xdev's plans simulate slower
    # the larger the payload.)
    from_file = plan.size_rows(plan.machine(str(path)), 1 << 20)
    builtin = plan.size_rows(plan.machine("hgx-h100"), 1 << 20)
    nccl_file = {r["label"]: r["time_us"] for r in from_file if r["nccl"]}
    nccl_builtin = {r["label"]: r["time_us"] for r in builtin if r["nccl"]}
    assert "nccl_nvls/Simple" in nccl_file
    assert nccl_file == pytest.approx(nccl_builtin, rel=1e-12)
    # Without "nvswitch" the same matrix is a fully connected host of direct links.
    plain = write(tmp_path, "plain", {"nvlink": switched})
    assert topology.load_topology_file(plain)["class"] == "fully_connected"
