"""Process groups in multi-rank tests."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch.distributed as dist


def leave_group(timeout_s: float = 30.0) -> None:
    """Tear this rank's default group down once every rank is done with it: a rank that
    destroys its gloo pairs while a peer's gloo threads still use them can abort the peer's
    process ("terminate called without an active exception"). A rank that failed still
    arrives here (callers call it in ``finally``); one that never does costs ``timeout_s``,
    then the group is torn down anyway and the test reports what failed."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(RuntimeError):  # a rank that never came: tear down anyway
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
    dist.destroy_process_group()
