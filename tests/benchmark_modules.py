"""A benchmark script (benchmarks/<name>.py) loaded as a module, for the tests of its functions."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, needs_build: bool = False) -> ModuleType:
    """benchmarks/<name>.py as the module ``name``. With needs_build, the calling test is
    skipped where torch_xdev._C cannot be imported (not built, or torch missing)."""
    if needs_build:
        try:
            importlib.import_module("torch_xdev._C")
        except ImportError as e:
            pytest.skip(f"torch_xdev._C cannot be imported: {e}")
    if str(BENCHMARKS) not in sys.path:  # the scripts import their siblings
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
