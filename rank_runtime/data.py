"""Deterministic data for elastic training: the step fixes the global batch, the world splits it.

DESIGN.md: the global batch and the sample order are fixed by the step number, not by the world
size, so a recovered run (fewer ranks, or a spare in a dead rank's place) sees at each step the
samples the fault-free run would have seen.

**Order.** Each epoch is a permutation of ``range(dataset_len)`` drawn by a CPU
``torch.Generator`` seeded from ``(seed, epoch)`` alone. The sampler holds no state beyond
``(seed, step)``: ``indices(step)`` is a pure function, computed the same in every process. Only
the permutations of the one or two epochs last touched are cached, so consecutive steps cost a
slice, not a fresh permutation of the dataset.

- ``drop_last=True`` (default): an epoch is ``dataset_len // global_batch`` steps; step ``s``
  takes ``perm[epoch][k * B:(k + 1) * B]`` with ``epoch, k = divmod(s, steps_per_epoch)``. The
  ``dataset_len % global_batch`` samples left at the end of each permutation are skipped for that
  epoch (a different few each epoch). When ``B`` divides the dataset this equals the stream rule.
- ``drop_last=False``: the epochs' orders are laid end to end as one stream, and step ``s``
  takes the stream's items ``[s * B, (s + 1) * B)``; its epoch is ``s * B // dataset_len``.
  Every sample appears exactly once per epoch. A batch may straddle two epochs; so that it holds
  no sample twice, the samples at the head of epoch ``e`` that also end epoch ``e - 1`` in that
  batch are swapped (in order) with the first others from the middle of epoch ``e``'s
  permutation. The middle is never the tail, so each epoch's order depends only on its own
  permutation and the previous one's tail (a random step costs two permutations, not a replay).
  That needs room: ``dataset_len >= 2 * global_batch - gcd(dataset_len, global_batch)``.

Either way every global batch has exactly ``global_batch`` distinct samples.

**Sharding (contiguous).** Rank ``r`` of ``W`` takes the slice ``[lo_r, hi_r)`` of the global
batch, where with ``q, m = divmod(B, W)`` the first ``m`` ranks take ``q + 1`` samples and the
rest ``q`` (the split of ``torch.tensor_split``). The shards are disjoint, in rank order, and
their concatenation is the global batch; when ``W > B`` the last ranks get empty shards.

**Loss weighting.** Shards are uneven when ``W`` does not divide ``B``, so averaging per-rank mean
losses would overweight the small shards. DDP averages gradients over ranks (``all_reduce`` then
divide by ``W``), so rank ``r`` must back-propagate::

    loss_r = (W / B) * sum(l_i for i in shard_r)          # reduction="sum"
           = mean(l_i for i in shard_r) * n_r * W / B     # reduction="mean", n_r = len(shard_r)

Then ``(1 / W) * sum_r grad(loss_r) = (1 / B) * sum_i grad(l_i)``, the gradient of the mean loss
over the global batch, whatever the world. ``loss_scale`` returns the factor for the second form
(``n_r * W / B``, a torch loss's default ``reduction="mean"``). A rank with an empty shard
(``W > B``) must use the first form, whose sum over nothing is zero, since a mean over nothing is
NaN; it must still call backward so that DDP's all-reduce completes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch

__all__ = ["DataPosition", "StepSampler", "synthetic_regression"]

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
#: Permutations kept: the current epoch and the next (a ``drop_last=False`` batch may span both).
_CACHED_EPOCHS = 2


def _mix64(x: int) -> int:
    """Scramble a 64-bit integer (the splitmix64 finalizer)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def _epoch_seed(seed: int, epoch: int) -> int:
    """Derive the generator seed of one epoch from the sampler's seed."""
    # Pure integer arithmetic: the same in every process, on every platform (no hash()).
    return _mix64((_mix64(seed) + (epoch + 1) * _GOLDEN64) & _MASK64)


class DataPosition(NamedTuple):
    """Where a step's global batch starts: its epoch and its offset into that epoch's order."""

    epoch: int
    offset: int


class StepSampler:
    """Map a training step to its global batch and split that batch across any world."""

    def __init__(
        self,
        dataset_len: int,
        global_batch: int,
        seed: int,
        drop_last: bool = True,
        *,
        step: int = 0,
    ) -> None:
        if dataset_len < 1:
            raise ValueError(f"dataset_len must be at least 1, got {dataset_len}")
        if not 1 <= global_batch <= dataset_len:
            raise ValueError(
                f"global_batch must be between 1 and dataset_len ({dataset_len}), "
                f"got {global_batch}: a larger batch would repeat samples"
            )
        if not drop_last and dataset_len < _stream_minimum(dataset_len, global_batch):
            raise ValueError(
                f"drop_last=False needs dataset_len >= "
                f"{_stream_minimum(dataset_len, global_batch)} for global_batch {global_batch}, "
                f"got {dataset_len}: a batch spanning two epochs could not avoid repeating "
                "a sample; use drop_last=True"
            )
        if not 0 <= seed <= _MASK64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        _check_step(step)
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.seed = seed
        self.drop_last = drop_last
        #: The next step the training loop will take; the only state worth saving with ``seed``.
        self.step = step
        self._cache: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (
            f"StepSampler(dataset_len={self.dataset_len}, global_batch={self.global_batch}, "
            f"seed={self.seed}, drop_last={self.drop_last}, step={self.step})"
        )

    @property
    def steps_per_epoch(self) -> int:
        """Return the whole steps in one epoch (with ``drop_last=False``, rounded down)."""
        return self.dataset_len // self.global_batch

    def position(self, step: int) -> DataPosition:
        """Return the epoch and offset at which the global batch of ``step`` starts."""
        _check_step(step)
        if self.drop_last:
            epoch, k = divmod(step, self.steps_per_epoch)
            return DataPosition(epoch, k * self.global_batch)
        epoch, offset = divmod(step * self.global_batch, self.dataset_len)
        return DataPosition(epoch, offset)

    def indices(self, step: int) -> list[int]:
        """Return the global batch of ``step``: ``global_batch`` distinct dataset indices."""
        return self._take(step, 0, self.global_batch)

    def bounds(self, rank: int, world: int) -> tuple[int, int]:
        """Return the slice ``[lo, hi)`` of the global batch that ``rank`` of ``world`` takes."""
        if world < 1:
            raise ValueError(f"world must be at least 1, got {world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        q, m = divmod(self.global_batch, world)
        lo = rank * q + min(rank, m)
        return lo, lo + q + (1 if rank < m else 0)

    def shard(self, step: int, rank: int, world: int) -> list[int]:
        """Return the contiguous part of the global batch of ``step`` that ``rank`` trains on."""
        lo, hi = self.bounds(rank, world)
        return self._take(step, lo, hi)

    def loss_scale(self, step: int, rank: int, world: int) -> float:
        """Return the factor for a rank's mean loss that makes DDP's average the global mean."""
        # The global batch does not vary with the step today; ``step`` keeps the call stable if
        # it ever does, and is validated so that a bad step fails here as it would in ``shard``.
        _check_step(step)
        lo, hi = self.bounds(rank, world)
        return (hi - lo) * world / self.global_batch

    def state_dict(self) -> dict[str, int]:
        """Return the sampler's checkpoint state: its seed and next step."""
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at the step of a checkpoint made with the same seed."""
        seed, step = state["seed"], state["step"]
        if seed != self.seed:
            raise ValueError(
                f"checkpoint seed {seed} differs from the sampler's {self.seed}: "
                "the sample order would not follow the checkpointed run"
            )
        _check_step(step)
        self.step = step

    def _take(self, step: int, lo: int, hi: int) -> list[int]:
        """Return items ``[lo, hi)`` of the global batch of ``step``."""
        epoch, offset = self.position(step)
        out: list[int] = []
        start, stop = offset + lo, offset + hi
        # Only drop_last=False runs past the end of an epoch; B <= dataset_len bounds it to two.
        while start < stop:
            if start >= self.dataset_len:
                epoch, start, stop = epoch + 1, start - self.dataset_len, stop - self.dataset_len
                continue
            end = min(stop, self.dataset_len)
            out += self._permutation(epoch)[start:end].tolist()
            start = end
        return out

    def _permutation(self, epoch: int) -> torch.Tensor:
        """Return the sample order of ``epoch``, drawing it only when it is not cached."""
        perm = self._cache.get(epoch)
        if perm is None:
            perm = self._draw(epoch)
            if not self.drop_last and epoch > 0:
                perm = self._spread_boundary(epoch, perm)
            if len(self._cache) >= _CACHED_EPOCHS:
                del self._cache[next(iter(self._cache))]
            self._cache[epoch] = perm
        return perm

    def _draw(self, epoch: int) -> torch.Tensor:
        """Draw the raw permutation of ``epoch`` from its own seed."""
        generator = torch.Generator(device="cpu").manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(self.dataset_len, generator=generator, device="cpu")

    def _spread_boundary(self, epoch: int, perm: torch.Tensor) -> torch.Tensor:
        """Keep out of ``epoch``'s head the samples that end the previous epoch in one batch."""
        n, b = self.dataset_len, self.global_batch
        tail_len = epoch * n % b  # samples of epoch - 1 in the batch that straddles the boundary
        if tail_len == 0:
            return perm
        head_len, middle_end = b - tail_len, n - (epoch + 1) * n % b
        # Only heads and middles are ever swapped, so the previous epoch's tail is its raw one.
        previous = self._cache.get(epoch - 1)
        tail = (previous if previous is not None else self._draw(epoch - 1))[n - tail_len :]
        clashes = torch.isin(perm[:head_len], tail).nonzero().flatten()
        if clashes.numel() == 0:
            return perm
        middle = perm[head_len:middle_end]
        # The constructor's minimum length guarantees enough non-clashing samples in the middle.
        free = (~torch.isin(middle, tail)).nonzero().flatten()[: clashes.numel()] + head_len
        perm = perm.clone()
        perm[clashes], perm[free] = perm[free], perm[clashes]
        return perm


def _stream_minimum(dataset_len: int, global_batch: int) -> int:
    """Return the least dataset length whose epoch boundaries ``drop_last=False`` can spread."""
    # A straddling batch holds t samples of one epoch and B - t of the next, t a multiple of the
    # gcd; the swaps need a middle of B - t_next samples between the head and the tail.
    return 2 * global_batch - math.gcd(dataset_len, global_batch)


def _check_step(step: int) -> None:
    """Refuse a negative step."""
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")


def synthetic_regression(
    n: int, features: int, seed: int, *, noise: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``n`` samples ``(X, y)`` of a fixed noisy linear teacher, the same for a seed.

    ``X`` is ``(n, features)`` standard normal; ``y = X @ w + b + noise * eps`` is ``(n, 1)``,
    with ``w ~ N(0, 1 / features)`` (so ``y`` has unit-order variance), ``b ~ N(0, 1)`` and
    ``eps ~ N(0, 1)``, all float32 from one CPU generator seeded with ``seed``. A model that
    learns drives the mean squared error from about ``1 + b**2`` towards ``noise**2``.
    """
    if n < 1 or features < 1:
        raise ValueError(f"n and features must be at least 1, got n={n}, features={features}")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(features, 1, generator=generator) / features**0.5
    b = torch.randn(1, generator=generator)
    x = torch.randn(n, features, generator=generator)
    y = x @ w + b + noise * torch.randn(n, 1, generator=generator)
    return x, y
