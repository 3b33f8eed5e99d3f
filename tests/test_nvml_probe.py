"""The NVML probe of NVLink wiring (csrc/transport/nvml_links.cc), without a GPU.

Without NVML the probe says why; with a fake libnvidia-ml.so.1 built from C here it reports the
links, NVSwitch ports and disabled links the fake declares. Topology files and the
classification of link matrices are in test_topology.py.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import torch_xdev
from torch_xdev import topology
from torch_xdev._C import topology as _topology
from harness import subprocess_env
from topologies import DGX1_V100, zeros

# The directory holding the torch_xdev this process tested: the source tree for an in-place build.
PACKAGE_ROOT = Path(torch_xdev.__file__).resolve().parents[1]


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
        env={**subprocess_env(), "LD_LIBRARY_PATH": str(lib_dir)},
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
