"""The house style, checked: black and clang-format leave every tracked source as it is, and
mypy finds no type error in the package, the benchmarks, the examples and these tests.

Each check skips, saying why, where its tool is not installed (the README's test command
installs them all, at the versions the code is formatted with:
`pip install black==26.10.1 clang-format==23.1.5 mypy==2.4.1`). mypy reads torch's type stubs,
so its verdict is for the torch installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def tracked(*patterns: str) -> list[str]:
    """Tracked files matching the git pathspecs; skips outside a git checkout."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    done = subprocess.run(
        ["git", "ls-files", "--", *patterns], cwd=REPO, capture_output=True, text=True, check=True
    )
    files = done.stdout.split()
    assert files, f"no tracked files match {patterns}"
    return files


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (pip install {name})")
    return path


def run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True)


@pytest.mark.torch_free
def test_python_is_black_formatted() -> None:
    done = run([tool("black"), "--check", "--quiet", *tracked("*.py")])
    assert done.returncode == 0, f"run `black .` (pyproject.toml sets the style):\n{done.stderr}"


@pytest.mark.torch_free
def test_cpp_and_cuda_are_clang_formatted() -> None:
    sources = tracked("*.cc", "*.h", "*.cu", "*.cuh")
    done = run([tool("clang-format"), "--dry-run", "-Werror", *sources])
    assert done.returncode == 0, f"run `clang-format -i` on these (.clang-format):\n{done.stderr}"


def test_package_benchmarks_examples_and_tests_type_check() -> None:
    try:
        import mypy  # noqa: F401
    except ImportError:
        pytest.skip("mypy is not installed (pip install mypy)")
    done = run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--ignore-missing-imports",
            "--cache-dir=/dev/null",
            "torch_xdev",
            "benchmarks",
            "examples",
            "tests",
        ]
    )
    assert done.returncode == 0, f"mypy:\n{done.stdout}{done.stderr}"


@pytest.mark.torch_free
def test_the_style_tools_are_pinned_alike_everywhere() -> None:
    """README's test command, CI's script and pyproject's `test` extra install the same
    versions of the style tools: any other version may format differently and fail the checks
    above on a newcomer's machine."""
    pins: dict[str, dict[str, str]] = {}
    for source in ("README.md", ".ci/run", "pyproject.toml"):
        text = (REPO / source).read_text()
        pins[source] = dict(re.findall(r"\b(black|clang-format|mypy)==([0-9.]+)", text))
    assert pins["README.md"], "README names no pinned style tool"
    assert pins[".ci/run"] == pins["README.md"] == pins["pyproject.toml"], pins
