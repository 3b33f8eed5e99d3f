"""Fit the network model of the two-level plans from measured allreduces across hosts.

The model (csrc/plan/two_level.h) predicts the engine's ring over all P = H x L ranks as
2(P-1) steps, each a message latency plus a message of bytes/P at one stream's rate:

    time = 2(P-1) * latency + 2(P-1)/P * bytes / stream_rate

a straight line in bytes. Where a host's L streams outnumber its cores (``host_cores``, as
xdev's ``describe()`` reports them: fake hosts sharing one box), each stream gets
cores/L of a core, and the model stretches its latency and slows its rate by that share; the
fit undoes the share, so that the parameters describe a stream on a core of its own.
``fit_network`` fits that line, time = a + bytes * slope, to
measured (bytes, seconds per call) pairs by least squares on relative errors (every size
counts alike, whatever its time), and reads the latency and the per-stream rate off it. The
host link's rate (``net_host_gbps``) is not seen by a ring that sends one stream per host, so
it keeps its default.

``model_ring_s`` asks the backend itself for its prediction with given parameters, the
caps on a stream (the host's link and memory) included, which the line leaves out.

``fit_host_link`` reads the host's link off the step across hosts of the two-level allreduce
(``benchmarks/network.py`` times it): L rings of H ranks at once, L streams leaving each host.
Where those streams run slower than one stream on its share of a core, the link is what they
share: ``net_host_gbps`` is L times their rate. Where they do not, the link carried all L at
full rate, and only a lower bound is known.

``write_model`` writes the result in the XDEV_CPU_MODEL file format (a JSON object whose
``params`` set ``net_latency_us``, ``net_stream_gbps``, ``net_host_gbps`` and, where the fit
saw it, ``net_host_cores``), so that the fitted values can be fed back to xdev; into an
existing model file, it updates those.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, TypedDict

import torch_xdev

# The model's defaults, as the backend declares them (csrc/plan/two_level.h, network_default).
_DEFAULTS = torch_xdev._C.BackendConfig()
DEFAULT_HOST_GBPS: float = _DEFAULTS.net_host_gbps
DEFAULT_STREAM_GBPS: float = _DEFAULTS.net_stream_gbps
DEFAULT_LATENCY_US: float = _DEFAULTS.net_latency_us

# Streams slower than this share of what their cores allow are held back by the host's link.
LINK_BOUND_FRACTION = 0.8


class NetworkFit(TypedDict):
    net_latency_us: float
    net_stream_gbps: float
    intercept_us: float  # a: the line's time at zero bytes
    slope_ns_per_byte: float
    rms_relative_error: float
    points: int
    clamped: bool  # the free line had a < 0: refitted through the origin, latency 0
    host_cores: int  # the cores of a host the fit assumed; 0: a core per stream


def _line(xs: Sequence[float], ys: Sequence[float], through_origin: bool) -> tuple[float, float]:
    """(a, b) minimising sum(((a + b x - y) / y)^2): weights 1/y^2, closed form."""
    w = [1.0 / (y * y) for y in ys]
    swxx = sum(wi * x * x for wi, x in zip(w, xs))
    swxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    if through_origin:
        return 0.0, swxy / swxx
    sw = sum(w)
    swx = sum(wi * x for wi, x in zip(w, xs))
    swy = sum(wi * y for wi, y in zip(w, ys))
    det = sw * swxx - swx * swx
    if det <= 0:
        raise ValueError("fit_network: needs at least two different sizes")
    return (swxx * swy - swx * swxy) / det, (sw * swxy - swx * swy) / det


def _fit_times(
    who: str, sizes_bytes: Sequence[int], seconds: Sequence[float]
) -> tuple[float, float, bool]:
    """(a, slope, clamped): the line through the times per call, refitted through the origin
    where its intercept came out negative; raises where no rate can be read off it."""
    if len(sizes_bytes) != len(seconds) or len(set(sizes_bytes)) < 2:
        raise ValueError(f"{who}: needs one time per size, of at least two sizes")
    if any(t <= 0 for t in seconds) or any(s <= 0 for s in sizes_bytes):
        raise ValueError(f"{who}: sizes and times must be positive")
    xs = [float(s) for s in sizes_bytes]
    a, slope = _line(xs, seconds, through_origin=False)
    clamped = a < 0
    if clamped:
        a, slope = _line(xs, seconds, through_origin=True)
    if slope <= 0:
        raise ValueError(f"{who}: time does not grow with size; no rate to fit")
    return a, slope, clamped


def core_share(ranks_per_host: int, host_cores: int) -> float:
    """The share of a core each of a host's streams gets (0 cores: not modelled)."""
    if host_cores <= 0 or ranks_per_host <= host_cores:
        return 1.0
    return host_cores / ranks_per_host


def fit_network(
    num_hosts: int,
    ranks_per_host: int,
    sizes_bytes: Sequence[int],
    seconds: Sequence[float],
    host_cores: int = 0,
) -> NetworkFit:
    """Latency and per-stream rate from the engine's ring over all ranks, timed per call."""
    if num_hosts < 2 or ranks_per_host < 1:
        raise ValueError(
            f"fit_network: needs ranks on several hosts; got {num_hosts} x {ranks_per_host}"
        )
    a, slope, clamped = _fit_times("fit_network", sizes_bytes, seconds)
    xs = [float(s) for s in sizes_bytes]
    p = num_hosts * ranks_per_host
    steps = 2 * (p - 1)
    share = core_share(ranks_per_host, host_cores)
    residuals = [(a + slope * x - y) / y for x, y in zip(xs, seconds)]
    return {
        "net_latency_us": a / steps * share * 1e6,
        "net_stream_gbps": steps / p / slope / share / 1e9,
        "intercept_us": a * 1e6,
        "slope_ns_per_byte": slope * 1e9,
        "rms_relative_error": (sum(r * r for r in residuals) / len(residuals)) ** 0.5,
        "points": len(xs),
        "clamped": clamped,
        "host_cores": max(host_cores, 0),
    }


class HostLinkFit(TypedDict):
    net_host_gbps: Optional[float]  # L streams' rate where the link held them back; else None
    stream_gbps: float  # what each of the L streams achieved
    expected_stream_gbps: float  # what one stream's fitted rate on its share of a core allows
    link_bound: bool


def fit_host_link(
    num_hosts: int,
    streams_per_host: int,
    sizes_bytes: Sequence[int],
    seconds: Sequence[float],
    stream_gbps: float,
    host_cores: int = 0,
) -> HostLinkFit:
    """The host link's rate from L = ``streams_per_host`` rings of H = ``num_hosts`` ranks
    running at once, each allreducing ``sizes_bytes`` (the step across hosts of the two-level
    allreduce), against ``stream_gbps``, one stream's rate on a core of its own (from
    ``fit_network`` on a ring of one stream per host)."""
    if num_hosts < 2 or streams_per_host < 1:
        raise ValueError(
            f"fit_host_link: needs streams across several hosts; got {num_hosts} hosts of"
            f" {streams_per_host} stream(s)"
        )
    if stream_gbps <= 0:
        raise ValueError("fit_host_link: the stream's rate must be positive")
    _, slope, _ = _fit_times("fit_host_link", sizes_bytes, seconds)
    achieved = 2 * (num_hosts - 1) / num_hosts / slope / 1e9
    expected = stream_gbps * core_share(streams_per_host, host_cores)
    bound = achieved < LINK_BOUND_FRACTION * expected
    return {
        "net_host_gbps": streams_per_host * achieved if bound else None,
        "stream_gbps": achieved,
        "expected_stream_gbps": expected,
        "link_bound": bound,
    }


def model_ring_s(
    num_hosts: int,
    ranks_per_host: int,
    nbytes: int,
    latency_us: float,
    stream_gbps: float,
    host_cores: int = 0,
) -> float:
    """The backend's own prediction of the ring over all ranks with these parameters
    (csrc/plan/two_level.cc), its other parameters at their defaults. Unlike the line above it
    caps each stream by the host's link and memory, so where a cap binds it predicts more than
    the line, and the fit's rms error understates the model's."""
    config = torch_xdev._C.BackendConfig()
    config.net_latency_us = latency_us
    config.net_stream_gbps = stream_gbps
    config.net_host_cores = host_cores
    cores = host_cores if host_cores > 0 else ranks_per_host  # 0: a core per stream, as above
    return torch_xdev._C.plan.predict_flat_ring_across_hosts(
        config, num_hosts, ranks_per_host, nbytes, cores
    )


def format_fit(fit: NetworkFit) -> list[str]:
    lines = [
        f"# network fit from {fit['points']} sizes (time = a + bytes * slope, relative least"
        f" squares): a {fit['intercept_us']:.1f} us, slope {fit['slope_ns_per_byte']:.3f} ns/B,"
        f" rms error {fit['rms_relative_error'] * 100:.1f}%"
        + ("; a < 0 refitted through 0" if fit["clamped"] else ""),
        f"#   net_latency_us  fitted {fit['net_latency_us']:10.2f}   default {DEFAULT_LATENCY_US}",
        f"#   net_stream_gbps fitted {fit['net_stream_gbps']:10.3f}   default"
        f" {DEFAULT_STREAM_GBPS}",
        f"#   net_host_gbps   kept   {DEFAULT_HOST_GBPS:10.3f}   (one stream per host: not seen)",
    ]
    if fit["host_cores"] > 0:
        lines.append(
            f"#   net_host_cores  given  {fit['host_cores']:10d}   (a host's share of this"
            " machine's cores; the fit is per stream on a core of its own)"
        )
    return lines


def write_model(
    path: Path, fit: NetworkFit, source: dict[str, Any], host_gbps: Optional[float] = None
) -> dict[str, Any]:
    """Writes the fit as an XDEV_CPU_MODEL file: its params set the network model (the host's
    link too, where ``host_gbps`` is given). An existing model file (benchmarks/calibrate.py's,
    say) keeps its other parameters and entries."""
    out: dict[str, Any] = {}
    if path.exists():
        try:
            out = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path}: exists and is not a JSON cost model: {e}") from e
        if not isinstance(out, dict) or not isinstance(out.get("params", {}), dict):
            raise ValueError(f"{path}: exists and is not a JSON cost model with 'params'")
    params = out.setdefault("params", {})
    params.update(
        net_latency_us=fit["net_latency_us"],
        net_stream_gbps=fit["net_stream_gbps"],
        net_host_gbps=(
            host_gbps if host_gbps is not None else params.get("net_host_gbps", DEFAULT_HOST_GBPS)
        ),
    )
    if fit["host_cores"] > 0:
        params["net_host_cores"] = fit["host_cores"]
    out["network_fit"] = {**fit, "source": source}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    return out
