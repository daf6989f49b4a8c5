"""Hosts on one machine, for partitions that are real (``ip netns`` and veth pairs).

A namespace ``control`` holds the control plane's side (NATS, ``elasticctl serve``) with a
service address, ``SERVICE`` (10.199.0.1, on its loopback); each host namespace reaches it
through a link of its own (``ctl``: 10.200.<i>.2 to 10.200.<i>.1) and the other hosts through
a bridge in a ``switch`` namespace (``peer``: 10.201.0.<i+2>/24). So a host can be cut from
the control plane and not from its peers (its ``ctl`` link down), or from its peers and not
from the control plane (its port on the bridge down), each undone as it was done. PostgreSQL
stays where it is: its Unix socket is a file, which every namespace sees.

Made by root with iproute2 (``ip``), removed on ``close``; ``available()`` says why not.
Used by the tests of partitions and by ``elasticctl chaos``'s partition faults, which runs the
control plane's side in the control namespace (``entered``) and each pod on a host.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any

SERVICE = "10.199.0.1"


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2)"
    probe = f"elprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, text=True, check=False
    )
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


#: ``setns``'s flag for a network namespace (linux/sched.h).
_CLONE_NEWNET = 0x40000000


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({path}): {os.strerror(errno)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def entered(ns: str) -> Iterator[None]:
    """This process in namespace ``ns`` while the block runs, as ``ip netns exec`` puts a
    command there: what it starts, and the sockets it opens, are in ``ns``. Only from a
    process of one thread (a namespace is a thread's: threads started before would stay
    where they were)."""
    if threading.active_count() != 1:
        raise RuntimeError("a network namespace is entered before any thread starts")
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        _setns(f"/var/run/netns/{ns}")
        try:
            yield
        finally:
            _setns(f"/proc/self/fd/{home}")
    finally:
        os.close(home)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Hosts:
    """``count`` hosts, a control namespace and a switch (see the module's docstring)."""

    def __init__(self, count: int) -> None:
        tag = uuid.uuid4().hex[:5]
        self.control = f"el{tag}c"
        self.switch = f"el{tag}s"
        self.hosts = [f"el{tag}h{i}" for i in range(count)]
        self._tag = tag
        self._made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        for ns in (self.control, self.switch, *self.hosts):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.control, "addr", "add", f"{SERVICE}/32", "dev", "lo")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            # Its link to the control plane: "ctl" in the host, "c<i>" in the control ns.
            self._veth(f"a{i}", host, "ctl", self.control, f"c{i}")
            _ip("-n", host, "addr", "add", f"10.200.{i}.2/30", "dev", "ctl")
            _ip("-n", self.control, "addr", "add", f"10.200.{i}.1/30", "dev", f"c{i}")
            _ip("-n", host, "link", "set", "ctl", "up")
            _ip("-n", self.control, "link", "set", f"c{i}", "up")
            _ip("-n", host, "route", "add", f"{SERVICE}/32", "via", f"10.200.{i}.1")
            # Its link to the others: "peer" in the host, "p<i>" on the switch's bridge.
            self._veth(f"p{i}", host, "peer", self.switch, f"p{i}")
            _ip("-n", host, "addr", "add", f"{self.peer_address(i)}/24", "dev", "peer")
            _ip("-n", host, "link", "set", "peer", "up")
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")

    def _veth(self, link: str, ns: str, name: str, other_ns: str, other: str) -> None:
        """A veth pair between ``ns`` (its end named ``name``) and ``other_ns`` (``other``),
        made in the root namespace under names unique to these hosts (``link`` tells this
        pair from their others), then moved and renamed."""
        a, b = f"el{self._tag}{link}", f"el{self._tag}{link}x"
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        _ip("link", "set", a, "netns", ns)
        _ip("link", "set", b, "netns", other_ns)
        _ip("-n", ns, "link", "set", a, "name", name)
        _ip("-n", other_ns, "link", "set", b, "name", other)

    @staticmethod
    def peer_address(i: int) -> str:
        return f"10.201.0.{i + 2}"

    def popen(
        self,
        ns: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        out: IO[bytes] | int | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[bytes]:
        """``argv`` run in namespace ``ns`` (its own process group)."""
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv], env=dict(env), stdout=out,
            stderr=subprocess.STDOUT if out is not None else None, start_new_session=True,
            **kwargs,
        )  # fmt: skip

    def cut_from_control(self, i: int, cut: bool = True) -> None:
        """Host ``i`` cut from the control plane (NATS, the rendezvous), or joined again."""
        _ip("-n", self.control, "link", "set", f"c{i}", "down" if cut else "up")

    def cut_from_peers(self, i: int, cut: bool = True) -> None:
        """Host ``i`` cut from the other hosts, or joined again."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "down" if cut else "up")

    def close(self) -> None:
        """Remove every namespace (their links go with them)."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        self._made.clear()
