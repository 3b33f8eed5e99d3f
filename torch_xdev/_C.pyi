# Type stub for the compiled extension (csrc/backend/bindings.cc).
from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import Backend, Store

class BackendConfig:
    algorithm: str
    num_packs: int
    agg_small_grads_max_bytes: int
    agg_small_grads_max_group: int
    bytes_per_pack: int
    reduce_to_rank: int
    timeout: timedelta
    shm_slot_bytes: int
    single_copy: bool
    hostname: str
    group_name: str
    debug: bool
    def __init__(self) -> None: ...

class XdevBackend(Backend):
    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        config: BackendConfig,
        fallback: Any,  # a c10d Backend (ProcessGroupGloo); its stub does not say so
    ) -> None: ...
    def describe(self) -> dict[str, Any]: ...
    @property
    def shm_name(self) -> str: ...

def remove_orphaned_segments() -> int: ...
