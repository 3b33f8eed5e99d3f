"""GPU link matrices shared by the topology, NVML probe and CUDA tests."""

from __future__ import annotations

# nvidia-smi topo -m on a DGX-1 with V100: NV2 on 0-3, 0-4, 1-2, 1-5, 2-3, 4-7, 5-6, 6-7; GPU i
# is linked to 0:{1,2,3,4} 1:{0,2,3,5} 2:{0,1,3,6} 3:{0,1,2,7} 4:{0,5,6,7} 5:{1,4,6,7} ...
DGX1_V100: list[list[int]] = [
    [0, 1, 1, 2, 2, 0, 0, 0],
    [1, 0, 2, 1, 0, 2, 0, 0],
    [1, 2, 0, 2, 0, 0, 1, 0],
    [2, 1, 2, 0, 0, 0, 0, 1],
    [2, 0, 0, 0, 0, 1, 1, 2],
    [0, 2, 0, 0, 1, 0, 2, 1],
    [0, 0, 1, 0, 1, 2, 0, 2],
    [0, 0, 0, 1, 2, 1, 2, 0],
]


def zeros(n: int) -> list[list[int]]:
    """No link between any of n GPUs."""
    return [[0] * n for _ in range(n)]
