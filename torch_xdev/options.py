"""Options of an xdev process group, and their XDEV_* environment overrides."""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any, Callable, Optional, Union

ALGORITHMS = (
    "auto",
    "hierarchical_copy",
    "hierarchical_balanced",
    "reduce_to_one",
    "flat",
    "direct",
    "fallback",
)


@dataclasses.dataclass
class Options:
    """Passed as ``pg_options`` to ``init_process_group`` or ``new_group``.

    Every field can be overridden per process by an environment variable (see
    ``ENV_KNOBS``); the environment wins, as with ``NCCL_ALGO``.

    Attributes:
        algorithm: ``"auto"`` (default: chosen per call, see the README),
            ``"hierarchical_copy"`` (the seeds' plan; even world sizes only),
            ``"hierarchical_balanced"`` (the same two levels, trees balanced over the
            links; even world sizes only), ``"reduce_to_one"``,
            ``"flat"`` (reduce-scatter + allgather), ``"direct"`` (every rank
            reduces everything; one barrier) or ``"fallback"`` (Gloo).
        num_packs: packs for concat-and-split; ``None`` lets the algorithm
            choose (the world size for hierarchical copy), 0 disables it.
        agg_small_grads_max_bytes, agg_small_grads_max_group: small-tensor
            aggregation when ``num_packs`` is 0 and both are > 0.
        bytes_per_pack: cut the payload into packs of this many bytes (0: off).
        reduce_to_rank: the root of reduce-to-one.
        timeout: per-collective timeout; ``None`` uses the group's timeout.
        shm_slot_bytes: staging bytes per rank and slot set; larger payloads
            are processed in windows of this size.
        cuda_slot_bytes: GPU staging bytes per rank and slot set (each rank
            allocates two); larger CUDA payloads run in windows of this size.
            A multiple of 256, at least 4096.
        single_copy: let ranks read each other's tensors in place
            (process_vm_readv) for large CPU allreduces, when the host allows it.
        debug: log the chosen plans to stderr (``XDEV_DEBUG=INFO``).
    """

    algorithm: str = "auto"
    num_packs: Optional[int] = None
    agg_small_grads_max_bytes: int = 0
    agg_small_grads_max_group: int = 0
    bytes_per_pack: int = 0
    reduce_to_rank: int = 0
    timeout: Optional[Union[timedelta, float]] = None
    shm_slot_bytes: int = 256 << 10
    cuda_slot_bytes: int = 32 << 20
    single_copy: bool = False
    debug: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"Options.algorithm must be one of {', '.join(ALGORITHMS)}; got {self.algorithm!r}"
            )
        for name in (
            "num_packs",
            "agg_small_grads_max_bytes",
            "agg_small_grads_max_group",
            "bytes_per_pack",
            "reduce_to_rank",
        ):
            value = getattr(self, name)
            if value is None and name == "num_packs":
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"Options.{name} must be an int; got {value!r}")
            if value < 0:
                raise ValueError(f"Options.{name} must be >= 0; got {value}")
        if not isinstance(self.shm_slot_bytes, int) or self.shm_slot_bytes < 4096:
            raise ValueError(
                f"Options.shm_slot_bytes must be an int >= 4096; got {self.shm_slot_bytes!r}"
            )
        if (
            not isinstance(self.cuda_slot_bytes, int)
            or self.cuda_slot_bytes < 4096
            or self.cuda_slot_bytes % 256 != 0
        ):
            raise ValueError(
                "Options.cuda_slot_bytes must be an int >= 4096 and a multiple of 256; "
                f"got {self.cuda_slot_bytes!r}"
            )
        seconds = self.timeout_seconds()
        if seconds is not None and seconds <= 0:
            raise ValueError(f"Options.timeout must be positive; got {self.timeout!r}")

    def timeout_seconds(self) -> Optional[float]:
        if self.timeout is None:
            return None
        if isinstance(self.timeout, timedelta):
            return self.timeout.total_seconds()
        return float(self.timeout)


def _parse_int(text: str) -> int:
    return int(text, 0)


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _parse_debug(text: str) -> bool:
    return text.strip().upper() in ("1", "INFO", "DEBUG", "TRUE", "YES")


# One line per knob: field, variable, parser.
ENV_KNOBS: tuple[tuple[str, str, Callable[[str], Any]], ...] = (
    ("algorithm", "XDEV_ALGO", str.strip),
    ("num_packs", "XDEV_NUM_PACKS", _parse_int),
    ("agg_small_grads_max_bytes", "XDEV_AGG_SMALL_GRADS_MAX_BYTES", _parse_int),
    ("agg_small_grads_max_group", "XDEV_AGG_SMALL_GRADS_MAX_GROUP", _parse_int),
    ("bytes_per_pack", "XDEV_BYTES_PER_PACK", _parse_int),
    ("reduce_to_rank", "XDEV_REDUCE_TO_RANK", _parse_int),
    ("timeout", "XDEV_TIMEOUT", float),
    ("shm_slot_bytes", "XDEV_SHM_SLOT_BYTES", _parse_int),
    ("cuda_slot_bytes", "XDEV_CUDA_SLOT_BYTES", _parse_int),
    ("single_copy", "XDEV_SINGLE_COPY", _parse_bool),
    ("debug", "XDEV_DEBUG", _parse_debug),
)


def resolve_options(given: Optional[Options], environ: Optional[dict[str, str]] = None) -> Options:
    """Returns a validated copy of ``given`` (or defaults) with XDEV_* overrides applied."""
    if given is not None and not isinstance(given, Options):
        raise ValueError(
            f"pg_options for the xdev backend must be torch_xdev.Options; got {type(given).__name__}"
        )
    env = os.environ if environ is None else environ
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
        names = ", ".join(f"{v}" for f, v, _ in ENV_KNOBS if f in changes)
        raise ValueError(f"{e} (after applying {names})" if names else str(e)) from None
