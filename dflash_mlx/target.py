"""The target adapter: an mlx-lm model's forward that also returns chosen layers' outputs.

mlx-lm models return logits only. Instead of wrapping or patching the user's model, we
run its own submodules (embedding, decoder layers, final norm, lm_head) in the same
order its `__call__` does, and keep the outputs of the layers the drafter reads.

`Target` here is the adapter for plain decoders (llama, mistral, qwen2, qwen3, qwen3_moe)
and the base of the other families' adapters in `targets/`, whose `make_target(model)`
picks the adapter for the model's type. A verify forward can be undone
with a `rollback.Checkpoint` (see `rollback.py`). A draft tree is verified by
`tree_forward`, where the families and caches allow it (`supports_trees`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask, gather_last_axis
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .distributed import Stage, gathered_rows, world_size
from .kernels import decoder
from .kernels.tune import tune
from .rollback import Checkpoint


class Target:
    """A read-only view of an mlx-lm decoder: `forward` gives final hidden states and the
    concatenated outputs of `capture_layers` (HF `hidden_states[i + 1]` for each i)."""

    kernels = False  # verify projections through the custom kernel: see `use_kernels`
    kernel_choice: dict[str, dict] = {}  # kernel or MLX per shape and rows, as timed here (never mutated)

    def __init__(self, model: nn.Module, capture_layers: Sequence[int] = ()):
        self.model = model
        # Multimodal wrappers (qwen3_5, gemma4) keep the decoder in `language_model`.
        self.lm = getattr(model, "language_model", model)
        self.args = self.lm.args
        self.body = self.lm.model
        # Under an mlx-lm pipeline this rank runs layers [first, first + len(layers)) only.
        self.stage = Stage.of(self.body)
        self.first = self.stage.first if self.stage else 0
        self.layers = self.body.layers[self.first :]
        self.capture_layers = list(capture_layers)
        self.tied = getattr(self.args, "tie_word_embeddings", False) or not hasattr(self.lm, "lm_head")
        self.window: Optional[int] = getattr(self.body, "sliding_window", None)
        self.kinds = self.layer_kinds()

    def layer_kinds(self) -> list[str]:
        """Each layer's mask kind: "full", "sliding" (windowed) or "linear" (recurrent)."""
        return ["sliding" if getattr(layer, "use_sliding", False) else "full" for layer in self.layers]

    def use_kernels(self, on: bool = True) -> "Target":
        """With `on`, verify-sized forwards (2..16 tokens) of a quantized model run their
        projections through the custom kernel (kernels/decoder.py); other forwards, and
        models it does not know, run the model's own modules (so do sharded ones, whose
        layers all-reduce inside). Returns self."""
        self.kernels = on and world_size() == 1 and decoder.supports(self.layers)
        self.tune_kernels()
        return self

    def tune_kernels(self) -> None:
        """With kernels on, on a Mac: check each kernel's output against MLX's op on this
        model's shapes and time both (once per chip, MLX version and model; kernels/choice.py);
        a kernel runs only where it matched and was faster."""
        if self.kernels:
            self.kernel_choice = tune(self.layers, self.body.embed_tokens if self.tied else self.lm.lm_head)

    @property
    def num_layers(self) -> int:
        """The model's layer count (on every rank of a pipeline)."""
        return self.args.num_hidden_layers if self.stage else len(self.layers)

    @property
    def hidden_size(self) -> int:
        """The width of the residual stream (each captured layer's share of the features)."""
        return self.args.hidden_size

    @property
    def vocab_size(self) -> int:
        """The vocabulary size: the logits' last dimension."""
        return self.args.vocab_size

    def embed(self, tokens: mx.array) -> mx.array:
        """The raw embedding rows (any scale the model applies is the forward's business)."""
        return self.body.embed_tokens(tokens)

    def head(self, hidden: mx.array) -> mx.array:
        """The output layer alone (what a drafter's logits go through)."""
        if self.tied:
            embed = self.body.embed_tokens
            return decoder.as_linear(embed, hidden) if self.kernels else embed.as_linear(hidden)
        logits = decoder.linear(self.lm.lm_head, hidden) if self.kernels else self.lm.lm_head(hidden)
        group = getattr(self.lm, "sharding_group", None)  # tensor parallel over the vocabulary
        return gather_last_axis(logits, group) if group is not None else logits

    def lm_head(self, hidden: mx.array) -> mx.array:
        """Logits from final (normed) hidden states, as the model's own `__call__` computes them."""
        return self.head(hidden)

    def head_rows(self, ids: mx.array) -> mx.array:
        """The output matrix's rows for token `ids` (n, hidden), dequantized if needed:
        `h @ head_rows(ids).T` are those tokens' `head` outputs."""
        if self.tied:
            return self.body.embed_tokens(ids)  # an embedding lookup dequantizes its rows
        head = self.lm.lm_head
        if getattr(self.lm, "sharding_group", None) is not None:
            return gathered_rows(head, ids, self.lm.sharding_group)
        if hasattr(head, "scales"):
            biases = head.biases[ids] if getattr(head, "biases", None) is not None else None
            return mx.dequantize(head.weight[ids], head.scales[ids], biases, group_size=head.group_size, bits=head.bits)
        return head.weight[ids]

    def _masks(self, h: mx.array, cache: Sequence[Any]) -> list[Any]:
        """One mask per layer, made once per kind from the first cache of that kind."""
        made: dict[str, Any] = {}
        for kind, c in zip(self.kinds, cache):
            if kind not in made:
                if kind == "linear":
                    made[kind] = create_ssm_mask(h, c)
                else:
                    made[kind] = create_attention_mask(h, c, window_size=self.window if kind == "sliding" else None)
        return [made[kind] for kind in self.kinds]

    def _features(self, captured: dict[int, mx.array]) -> Optional[mx.array]:
        return mx.concatenate([captured[i] for i in self.capture_layers], axis=-1) if captured else None

    def forward(
        self, tokens: mx.array, cache: Sequence[Any], capture: bool = True, checkpoint: Optional[Checkpoint] = None
    ) -> tuple[mx.array, Optional[mx.array]]:
        """tokens: (1, L). Returns (normed hidden (1, L, hidden), features (1, L, k * hidden) or None).
        With a `checkpoint`, the inputs of the layers it may have to replay are recorded."""
        h = self.embed(tokens)
        h = self.stage.receive(h) if self.stage else h
        captured = {}
        wanted = set(self.capture_layers) if capture else set()
        explicit = self.kernels and decoder.MIN_ROWS <= tokens.shape[1] <= decoder.MAX_ROWS
        for i, (c, mask) in enumerate(zip(cache, self._masks(h, cache))):
            h = self.layer_forward(i, h, mask, c, explicit, checkpoint)
            if self.first + i in wanted:
                captured[self.first + i] = h
        if self.stage:  # the captured layers live on several ranks
            h, features = self.stage.share(h, captured, [i for i in self.capture_layers if i in wanted])
            return self.body.norm(h), features
        return self.body.norm(h), self._features(captured)

    def layer_forward(
        self, i: int, h: mx.array, mask: Any, cache: Any, explicit: bool, checkpoint: Optional[Checkpoint]
    ) -> mx.array:
        """Layer i on h (1, L, hidden): through the kernel path when `explicit` (a verify-sized
        forward with kernels on), else the layer's own call; a checkpoint records its input."""
        if checkpoint is not None:
            checkpoint.record(i, h)
        layer = self.layers[i]
        return decoder.decoder_layer(layer, h, mask, cache) if explicit else layer(h, mask, cache)

    def supports_trees(self, cache: Sequence[Any]) -> bool:
        """Whether `tree_forward` can verify a draft tree on `cache`: every layer one the
        explicit path runs at per-row positions, every cache one `rollback.keep_rows`
        compacts (sliding windows and recurrent states keep the chain), in one process."""
        kv = all(type(c) in (KVCache, QuantizedKVCache) for c in cache)
        return kv and world_size() == 1 and len(cache) == len(self.layers) and decoder.tree_supports(self.layers)

    def tree_forward(
        self, tokens: mx.array, cache: Sequence[Any], positions: mx.array, mask: mx.array
    ) -> tuple[mx.array, Optional[mx.array]]:
        """A tree verify: tokens (1, m) (root + nodes), row i at RoPE position positions[i]
        (m,), attending as mask (m, cache + m) allows. The rows join the cache in tree
        order; `rollback.keep_rows` keeps the accepted path. Returns what `forward` does."""
        h = self.embed(tokens)
        captured = {}
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = decoder.decoder_layer(layer, h, mask, c, positions=positions, kernels=self.kernels)
            if i in self.capture_layers:
                captured[i] = h
        return self.body.norm(h), self._features(captured)

    def replay(self, layer: int, inputs: mx.array, cache: Any) -> None:
        """Feed a recurrent layer's `inputs` (1, n, hidden) through it again, to rebuild
        its cache (see `rollback.py`); plain decoders have no recurrent layers."""
        raise NotImplementedError(f"{type(self).__name__} has no recurrent layers to replay")
