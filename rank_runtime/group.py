"""The process group of a generation: the backend by device, and leaving a broken group fast.

NCCL on CUDA (a GPU per member by ``LOCAL_RANK``), gloo on the CPU.

Leaving a broken group must release the peers still blocked in a collective with this member
at once, not at the collective timeout. NCCL can abort a communicator. Gloo cannot: its
``abort()`` returns without failing a pending operation, and its connections close only when
the last reference to the group goes, which FSDP2's DTensor caches and a loop's own variables
easily outlive (measured here: a peer blocked in ``all_reduce`` waited the whole timeout after
this side had destroyed its group and dropped its model). ``GroupSockets`` records the sockets
``init_process_group`` opened — gloo connects its full mesh there — and those the loop's
``build`` opened (a device mesh's sub-groups, ``new_group``), and ``shutdown`` ends the
connected ones (never a listener) for reading: gloo's own loop then reads the end of each
connection, fails what waits on it and closes it, and every peer blocked on this member gets
"connection closed" in milliseconds and goes to the control plane, as a peer of a dead rank
does. Only reading: a send gloo writes in the meantime still goes out. A connection ended for
writing too fails that write with EPIPE, which gloo's asynchronous path takes as "try again
later" and queues; once the connection is found closed, gloo fails the connection's pending
receives and its sends still waiting for the peer, but not a send already queued for writing,
whose waiter then waits the whole collective timeout (``pair.cc``: ``signalException`` fails
the queued writes of bound buffers only). Ending for reading narrows that window to a peer's
reset arriving before gloo's loop saw the connection end; it does not close it, which is why
a decision does not end the connections of a step still running its course
(``Elastic._on_command``). A socket another thread opened meanwhile (a peer store transfer) may
be among them; ending it fails that one transfer, which is retried as any failed replication
is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"


def member_device() -> Any:
    """The device this member trains on: the GPU of its ``LOCAL_RANK`` when CUDA is
    available, else the CPU."""
    import torch

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: Any) -> str:
    """The process-group backend of ``device``: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def forget_failed_group() -> None:
    """Forget a default group whose ``init_process_group`` failed (a peer left midway).

    torch names the default group by a count it bumps before creating the group and resets
    only in ``destroy_process_group``, which has nothing to destroy after a failed creation.
    The peers that formed and destroyed the group count from 0 again, this member from 1:
    their next group's store keys (prefixed by that name) would never meet, and every rank
    of the next generation would wait in ``init_process_group`` until the timeout. Reset it.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized() and dist.get_pg_count():
        distributed_c10d._world.group_count = 0


def _sockets() -> dict[int, str]:
    """This process's open socket descriptors and what they are (``socket:[inode]``); empty
    where ``/proc`` is not there to ask."""
    found: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(_FD_DIR):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(f"{_FD_DIR}/{name}")
                if target.startswith("socket:"):
                    found[int(name)] = target
    return found


class GroupSockets:
    """The sockets a process group's creation opened (see the module's docstring)."""

    def __init__(self, opened: dict[int, str]) -> None:
        self._opened = opened

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Add the sockets opened while the block runs (a device mesh's sub-groups, created
        by the loop's ``build``), even when it fails midway."""
        before = _sockets()
        try:
            yield
        finally:
            self._opened.update(
                {fd: what for fd, what in _sockets().items() if before.get(fd) != what}
            )

    def __len__(self) -> int:
        return len(self._opened)

    def shutdown(self) -> int:
        """End every recorded socket still open, for reading (see the module's docstring);
        how many were ended. Once: the record is cleared."""
        ended = 0
        opened, self._opened = self._opened, {}
        for fd, what in opened.items():
            try:
                if os.readlink(f"{_FD_DIR}/{fd}") != what:
                    continue  # closed, and the number reused for something else
                with socket.socket(fileno=os.dup(fd)) as sock:
                    # Never its listener: gloo's accept loop aborts the process on a listener
                    # shut down under it (an EINVAL it enforces against). Never a local socket
                    # either: the group's connections are TCP, and a Unix socket opened
                    # meanwhile is another part's (the heartbeat relay's).
                    if sock.family == socket.AF_UNIX or sock.getsockopt(
                        socket.SOL_SOCKET, socket.SO_ACCEPTCONN
                    ):
                        continue
                    sock.shutdown(socket.SHUT_RD)
                ended += 1
            except OSError as exc:  # closed meanwhile, or not connected: nothing to end
                log.debug("socket %d: %s", fd, exc)
        return ended
