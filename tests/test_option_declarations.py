"""The two declarations of every option agree: torch_xdev.Options (Python) and the field
lists of csrc/backend/backend_config.h (C++), and the type stub matches the binding."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import torch_xdev
from torch_xdev import _C
from torch_xdev.options import (
    ENV_KNOBS,
    OTHER_VARIABLES,
    backend_config,
    resolve_options,
    unknown_variables,
)

STUB = os.path.join(os.path.dirname(torch_xdev.__file__), "_C.pyi")


def _declared() -> list[_C.BackendConfigField]:
    return _C.BackendConfig.fields()


def test_python_and_cpp_declare_the_same_options() -> None:
    python = [f.name for f in dataclasses.fields(torch_xdev.Options)]
    cpp = [f["name"] for f in _declared() if f["option"]]
    assert python == cpp, (
        "torch_xdev.Options (options.py) and XDEV_OPTION_FIELDS (backend_config.h) must "
        f"declare the same options in the same order: only in Python "
        f"{sorted(set(python) - set(cpp))}, only in C++ {sorted(set(cpp) - set(python))}"
    )
    assert [knob[0] for knob in torch_xdev.ENV_KNOBS] == python


def test_defaults_agree() -> None:
    # Options' timeout of None means the group's; the C++ default is torch's default group
    # timeout, which is what a group gets when none is given.
    copied = backend_config(torch_xdev.Options(), dist.default_pg_timeout)
    fresh = _C.BackendConfig()
    for f in _declared():
        if f["option"]:
            name = f["name"]
            assert getattr(copied, name) == getattr(fresh, name), name


def test_options_reach_the_config() -> None:
    options = torch_xdev.Options(
        algorithm="flat",
        num_packs=3,
        agg_small_grads_max_bytes=10,
        agg_small_grads_max_group=4,
        bytes_per_pack=512,
        reduce_to_rank=1,
        timeout=2.5,
        shm_slot_bytes=8192,
        cuda_slot_bytes=8192,
        single_copy=True,
        cuda_host_check=False,
        shared_buckets=False,
        two_level_pieces=3,
        debug=True,
    )
    # Every field away from its default, so that a field the config dropped shows.
    assert all(
        getattr(options, f.name) != f.default for f in dataclasses.fields(torch_xdev.Options)
    ), options
    config = backend_config(options, timedelta(seconds=99))
    expected = dataclasses.asdict(options) | {"timeout": timedelta(seconds=2.5)}
    assert {name: getattr(config, name) for name in expected} == expected
    assert backend_config(torch_xdev.Options(), timedelta(seconds=99)).timeout == timedelta(
        seconds=99
    )
    assert backend_config(torch_xdev.Options(), timedelta(seconds=99)).num_packs == -1


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("shm_slot_bytes", 4095, r"shm_slot_bytes must be >= 4096 and <= \d+ \(1 GiB\); got 4095"),
        ("shm_slot_bytes", (1 << 30) + 1, r"shm_slot_bytes must be >= 4096 and <= 1073741824"),
        ("cuda_slot_bytes", 4096 + 128, "cuda_slot_bytes must be a multiple of 256"),
        ("cuda_slot_bytes", 256, "cuda_slot_bytes must be a multiple of 256, >= 4096 and <= "),
        ("cuda_slot_bytes", 1 << 31, "cuda_slot_bytes must be a multiple of 256, >= 4096"),
    ],
)
def test_cpp_validate_checks_slots(field: str, value: int, message: str) -> None:
    config = _C.BackendConfig()
    config.validate()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=message):
        config.validate()
    with pytest.raises(ValueError, match=f"Options.{message}"):
        torch_xdev.Options(**{field: value})  # type: ignore[arg-type]  # the name is a case


def test_describe_keys_are_declared() -> None:
    # The option keys describe() reports (README and tests read them).
    keys = {f["describe_key"] for f in _declared() if f["describe_key"] is not None}
    assert keys == {
        "algorithm",
        "num_packs",
        "agg_small_grads_max_bytes",
        "agg_small_grads_max_group",
        "bytes_per_pack",
        "reduce_to_rank",
        "timeout_s",
        "shm_slot_bytes",
        "two_level_pieces",
    }


def _stub_fields() -> list[str]:
    with open(STUB, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "BackendConfig":
            return [
                f"{ast.unparse(item.target)}: {ast.unparse(item.annotation)}"
                for item in node.body
                if isinstance(item, ast.AnnAssign)
            ]
    return []


def test_stub_matches_the_binding() -> None:
    expected = [f"{f['name']}: {f['type']}" for f in _declared()]
    # Each attribute of the binding is a field of the struct, and the other way round.
    bound = [name for name in vars(_C.BackendConfig) if not name.startswith("_")]
    assert set(bound) - {"validate", "fields"} == {f["name"] for f in _declared()}
    paste = "\n".join(f"    {line}  # {f['doc']}" for line, f in zip(expected, _declared()))
    assert (
        _stub_fields() == expected
    ), f"the BackendConfig attributes of {STUB} differ from the binding; paste these:\n{paste}"


def _readme_option_rows() -> dict[str, list[str]]:
    # The checkout's README (the package may be installed elsewhere).
    readme = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    section = text.split("### Options and environment variables", 1)[1].split("\n### ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 4:
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def _default_as_readme_says(value: object) -> set[str]:
    if isinstance(value, bool):
        return {f"`{value}`", f"`{int(value)}`", "off"} if not value else {"`True`", "`1`"}
    if value is None:
        return {"`None`", "group timeout"}
    return {f"`{value}`"}


def test_the_readme_table_lists_every_option_with_its_variable_and_default() -> None:
    rows = _readme_option_rows()
    fields = dataclasses.fields(torch_xdev.Options)
    assert sorted(rows) == sorted(f.name for f in fields), "README options table vs Options"
    for f in fields:
        variable, default, _ = rows[f.name]
        assert variable.startswith(f"`{f.metadata['env']}"), (f.name, variable)
        assert default in _default_as_readme_says(f.default), (f.name, default, f.default)


def test_the_options_docstring_describes_every_option() -> None:
    doc = torch_xdev.Options.__doc__ or ""
    attributes = doc.split("Attributes:", 1)[1]
    for f in dataclasses.fields(torch_xdev.Options):
        assert f"{f.name}:" in attributes or f"{f.name}," in attributes, f.name


def test_every_variable_read_is_known_to_the_misspelling_check() -> None:
    # A variable read somewhere but missing from OTHER_VARIABLES would be called unknown.
    package = Path(torch_xdev.__file__).resolve().parent  # the installed one, or the checkout's
    checkout = Path(__file__).resolve().parents[1]
    sources = [*package.glob("*.py"), checkout / "setup.py", checkout / "tests" / "cuda_ranks.py"]
    read = {m for path in sources for m in re.findall(r"\"(XDEV_[A-Z0-9_]+)\"", path.read_text())}
    read.discard("XDEV_WITH_CUDA")  # the C++ macro setup.py defines, not a variable
    known = {variable for _, variable, _ in ENV_KNOBS} | set(OTHER_VARIABLES)
    assert read - known == set(), read - known
    assert set(OTHER_VARIABLES) <= read  # and nothing there is stale


def test_a_misspelt_variable_is_named_with_the_nearest_one() -> None:
    env = {"XDEV_ALGORITHM": "direct", "XDEV_HOST_ID": "node-1", "XDEV_ALGO": "flat", "XDEV_X": "1"}
    with pytest.warns(UserWarning) as caught:
        options = resolve_options(None, env)
    assert options.algorithm == "flat"  # the misspelt one changed nothing
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "XDEV_ALGORITHM (did you mean XDEV_ALGO?)" in message, message
    assert "XDEV_HOST_ID (did you mean XDEV_HOSTNAME?)" in message, message
    assert "XDEV_X: it changes nothing" in message, message
    assert unknown_variables({"XDEV_ALGO": "flat", "XDEV_HOSTNAME": "a", "OTHER": "1"}) == []
    with pytest.raises(
        ValueError, match=r"expected an integer \(decimal, or hex as 0x...\) or none"
    ):
        resolve_options(None, {"XDEV_NUM_PACKS": "abc"})


def test_python_and_cpp_name_the_same_algorithms() -> None:
    # Options.algorithm is checked against ALGORITHMS in Python, and the C++ side parses the
    # name again: its error lists the names it knows, which must be the same, in order.
    machine = _C.plan.cpu_machine(2, 2, 10.0, 20.0, 1.0, 1.0, 1 << 18)
    with pytest.raises(ValueError) as info:
        _C.plan.predict(machine, "no_such_plan", -1, 4096, 4, False)
    assert re.findall(r"'(\w+)'", str(info.value))[:-1] == list(torch_xdev.ALGORITHMS), info.value
