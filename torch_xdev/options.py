"""Options of an xdev process group, and their XDEV_* environment overrides.

Each option is declared once, as a field of ``Options`` below: its default, its environment
variable and parser, its check, and how it is copied into the C++ ``BackendConfig``, whose own
declaration of the same option is in csrc/backend/backend_config.h. ``ENV_KNOBS`` and the
copy into C++ (``backend_config``) are derived from the fields; tests/test_option_declarations.py
fails when the two declarations disagree.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import warnings
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, Union

from . import _C

ALGORITHMS = (
    "auto",
    "hierarchical_copy",
    "hierarchical_balanced",
    "reduce_to_one",
    "flat",
    "direct",
    "fallback",
)


def _parse_int(text: str) -> int:
    for base in (0, 10):  # 4096, 0x1000; then 08, which base 0 refuses
        try:
            return int(text, base)
        except ValueError:
            pass
    raise ValueError("expected an integer (decimal, or hex as 0x...)")


def _parse_optional_int(text: str) -> Optional[int]:
    if text.strip().lower() == "none":
        return None
    try:
        return _parse_int(text)
    except ValueError as e:
        raise ValueError(f"{e} or none") from None


def _parse_name(text: str) -> str:
    return text.strip().lower()  # as NCCL_ALGO: FLAT is flat


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _parse_debug(text: str) -> bool:
    # NCCL_DEBUG's levels: INFO and DEBUG log, VERSION and WARN (NCCL's quieter ones) do not;
    # else a bool. Anything else is refused rather than read as off, so that a misspelt
    # XDEV_DEBUG (or "on", which the bool options take) does not go silent.
    level = text.strip().upper()
    if level in ("INFO", "DEBUG", "VERSION", "WARN"):
        return level in ("INFO", "DEBUG")
    try:
        return _parse_bool(text)
    except ValueError:
        raise ValueError(
            "expected INFO, DEBUG, WARN, VERSION, 1/0, true/false, yes/no or on/off"
        ) from None


def _check_algorithm(name: str, value: Any) -> None:
    if value not in ALGORITHMS:
        raise ValueError(f"Options.{name} must be one of {', '.join(ALGORITHMS)}; got {value!r}")


# The C++ fields are int64_t: a larger value would fail in the binding with a TypeError that
# names no option.
_INT64_MAX = (1 << 63) - 1


def _check_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"Options.{name} must be an int; got {value!r}")
    if not -_INT64_MAX - 1 <= value <= _INT64_MAX:
        raise ValueError(f"Options.{name} must fit in 64 bits; got {value}")


def _check_bool(name: str, value: Any) -> None:
    # The binding would take None (and any object with __bool__) as False, silently; 0 and 1
    # say what they mean.
    if not isinstance(value, bool) and not (isinstance(value, int) and value in (0, 1)):
        raise ValueError(f"Options.{name} must be True or False; got {value!r}")


def _check_count(name: str, value: Any) -> None:
    _check_int(name, value)
    if value < 0:
        raise ValueError(f"Options.{name} must be >= 0; got {value}")


def _check_optional_count(name: str, value: Any) -> None:
    if value is None:
        return
    _check_int(name, value)
    if value < 0:  # _check_count's bound, naming how to say "choose"
        raise ValueError(
            f"Options.{name} must be >= 0, or None (XDEV_{name.upper()}=none) to let the"
            f" algorithm choose; got {value}"
        )


# Plans, executors and the CPU cost model take time linear in the number of packs (packs
# from one per tensor are not capped; bytes_per_pack makes at most this many too, see
# csrc/plan/packing.h). Under auto the model predicts at the count a user sets, and on GPU
# hosts, where packs pipeline, its simulation shares bandwidth among the flows in progress at
# every event. Choosing for one size class (1 MiB / 32 MiB) takes 0.5 / 1.4 s on dgx1-v100 at
# 1024 packs and 7 / 23 s at 4096; on cpu-8 0.5 / 2.3 s and 2 / 9 s. Nothing gains from more:
# auto's own candidates go up to 48 packs per rank.
MAX_PACKS: int = _C.plan.MAX_PACKS


def _check_packs(name: str, value: Any) -> None:
    _check_optional_count(name, value)
    if value is not None and value > MAX_PACKS:
        raise ValueError(f"Options.{name} must be <= {MAX_PACKS}; got {value}")


def _seconds(timeout: Union[timedelta, float]) -> float:
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    try:
        return float(timeout)
    except OverflowError:  # an integer beyond any float: "never" as infinity is, or refused
        return math.inf if timeout > 0 else -math.inf


# C++ holds the timeout in whole milliseconds (a shorter one would become 0 ms: every wait
# fails at once). A longer one than 100 years, infinity included (the usual way to say
# "never"), is taken as 100 years: what xdev's own waits honour at most, and short enough for
# the engines it is handed to (Gloo's allreduce never completes with a timeout of 100000
# days: its deadline overflows).
_MIN_TIMEOUT_S = 1e-3
_MAX_TIMEOUT_S = timedelta(days=36500).total_seconds()


def _check_timeout(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (timedelta, int, float)):
        raise ValueError(f"Options.{name} must be seconds or a timedelta; got {value!r}")
    seconds = _seconds(value)
    if math.isnan(seconds) or seconds < _MIN_TIMEOUT_S:
        raise ValueError(f"Options.{name} must be at least 1 ms; got {value!r}")


def _same(value: Any, group_timeout: timedelta) -> Any:
    return value


def _packs_to_config(value: Optional[int], group_timeout: timedelta) -> int:
    return -1 if value is None else value  # -1: the algorithm chooses


def _timeout_to_config(value: Optional[Union[timedelta, float]], group_timeout: timedelta) -> Any:
    if value is None:  # the group's, init_process_group's timeout=, bounded alike
        value = group_timeout
        if not _seconds(value) >= _MIN_TIMEOUT_S:  # NaN too
            raise ValueError(
                f"xdev: the group's timeout (timeout= of init_process_group or new_group) must "
                f"be at least 1 ms; got {value!r}"
            )
    return timedelta(seconds=min(_seconds(value), _MAX_TIMEOUT_S))


def _option(
    default: Any,
    env: str,
    parse: Callable[[str], Any],
    check: Optional[Callable[[str, Any], None]] = None,
    to_config: Callable[[Any, timedelta], Any] = _same,
) -> Any:
    """Declares one option.

    Args:
        default: its value when neither the caller nor the environment sets it.
        env: the environment variable that overrides it; ``parse`` turns the text into a value.
        check: raises ValueError for a bad value; range checks that C++ also needs are
            ``BackendConfig.validate``'s, run by ``Options.validate`` after these.
        to_config: its value in the C++ ``BackendConfig`` field of the same name, given the
            group's timeout.
    """
    metadata = {"env": env, "parse": parse, "check": check, "to_config": to_config}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class Options:
    """Passed as ``pg_options`` to ``init_process_group`` or ``new_group``.

    Every field can be overridden per process by an environment variable (see
    ``ENV_KNOBS``); the environment wins, as with ``NCCL_ALGO``.

    Attributes:
        algorithm: ``"auto"`` (default: chosen per call, see the README),
            ``"hierarchical_copy"`` (TensorFlow's HierarchicalCopyAllReduce; even world sizes only),
            ``"hierarchical_balanced"`` (the same two levels, trees balanced over the
            links; even world sizes only), ``"reduce_to_one"``,
            ``"flat"`` (reduce-scatter + allgather), ``"direct"`` (every rank
            reduces everything; one barrier) or ``"fallback"`` (Gloo).
        num_packs: packs for concat-and-split; ``None`` (``XDEV_NUM_PACKS=none``) lets the
            algorithm choose (the world size for hierarchical copy), 0 disables it.
        agg_small_grads_max_bytes, agg_small_grads_max_group: small-tensor
            aggregation when both are > 0, ``num_packs`` is 0 or ``None`` and
            ``bytes_per_pack`` is 0.
        bytes_per_pack: cut the payload into packs of this many bytes (0: off; at most
            1024 packs).
        reduce_to_rank: the root of reduce-to-one.
        timeout: per-collective timeout; ``None`` uses the group's timeout.
        shm_slot_bytes: staging bytes per rank and slot set; larger payloads
            are processed in windows of this size.
        cuda_slot_bytes: GPU staging bytes per rank and slot set (each rank
            allocates two); larger CUDA payloads run in windows of this size.
            A multiple of 256, at least 4096.
        cuda_host_check: before queuing a CUDA collective's kernels, check on the host that
            every rank runs the same call (a mismatch raises on every rank and the group stays
            usable). False: only the kernels' GPU barrier checks, which saves the host barrier
            per call; a mismatch then stops every rank's kernels and breaks the group, and the
            group has no CUDA heap (running in place needs the host's agreement on places).
        single_copy: let ranks read each other's tensors in place
            (process_vm_readv) for large CPU allreduces, when the host allows it.
        shared_buckets: let DDP allocate its gradient buckets (and other callers of c10d's
            ``allocateTensor``) in this group's symmetric heap, memory every rank maps, so
            their allreduce runs in place (on several hosts, in place inside each host); CUDA
            tensors from the group's CUDA heap (CUDA IPC) where its CUDA transport is on. See
            the README.
        two_level_pieces: on several hosts, pipeline a two-level allreduce in this many
            pieces, so that the steps inside each host overlap the engine's across hosts
            (a payload whose slices ride in the check across hosts, 64 KiB each, stays
            whole); 0 (default): the cost model's choice. Whether two levels run at all stays
            the model's call, weighing this plan against the engine's ring.
        debug: log the chosen plans to stderr (``XDEV_DEBUG=INFO``).
    """

    algorithm: str = _option("auto", "XDEV_ALGO", _parse_name, _check_algorithm)
    num_packs: Optional[int] = _option(
        None, "XDEV_NUM_PACKS", _parse_optional_int, _check_packs, _packs_to_config
    )
    agg_small_grads_max_bytes: int = _option(
        0, "XDEV_AGG_SMALL_GRADS_MAX_BYTES", _parse_int, _check_count
    )
    agg_small_grads_max_group: int = _option(
        0, "XDEV_AGG_SMALL_GRADS_MAX_GROUP", _parse_int, _check_count
    )
    bytes_per_pack: int = _option(0, "XDEV_BYTES_PER_PACK", _parse_int, _check_count)
    reduce_to_rank: int = _option(0, "XDEV_REDUCE_TO_RANK", _parse_int, _check_count)
    timeout: Optional[Union[timedelta, float]] = _option(
        None, "XDEV_TIMEOUT", float, _check_timeout, _timeout_to_config
    )
    shm_slot_bytes: int = _option(256 << 10, "XDEV_SHM_SLOT_BYTES", _parse_int, _check_int)
    cuda_slot_bytes: int = _option(32 << 20, "XDEV_CUDA_SLOT_BYTES", _parse_int, _check_int)
    cuda_host_check: bool = _option(True, "XDEV_CUDA_HOST_CHECK", _parse_bool, _check_bool)
    single_copy: bool = _option(False, "XDEV_SINGLE_COPY", _parse_bool, _check_bool)
    shared_buckets: bool = _option(True, "XDEV_SHARED_BUCKETS", _parse_bool, _check_bool)
    two_level_pieces: int = _option(0, "XDEV_TWO_LEVEL_PIECES", _parse_int, _check_count)
    debug: bool = _option(False, "XDEV_DEBUG", _parse_debug, _check_bool)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        for field in dataclasses.fields(self):
            check = field.metadata["check"]
            if check is not None:
                check(field.name, getattr(self, field.name))
        try:
            backend_config(self, _C.BackendConfig().timeout).validate()
        except ValueError as e:  # C++ names the field
            raise ValueError(f"Options.{e}") from None

    def timeout_seconds(self) -> Optional[float]:
        return None if self.timeout is None else _seconds(self.timeout)


def backend_config(options: Options, group_timeout: timedelta) -> _C.BackendConfig:
    """A C++ BackendConfig holding every option (its other fields at their defaults).

    A timeout of None becomes ``group_timeout``.
    """
    config = _C.BackendConfig()
    for field in dataclasses.fields(options):
        value = field.metadata["to_config"](getattr(options, field.name), group_timeout)
        setattr(config, field.name, value)
    return config


# (field, variable, parser) of every option.
ENV_KNOBS: tuple[tuple[str, str, Callable[[str], Any]], ...] = tuple(
    (field.name, field.metadata["env"], field.metadata["parse"])
    for field in dataclasses.fields(Options)
)


def _set_in_environment(environ: Optional[Mapping[str, str]]) -> list[tuple[str, str, str]]:
    """(field, variable, text) of every XDEV_* variable set (non-empty) here."""
    env = os.environ if environ is None else environ
    return [
        (field, variable, env[variable]) for field, variable, _ in ENV_KNOBS if env.get(variable)
    ]


def environment_overrides(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """The XDEV_* variables that override Options here, as ``NAME=value``."""
    return [f"{variable}={text}" for _, variable, text in _set_in_environment(environ)]


def fields_from_environment(environ: Optional[Mapping[str, str]] = None) -> set[str]:
    """The Options fields that XDEV_* variables set here."""
    return {field for field, _, _ in _set_in_environment(environ)}


# The XDEV_* variables read that set no Options field: a host's name (_registration.py), a CPU
# cost model (_registration.py), a GPU topology file (topology.py), the debug build (setup.py)
# and the switch that makes the GPU tests fail where they would skip (tests/cuda_ranks.py).
OTHER_VARIABLES = (
    "XDEV_HOSTNAME",
    "XDEV_CPU_MODEL",
    "XDEV_TOPO_FILE",
    "XDEV_DEBUG_BUILD",
    "XDEV_TEST_REQUIRE_CUDA",
)


def unknown_variables(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """The XDEV_* variables set here that torch_xdev does not read, each with the nearest name
    it reads, if one is close: a misspelt name would otherwise change nothing, silently."""
    env = os.environ if environ is None else environ
    known = [variable for _, variable, _ in ENV_KNOBS] + list(OTHER_VARIABLES)
    notes = []
    for name in sorted(n for n in env if n.startswith("XDEV_") and n not in known):
        notes.append(f"{name} (did you mean {near}?)" if (near := _nearest(name, known)) else name)
    return notes


def _nearest(name: str, known: list[str]) -> Optional[str]:
    # Compared without the XDEV_ all share: ALGORITHM is near ALGO, FOO near nothing; else a
    # first word one starts the other's with (HOST_ID, HOSTNAME).
    tail = name[len("XDEV_") :]
    tails = {k[len("XDEV_") :]: k for k in known}
    close = difflib.get_close_matches(tail, list(tails), n=1, cutoff=0.6)
    if close:
        return tails[close[0]]
    word = tail.split("_")[0]
    for t, variable in tails.items():
        first = t.split("_")[0]
        if min(len(word), len(first)) >= 4 and (first.startswith(word) or word.startswith(first)):
            return variable
    return None


def resolve_options(given: Optional[Options], environ: Optional[dict[str, str]] = None) -> Options:
    """Returns a validated copy of ``given`` (or defaults) with XDEV_* overrides applied."""
    if given is not None and not isinstance(given, Options):
        raise ValueError(
            f"pg_options for the xdev backend must be torch_xdev.Options; got {type(given).__name__}"
        )
    env = os.environ if environ is None else environ
    unknown = unknown_variables(env)
    if unknown:
        warnings.warn(
            f"torch_xdev reads no variable named {', '.join(unknown)}: it changes nothing. The "
            "README names the variables it reads (its Options table, XDEV_HOSTNAME, "
            "XDEV_CPU_MODEL, XDEV_TOPO_FILE).",
            stacklevel=2,
        )
    changes: dict[str, Any] = {}
    for field, variable, parse in ENV_KNOBS:
        text = env.get(variable)
        if text is None or text == "":
            continue
        try:
            changes[field] = parse(text)
        except ValueError as e:
            raise ValueError(f"{variable}={text!r} is not valid for Options.{field}: {e}") from None
    base = given if given is not None else Options()
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as e:
        overrides = ", ".join(environment_overrides(env))
        raise ValueError(f"{e} (after applying {overrides})" if overrides else str(e)) from None
