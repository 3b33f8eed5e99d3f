"""benchmarks/network_fit.py: the line fit recovers a network the model itself produced.

Times come from the model's formula for the engine's ring over all ranks (2(P-1) steps of a
latency plus bytes/P at one stream's rate), computed here independently of the module; the
fit must give back the latency and rate, and its file must set them through XDEV_CPU_MODEL's
loader. The host link's rate is read off rings that run at once, several streams per host.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from benchmark_modules import load_benchmark

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]


@pytest.fixture(scope="module")
def network_fit() -> ModuleType:
    return load_benchmark("network_fit")


def ring_seconds(hosts: int, per_host: int, nbytes: int, latency_us: float, gbps: float) -> float:
    p = hosts * per_host
    return 2 * (p - 1) * latency_us * 1e-6 + 2 * (p - 1) / p * nbytes / (gbps * 1e9)


@pytest.mark.parametrize("hosts,per_host", [(2, 2), (4, 3)])
def test_fit_recovers_exact_parameters(network_fit: ModuleType, hosts: int, per_host: int) -> None:
    times = [ring_seconds(hosts, per_host, s, 45.0, 1.7) for s in SIZES]
    fit = network_fit.fit_network(hosts, per_host, SIZES, times)
    assert math.isclose(fit["net_latency_us"], 45.0, rel_tol=1e-9)
    assert math.isclose(fit["net_stream_gbps"], 1.7, rel_tol=1e-9)
    assert fit["rms_relative_error"] < 1e-9 and not fit["clamped"]
    assert fit["points"] == len(SIZES)


def test_fit_undoes_the_share_of_a_core(network_fit: ModuleType) -> None:
    # 4 ranks per host on 2 cores: each stream gets half a core, so the ring's messages take
    # twice the latency at half the rate of a stream on a core of its own.
    times = [ring_seconds(2, 4, s, 2 * 45.0, 1.7 / 2) for s in SIZES]
    fit = network_fit.fit_network(2, 4, SIZES, times, host_cores=2)
    assert math.isclose(fit["net_latency_us"], 45.0, rel_tol=1e-9)
    assert math.isclose(fit["net_stream_gbps"], 1.7, rel_tol=1e-9)
    assert fit["host_cores"] == 2
    # The backend's model (no cap binds at these rates) predicts what the fit inverted.
    for size, t in zip(SIZES, times):
        predicted = network_fit.model_ring_s(2, 4, size, 45.0, 1.7, host_cores=2)
        assert math.isclose(predicted, t, rel_tol=1e-9), size
    # A core per stream: no share to undo.
    assert network_fit.fit_network(2, 4, SIZES, times, host_cores=4)["net_latency_us"] > 89


def test_backend_model_caps_what_the_line_does_not(network_fit: ModuleType) -> None:
    # A stream faster than the host's memory allows (27.5 GB/s by default, crossed 4 times by
    # every socket byte, shared by 2 streams: 3.4 GB/s each): the line goes on, the model not.
    size = 16 << 20
    line = ring_seconds(2, 2, size, 10.0, 100.0)
    capped = 2 * 3 / 4 * size / (27.5e9 / 4 / 2) + 6 * 10e-6
    assert math.isclose(network_fit.model_ring_s(2, 2, size, 10.0, 100.0), capped, rel_tol=1e-9)
    assert capped > 5 * line


def test_backend_model_refuses_what_it_cannot_predict(network_fit: ModuleType) -> None:
    import torch_xdev

    predict = torch_xdev._C.plan.predict_flat_ring_across_hosts
    for field, value in [("net_stream_gbps", 0.0), ("net_host_gbps", -1.0), ("net_latency_us", -5)]:
        config = torch_xdev._C.BackendConfig()
        setattr(config, field, value)
        with pytest.raises(ValueError, match=field):
            predict(config, 2, 2, 1 << 20, 2)
    config = torch_xdev._C.BackendConfig()
    with pytest.raises(ValueError, match="cores"):
        predict(config, 2, 2, 1 << 20, -1)
    with pytest.raises(ValueError, match="2\\^20"):
        predict(config, 1 << 16, 1 << 16, 1 << 20, 2)


def test_fit_with_noise_stays_close(network_fit: ModuleType) -> None:
    # +-8% alternating: each size off by as much, the line still near the truth.
    noise = [1.08, 0.92, 1.08, 0.92]
    times = [ring_seconds(2, 2, s, 200.0, 0.8) * n for s, n in zip(SIZES, noise)]
    fit = network_fit.fit_network(2, 2, SIZES, times)
    assert abs(fit["net_latency_us"] / 200.0 - 1) < 0.15
    assert abs(fit["net_stream_gbps"] / 0.8 - 1) < 0.15
    assert 0.05 < fit["rms_relative_error"] < 0.1


def test_negative_intercept_refits_through_zero(network_fit: ModuleType) -> None:
    # Small sizes faster than a line through the large ones allows: no negative latency.
    times = [ring_seconds(2, 2, s, 0.0, 2.0) for s in SIZES]
    times[0] *= 0.5
    fit = network_fit.fit_network(2, 2, SIZES, times)
    assert fit["clamped"] and fit["net_latency_us"] == 0.0
    assert fit["net_stream_gbps"] > 0


def test_fit_rejects_what_it_cannot_fit(network_fit: ModuleType) -> None:
    with pytest.raises(ValueError, match="two sizes"):
        network_fit.fit_network(2, 2, [SIZES[0]], [1e-3])
    with pytest.raises(ValueError, match="several hosts"):
        network_fit.fit_network(1, 4, SIZES, [1e-3] * 4)
    with pytest.raises(ValueError, match="positive"):
        network_fit.fit_network(2, 2, SIZES, [1e-3, 0.0, 1e-3, 1e-3])
    with pytest.raises(ValueError, match="does not grow"):
        network_fit.fit_network(2, 2, SIZES, [1e-3 / (k + 1) for k in range(4)])


def test_written_model_feeds_xdev_and_keeps_other_params(
    network_fit: ModuleType, tmp_path: Path
) -> None:
    registration = pytest.importorskip("torch_xdev._registration", exc_type=ImportError)
    times = [ring_seconds(2, 2, s, 60.0, 2.5) for s in SIZES]
    fit = network_fit.fit_network(2, 2, SIZES, times)
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"params": {"core_gbps": 7.0, "net_host_gbps": 40.0}}))
    network_fit.write_model(path, fit, {"hosts": 2})
    written = json.loads(path.read_text())
    assert written["params"]["core_gbps"] == 7.0  # calibrate.py's parameters stay
    assert written["params"]["net_host_gbps"] == 40.0
    assert written["network_fit"]["source"] == {"hosts": 2}
    config = SimpleNamespace()
    registration.apply_cpu_model_file(config, str(path))
    assert math.isclose(config.net_latency_us, 60.0, rel_tol=1e-9)
    assert math.isclose(config.net_stream_gbps, 2.5, rel_tol=1e-9)
    assert config.cpu_core_gbps == 7.0
    assert not hasattr(config, "net_host_cores")  # a core per stream: left to xdev
    # A fit that shared cores writes how many, so that xdev predicts with the same share.
    network_fit.write_model(path, network_fit.fit_network(2, 2, SIZES, times, host_cores=1), {})
    registration.apply_cpu_model_file(config, str(path))
    assert config.net_host_cores == 1


def across_seconds(hosts: int, nbytes: int, latency_us: float, gbps: float) -> float:
    """One ring of `hosts` ranks (one per host) allreducing nbytes at `gbps` per stream."""
    return 2 * (hosts - 1) * (latency_us * 1e-6 + nbytes / hosts / (gbps * 1e9))


def test_host_link_read_off_streams_it_holds_back(network_fit: ModuleType) -> None:
    # 4 streams per host on 8 cores (a core each) would run at 2.5 GB/s; a 6 GB/s link holds
    # each to 1.5 GB/s.
    times = [across_seconds(3, s, 40.0, 6.0 / 4) for s in SIZES]
    link = network_fit.fit_host_link(3, 4, SIZES, times, stream_gbps=2.5, host_cores=8)
    assert link["link_bound"] and math.isclose(link["net_host_gbps"], 6.0, rel_tol=1e-9)
    assert math.isclose(link["stream_gbps"], 1.5, rel_tol=1e-9)
    assert link["expected_stream_gbps"] == 2.5


def test_host_link_unseen_where_cores_explain_the_streams(network_fit: ModuleType) -> None:
    # 2 streams on 1 core: half a core each, 1.25 of 2.5 GB/s; the link holds nothing back.
    times = [across_seconds(2, s, 40.0, 1.25) for s in SIZES]
    link = network_fit.fit_host_link(2, 2, SIZES, times, stream_gbps=2.5, host_cores=1)
    assert not link["link_bound"] and link["net_host_gbps"] is None
    assert math.isclose(link["expected_stream_gbps"], 1.25, rel_tol=1e-9)
    # The same times with a core per stream: the streams ran at half their rate, so the link
    # (2 x 1.25 GB/s) is what held them.
    link = network_fit.fit_host_link(2, 2, SIZES, times, stream_gbps=2.5, host_cores=2)
    assert link["link_bound"] and math.isclose(link["net_host_gbps"], 2.5, rel_tol=1e-9)
    with pytest.raises(ValueError, match="several hosts"):
        network_fit.fit_host_link(1, 2, SIZES, times, stream_gbps=2.5)
    with pytest.raises(ValueError, match="positive"):
        network_fit.fit_host_link(2, 2, SIZES, times, stream_gbps=0.0)


def test_written_host_link_feeds_xdev(network_fit: ModuleType, tmp_path: Path) -> None:
    registration = pytest.importorskip("torch_xdev._registration", exc_type=ImportError)
    fit = network_fit.fit_network(2, 1, SIZES, [across_seconds(2, s, 50.0, 2.0) for s in SIZES])
    path = tmp_path / "model.json"
    network_fit.write_model(path, fit, {}, host_gbps=3.5)
    config = SimpleNamespace()
    registration.apply_cpu_model_file(config, str(path))
    assert config.net_host_gbps == 3.5
    assert math.isclose(config.net_latency_us, 50.0, rel_tol=1e-9)
    assert math.isclose(config.net_stream_gbps, 2.0, rel_tol=1e-9)
