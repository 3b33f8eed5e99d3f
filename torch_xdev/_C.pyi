# Type stub for the compiled extension (csrc/backend/bindings.cc).
from datetime import timedelta
from typing import Any, Callable, Optional, TypedDict

import torch
from torch._C._distributed_c10d import Backend, Store

class BackendConfigField(TypedDict):
    name: str
    type: str  # as this stub spells it
    option: bool  # a field of torch_xdev.Options; else set by torch_xdev._registration
    doc: str
    describe_key: str | None  # its key in XdevBackend.describe(), if it has one

class BackendConfig:
    """Declared by XDEV_OPTION_FIELDS and XDEV_INTERNAL_FIELDS (csrc/backend/backend_config.h).

    tests/test_option_declarations.py checks the attributes below against the binding, and
    prints the lines to paste when they differ.
    """

    algorithm: str  # allreduce algorithm, or "auto" to choose per call
    num_packs: int  # packs for concat-and-split; -1: the algorithm's choice, 0: off
    agg_small_grads_max_bytes: int  # small-tensor aggregation: largest tensor grouped
    agg_small_grads_max_group: int  # small-tensor aggregation: most tensors per group
    bytes_per_pack: int  # cut the payload into packs of this many bytes (0: off)
    reduce_to_rank: int  # the root of reduce_to_one
    timeout: timedelta  # per-collective timeout
    shm_slot_bytes: int  # staging bytes per rank and slot set; larger payloads run in windows
    cuda_slot_bytes: int  # GPU staging bytes per rank and slot set (two sets per rank)
    cuda_host_check: bool  # check each CUDA collective against the peers' on the host before its kernels are queued
    single_copy: bool  # let peers read large tensors in place (process_vm_readv)
    shared_buckets: bool  # give DDP its gradient buckets in memory every rank maps
    two_level_pieces: int  # pieces a two-level allreduce is pipelined in; 0: the model's choice
    debug: bool  # log the chosen plans to stderr
    hostname: str  # this rank's host identity (XDEV_HOSTNAME)
    group_name: str  # the group's name
    global_ranks: list[int]  # the group's members as global ranks, by group rank (empty: the default group)
    algorithm_from_environment: bool  # set by XDEV_ALGO: a group it cannot run on uses auto
    reduce_to_rank_from_environment: bool  # set by XDEV_REDUCE_TO_RANK: else rank 0
    topo_file: str  # XDEV_TOPO_FILE: an injected GPU link matrix (empty: detect)
    topo_nvlink: list[list[int]]  # NVLinks per pair of local ranks
    topo_reachable: list[list[int]]  # peer access per pair of local ranks; empty: where nvlink > 0
    topo_nvswitch: list[int]  # NVLinks to NVSwitches per local rank
    cpu_core_gbps: float  # CPU cost model: one core, GB/s
    cpu_memory_gbps: float  # CPU cost model: memory, GB/s
    cpu_launch_us: float  # CPU cost model: per call, us
    cpu_barrier_us: float  # CPU cost model: barrier, us
    cpu_step_us: float  # CPU cost model: per step, us
    cpu_sleeping_barrier_us: float  # CPU cost model: barrier with more ranks than cores, us
    net_host_gbps: float  # network model: one host's link, GB/s
    net_stream_gbps: float  # network model: one TCP stream, GB/s
    net_latency_us: float  # network model: one message between hosts, us
    net_host_cores: float  # network model: one host's cores for its streams; 0: its share
    def __init__(self) -> None: ...
    def validate(self) -> None: ...
    @staticmethod
    def fields() -> list[BackendConfigField]: ...

class XdevBackend(Backend):
    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        config: BackendConfig,
        fallback: Any,  # a c10d Backend (ProcessGroupGloo); its stub does not say so
        cuda_fallback: Any = None,  # ProcessGroupNCCL for CUDA tensors, or None
        # (prefix, rank, size) -> an engine (ProcessGroupGloo) for the ranks of one local
        # index across hosts; called once at construction where ranks span hosts evenly.
        cross_host_engine: Optional[Callable[[str, int, int], Any]] = None,
    ) -> None: ...
    def describe(self) -> dict[str, Any]: ...
    def options_note(self) -> str: ...
    def _get_sequence_number_for_group(self) -> int: ...
    # Collective: a CPU tensor in memory every rank of the group maps (torch_xdev.shared_empty).
    def shared_empty(self, sizes: list[int], dtype: torch.dtype) -> torch.Tensor: ...
    # Collective: opens the group's CUDA transport and NCCL's communicator on `device`
    # (torch_xdev.prepare_cuda_graph_capture).
    def prepare_cuda_graph_capture(self, device: int) -> None: ...
    @property
    def shm_name(self) -> str: ...
    # Whether a collective on the group's worker thread has a core of its own while its
    # caller computes (every rank of the host has two cores).
    @property
    def worker_has_own_core(self) -> bool: ...
    # c10d's Backend options of the group (XdevBackendOptions), which split_group copies.
    @property
    def options(self) -> Any: ...
    # Lets c10d's split_group split the group: its children are made by
    # torch_xdev._registration.split_backend with these options (JSON; "" for none).
    def _set_split_options(self, options_json: str) -> None: ...

# c10d's Backend options of an xdev group (a subclass of c10d's, which its stub does not name).
class XdevBackendOptions:
    def __deepcopy__(self, memo: dict[int, Any]) -> XdevBackendOptions: ...

def remove_orphaned_segments() -> int: ...
def wait_for_ranks(
    store: Store, prefix: str, world_size: int, timeout: timedelta, what: str
) -> None: ...
def wait_for_detached_teardowns(timeout: timedelta) -> bool: ...
def detached_teardowns() -> tuple[int, int]: ...

built_with_cuda: bool
built_with_torch: str

class plan:
    """The submodule torch_xdev._C.plan (csrc/backend/plan_bindings.cc): the cost model.

    Declared as a class because a single-file stub cannot declare a submodule; at run time
    it is a module. Prediction and Choice exist for type checking only.
    """

    MAX_PACKS: int

    class MachineModel:
        @property
        def name(self) -> str: ...
        @property
        def num_devices(self) -> int: ...
        @property
        def source(self) -> str: ...
        @property
        def window_bytes(self) -> int: ...
        @property
        def launch_latency_s(self) -> float: ...
        @property
        def step_latency_s(self) -> float: ...
        @property
        def barrier_latency_s(self) -> float: ...
        @property
        def barrier_between_phases(self) -> bool: ...
        @property
        def has_nccl(self) -> bool: ...  # NCCL's candidates are predicted on this machine
        def links(self) -> list[list[int]]: ...

    class Prediction(TypedDict):
        label: str  # "hierarchical_copy/8", "flat", "nccl_ring/LL", "ring (reference)"
        algorithm: str  # an algorithm name, "nccl", or "ring" for the ring reference
        num_packs: int
        ring_reference: bool
        nccl: bool  # NCCL's algorithm/protocol, predicted by NCCL's own tuning model
        bytes: int
        seconds: float
        algbw: float  # bytes/s
        busbw: float  # bytes/s

    class Choice(TypedDict):
        best: plan.Prediction
        best_native: plan.Prediction
        best_nccl: Optional[plan.Prediction]  # None on machines without NCCL
        predictions: list[plan.Prediction]

    class Traffic(TypedDict):
        inter_host_bytes: float  # sent by each host to other hosts
        inter_host_steps: int  # sequential steps whose messages cross hosts
        inter_host_streams: int  # leaving each host at once
        intra_host_socket_bytes: float  # between ranks of one host, through sockets

    @staticmethod
    def predict_cuda_across_hosts(
        machine: plan.MachineModel,
        num_hosts: int,
        nbytes: int,
        nics: int,
        nic_gbps: float,
        amd_cpu: bool = False,
    ) -> dict[str, Any]: ...  # nccl, best_nccl, reduce_scatter, across, all_gather, two_level_*
    @staticmethod
    def across_hosts_traffic(
        num_hosts: int, ranks_per_host: int, nbytes: int, collective: str = "allreduce"
    ) -> dict[
        str, plan.Traffic
    ]: ...  # keys "two_level" and "flat_ring"; or all_gather/reduce_scatter
    @staticmethod
    def predict_flat_ring_across_hosts(
        config: BackendConfig, num_hosts: int, ranks_per_host: int, nbytes: int, cores: int
    ) -> float: ...
    @staticmethod
    def builtin_machine(name: str) -> plan.MachineModel: ...
    @staticmethod
    def builtin_machine_names() -> list[str]: ...
    @staticmethod
    def gpu_machine(
        name: str,
        links: list[list[int]],
        nvlink_gbps: float = 25.0,
        pcie_gbps: float = 12.0,
        memory_gbps: float = 900.0,
        compute_capability: int = 70,
        nvswitch: list[int] = [],
    ) -> plan.MachineModel: ...
    @staticmethod
    def cpu_machine(
        ranks: int,
        cores: int,
        core_gbps: float,
        memory_gbps: float,
        launch_us: float,
        barrier_us: float,
        window_bytes: int,
        step_us: float = 0.0,
        sleeping_barrier_us: float = 8.6,
    ) -> plan.MachineModel: ...
    @staticmethod
    def shared_gpu_machine(
        ranks: int,
        memory_gbps: float,
        launch_us: float,
        step_us: float,
        window_bytes: int = 33554432,
    ) -> plan.MachineModel: ...
    @staticmethod
    def predict(
        machine: plan.MachineModel,
        algorithm: str,
        num_packs: int,
        nbytes: int,
        elem_bytes: int = 4,
        ring_reference: bool = False,
    ) -> plan.Prediction: ...
    @staticmethod
    def size_class(nbytes: int) -> int: ...
    @staticmethod
    def choose(
        machine: plan.MachineModel,
        nbytes: int,
        num_packs: int = -1,
        with_ring_reference: bool = True,
        with_nccl: bool = True,
    ) -> plan.Choice: ...
    @staticmethod
    def choose_gather_scatter(
        machine: plan.MachineModel,
        collective: str,
        nbytes: int,
        single_copy: bool = True,
        in_place: bool = True,
        with_ring_reference: bool = True,
        elem_bytes: int = 4,
        with_nccl: bool = True,
    ) -> dict[str, Any]: ...  # "best" and "predictions": dicts with label, form, nccl, seconds...
    @staticmethod
    def classify(links: list[list[int]]) -> str: ...

class topology:
    """The submodule torch_xdev._C.topology (csrc/backend/topology_bindings.cc).

    Declared as a class because a single-file stub cannot declare a submodule; at run time
    it is a module. NvlinkReport exists for type checking only.
    """

    class NvlinkReport(TypedDict):
        links: list[list[int]]  # NVLinks per pair of local ranks (switched too); 0 on a shared GPU
        nvswitch: list[int]  # per local rank, its GPU's NVLinks to NVSwitches
        available: bool  # NVML loaded, initialised and knew every GPU
        note: str  # what was found, or why nothing was

    @staticmethod
    def probe_nvlinks(bus_ids: list[str]) -> topology.NvlinkReport: ...
    @staticmethod
    def classify_gpus(
        nvlink: list[list[int]], reachable: list[list[int]], nvswitch: list[int] = ...
    ) -> str: ...
