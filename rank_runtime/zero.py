"""Back up and restore a ``ZeroRedundancyOptimizer`` shard across world sizes.

Each rank owns the optimizer state of a partition of the parameters. ``shard_state`` records
that state with the global index of every parameter in it, so any set of shards can be merged
into the global state (``consolidate``) without the collective ZeRO's own
``consolidate_state_dict`` needs (impossible once a rank is dead), and loaded into a new
ZeRO on any world size, which keeps the part of its new partition (``load_state_dict``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer


def shard_state(optimizer: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """This rank's optimizer state, with the global index of each of its parameters."""
    index = {
        id(p): i
        for i, p in enumerate(itertools.chain(*(g["params"] for g in optimizer.param_groups)))
    }
    # No public API names a rank's partition; ZeRO's own state_dict() reads this one.
    partitions = optimizer._partition_parameters  # type: ignore[attr-defined]
    partition = partitions()[optimizer.rank]
    return {
        "local": optimizer.optim.state_dict(),
        "global_index": [index[id(p)] for group in partition for p in group["params"]],
    }


def consolidate(
    shards: Iterable[dict[str, Any]], optimizer: ZeroRedundancyOptimizer
) -> dict[str, Any]:
    """The global state of ``optimizer``'s parameters from ``shards`` (any subset), for
    ``optimizer.load_state_dict``."""
    state: dict[int, Any] = {}
    for shard in shards:
        local = shard["local"]
        for local_index, global_index in enumerate(shard["global_index"]):
            if local_index in local["state"]:
                state[global_index] = local["state"][local_index]
    groups = Optimizer.state_dict(optimizer)["param_groups"]
    return {"state": state, "param_groups": groups}
