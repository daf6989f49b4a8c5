"""Leaving a gloo group releases the peers blocked on this member (``rank_runtime.group``):
without it, a peer waits in its collective until the timeout, whatever this side destroys or
drops."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rank_runtime.group import GroupSockets, backend_for

TIMEOUT_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _member(rank: int, port: int, end: bool, results: mp.Queue) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    opened = GroupSockets({})
    with opened.recording():
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=TIMEOUT_S)
        )
    dist.barrier()
    if rank == 0:  # blocked: rank 1 never joins this all_reduce
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            results.put(("returned", 0.0))
        except RuntimeError:
            results.put(("released", time.monotonic() - started))
    else:
        time.sleep(0.5)
        ended = opened.shutdown() if end else 0
        results.put(("ended", float(ended)))
        time.sleep(TIMEOUT_S + 2)  # alive (its group not destroyed) while rank 0 waits
    results.close()
    results.join_thread()  # what was put reaches the parent before this process ends
    os._exit(0)


def _run(end: bool) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_member, args=(r, port, end, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=TIMEOUT_S + 30) for _ in range(2))
    finally:
        for p in procs:
            p.kill()
            p.join()


@pytest.mark.timeout(90)
def test_ending_the_groups_sockets_releases_a_blocked_peer_at_once() -> None:
    got = _run(end=True)
    assert got["ended"] >= 1  # gloo's connection to the peer (its listener left alone)
    assert got["released"] < 5.0, got  # not the 20 s collective timeout


def test_the_backend_follows_the_device() -> None:
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"


def test_nothing_recorded_ends_nothing() -> None:
    assert GroupSockets({}).shutdown() == 0
    # A descriptor number that now names something else is left alone.
    r, w = os.pipe()
    try:
        assert GroupSockets({r: "socket:[1]"}).shutdown() == 0
    finally:
        os.close(r)
        os.close(w)


def test_a_local_socket_opened_while_a_group_forms_is_not_the_groups(tmp_path) -> None:
    """A member's heartbeat-relay socket (a Unix datagram socket) opened by its heartbeat
    thread while the group forms is recorded with the group's, but never ended with them: a
    recovery must not silence the member's heartbeats."""
    listener = socket.create_server(("127.0.0.1", 0))
    relay = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    relay.bind(str(tmp_path / "relay.sock"))
    opened = GroupSockets({})
    with opened.recording():
        tcp = socket.create_connection(listener.getsockname())
        beats = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    accepted, _ = listener.accept()
    try:
        assert opened.shutdown() == 1  # the TCP connection only
        tcp.settimeout(0)
        assert tcp.recv(1) == b""  # ended: its reader sees the end at once
        beats.sendto(b"beat", str(tmp_path / "relay.sock"))  # the local one still sends
        assert relay.recv(16) == b"beat"
    finally:
        for s in (listener, relay, tcp, beats, accepted):
            s.close()
