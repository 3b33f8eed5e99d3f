"""Creates xdev backends for torch.distributed and registers the name "xdev"."""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import math
import os
import socket
import sys
import warnings
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, _ProcessGroupWrapper

from . import _C
from .options import (
    Options,
    backend_config,
    environment_overrides,
    fields_from_environment,
    resolve_options,
)

BACKEND_NAME = "xdev"


def host_identity() -> str:
    """The name ranks compare to find who shares their host (XDEV_HOSTNAME overrides)."""
    name = os.environ.get("XDEV_HOSTNAME") or socket.gethostname()
    # The ranks exchange it as a line of text: a line break would cut it short on its way.
    if any(c in name for c in "\r\n"):
        raise ValueError(f"xdev: XDEV_HOSTNAME must be one line; got {name!r}")
    return name


# Fields of a cost-model file (benchmarks/calibrate.py --out) and the config fields they set.
CPU_MODEL_FIELDS = {
    "core_gbps": "cpu_core_gbps",
    "memory_gbps": "cpu_memory_gbps",
    "launch_us": "cpu_launch_us",
    "barrier_us": "cpu_barrier_us",
    "step_us": "cpu_step_us",
    "sleeping_barrier_us": "cpu_sleeping_barrier_us",
    "net_host_gbps": "net_host_gbps",
    "net_stream_gbps": "net_stream_gbps",
    "net_latency_us": "net_latency_us",
    "net_host_cores": "net_host_cores",
}
# Keys benchmarks/calibrate.py writes beside them for the record: the machine it measured.
CPU_MODEL_RECORDS = ("cores", "window_bytes")
# What a rate (GB/s) or a latency (us) in a model file may be: from a kB/s to an EB/s, and
# no latency beyond 1000 s.
MODEL_RANGES = {"gbps": (1e-6, 1e9), "us": (0.0, 1e9)}
# The "model" a CPU model file names, where it names one (older files do not).
CPU_MODEL_KIND = "cpu_machine"


def _finite_float(value: Any) -> Optional[float]:
    """``value`` as a float if it is a finite int or float (an int too large for a float is not)."""
    if not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def apply_cpu_model_file(config: Any, path: str) -> None:
    """Sets the CPU cost-model parameters of `config` from a calibration file (XDEV_CPU_MODEL)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"XDEV_CPU_MODEL={path!r}: cannot read a JSON cost model: {e}") from e
    params = data.get("params", data) if isinstance(data, dict) else None
    if not isinstance(params, dict):
        raise ValueError(f"XDEV_CPU_MODEL={path!r}: expected a JSON object with 'params'")
    # benchmarks/calibrate_gpu.py's report names its model, and its keys are a CPU model's too.
    kind = data.get("model", CPU_MODEL_KIND)
    if kind != CPU_MODEL_KIND:
        raise ValueError(
            f"XDEV_CPU_MODEL={path!r}: a {kind!r} model is not a CPU cost model "
            f"({CPU_MODEL_KIND!r}, from benchmarks/calibrate.py)"
        )
    unknown = sorted(set(params) - set(CPU_MODEL_FIELDS) - set(CPU_MODEL_RECORDS))
    if unknown:
        # A misspelt key would otherwise leave its parameter at the default without a word.
        raise ValueError(
            f"XDEV_CPU_MODEL={path!r}: unknown parameter(s) {', '.join(unknown)}; a CPU model "
            f"sets {', '.join(CPU_MODEL_FIELDS)} (and records {', '.join(CPU_MODEL_RECORDS)})"
        )
    for key, field in CPU_MODEL_FIELDS.items():
        if key not in params:
            continue
        value = params[key]
        # json reads NaN and Infinity (and json.dump writes them): with one in the model the
        # C++ planner never finishes choosing, and every rank hangs.
        number = None if isinstance(value, bool) else _finite_float(value)
        if number is None or number < 0 or (key.endswith("gbps") and number == 0):
            least = "> 0" if key.endswith("gbps") else ">= 0"
            raise ValueError(
                f"XDEV_CPU_MODEL={path!r}: {key} must be a finite number {least}; got {value!r}"
            )
        # Finite but absurd values make every prediction inf (1e-320 GB/s) or 0, and auto
        # then takes whichever plan it weighs first.
        low, high = MODEL_RANGES.get(key[key.rindex("_") + 1 :], (0.0, math.inf))
        if not low <= number <= high:
            raise ValueError(
                f"XDEV_CPU_MODEL={path!r}: {key} must be within [{low:g}, {high:g}]; got {value!r}"
            )
        if key == "net_host_cores" and not number.is_integer():
            raise ValueError(
                f"XDEV_CPU_MODEL={path!r}: net_host_cores must be a whole number of cores "
                f"(0: the host's share of this machine); got {value!r}"
            )
        setattr(config, field, number)
    fitted_on, here = params.get("cores"), os.cpu_count()
    if isinstance(fitted_on, int) and here is not None and fitted_on != here:
        # Its rates and latencies are another machine's: auto would plan by them silently.
        warnings.warn(
            f"xdev: XDEV_CPU_MODEL={path!r} was fitted on a machine of {fitted_on} cores, and "
            f"this one has {here}: its parameters may not hold here (benchmarks/calibrate.py "
            f"--run fits this machine)",
            stacklevel=3,
        )


def apply_topology_file(config: Any, path: str) -> None:
    """Injects the GPU link matrix of a topology file (XDEV_TOPO_FILE) into `config`."""
    # Imported here: `import torch_xdev` importing torch_xdev.topology made `python -m
    # torch_xdev.topology` warn (runpy) that the module was imported before it ran.
    from .topology import load_topology_file

    try:
        topo = load_topology_file(path)
    except ValueError as e:
        raise ValueError(f"XDEV_TOPO_FILE: {e}") from e
    config.topo_file = str(path)
    config.topo_nvlink = [list(row) for row in topo["nvlink"]]
    config.topo_reachable = [list(row) for row in topo["reachable"]]
    config.topo_nvswitch = list(topo["nvswitch"])


def _make_nccl(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """PyTorch's NCCL backend on its own prefix of our store, for CUDA tensors xdev delegates.

    None where torch has no NCCL or sees no GPU; CUDA tensors then go to Gloo. Creating it is
    cheap: NCCL builds its communicators at the first collective that uses them.
    """
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    from torch._C._distributed_c10d import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return ProcessGroupNCCL(PrefixStore("xdev/nccl/", store), rank, size, options)


def _gloo_devices() -> list[Any]:
    """The devices torch's ProcessGroupGloo constructor picks: one per interface in
    GLOO_SOCKET_IFNAME (comma-separated), else the default (the host name's address)."""
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    if interfaces:
        return [ProcessGroupGloo.create_device(interface=i, lazy_init=False) for i in interfaces]
    return [ProcessGroupGloo.create_default_device(lazy_init=False)]


def _connect_gloo(
    store: Any, prefix: str, rank: int, size: int, timeout: timedelta, what: str, eager: bool
) -> Any:
    """A Gloo group on `prefix` of the store, made as torch makes its own Gloo groups: on the
    interfaces GLOO_SOCKET_IFNAME names (on clusters whose host names resolve to loopback, that
    is what lets hosts reach each other), else the host name's address, with two threads per
    interface. `eager` connects every pair before it returns; otherwise torch's default holds
    (TORCH_GLOO_LAZY_INIT). A peer that never connects gives a DistStoreError that says which
    engine timed out and what to check: Gloo's own message names a store key only.
    """
    prefixed = PrefixStore(prefix, store)
    try:
        if not eager:
            return ProcessGroupGloo(prefixed, rank, size, timeout)
        # The options class with _devices (torch's type stub does not declare it).
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = _gloo_devices()
        options._threads = 2 * len(options._devices)
        return ProcessGroupGloo(prefixed, rank, size, options)
    except RuntimeError as error:  # DistStoreError; FileStore's timeout is a plain RuntimeError
        if not isinstance(error, dist.DistStoreError) and "timeout" not in str(error).lower():
            raise
        raise dist.DistStoreError(
            f"xdev: connecting {what} timed out after {timeout.total_seconds():g} s: a peer "
            f"exited or is stuck, or the group's timeout (init_process_group's timeout=, "
            f"XDEV_TIMEOUT) is too short for its ranks to connect ({error})"
        ) from None


def _cross_host_engine(store: Any, timeout: timedelta) -> Callable[[str, int, int], Any]:
    """Makes the Gloo group of the two-level allreduce's step across hosts.

    The backend calls it once per group where ranks span hosts evenly: the ranks of one local
    index, one per host. It connects to them when it is made, as torch's own Gloo groups do, so
    that a peer that dies or lets go of its engine later (a failed group closes it) resets the
    connection and a call waiting on it fails at once. (Connected lazily, a pair whose peer
    died first waited for that connection until the timeout.)
    """

    def make(prefix: str, rank: int, size: int) -> Any:
        return _connect_gloo(
            store, prefix, rank, size, timeout, "the Gloo engine of the step across hosts", True
        )

    return make


# How long a rank that is about to refuse setup waits for its peers to read why.
_VERDICT_READ_TIMEOUT = timedelta(seconds=30)
# The setup verdict of a rank that a peer given a smaller world size says does not exist.
_NO_SUCH_RANK = "-"


def _agree_on_setup(
    store: Any, rank: int, size: int, timeout: timedelta, error: Optional[BaseException]
) -> None:
    """Every rank says whether its own setup (options, environment, model files) failed, and
    learns whether a peer's did, before anything waits for peers: a rank that refused its
    settings would otherwise leave the others waiting for it until the group's timeout.
    Raises on a rank whose peer failed; the failing rank raises its own error after. A rank
    that never comes gives a DistStoreError naming it at the group's timeout."""
    verdict = "ok" if error is None else f"failed: {type(error).__name__}: {error}"
    # With the size this rank was given: ranks started by hand with different world sizes
    # would otherwise pass here and wait in Gloo's rendezvous, where the message names a key.
    store.set(f"xdev/setup/{rank}", f"{size};{verdict}")
    # At the timeout, names the ranks that never came: the store's own message lists keys.
    _C.wait_for_ranks(store, "xdev/setup/", size, timeout, "creating the group")
    keys = [f"xdev/setup/{peer}" for peer in range(size)]
    # One round trip for all the verdicts, not one per peer.
    verdicts = [value.decode().split(";", 1) for value in store.multi_get(keys)]
    refused = [
        f"rank {peer} {reason}"
        for peer, (given, reason) in enumerate(verdicts)
        if reason != "ok" and peer != rank and given != _NO_SUCH_RANK
    ]
    failed = ["a peer refused its settings; " + "; ".join(refused)] if refused else []
    sizes = [
        f"rank {peer}: {given}"
        for peer, (given, _) in enumerate(verdicts)
        if given not in (str(size), _NO_SUCH_RANK)
    ]
    if sizes:
        # Peers given a larger size wait for ranks this one says do not exist: fill in their
        # places, unless a rank took one, so that those peers learn the sizes now too rather
        # than name a missing rank at the timeout.
        largest = max(int(given) for given, _ in verdicts if given != _NO_SUCH_RANK)
        for absent in range(size, largest):
            for key, value in (
                (f"xdev/setup/{absent}", f"{_NO_SUCH_RANK};"),
                (f"xdev/setup/read/{absent}", "1"),
            ):
                # set() again what is there now: TCPStore without libuv wakes no waiter
                # on compare_set.
                store.set(key, store.compare_set(key, "", value))
        failed.append(
            f"the ranks were given different world sizes (this rank, {rank}: {size}; "
            f"{'; '.join(sizes)}): start every rank with the same world_size"
        )
    if failed or error is not None:
        # Every rank is about to raise. The rank hosting the store (rank 0 under a plain
        # init_process_group) must not exit before its peers have read the verdicts, or they
        # get a closed connection instead of the reason.
        store.set(f"xdev/setup/read/{rank}", "1")
        try:
            # Within the group's timeout: a peer given a larger world size never reads.
            read_timeout = min(_VERDICT_READ_TIMEOUT, timeout)
            store.wait([f"xdev/setup/read/{peer}" for peer in range(size)], read_timeout)
        except RuntimeError:  # DistError; FileStore's timeout is a plain RuntimeError
            pass  # a peer died: it reads nothing, and our own error says enough
    if failed and error is None:
        raise ValueError("xdev: the group cannot start because " + "; ".join(failed))


# How many backends this process has made for each group name and membership. A group
# destroyed and made again in the same processes (init_process_group after
# destroy_process_group) gets the same name and, where the caller keeps its store, the same
# store.
_backends_made: dict[tuple[str, str], int] = {}


def store_of_this_backend(store: Any, group_name: str, global_ranks: Sequence[int]) -> Any:
    """The part of ``store`` that a new backend of ``group_name`` owns: no earlier backend of
    that name wrote there, in this attempt of the job or an earlier one.

    Keys an earlier backend left (a rank's Gloo address, its setup verdict, its shared
    memory's names) would otherwise be read as this one's, sending ranks to a closed port or
    a segment that is gone; Gloo and NCCL race on their own keys the same way (PyTorch issue
    167288). Three things name the keys:

    - the group's members (``global_ranks``, empty for the default group): c10d numbers
      groups from 1 again after destroy_process_group, so one name can come back with other
      members;
    - the backends this process has made for that name and membership: the members destroy
      and make a group together, so the count agrees across them (a count per name alone
      did not: a rank that was a member of an earlier group of the name, and one that was
      not, counted differently and waited for each other under different keys);
    - under torchrun, the attempt: torchrun keeps one store for every attempt and restarts
      its workers (``--max-restarts``) with TORCHELASTIC_RESTART_COUNT one higher. With one
      agent (GROUP_WORLD_SIZE 1: one host) every worker of an attempt has the same count;
      with several, the counts can differ (an agent that restarts its workers because a
      node joins does not count that), so the attempt is left out there, as Gloo leaves it.
    """
    members = ",".join(str(r) for r in global_ranks)
    made = _backends_made.get((group_name, members), 0)
    _backends_made[(group_name, members)] = made + 1
    # A digest keeps the keys short in groups of thousands of ranks.
    backend = f"{hashlib.sha256(members.encode()).hexdigest()[:16]}/backend{made}/"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is not None and os.environ.get("GROUP_WORLD_SIZE", "1") == "1":
        return PrefixStore(f"xdev/attempt{attempt}/{backend}", store)
    return PrefixStore(f"xdev/{backend}", store)


def _create_backend(
    dist_opts: Any, pg_options: Optional[Options], store_is_its_own: bool = False
) -> Any:
    # One XdevBackend serves every device type of its group: c10d registers it
    # for "cpu" and "cuda" and calls this creator once. store_is_its_own: no
    # earlier backend wrote under dist_opts.store (a split's, see split_backend).
    group_id = str(dist_opts.group_id)
    rank, size = int(dist_opts.group_rank), int(dist_opts.group_size)
    store = (
        dist_opts.store
        if store_is_its_own
        else store_of_this_backend(dist_opts.store, group_id, dist_opts.global_ranks_in_group)
    )
    try:
        options = resolve_options(pg_options)
        config = backend_config(options, dist_opts.timeout)
        config.hostname = host_identity()
        config.group_name = group_id
        # Errors name a subgroup's ranks by both numbers (group and global).
        config.global_ranks = [int(r) for r in dist_opts.global_ranks_in_group]
        from_environment = fields_from_environment()
        config.algorithm_from_environment = "algorithm" in from_environment
        config.reduce_to_rank_from_environment = "reduce_to_rank" in from_environment
        model_file = os.environ.get("XDEV_CPU_MODEL")
        if model_file:
            apply_cpu_model_file(config, model_file)
        topo_file = os.environ.get("XDEV_TOPO_FILE")
        if topo_file:
            apply_topology_file(config, topo_file)
    except Exception as error:
        # The group's own timeout may be what was refused: the store's bounds this wait.
        _agree_on_setup(store, rank, size, store.timeout, error)
        raise
    _agree_on_setup(store, rank, size, config.timeout, None)
    fallback = _connect_gloo(
        store, "xdev/gloo/", rank, size, config.timeout, "the group's Gloo engine", False
    )
    cuda_fallback = _make_nccl(store, rank, size, config.timeout)
    try:
        backend = _C.XdevBackend(
            store,
            rank,
            size,
            config,
            fallback,
            cuda_fallback,
            cross_host_engine=_cross_host_engine(store, config.timeout),
        )
    except ValueError as error:
        # The checks that need the group (its size and hosts, every rank's settings) run here:
        # name the options that came from the environment, which applies to every group the
        # process makes. (An algorithm or root from XDEV_ALGO or XDEV_REDUCE_TO_RANK that this
        # group cannot use is not an error: the group uses the default, see options_note.)
        overrides = environment_overrides()
        if not overrides:
            raise
        raise ValueError(f"{error} (Options after applying {', '.join(overrides)})") from None
    note = backend.options_note()
    if note and rank == 0:
        # Once per process and text (Python's warning filter), from the group's first rank.
        warnings.warn(f"xdev: {note}", stacklevel=2)
    # For split_group's children, as text: the backend holds no Python object (see bindings.cc).
    # Without a timeout of their own: a child takes the split's.
    options_json = ""
    if pg_options is not None:
        options_json = json.dumps(dataclasses.asdict(dataclasses.replace(pg_options, timeout=None)))
    backend._set_split_options(options_json)
    return backend


def split_backend(
    options_json: str,
    store: Any,
    rank: int,
    size: int,
    timeout: timedelta,
    group_name: str,
    global_ranks: Sequence[int],
) -> Any:
    """The child group's backend that c10d's ``split_group`` asks of an xdev group: made as
    ``init_process_group`` makes one, with the parent's ``torch_xdev.Options`` but its
    timeout (the ``XDEV_*`` variables apply again), the split's timeout, group name and
    members (global ranks), on the store the parent gives it (a prefix of its own store,
    the same on every rank)."""
    dist_opts = SimpleNamespace(
        store=store,
        group_rank=rank,
        group_size=size,
        timeout=timeout,
        group_id=group_name,
        global_ranks_in_group=list(global_ranks),
    )
    options = Options(**json.loads(options_json)) if options_json else None
    return _create_backend(dist_opts, options, store_is_its_own=True)


# How long the interpreter's exit waits for groups (and the engines across hosts of failed
# groups) still being destroyed on threads of their own.
_TEARDOWN_WAIT = timedelta(seconds=10)


def _wait_for_detached_teardowns() -> None:
    # A group whose last reference went in a callback of its own Work is destroyed on a thread
    # nothing joins; the interpreter must not finalize under it.
    if not _C.wait_for_detached_teardowns(_TEARDOWN_WAIT):
        in_flight = _C.detached_teardowns()[1]
        print(
            f"[xdev] exiting while {in_flight} process group(s) or engine(s) across hosts are "
            f"still being destroyed after {_TEARDOWN_WAIT.total_seconds():g} s (a callback, or "
            "an engine call waiting on a stuck peer, that does not return?)",
            file=sys.stderr,
        )


def register() -> None:
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    atexit.register(_wait_for_detached_teardowns)
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )


def backends_by_device(group: Optional[dist.ProcessGroup] = None) -> dict[str, Any]:
    """The backend of a process group (the default group if None) for CPU and for CUDA
    tensors, where it has one: a group may use xdev for one of them only
    ("cpu:gloo,cuda:xdev")."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, dist.ProcessGroup):
        # new_group hands ranks outside the group GroupMember.NON_GROUP_MEMBER, not a group.
        raise ValueError(
            f"this rank is not a member of that group (got {pg!r}): only its members may ask "
            "for its backend, describe() or shared_empty()"
        )
    backends: dict[str, Any] = {}
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
        except RuntimeError:  # no backend for this device
            continue
        # Under TORCH_DISTRIBUTED_DEBUG=DETAIL c10d wraps each backend in a checker that
        # compares every collective across ranks before running it; ours is inside.
        while isinstance(backend, _ProcessGroupWrapper):
            backend = backend.wrapped_pg
        backends[device] = backend
    return backends


def backend_of(
    group: Optional[dist.ProcessGroup] = None, devices: tuple[str, ...] = ("cpu",)
) -> _C.XdevBackend:
    """The XdevBackend behind a process group (the default group if None) for the first of
    ``devices`` it serves."""
    backends = backends_by_device(group)
    for device in devices:
        if isinstance(backends.get(device), _C.XdevBackend):
            return backends[device]
    found = ", ".join(f"{d}: {type(b).__name__}" for d, b in backends.items())
    raise ValueError(
        f"this process group does not use the xdev backend for {' or '.join(devices)} tensors "
        f"({found or 'no backend'}); create it with backend='xdev'"
    )
