"""GPU topology: classification, topology files, XDEV_TOPO_FILE, the CLI and the NVML probe.

torch_xdev/topology.py, csrc/backend/topology_bindings.cc, csrc/transport/nvml_links.cc and
classify_gpus in csrc/plan/topology.cc. Everything here runs without a GPU: topologies are
injected as files, and the NVML probe runs against a fake libnvidia-ml.so.1 built from C.
"""

from __future__ import annotations

import ctypes
import json
import shutil
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
from topologies import DGX1_V100

# The directory holding the torch_xdev this process tested: the source tree for an in-place build.
PACKAGE_ROOT = Path(torch_xdev.__file__).resolve().parents[1]

Matrix = list[list[int]]


def full(n: int, value: int = 1) -> Matrix:
    return [[0 if i == j else value for j in range(n)] for i in range(n)]


def zeros(n: int) -> Matrix:
    return [[0] * n for _ in range(n)]


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


# ---------------------------------------------------------------------------------------
# The NVML probe


def nvml_loadable() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_probe_without_nvml() -> None:
    # Bus ids no machine has: without NVML the probe reports why; with a real NVML it does not
    # know these GPUs. Either way: not available, a note, and no links.
    ids = ["0000:fe:1f.0", "00000000:FE:1E.0", "fe:1d.0", "0000:fe:1f.0"]
    report = _topology.probe_nvlinks(ids)
    assert report["available"] is False
    assert report["links"] == zeros(4)
    assert report["nvswitch"] == [0, 0, 0, 0]
    assert report["note"]
    if not nvml_loadable():
        assert report["note"].startswith("libnvidia-ml.so.1 not found: "), report["note"]
    empty = _topology.probe_nvlinks([])
    assert empty == {"links": [], "nvswitch": [], "available": False, "note": "no GPUs given"}


@pytest.mark.parametrize(
    "bad", ["", "gpu0", "0000:07", "0000:07:00.0.0", "0000:107:00.0", "0000:07:20.0"]
)
def test_probe_rejects_bad_bus_ids(bad: str) -> None:
    with pytest.raises(ValueError, match="is not a PCI bus id"):
        _topology.probe_nvlinks(["0000:07:00.0", bad])


# A fake libnvidia-ml.so.1 with the ABI nvml_links.cc declares: eight GPUs at buses 0x10..0x17.
# FAKE_NVML_MODE (read at nvmlInit_v2) picks the wiring:
#   dgx1       GPU a has LINKS[a][b] NVLinks to GPU b, then disabled links, then unsupported ones;
#   switch     18 links per GPU to NVSwitches (GPU 7: 12), link 5 disabled everywhere;
#   init_fail  nvmlInit_v2 fails with NVML_ERROR_DRIVER_NOT_LOADED.
# Built once with nvmlDeviceGetNvLinkRemoteDeviceType and once without (as old drivers lack it).
FAKE_NVML = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  char busIdLegacy[16];
  unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
  char busId[32];
} nvmlPciInfo_t;
typedef struct { int index; } gpu_t;

static const int LINKS[8][8] = { @LINKS@ };
static gpu_t gpus[8] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
static int mode;  /* 0 dgx1, 1 switch, 2 init_fail */
int fake_nvml_inits, fake_nvml_shutdowns;

/* The peer of GPU g's link l in dgx1 mode, or -1 past its NVLinks. */
static int dgx1_peer(int g, unsigned l) {
  unsigned k = 0;
  for (int b = 0; b < 8; ++b)
    for (int c = 0; c < LINKS[g][b]; ++c, ++k)
      if (k == l) return b;
  return -1;
}

int nvmlInit_v2(void) {
  const char* m = getenv("FAKE_NVML_MODE");
  mode = m && !strcmp(m, "switch") ? 1 : m && !strcmp(m, "init_fail") ? 2 : 0;
  if (mode == 2) return 9;
  ++fake_nvml_inits;
  return 0;
}
int nvmlShutdown(void) { ++fake_nvml_shutdowns; return 0; }
const char* nvmlErrorString(int rc) { return rc == 9 ? "Driver Not Loaded" : "Not Found"; }

int nvmlDeviceGetHandleByPciBusId_v2(const char* id, gpu_t** device) {
  unsigned domain, bus, dev, fn;
  if (strlen(id) != 16 || sscanf(id, "%8x:%2x:%2x.%1x", &domain, &bus, &dev, &fn) != 4) return 2;
  if (domain != 0 || bus < 0x10 || bus > 0x17 || dev != 0 || fn != 0) return 6;
  *device = &gpus[bus - 0x10];
  return 0;
}

int nvmlDeviceGetNvLinkState(gpu_t* d, unsigned link, int* active) {
  if (link >= 18) return 2;
  if (mode == 1) {
    *active = link != 5 && (d->index != 7 || link < 12);
    return 0;
  }
  if (link >= 14) return 3;
  *active = dgx1_peer(d->index, link) >= 0;
  return 0;
}

int nvmlDeviceGetNvLinkRemotePciInfo_v2(gpu_t* d, unsigned link, nvmlPciInfo_t* pci) {
  memset(pci, 0, sizeof(*pci));
  pci->bus = mode == 1 ? 0xc0 + link % 4 : (unsigned)(0x10 + dgx1_peer(d->index, link));
  snprintf(pci->busId, sizeof(pci->busId), "00000000:%02x:00.0", pci->bus);
  return 0;
}

#ifndef NO_REMOTE_TYPE
int nvmlDeviceGetNvLinkRemoteDeviceType(gpu_t* d, unsigned link, int* type) {
  (void)d; (void)link;
  *type = mode == 1 ? 2 : 0;
  return 0;
}
#endif
"""

PROBE = r"""
import ctypes, json, os, sys
fake = ctypes.CDLL(sys.argv[1])  # keeps the fake loaded, so its counters outlive dlclose
from torch_xdev._C import topology
reports = []
for mode, ids in json.loads(sys.argv[2]):
    os.environ["FAKE_NVML_MODE"] = mode
    reports.append(topology.probe_nvlinks(ids))
counts = [ctypes.c_int.in_dll(fake, n).value for n in ("fake_nvml_inits", "fake_nvml_shutdowns")]
print(json.dumps({"reports": reports, "inits": counts[0], "shutdowns": counts[1]}))
"""


def gpu(i: int, style: str = "0000:{:02x}:00.0") -> str:
    return style.format(0x10 + i)


def probe_with_fake(tmp_path: Path, cases: list[tuple[str, list[str]]], *flags: str) -> Any:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler for the fake NVML")
    if nvml_loadable():
        pytest.skip("a real libnvidia-ml.so.1 is installed; the fake could not shadow it")
    lib_dir = tmp_path / ("lib" + "".join(flags).replace("-", "_"))
    lib_dir.mkdir()
    source = lib_dir / "fake_nvml.c"
    links = ", ".join("{" + ", ".join(map(str, row)) + "}" for row in DGX1_V100)
    source.write_text(FAKE_NVML.replace("@LINKS@", links))
    lib = lib_dir / "libnvidia-ml.so.1"
    build = subprocess.run(
        [
            compiler,
            "-shared",
            "-fPIC",
            "-O1",
            "-Wl,-soname,libnvidia-ml.so.1",
            *flags,
            str(source),
            "-o",
            str(lib),
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(lib), json.dumps(cases)],
        cwd=PACKAGE_ROOT,
        env=clean_env(LD_LIBRARY_PATH=str(lib_dir)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_probe_fake_nvml(tmp_path: Path) -> None:
    eight = [gpu(i) for i in range(8)]
    order = [3, 0, 6, 5, 1, 7, 2, 4]
    mixed_styles = [gpu(i, s) for i, s in enumerate(["{:02X}:00.0", "00000000:{:02x}:00.0"] * 4)]
    cases = [
        ("dgx1", eight),
        ("dgx1", [gpu(i) for i in order]),  # rows follow the given order
        ("dgx1", mixed_styles),  # compared as numbers, not strings
        ("dgx1", [gpu(0), gpu(0), gpu(3), gpu(3)]),  # ranks sharing a GPU
        ("dgx1", [gpu(0), gpu(1), "0000:50:00.0"]),  # a GPU NVML does not know
        ("dgx1", [gpu(i) for i in range(4)]),  # links to GPUs not given are not counted
        ("switch", eight),
        ("init_fail", eight),
    ]
    out = probe_with_fake(tmp_path, cases)
    r = out["reports"]
    assert r[0] == {
        "links": DGX1_V100,
        "nvswitch": [0] * 8,
        "available": True,
        "note": r[0]["note"],
    }
    total = sum(DGX1_V100[a][b] for a in range(8) for b in range(a + 1, 8))
    assert r[0]["note"] == (
        f"NVML: 8 GPU(s), {total} direct NVLink(s) between them, 0 pair(s) joined through NVSwitch"
    )
    assert _topology.classify_gpus(r[0]["links"], topology.reachable_from_links(DGX1_V100)) == (
        "dgx1"
    )
    assert r[1]["links"] == [[DGX1_V100[a][b] for b in order] for a in order]
    assert r[1]["available"] is True
    assert r[2]["links"] == DGX1_V100 and r[2]["available"] is True
    c = DGX1_V100[0][3]
    assert r[3] == {
        "links": [[0, 0, c, c], [0, 0, c, c], [c, c, 0, 0], [c, c, 0, 0]],
        "nvswitch": [0] * 4,
        "available": True,
        "note": r[3]["note"],
    }
    assert r[4]["available"] is False
    assert r[4]["links"] == [[0, 1, 0], [1, 0, 0], [0, 0, 0]]
    assert "no NVML handle for 00000000:50:00.0: Not Found (6)" in r[4]["note"]
    assert r[5]["links"] == [row[:4] for row in DGX1_V100[:4]] and r[5]["available"] is True
    # Through NVSwitches every pair is linked: min(17, 17), and min(17, 11) with GPU 7.
    switched = [[0 if a == b else 11 if 7 in (a, b) else 17 for b in range(8)] for a in range(8)]
    assert r[6]["links"] == switched and r[6]["available"] is True
    assert r[6]["nvswitch"] == [17] * 7 + [11]
    assert "28 pair(s) joined through NVSwitch" in r[6]["note"]
    assert (
        _topology.classify_gpus(r[6]["links"], topology.reachable_from_links(switched))
        == "fully_connected"
    )
    assert (
        topology.classify(r[6]["links"], topology.reachable_from_links(switched), r[6]["nvswitch"])
        == "nvswitch"
    )
    assert r[7] == {
        "links": zeros(8),
        "nvswitch": [0] * 8,
        "available": False,
        "note": "nvmlInit_v2 failed: Driver Not Loaded (9) (no NVLink known)",
    }
    # Every successful nvmlInit_v2 had its nvmlShutdown.
    assert out["inits"] == out["shutdowns"] == 7


def test_probe_fake_nvml_without_remote_device_type(tmp_path: Path) -> None:
    # An old driver: switch links cannot be told apart; their remote PCI address is no GPU's.
    out = probe_with_fake(
        tmp_path,
        [("switch", [gpu(i) for i in range(8)]), ("dgx1", [gpu(0), gpu(4)])],
        "-DNO_REMOTE_TYPE",
    )
    assert out["reports"][0]["links"] == zeros(8) and out["reports"][0]["available"] is True
    assert out["reports"][1]["links"] == [[0, 2], [2, 0]]


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
