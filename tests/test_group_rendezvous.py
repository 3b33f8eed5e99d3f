"""Group creation when ranks disagree or a peer never comes: every rank learns why at once,
or at the group's timeout with the engine and the ranks named, never a bare store key."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import torch_xdev  # noqa: F401  (registers "xdev" for the ranks run_ranks starts)
from harness import run_ranks

STORE_KINDS = ("hash", "file", "tcp", "tcp_without_libuv")


def _store_per_rank(kind: str, tmp_path: Path, ranks: int) -> list[Any]:
    """One client per rank (a thread each) of one store of this kind."""
    if kind == "hash":
        return [dist.HashStore()] * ranks
    if kind == "file":
        return [dist.FileStore(str(tmp_path / "store"), ranks) for _ in range(ranks)]
    libuv = kind == "tcp"
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=libuv)
    clients = [dist.TCPStore("127.0.0.1", server.port, use_libuv=libuv) for _ in range(ranks - 1)]
    return [server, *clients]


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_ranks_given_different_world_sizes_are_told_so(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ranks started by hand (tcp://) with world sizes 2 and 3: both name the sizes instead of
    # waiting in Gloo's rendezvous, the one given 3 too, although no rank 2 ever comes (the
    # other says so for it), long before the 20 s timeout. (TCPStore without libuv wakes no
    # waiter on compare_set: the rank given 3 waited the whole timeout there.)
    from torch_xdev import _registration

    monkeypatch.setattr(_registration, "_VERDICT_READ_TIMEOUT", timedelta(seconds=1))
    stores = _store_per_rank(kind, tmp_path, 2)
    errors: dict[int, BaseException] = {}

    def setup(rank: int, size: int) -> None:
        try:
            _registration._agree_on_setup(stores[rank], rank, size, timedelta(seconds=20), None)
        except Exception as e:
            errors[rank] = e

    threads = [threading.Thread(target=setup, args=(rank, 2 + rank)) for rank in (0, 1)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert isinstance(errors[0], ValueError), errors
    assert "different world sizes (this rank, 0: 2; rank 1: 3)" in str(errors[0]), errors[0]
    assert isinstance(errors[1], ValueError), errors
    assert str(errors[1]).endswith(
        "the ranks were given different world sizes (this rank, 1: 3; rank 0: 2): start every "
        "rank with the same world_size"
    ), errors[1]
    assert time.monotonic() - start < 10


def _init_and_report(rank: int, world: int) -> str:
    # A long group timeout: the peers of a rank that refuses its settings must not wait it out.
    try:
        dist.init_process_group("xdev", rank=rank, world_size=world, timeout=timedelta(minutes=5))
    except ValueError as e:
        return str(e)
    dist.destroy_process_group()
    return ""


def test_a_rank_refusing_its_settings_stops_every_rank() -> None:
    # Rank 1 refuses its own XDEV_ALGO at once; its peers used to wait for it in the engine's
    # setup until the group's timeout, and then failed with an unrelated store error.
    errors = run_ranks(
        _init_and_report, 3, per_rank_env=[{}, {"XDEV_ALGO": "bogus"}, {}], timeout=120
    )
    assert "XDEV_ALGO" in errors[1] and "bogus" in errors[1], errors[1]
    for peer in (0, 2):
        assert "a peer refused its settings" in errors[peer], errors[peer]
        assert "rank 1 failed" in errors[peer] and "XDEV_ALGO" in errors[peer], errors[peer]


def test_a_host_name_with_a_line_break_is_refused_at_once() -> None:
    # The name went into a line-based record and came back cut short: every rank waited for
    # the shared memory of a host it no longer matched, until the group's timeout.
    env = [{"XDEV_HOSTNAME": "host-a\n"}, {"XDEV_HOSTNAME": "host-b\n"}]
    errors = run_ranks(_init_and_report, 2, per_rank_env=env, timeout=120)
    for rank, error in enumerate(errors):
        assert "XDEV_HOSTNAME must be one line" in error, (rank, error)


@pytest.mark.parametrize("kind", ["hash", "file"])
def test_a_peer_that_never_connects_gloo_is_named_as_a_timeout_not_a_store_key(
    kind: str, tmp_path: Path
) -> None:
    # Rank 1 passed the setup agreement (its key is there) and never made its Gloo engine:
    # rank 0's wait for it in Gloo's constructor said only "wait timeout after 1000ms, keys:"
    # (FileStore: "Wait timeout").
    from types import SimpleNamespace

    from torch_xdev import _registration

    store = _store_per_rank(kind, tmp_path, 1)[0]
    store.set("xdev/setup/1", "2;ok")
    opts = SimpleNamespace(
        group_id="lonely",
        group_rank=0,
        group_size=2,
        store=store,
        timeout=timedelta(seconds=1),
        global_ranks_in_group=[0, 1],
    )
    with pytest.raises(dist.DistStoreError) as info:
        _registration._create_backend(opts, None, store_is_its_own=True)
    assert str(info.value).startswith(
        "xdev: connecting the group's Gloo engine timed out after 1 s: a peer exited or is stuck"
    ), info.value


def test_a_peer_that_never_connects_the_engine_across_hosts_is_named_as_a_timeout() -> None:
    # The engine of the two-level step across hosts is made by the backend after the group's
    # own Gloo engine connected; a peer that dies in between left its rank with Gloo's bare
    # "wait timeout after 1000ms, keys:" message.
    from torch_xdev import _registration

    make = _registration._cross_host_engine(dist.HashStore(), timedelta(seconds=1))
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError) as info:
        make("xdev/cross/0/", 0, 2)
    assert str(info.value).startswith(
        "xdev: connecting the Gloo engine of the step across hosts timed out after 1 s: a peer "
        "exited or is stuck"
    ), info.value
    assert time.monotonic() - start < 30
