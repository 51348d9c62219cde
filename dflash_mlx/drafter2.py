"""The DFlash2 drafter (z-lab's `DFlash2DraftModel`): the v1 drafter plus two things.

* Every decoder layer wraps attention and the MLP in grouped dynamic causal
  convolutions: a learned base kernel plus a per-token kernel projected from the
  (normed) hidden state, shared by the channels of a group. The convolution runs along
  the block only, zero-padded before its first position: context tokens never pass
  through a layer, so nothing of it carries from one cycle to the next and the context
  cache stays v1's (context K/V only, no rollback).
* A candidate selector: the draft is not each position's argmax but a path through
  each position's top-k candidates, scored by their logits plus a low-rank interaction
  between the token before (the predecessor: block token 0 for position 1) and the
  candidate, modulated by the position's hidden state. Under sampling, each position's
  token is a sample of softmax(scores / temp) over its k candidates, drawn with the
  noise the target chooses that position with (sampling.py), so that they often agree.

Everything else (attention with injected context, sliding-window layers, masks, the
draft vocabulary, the cache) is the v1 drafter's (`drafter.py`, `context_cache.py`).
Parameter names follow z-lab's checkpoints: the codebooks are stored as plain tensors
(`candidate_selector.predecessor_codebook`), and torch state dicts' `.weight` names load too.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .drafter import DecoderLayer, Drafter, DrafterConfig
from .sampling import Draws
from .topk import top_k_columns

if TYPE_CHECKING:
    from .target import Target

#: The config fields DFlash2 adds (under `dflash_config`, or at the top level).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class Drafter2Config(DrafterConfig):
    """A v1 config plus the convolution and selector sizes (None: missing, which
    `config.check_config` reports)."""

    architecture: ClassVar[str] = "DFlash2DraftModel"
    family_fields: ClassVar[tuple[str, ...]] = DFLASH2_FIELDS

    conv_kernel_size: Optional[int] = None
    conv_group_size: Optional[int] = None
    selector_rank: Optional[int] = None
    selector_top_k: Optional[int] = None

    @classmethod
    def from_dict(cls, config: dict) -> "Drafter2Config":
        """Parse a z-lab DFlash2 config.json dict (z-lab's lookup: `dflash_config` first)."""
        base = DrafterConfig.from_dict(config)
        sub = config.get("dflash_config") or {}
        values = {f.name: getattr(base, f.name) for f in fields(DrafterConfig)}
        values["extra"] = {k: v for k, v in base.extra.items() if k not in DFLASH2_FIELDS}
        values.update({k: sub.get(k, config.get(k)) for k in DFLASH2_FIELDS})
        return cls(**values)

    def to_dict(self) -> dict:
        """v1's config.json layout, with the DFlash2 fields under `dflash_config`."""
        out = super().to_dict()
        out["dflash_config"].update({k: getattr(self, k) for k in DFLASH2_FIELDS})
        return out

    def make_drafter(self) -> "Drafter2":
        """A DFlash2 drafter of this config, with freshly initialised weights."""
        return Drafter2(self)


def grouped_causal_conv(x: mx.array, dynamic: mx.array, base: mx.array, group_size: int) -> mx.array:
    """out[t] = sum_o (base[o] + dynamic[t, o, group]) * x[t - o], zero before t = 0.
    x (N, L, hidden); dynamic (N, L, K, hidden / group_size); base (K, hidden)."""
    kernel = base.astype(x.dtype) + mx.repeat(dynamic, group_size, axis=-1)  # (N, L, K, hidden)
    out = kernel[:, :, 0] * x
    for o in range(1, min(base.shape[0], x.shape[1])):
        shifted = mx.pad(x[:, :-o], [(0, 0), (o, 0), (0, 0)])  # x[t - o]
        out = out + kernel[:, :, o] * shifted
    return out


def identity_kernel(kernel_size: int, hidden_size: int) -> mx.array:
    """A base kernel (2, K, hidden) for [before, after] that passes its input through: 1 at
    offset 0, 0 at the others."""
    return mx.zeros((2, kernel_size, hidden_size)).at[:, 0].add(1.0)


class DynamicCausalConv(nn.Module):
    """The pair of convolutions around one sublayer. Both take their per-token kernels
    from the sublayer's (normed) input: `before` filters that input, `after` the
    sublayer's output."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = identity_kernel(kernel_size, hidden_size)  # [before, after] x offset x channel
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def before(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (N, L, hidden) -> (filtered x, the per-token kernels (N, L, K, groups) for `after`)."""
        N, L, _ = x.shape
        dynamic = self.kernel_projection(x).reshape(N, L, 2, self.kernel_size, -1)
        return grouped_causal_conv(x, dynamic[:, :, 0], self.base_kernel[0], self.group_size), dynamic[:, :, 1]

    def after(self, y: mx.array, dynamic: mx.array) -> mx.array:
        """The sublayer's output y (N, L, hidden), filtered with the kernels `before` made."""
        return grouped_causal_conv(y, dynamic, self.base_kernel[1], self.group_size)

    def make_identity(self) -> None:
        """Both convolutions pass their input through exactly: the identity base kernel and
        no per-token part (a zero projection, which still receives gradients)."""
        self.base_kernel = identity_kernel(self.kernel_size, self.base_kernel.shape[-1])
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)


class DecoderLayer2(DecoderLayer):
    """A v1 layer whose attention and MLP are each wrapped in a dynamic causal convolution."""

    def __init__(self, cfg: Drafter2Config):
        super().__init__(cfg)
        args = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.attention_conv = DynamicCausalConv(*args)
        self.mlp_conv = DynamicCausalConv(*args)

    def __call__(
        self, x: mx.array, context: tuple[mx.array, mx.array], offset: int | mx.array, mask: Optional[mx.array]
    ) -> mx.array:
        """As a v1 layer's call, each sublayer between its two convolutions."""
        h, kernel = self.attention_conv.before(self.input_layernorm(x))
        x = x + self.attention_conv.after(self.self_attn(h, context, offset, mask), kernel)
        h, kernel = self.mlp_conv.before(self.post_attention_layernorm(x))
        return x + self.mlp_conv.after(self.mlp(h), kernel)


class CandidateSelector(nn.Module):
    """Picks the draft path through each position's top-k candidates."""

    def __init__(self, cfg: Drafter2Config):
        super().__init__()
        self.top_k = cfg.selector_top_k
        scale = cfg.selector_rank**-0.5
        self.predecessor_codebook = scale * mx.random.normal((cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = scale * mx.random.normal((cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def select(self, hidden: mx.array, logits: mx.array, anchor: mx.array, draws: Draws) -> mx.array:
        """hidden (n, hidden) and logits (n, vocab) of block positions 1..n; anchor: block
        token 0. Returns the path (n,), one position at a time: the best-scoring candidate
        when greedy, else the one whose tempered score plus the position's noise (the
        noise the target chooses with) is highest, a sample of softmax(score / temp)."""
        candidates = top_k_columns(logits, self.top_k)  # (n, top_k), unordered
        unary = mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)
        query = self.hidden_projection(hidden).astype(mx.float32)  # (n, rank)
        successors = self.successor_codebook[candidates].astype(mx.float32)  # (n, k, rank)
        noise = None
        if not draws.greedy:
            noise = mx.take_along_axis(draws.noise(hidden.shape[0], logits.shape[-1]), candidates, axis=-1)
        token, path = anchor, []
        for i in range(hidden.shape[0]):
            edges = successors[i] @ (self.predecessor_codebook[token].astype(mx.float32) * query[i])  # (k,)
            scores = unary[i] + edges
            if noise is not None:
                scores = scores / draws.temp + noise[i]
            token = candidates[i, mx.argmax(scores)]
            path.append(token)
        return mx.stack(path)


class Drafter2(Drafter):
    """A DFlash2 drafter: v1's context handling and call, DFlash2 layers, and the selector."""

    layer_class = DecoderLayer2
    key_aliases = {
        f"candidate_selector.{n}.weight": f"candidate_selector.{n}"
        for n in ("predecessor_codebook", "successor_codebook")
    }

    def __init__(self, config: Drafter2Config):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)

    def candidates(
        self, block: mx.array, cache: Sequence[KVCache], target: "Target", draws: Draws
    ) -> tuple[mx.array, mx.array]:
        """(draft logits (B-1, vocab), whose top `selector_top_k` tokens are the selector's
        candidates at each position; the chain draft (B-1,): the selector's path through
        them, z-lab's sampling: temperature only, no top-p / top-k) for block positions 1..B-1."""
        h = self.hidden(block, cache, target)
        logits = self.head(h, target)
        return logits, self.candidate_selector.select(h, logits, block[0, 0], draws)
