"""``python -m torch_xdev.plan --plot``: the predicted busbw against size, drawn with
matplotlib when it is installed."""

from __future__ import annotations

import importlib
from typing import Any, Sequence

from .plan import MachineModel, Row, format_size


def import_pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        return None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def plot(
    model: MachineModel,
    table: Sequence[Row],
    path: str,
    pyplot: Any,
    collective: str = "allreduce",
) -> None:
    """busbw against size, one line per algorithm (its best num_packs at each size)."""
    families: dict[str, dict[int, Row]] = {}
    for r in table:
        family = "ring (reference)" if r["ring_reference"] else r["algorithm"]
        best = families.setdefault(family, {})
        if r["size"] not in best or r["time_us"] < best[r["size"]]["time_us"]:
            best[r["size"]] = r
    fig, ax = pyplot.subplots(figsize=(9, 5.5))
    for family, by_size in families.items():
        sizes = sorted(by_size)
        ring = family.startswith("ring")
        packed = any(r["num_packs"] > 0 for r in table if r["algorithm"] == family)
        ax.plot(
            sizes,
            [by_size[s]["busbw_gbps"] for s in sizes],
            linestyle="--" if ring else "-",
            color="black" if ring else None,
            marker=None if ring else "o",
            markersize=3,
            label=f"{family} (best num_packs)" if packed and not ring else family,
        )
    chosen = [r for r in table if r["chosen"]]
    ax.scatter(
        [r["size"] for r in chosen],
        [r["busbw_gbps"] for r in chosen],
        s=80,
        facecolors="none",
        edgecolors="red",
        zorder=3,
        label="chosen",
    )
    sizes_all = sorted({r["size"] for r in table})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes_all)
    ax.set_xticklabels([format_size(s) for s in sizes_all], rotation=45, ha="right")
    ax.minorticks_off()
    ax.set_xlabel(f"size (bytes, float32 {collective})")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"Predicted {collective} busbw on {model.name}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot.close(fig)
