"""A recovery stops the replicator at once: a backup still being digested or sent (to a
holder that reads nothing, even) is abandoned and never reported, and later backups replicate
again. No bus: the ``Elastic``'s world is set by hand, its events recorded."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from rank_runtime.elastic import World
from tests.unit.test_replication import _deaf_holder
from tests.unit.test_restore_member import member


def test_a_recovery_abandons_a_backup_on_its_way_and_reports_none(monkeypatch):
    from rank_runtime import elastic as elastic_module
    from rank_runtime.replication import Abandoned

    server, accepted = _deaf_holder()
    elastic = member(monkeypatch, "w0", 0, own=None)
    elastic._secret = None  # the deaf holder does not authenticate
    sending, ended = threading.Event(), []
    real_send = elastic_module.send

    def send(*args: Any, **kwargs: Any) -> None:
        sending.set()
        try:
            real_send(*args, **kwargs)
        except BaseException as exc:
            ended.append(exc)
            raise

    monkeypatch.setattr(elastic_module, "send", send)
    endpoint = f"127.0.0.1:{server.getsockname()[1]}"
    elastic.world = World(2, 0, 2, ("w0", "w1"), (("w1",), ()), {"w1": endpoint}, "x")
    published: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(elastic.client, "publish", lambda kind, payload: published.append(
        (kind, payload)))  # fmt: skip
    elastic.backup(20, {"w": torch.randn(16 * 1024 * 1024)})  # 64 MiB: more than a socket takes
    elastic._replicator = threading.Thread(target=elastic._replicate, daemon=True)
    elastic._replicator.start()
    assert sending.wait(30)
    time.sleep(0.3)  # blocked sending: the holder reads nothing
    replicator = elastic._replicator
    assert accepted and replicator.is_alive() and not ended
    started = time.monotonic()
    elastic._drain_replication(abandon=True)
    assert not replicator.is_alive() and time.monotonic() - started < 10
    assert len(ended) == 1 and isinstance(ended[0], Abandoned)
    assert [kind for kind, _ in published if kind == "backup.snapshot"] == []
    assert not elastic._abandon.is_set()  # the next replicator runs
    server.close()
    for conn in accepted:
        conn.close()


def test_without_abandon_the_drain_sends_what_is_queued(monkeypatch):
    """``finish`` drains without abandoning: the last backup still reaches its holder."""
    from rank_runtime.replication import PeerStore

    holder = PeerStore()
    endpoint = holder.start()
    try:
        elastic = member(monkeypatch, "w0", 0, own=None)
        elastic._secret = None  # as the holder
        elastic.world = World(2, 0, 2, ("w0", "w1"), (("w1",), ()), {"w1": endpoint}, "x")
        published: list[str] = []
        monkeypatch.setattr(elastic.client, "publish", lambda kind, _: published.append(kind))
        elastic.backup(20, {"w": torch.randn(1024)})
        elastic._replicator = threading.Thread(target=elastic._replicate, daemon=True)
        elastic._replicator.start()
        elastic._drain_replication()
        assert "backup.snapshot" in published and holder.held("w0", 0, 20) is not None
    finally:
        holder.close()
