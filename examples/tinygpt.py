"""A small decoder-only transformer and byte-level text that ships with Python: no download.

- ``build_model(vocab, dim, layers, heads, seq, seed)``: token embedding, learned positions,
  ``layers`` pre-norm blocks (causal self-attention, then a GELU MLP), a final LayerNorm and a
  bias-free head (tied to the token embedding by default). Deterministic for a seed, without
  touching the global RNG.
- ``HashedNgrams(rows, dim, mesh, seed)``: an optional large input embedding of hashed byte
  trigrams (``model.ngrams``), its rows sharded over a mesh (a DTensor, ``Shard(0)``) and never
  gathered: each rank looks up its rows for the whole global batch and one reduce-scatter of
  the activations hands every rank its samples' sum. Gigabytes of state, a cheap step.
- ``shard(model, mesh)``: FSDP2, one ``fully_shard`` per block, then the root (embeddings,
  final norm, head; ``ngrams`` stays row-sharded, outside FSDP2).
- ``split_stages(model, stages)``: an untied ``TinyGPT`` cut into pipeline stages
  (``GPTStage``: the embeddings and the first blocks, ..., the last blocks, final norm and
  head), each keeping the whole model's parameter names.
- ``TextData``: the sources of a fixed list of pure-Python standard library modules (about
  300 KB with CPython 3.11), as bytes (vocab 256), cut into windows of ``seq + 1`` tokens. The
  global batch of step ``s`` is a function of ``s`` alone (``rank_runtime.data.StepSampler``)
  and each rank of any world takes its contiguous part of it; ``step_loss`` weighs a rank's
  tokens so that the gradient average over ranks is the global batch's mean whatever the world.

The corpus is the same on every machine with the same Python version; ``corpus_digest()``
names it, for ranks to compare before training together.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
from functools import cache
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from rank_runtime.data import StepSampler

__all__ = [
    "CORPUS_MODULES",
    "GPTStage",
    "HashedNgrams",
    "TextData",
    "TinyGPT",
    "build_model",
    "corpus",
    "corpus_digest",
    "ngram_rows",
    "shard",
    "split_stages",
    "step_loss",
    "tensor_parallel",
    "trigram_ids",
]

VOCAB = 256
#: Pure-Python standard library modules whose sources make the corpus, in this order.
CORPUS_MODULES = (
    "textwrap",
    "heapq",
    "bisect",
    "colorsys",
    "fnmatch",
    "shlex",
    "string",
    "calendar",
    "difflib",
    "statistics",
    "fractions",
    "glob",
    "queue",
    "sched",
    "graphlib",
)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.reshape(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(n, t, d))
        return out


class Block(nn.Module):
    """Pre-norm: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyGPT(nn.Module):
    def __init__(
        self, vocab: int, dim: int, layers: int, heads: int, seq: int, *, tied: bool = True
    ) -> None:
        super().__init__()
        self.seq = seq
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        #: An input embedding added to the token's (``HashedNgrams``), set after construction.
        self.ngrams: nn.Module | None = None
        if tied:
            self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # GPT-2's scaling of the residual projections by depth.
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(n, t, vocab)`` for token ids ``(n, t)``, ``t <= seq``."""
        t = tokens.shape[1]
        if t > self.seq:
            raise ValueError(f"sequence of {t} tokens exceeds the model's {self.seq}")
        positions = torch.arange(t, device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        if self.ngrams is not None:
            x = x + self.ngrams(tokens)
        for block in self.blocks:
            x = block(x)
        # Bias-free head: its output is not a view (FSDP2 warns about views returned by a root).
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def build_model(  # noqa: PLR0917 (the signature the training scripts call)
    vocab: int, dim: int, layers: int, heads: int, seq: int, seed: int, *, tied: bool = True
) -> nn.Module:
    """A ``TinyGPT`` initialised from ``seed`` alone (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyGPT(vocab, dim, layers, heads, seq, tied=tied)


#: Rows of a ``HashedNgrams`` initialised from one generator (world-independent init).
_INIT_BLOCK = 1 << 14


class _ReduceScatter(torch.autograd.Function):
    """``(world, *shape)`` partial sums in, this rank's ``shape`` sum out; backward gathers the
    ranks' gradients of their outputs and averages them, as FSDP2 averages its gradients."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        out = partial.new_empty(partial.shape[1:])
        dist.reduce_scatter_single(out, partial.flatten(0, 1).contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        size = dist.get_world_size(ctx.group)
        gathered = grad.new_empty((size * grad.shape[0], *grad.shape[1:]))
        dist.all_gather_single(gathered, grad.contiguous(), group=ctx.group)
        return gathered.view(size, *grad.shape) / size, None


def trigram_ids(tokens: torch.Tensor, rows: int) -> torch.Tensor:
    """The row of each position's byte trigram (the two bytes before it, zeros at the start of
    a window, and itself), hashed into ``rows``."""
    p1 = F.pad(tokens, (1, 0))[:, :-1]
    p2 = F.pad(tokens, (2, 0))[:, :-2]
    gram = (p2 * VOCAB + p1) * VOCAB + tokens
    return (gram * 2654435761 + 97) % rows


def ngram_rows(  # noqa: PLR0917
    rows: int, dim: int, seed: int, lo: int, hi: int, std: float = 0.02
) -> torch.Tensor:
    """Rows ``lo`` to ``hi - 1`` of a ``HashedNgrams``'s initial weight (normal, ``std``),
    drawn in blocks of ``_INIT_BLOCK`` rows from generators seeded by ``seed`` and the block:
    the same values whichever rank (of whichever world) draws them."""
    out = torch.empty(hi - lo, dim)
    for block in range(lo // _INIT_BLOCK, -(-hi // _INIT_BLOCK)):
        start = block * _INIT_BLOCK
        stop = min(rows, start + _INIT_BLOCK)
        key = hashlib.sha256(f"{seed}:{block}".encode()).digest()[:8]
        gen = torch.Generator().manual_seed(int.from_bytes(key) >> 1)
        values = torch.empty(stop - start, dim).normal_(0.0, std, generator=gen)
        a, b = max(start, lo), min(stop, hi)
        out[a - lo : b - lo] = values[a - start : b - start]
    return out


class HashedNgrams(nn.Module):
    """A ``rows x dim`` embedding of hashed byte trigrams, row-sharded over the 1-D ``mesh``.

    ``weight`` is a DTensor sharded on dimension 0 (``Shard(0)``, as ``torch.chunk`` splits
    it): this rank holds its rows only, and they never move. A forward gathers the token ids
    of every rank (bytes, not rows), looks up this rank's rows for all of them (zero for rows
    held elsewhere) and reduce-scatters those partial sums: each rank gets its own samples'
    embeddings. Backward gathers the output gradients, so each rank's rows get the gradient of
    every sample that used them (averaged over ranks, as FSDP2 averages); no further reduction.
    The ranks' batches may differ in size (they are padded for the collectives); the windows
    must have one length.

    ``init``: the rows drawn from ``seed`` in blocks of ``_INIT_BLOCK`` (each rank draws only
    the blocks over its rows, and the values do not depend on the world); without, the memory
    is left as allocated (for a build whose state is restored right after).
    """

    def __init__(
        self, rows: int, dim: int, mesh: Any, seed: int, *, init: bool = True, std: float = 0.02
    ) -> None:
        super().__init__()
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if mesh.ndim != 1:
            raise ValueError("HashedNgrams shards over a 1-D mesh")
        if rows < mesh.size():
            raise ValueError(f"{rows} rows do not shard over {mesh.size()} ranks")
        self.rows, self.dim, self.mesh = rows, dim, mesh
        shape, offset = compute_local_shape_and_global_offset((rows, dim), mesh, [Shard(0)])
        self.lo, self.hi = offset[0], offset[0] + shape[0]
        device = mesh.device_type
        local = torch.empty(shape, device=device)
        if init:
            local.copy_(ngram_rows(rows, dim, seed, self.lo, self.hi, std))
        weight = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, dim)),
            stride=(dim, 1),
        )  # fmt: skip
        self.weight = nn.Parameter(weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        group = self.mesh.get_group()
        size = self.mesh.size()
        n, t = tokens.shape
        counts = torch.zeros(size, dtype=torch.long, device=tokens.device)
        dist.all_gather_single(
            counts, torch.tensor([n], dtype=torch.long, device=tokens.device), group=group
        )
        most = int(counts.max().item())
        ids = torch.zeros(most, t, dtype=torch.long, device=tokens.device)
        ids[:n] = trigram_ids(tokens, self.rows)
        every = ids.new_empty((size * most, t))
        dist.all_gather_single(every, ids, group=group)
        every = every.view(size, most, t)
        local: torch.Tensor = cast(Any, self.weight).to_local()
        mine = (every >= self.lo) & (every < self.hi)
        rows = F.embedding((every - self.lo).clamp(0, self.hi - self.lo - 1), local)
        partial = rows * mine.unsqueeze(-1).to(rows.dtype)
        out: torch.Tensor = _ReduceScatter.apply(partial, group)  # type: ignore[no-untyped-call]
        return out[:n]


class GPTStage(nn.Module):
    """A pipeline stage of a ``TinyGPT``: the blocks ``first`` to ``last - 1``, after the
    embeddings (the first stage) and before the final norm and head (the last stage).

    Its parameters keep the whole model's names (``tok.weight``, ``blocks.2.attn.qkv.weight``,
    ``head.weight``: the blocks in a ``ModuleDict`` keyed by their index), so the stages'
    state dicts are disjoint and together make the model's."""

    def __init__(self, model: TinyGPT, first: int, last: int, *, embed: bool, head: bool) -> None:
        super().__init__()
        self.seq = model.seq
        self.tok: nn.Embedding | None = model.tok if embed else None
        self.pos: nn.Embedding | None = model.pos if embed else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first, last)})
        self.ln_f: nn.LayerNorm | None = model.ln_f if head else None
        self.head: nn.Linear | None = model.head if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids ``(n, t)`` (the first stage) or activations ``(n, t, dim)`` in; the next
        stage's activations, or logits ``(n, t, vocab)`` (the last stage), out."""
        if self.tok is not None and self.pos is not None:
            t = x.shape[1]
            if t > self.seq:
                raise ValueError(f"sequence of {t} tokens exceeds the model's {self.seq}")
            x = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.ln_f is not None and self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def split_stages(model: nn.Module, stages: int) -> list[GPTStage]:
    """``model`` (a ``TinyGPT`` with an untied head) cut into ``stages`` pipeline stages of
    consecutive blocks, as even as they go (the first stages take one more when they do not
    divide). The stages share the model's modules: nothing is copied."""
    if not isinstance(model, TinyGPT):
        raise TypeError("split_stages expects a TinyGPT")
    layers = len(model.blocks)
    if not 1 <= stages <= layers:
        raise ValueError(f"{layers} blocks do not split into {stages} stages")
    if stages > 1 and model.head.weight is model.tok.weight:
        raise ValueError("a tied head cannot live in another stage than the embedding")
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + layers // stages + (s < layers % stages))
    return [
        GPTStage(model, bounds[s], bounds[s + 1], embed=s == 0, head=s == stages - 1)
        for s in range(stages)
    ]


def shard(model: nn.Module, mesh: Any, **options: Any) -> nn.Module:
    """FSDP2 over ``mesh``: each block its own ``fully_shard`` group, the rest in the root's
    (a ``HashedNgrams`` excepted: its rows stay sharded as they are, outside FSDP2).

    ``options`` go to every ``fully_shard`` call (e.g. ``reshard_after_forward=False``).
    """
    from torch.distributed.fsdp import fully_shard

    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError("shard expects a model with a ModuleList of blocks (a TinyGPT)")
    for block in blocks:
        fully_shard(block, mesh=mesh, **options)
    ngrams = getattr(model, "ngrams", None)
    if isinstance(ngrams, nn.Module):
        options = {**options, "ignored_params": set(ngrams.parameters())}
    fully_shard(model, mesh=mesh, **options)
    return model


def tensor_parallel(model: nn.Module, mesh: Any) -> nn.Module:
    """Megatron-style tensor parallelism of every block's MLP over ``mesh`` (1-D): the first
    linear column-wise, the second row-wise, so each rank holds a slice of the hidden layer and
    one all-reduce per block rebuilds the output. The ranks of ``mesh`` must see the same
    inputs. Attention, embeddings and norms stay whole on each rank of ``mesh`` (FSDP2 over the
    data-parallel dimension shards them)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError("tensor_parallel expects a model with a ModuleList of blocks (a TinyGPT)")
    for block in blocks:
        parallelize_module(block.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


@cache
def corpus() -> bytes:
    """The concatenated sources of ``CORPUS_MODULES`` (each ends with a newline)."""
    parts: list[bytes] = []
    for name in CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin is None or not origin.endswith(".py") or not Path(origin).is_file():
            raise FileNotFoundError(
                f"the source of the standard library module {name!r} is not installed "
                f"(found {origin!r}); TextData needs the stdlib's .py files"
            )
        data = Path(origin).read_bytes().replace(b"\r\n", b"\n")
        parts.append(data if data.endswith(b"\n") else data + b"\n")
    return b"".join(parts)


def corpus_digest() -> str:
    """A short name of the corpus's bytes (sha256, 16 hex digits)."""
    return hashlib.sha256(corpus()).hexdigest()[:16]


class TextData:
    """Byte windows of ``seq + 1`` tokens; step ``s``'s global batch is fixed by ``s`` alone."""

    def __init__(
        self, seq: int, global_batch: int, seed: int = 0, *, text: bytes | None = None
    ) -> None:
        data = corpus() if text is None else text
        if len(data) < seq + 1:
            raise ValueError(f"{len(data)} bytes of text are too few for windows of {seq + 1}")
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq = seq
        self.global_batch = global_batch
        #: Window ``i`` is ``tokens[i * seq : i * seq + seq + 1]``: inputs ``[:-1]``, targets
        #: ``[1:]``.
        self.windows = (len(data) - 1) // seq
        self.sampler = StepSampler(self.windows, global_batch, seed)

    def __len__(self) -> int:
        return self.windows

    def samples(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``(len(indices), seq)`` of the given windows."""
        if not indices:
            empty = torch.empty(0, self.seq, dtype=torch.long)
            return empty, empty.clone()
        starts = torch.tensor(indices, dtype=torch.long) * self.seq
        rows = self.tokens[starts[:, None] + torch.arange(self.seq + 1)]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def batch(self, step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The part of step ``step``'s global batch that ``rank`` of ``world`` trains on."""
        return self.samples(self.sampler.shard(step, rank, world))


def step_loss(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, world: int, global_batch: int
) -> torch.Tensor:
    """This rank's loss, scaled so that averaging gradients over ``world`` ranks (DDP, FSDP)
    gives the gradient of the mean token loss over the global batch.

    ``(world / (global_batch * seq)) * sum of token losses``: zero, yet differentiable, for an
    empty shard, which must still run backward for the collectives to complete.
    """
    logits = model(inputs)
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )
    return total * (world / (global_batch * inputs.shape[1]))
