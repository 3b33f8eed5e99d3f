"""``python -m torch_xdev.plan --hosts H``: an allreduce of CUDA tensors over several GPU hosts,
NCCL's tuning model across nodes against a two-level plan (see ``pydoc torch_xdev.plan``,
"Several hosts", and ``csrc/plan/cuda_across_hosts.h``)."""

from __future__ import annotations

import argparse
import sys

from ._C import plan as _plan
from ._registration import MODEL_RANGES
from .plan import (
    COLUMNS,
    DEFAULT_NIC_GBPS,
    MachineModel,
    Row,
    format_row,
    table_stream,
    write_json,
)

INT_MAX = (1 << 31) - 1
MAX_HOSTS = 1 << 16  # 65536 hosts: half a million GPUs
MAX_NICS = 1024  # per host


def hosts_rows(
    model: MachineModel, hosts: int, size: int, nics: int, nic_gbps: float, amd_cpu: bool = False
) -> tuple[list[Row], str]:
    """NCCL's candidates over ``hosts`` copies of a GPU machine and the two-level plan's
    prediction for an allreduce of ``size`` bytes; the second item says what the two-level
    plan's steps take."""
    d = _plan.predict_cuda_across_hosts(model, hosts, size, nics, nic_gbps, amd_cpu)
    ranks = hosts * model.num_devices
    to_busbw = 2 * (ranks - 1) / ranks

    def row(label: str, seconds: float, nccl: bool, chosen: bool) -> Row:
        algbw = size / seconds if seconds > 0 else 0.0
        return Row(
            size=size,
            label=label,
            algorithm="nccl" if nccl else "two_level",
            num_packs=0,
            ring_reference=False,
            nccl=nccl,
            time_us=seconds * 1e6,
            algbw_gbps=algbw / 1e9,
            busbw_gbps=algbw * to_busbw / 1e9,
            chosen=chosen,
        )

    best = d["best_nccl"]["label"]
    table = [row(p["label"], p["seconds"], True, p["label"] == best) for p in d["nccl"]]
    table.append(row("two_level", d["two_level_seconds"], False, False))
    return table, d["reason"]


def main(parser: argparse.ArgumentParser, args: argparse.Namespace, model: MachineModel) -> int:
    # The model counts ranks (hosts x GPUs) and NCCL's ring steps (twice the ranks) in a C++
    # int; no cluster comes near the cap.
    max_hosts = min(MAX_HOSTS, INT_MAX // (2 * max(1, model.num_devices)))
    if not 2 <= args.hosts <= max_hosts:
        parser.error(f"--hosts must be >= 2 and <= {max_hosts}")
    if args.collective != "allreduce" or not model.has_nccl or model.num_devices < 2:
        parser.error("--hosts predicts the allreduce on a GPU machine (one with NCCL and 2+ GPUs)")
    if args.plot is not None or args.num_packs != -1:
        parser.error("--plot and --num-packs do not apply with --hosts")
    nics = model.num_devices if args.nics is None else args.nics
    if args.nic_gbps is None:
        args.nic_gbps = DEFAULT_NIC_GBPS
    low, high = MODEL_RANGES["gbps"]  # the range a topology file's rates are held to
    if not 1 <= nics <= MAX_NICS or not low <= args.nic_gbps <= high:
        parser.error(f"--nics must be in 1..{MAX_NICS}, and --nic-gbps in {low:g}..{high:g}")
    cpu = "AMD" if args.amd_cpu else "Intel"
    out = table_stream(args.json)
    print(
        f"# machine: {args.hosts} hosts x {model.name} ({model.num_devices} GPUs each), "
        f"{nics} NICs x {args.nic_gbps:g} GB/s per host, {cpu} CPUs\n"
        f"# source: {model.source}\n"
        "# predicted allreduce of float32 sums over all ranks; nccl_* rows: NCCL's tuning model "
        "across nodes, * = its choice (what auto runs); two_level: xdev inside each host, NCCL "
        "across (not built for CUDA tensors)\n#\n" + COLUMNS,
        file=out,
        flush=True,
    )
    table: list[Row] = []
    for i, size in enumerate(args.sizes):
        size_table, reason = hosts_rows(model, args.hosts, size, nics, args.nic_gbps, args.amd_cpu)
        block = "\n".join(format_row(r) for r in size_table)
        print(("\n" if i > 0 else "") + block + "\n  # " + reason, file=out, flush=True)
        table += size_table
    if args.json is not None:
        try:
            write_json(args.json, table)
        except OSError as e:  # the table is printed already
            print(f"error: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
            return 1
    return 0
