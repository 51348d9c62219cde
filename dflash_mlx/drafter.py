"""The DFlash drafter: a few Qwen3 decoder layers that fill a whole block in one forward.

Queries come only from the block ([last token, MASK, ..., MASK]). Keys and values are the block's own plus those of
the *context*: features of the target's chosen layers, projected once by `fc` + `hidden_norm` and injected into every
layer. Only context K/V are cached, so the cache never needs rolling back. Position k of the block predicts the token
at position k. The drafter has no embedding and no lm_head: it borrows the target's. Parameter names follow z-lab's
checkpoints exactly, so their weights load key by key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from .context_cache import ContextCache, block_masks
from .sampling import Draws

if TYPE_CHECKING:
    from .target import Target


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's spread of feature layers when a config names none."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    step = (num_target_layers - 4) / (num_draft_layers - 1)
    return [int(round(1 + i * step)) for i in range(num_draft_layers)]


def _layer_types(c: dict) -> Optional[list[str]]:
    """`layer_types`, or, without them, what transformers' Qwen3Config derives: sliding
    layers from `max_window_layers` on when `use_sliding_window` is set."""
    if c.get("layer_types") is not None or not c.get("use_sliding_window"):
        return c.get("layer_types")
    first = c.get("max_window_layers", 28)
    return ["sliding_attention" if i >= first else "full_attention" for i in range(c["num_hidden_layers"])]


@dataclass
class DrafterConfig:
    """Everything a drafter needs, read from z-lab's config.json (any of its variants)."""

    architecture: ClassVar[str] = "DFlashDraftModel"
    family_fields: ClassVar[tuple[str, ...]] = ()  # config fields only this family has

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    layer_types: Optional[list[str]] = None
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    # dflash_config fields of gemma-4 drafters (z-lab's reference applies them as here):
    input_embedding_scale: float = 1.0  # the block's raw target embeddings are multiplied by it
    output_multiplier: float = 1.0  # the drafter's logits are multiplied by it ...
    final_logit_softcapping: Optional[float] = None  # ... then tanh-capped at +-this (None, 0: off)
    extra: dict = field(default_factory=dict, repr=False)  # unknown keys, kept for export

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    @classmethod
    def from_dict(cls, config: dict) -> "DrafterConfig":
        """Parse a z-lab config.json dict: `block_size`, `target_layer_ids` and
        `mask_token_id` may sit at the top level or under `dflash_config`."""
        c = dict(config)
        dflash = c.pop("dflash_config", None) or {}
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in required if k not in c]
        if missing:
            raise ValueError(f"drafter config.json lacks {', '.join(missing)}")
        n_layers = c["num_hidden_layers"]
        n_target = c.get("num_target_layers")
        ids = dflash.get("target_layer_ids", c.get("target_layer_ids"))
        if n_target is None:
            raise ValueError("drafter config.json lacks num_target_layers")
        if ids is None:
            ids = default_target_layer_ids(n_target, n_layers)
        mask = dflash.get("mask_token_id", c.get("mask_token_id"))
        if mask is None:
            raise ValueError("drafter config.json lacks dflash_config.mask_token_id")
        rope_params = c.get("rope_parameters") or {}
        rope_scaling = c.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        known = {f for f in cls.__dataclass_fields__} | {
            "dflash_config",
            "rope_parameters",
            "architectures",
            "model_type",
        }
        return cls(
            hidden_size=c["hidden_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            intermediate_size=c["intermediate_size"],
            vocab_size=c["vocab_size"],
            num_target_layers=n_target,
            target_layer_ids=list(ids),
            mask_token_id=int(mask),
            block_size=int(dflash.get("block_size", c.get("block_size", 16))),
            head_dim=c.get("head_dim"),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=c.get("rope_theta", rope_params.get("rope_theta", 1_000_000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=c.get("max_position_embeddings", 40960),
            attention_bias=c.get("attention_bias", False),
            layer_types=_layer_types(c),
            sliding_window=c.get("sliding_window"),
            is_causal=c.get("is_causal"),
            input_embedding_scale=float(dflash.get("input_embedding_scale", c.get("input_embedding_scale", 1.0))),
            output_multiplier=float(dflash.get("output_multiplier", c.get("output_multiplier", 1.0))),
            final_logit_softcapping=dflash.get("final_logit_softcapping", c.get("final_logit_softcapping")),
            extra={k: v for k, v in config.items() if k not in known},
        )

    def to_dict(self) -> dict:
        """z-lab's config.json layout (what SGLang / vLLM and z-lab's loader read)."""
        out = dict(self.extra)
        out.update(
            architectures=[self.architecture],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            hidden_act="silu",
            tie_word_embeddings=False,
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config={"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        )
        for name, off in (
            ("input_embedding_scale", 1.0),
            ("output_multiplier", 1.0),
            ("final_logit_softcapping", None),
        ):
            if getattr(self, name) != off:
                out["dflash_config"][name] = getattr(self, name)
        if any(t != "full_attention" for t in self.layer_types):
            out.update(layer_types=self.layer_types, sliding_window=self.sliding_window)
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        return out

    def make_drafter(self) -> "Drafter":
        """A drafter of this config's family, with freshly initialised weights."""
        return Drafter(self)


def check_fit(config: DrafterConfig, *, num_layers: int, hidden_size: int, vocab_size: int) -> None:
    """Raise ValueError (one line, naming the field) if a drafter cannot serve a target."""
    if config.hidden_size != hidden_size:
        raise ValueError(f"drafter hidden_size {config.hidden_size} != target hidden_size {hidden_size}")
    if config.num_target_layers != num_layers:
        raise ValueError(f"drafter num_target_layers {config.num_target_layers} != target's {num_layers} layers")
    bad = [i for i in config.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"drafter target_layer_ids {bad} out of range for a {num_layers}-layer target")
    if config.vocab_size != vocab_size:
        raise ValueError(f"drafter vocab_size {config.vocab_size} != target vocab_size {vocab_size}")
    if not 0 <= config.mask_token_id < vocab_size:
        raise ValueError(f"drafter mask_token_id {config.mask_token_id} is not in the target's vocabulary")


class Attention(nn.Module):
    """Qwen3 attention (q/k norms, RoPE) of a block's queries over the context's K/V and the block's own."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = hd**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, cfg.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(hd, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n, -1).transpose(0, 2, 1, 3)

    def context_kv(self, context: mx.array, offset: int = 0) -> tuple[mx.array, mx.array]:
        """Keys (rotated at positions offset..) and values (N, kv_heads, L, head_dim) of
        projected context tokens (N, L, hidden): the same projections as the block's."""
        keys = self.rope(self.k_norm(self._heads(self.k_proj(context), self.n_kv_heads)), offset=offset)
        return keys, self._heads(self.v_proj(context), self.n_kv_heads)

    def append_context(self, context: mx.array, cache: KVCache) -> None:
        """Project new context tokens once; they sit at their own positions."""
        cache.update_and_fetch(*self.context_kv(context, cache.offset))

    def __call__(
        self, x: mx.array, context: tuple[mx.array, mx.array], offset: int | mx.array, mask: Optional[mx.array]
    ) -> mx.array:
        """x: (N, B, hidden) blocks at positions offset .. offset+B-1 (`offset` an int or an
        (N,) array, one per block); context: keys and values (N, kv_heads, L, head_dim), or
        training's `SequenceContext`, which attends the blocks itself."""
        N, L, _ = x.shape
        q = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=offset)
        k, v = self.context_kv(x, offset)
        # The block's own K/V are used once and never cached: no rollback needed.
        if isinstance(context, tuple):
            keys, values = mx.concatenate([context[0], k], axis=2), mx.concatenate([context[1], v], axis=2)
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        else:
            out = context.attend(q, k, v, self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(N, L, -1))


class MLP(nn.Module):
    """A drafter layer's SwiGLU MLP."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm layer on blocks x (N, B, hidden): attention over the context and the block, then the MLP."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(
        self, x: mx.array, context: tuple[mx.array, mx.array], offset: int | mx.array, mask: Optional[mx.array]
    ) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), context, offset, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nn.Module):
    """A DFlash v1 drafter: context in by `append_context`, drafts out by `draft` / `candidates`."""

    layer_class: ClassVar[type] = DecoderLayer

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        n_feat = len(config.target_layer_ids)
        self.fc = nn.Linear(n_feat * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [self.layer_class(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # "_" keeps these out of parameters(): not trained, not saved with the weights
        self._draft_vocab: Optional[mx.array] = None
        self._head_rows: Optional[tuple[int, mx.array]] = None  # (id of the target model, rows)

    @property
    def draft_vocab(self) -> Optional[mx.array]:
        """Sorted token ids this drafter may propose (None: the whole vocabulary)."""
        return self._draft_vocab

    def use_draft_vocab(self, ids: Optional[mx.array]) -> None:
        """Propose only tokens in `ids` (see `draft_vocab.py`); None lifts the limit."""
        self._draft_vocab, self._head_rows = ids, None

    #: checkpoint key -> parameter name, for the names some checkpoints use instead of ours
    key_aliases: ClassVar[dict[str, str]] = {}

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """A checkpoint's tensors under this drafter's parameter names, without the copies
        of the target's embed_tokens / lm_head that some uploads carry."""
        drop = ("embed_tokens.weight", "lm_head.weight")
        return {self.key_aliases.get(k, k): v for k, v in weights.items() if k not in drop}

    def make_cache(self, window: Optional[int] = None, sink: int = 0) -> list[ContextCache]:
        """One context K/V cache per layer, keeping the first `sink` and last `window` tokens."""
        return [ContextCache(window, sink) for _ in self.layers]

    def project_context(self, features: mx.array) -> mx.array:
        """Raw concatenated target layer outputs (..., len(ids) * hidden) -> the context
        every layer reads (..., hidden). It does not pass through the layers' input_layernorm."""
        return self.hidden_norm(self.fc(features))

    def append_context(self, features: mx.array, cache: Sequence[KVCache]) -> None:
        """Add context tokens: features (1, n, len(ids) * hidden), projected once."""
        context = self.project_context(features)
        for layer, c in zip(self.layers, cache):
            layer.self_attn.append_context(context, c)

    def draft(self, block: mx.array, cache: Sequence[KVCache], target: "Target", draws: Draws) -> mx.array:
        """The hook a chain cycle calls: draft tokens (B-1,) for block positions 1..B-1 of
        `block` (1, B) (`candidates`' chain)."""
        return self.candidates(block, cache, target, draws)[1]

    def candidates(
        self, block: mx.array, cache: Sequence[KVCache], target: "Target", draws: Draws
    ) -> tuple[mx.array, mx.array]:
        """The hook a tree cycle calls: (draft logits (B-1, vocab), whose top tokens are a
        tree's candidates; the chain draft (B-1,), chosen from them by the target's rule
        (`draws`, positions from block position 1 on)) for block positions 1..B-1."""
        logits = self.propose(block, cache, target)
        return logits, draws.choose(logits)

    def propose(self, block: mx.array, cache: Sequence[KVCache], target: "Target") -> mx.array:
        """Draft logits (B-1, vocab) for block positions 1..B-1 of `block` (1, B)."""
        return self.head(self.hidden(block, cache, target), target)

    def hidden(self, block: mx.array, cache: Sequence[KVCache], target: "Target") -> mx.array:
        """Normed hidden states (B-1, hidden) of block positions 1..B-1 of `block` (1, B),
        fed the target's embedding of it (times the config's input_embedding_scale)."""
        return self(self.embed_blocks(block, target), cache)[0, 1:]

    def embed_blocks(self, blocks: mx.array, target: "Target") -> mx.array:
        """The drafter's input (N, B, hidden) for blocks (N, B): the target's embedding times
        the config's input_embedding_scale."""
        return target.embed(blocks) * self.config.input_embedding_scale  # x 1.0 is exact

    def head(self, h: mx.array, target: "Target") -> mx.array:
        """Logits (n, vocab) of normed hidden states h (n, hidden), by the target's output layer.
        With a draft vocabulary only its rows of the head are computed; other tokens get -inf."""
        if self._draft_vocab is None:
            return self._scale_logits(target.head(h))
        if self._head_rows is None or self._head_rows[0] != id(target.model):
            rows = target.head_rows(self._draft_vocab)  # sliced once per target
            mx.eval(rows)
            self._head_rows = (id(target.model), rows)
        logits = mx.full((h.shape[0], target.vocab_size), -mx.inf, dtype=h.dtype)
        logits[:, self._draft_vocab] = self._scale_logits(h @ self._head_rows[1].T)
        return logits

    def _scale_logits(self, logits: mx.array) -> mx.array:
        """`output_multiplier`, then the tanh soft cap, as z-lab's reference applies them."""
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping:
            logits = mx.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits

    def __call__(self, block_embeddings: mx.array, cache: Sequence[KVCache]) -> mx.array:
        """block_embeddings: (1, B, hidden), the target's embedding of [last token, MASK...].
        Returns normed hidden states (1, B, hidden); position k predicts the token at k."""
        *_, h = (block_embeddings, *self._layer_outputs(block_embeddings, cache))
        return self.norm(h)

    def _layer_outputs(self, h: mx.array, cache: Sequence[KVCache]) -> Iterator[mx.array]:
        """The residual stream (1, B, hidden) after each layer, fed block embeddings h (1, B, hidden)."""
        start = cache[0].offset
        windowed = isinstance(cache[0], ContextCache) and cache[0].stored < start
        keys = cache[0].positions() if windowed else None  # (stored,): the same in every layer
        masks = block_masks(self.config, start, h.shape[1], keys)
        for layer, kind, c in zip(self.layers, self.config.layer_types, cache):
            n = c.stored if isinstance(c, ContextCache) else c.offset
            context = (c.keys[..., :n, :], c.values[..., :n, :])
            h = layer(h, context, start, masks.get(kind))
            yield h

    def activation_peak(self, features: mx.array, block_embeddings: mx.array) -> float:
        """The largest |activation| this drafter reaches, computed in float32 whatever its
        weights' dtype: over the projected context fc(features) (before its norm) and the
        residual stream after every layer, for context features (1, n, len(ids) * hidden) and
        a block's embeddings (1, B, hidden). A fresh cache: nothing of a live one is touched."""
        features, block_embeddings = features.astype(mx.float32), block_embeddings.astype(mx.float32)
        cache = self.make_cache()
        self.append_context(features, cache)
        states = [self.fc(features), *self._layer_outputs(block_embeddings, cache)]
        return float(mx.max(mx.stack([mx.abs(x).max() for x in states])).item())
