"""Test helper: z-lab's reference drafter and loops run on our inputs (PyPI ``dflash==0.1.0``).

One torch drafter forward (`torch_draft_logits`), a growing context through z-lab's own
cache (`TorchDraftSession`), their torch generation loop (`run_dflash_generate`), the
DFlash2 selector (`torch_select`) and their MLX loop (`zlab_generate`). Building and
saving reference drafters, and z-lab's drafter API, are in ``zlab_reference.py``.

Facts about z-lab's loops (read from the installed 0.1.0 sources)
==============================================================

PyTorch side, ``dflash.model``
------------------------------
* ``dflash_generate(model, target, input_ids, max_new_tokens, stop_token_ids,
  temperature=0.0, top_p=1.0, top_k=0, block_size=None, return_stats=False)``
  returns output ids (1, prompt + generated), or with ``return_stats=True`` a
  namespace with timings that calls ``torch.cuda.synchronize`` (so CPU needs
  ``return_stats=False``). Loop, as it drives the drafter:
  - prefill the target with ``output_hidden_states``; context = features of the
    whole prompt; ``start`` = prompt length; the block is
    ``output_ids[start:start+B]`` (buffer prefilled with ``mask_token_id``).
  - the draft cache is ``DynamicCache(config=model.config)`` with
    ``activate_past_recording()``; each step calls the drafter with
    ``position_ids[:, start - n_new : start + B]`` and then CROPS the cache back
    to ``start`` (``crop(-(len - start))``): the block's K/V are appended, used
    and immediately removed, so the cache holds context K/V of positions
    ``0 .. start-1`` only. Draft tokens come from ``out[:, 1 - B:]`` (position 0's
    output is discarded; position k predicts the token AT start + k).
  - after verify, the new context is the features of ``block[:produced]``
    (first token + accepted drafts; ``produced`` may be cut at a stop token,
    which is included, or at max length), and ``start += produced``.
  - the last block shrinks to ``min(B, max_length - start)``.
  - with transformers 5.x ``crop(0)`` is a no-op (negative = remove that many).
  - transformers 5.24 emits a FutureWarning (``past_key_values`` -> ``cache``,
    removal in 5.40); dflash 0.1.0's ``[local]`` extra pins transformers 5.15.0.

MLX side, ``dflash.model_mlx`` (imports and runs on Linux with mlx[cpu])
-----------------------------------------------------------------------
* ``load(model_id)`` is ``mlx_lm.load``. ``load_draft(draft_id)`` always calls
  ``huggingface_hub.snapshot_download`` (``*.safetensors``, ``*.json``), so a LOCAL
  directory raises ``HFValidationError``: use :func:`zlab_mlx_load_draft`, which
  swaps in an identity function for that one call. It reads config.json
  (required: hidden_size, num_hidden_layers, num_attention_heads,
  num_key_value_heads, head_dim, intermediate_size, vocab_size, rms_norm_eps,
  max_position_embeddings, num_target_layers, dflash_config.target_layer_ids and
  dflash_config.mask_token_id: no defaults there), loads EVERY ``*.safetensors``
  in the folder (the index is ignored, ``.bin`` unsupported) and calls
  ``load_weights`` strictly, so extra tensors such as ``embed_tokens.weight``
  make it fail.
* ``DFlashDraftModel(DFlashConfig)``; ``bind(target)`` takes the target's
  ``embed_tokens`` and ``lm_head`` (or ``embed_tokens.as_linear``);
  ``draft(block_ids, target_hidden, cache, logits_start=1)`` returns logits,
  ``draft.hidden_states(...)`` the normed hidden. Its cache (``KVCache`` per
  layer) stores ONLY the context K/V (block K/V never enter it); context keys are
  rotated at ``cache.offset``, block queries/keys at ``cache.offset + n_new``.
* ``stream_generate(model, draft, tokenizer, prompt, block_size=None,
  max_tokens=256, temperature=0.0, top_p=1.0, top_k=0, prefill_step_size=2048)``
  is a generator of z-lab's OWN ``GenerationResponse`` dataclass (not mlx-lm's):
  ``text, tokens: list[int], accepted: int | None, prompt_tokens, prompt_tps,
  generation_tokens, generation_tps, peak_memory, finish_reason``. First yield:
  the prefill token (``accepted=None``); then one yield per cycle with the new
  tokens (``accepted = len(tokens)`` = drafts accepted + 1); an EOS ends with
  ``finish_reason="stop"`` (EOS included); otherwise a last yield with
  ``tokens=[]``, ``finish_reason="length"``. ``max_tokens`` counts the first
  token. ``prompt`` may be a str, a token list or an mx.array.
* It MUTATES the target for good: ``model._hidden_states`` is added and
  ``model.model.layers[i]`` are replaced by hook wrappers (output of layer i).
  If ``_hidden_states`` already exists it returns early, so a second drafter
  with different ``target_layer_ids`` silently reuses the first one's hooks.
  Use a fresh target object per z-lab drafter. Hybrid (GatedDeltaNet) targets
  get ``GatedDeltaNet.__call__`` patched class-wide under a global lock.
* Nothing unusual is needed on Linux: ``wired_limit`` is a no-op off Metal and the
  gated-delta kernel falls back to ops on CPU.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from zlab_reference import zlab_torch_module


@contextmanager
def _local_snapshot(module):
    original = module.snapshot_download

    def local(repo_id, **_kwargs):
        return str(repo_id)

    module.snapshot_download = local
    try:
        yield
    finally:
        module.snapshot_download = original


def zlab_mlx_load_draft(path):
    """z-lab's MLX ``load_draft`` on a local directory (their loader only takes Hub ids)."""
    from dflash import model_mlx

    with _local_snapshot(model_mlx):
        return model_mlx.load_draft(str(path))


def _as_tensor(x, torch):
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu")
    else:
        t = torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float32)))
    if t.ndim == 2:
        t = t[None]
    return t


def _model_dtype(model):
    return next(model.parameters()).dtype


def _run_block(model, target_hidden, block_embeddings, position_ids, cache, lm_head):
    import torch

    dtype = _model_dtype(model)
    ctx = _as_tensor(target_hidden, torch).to(dtype)
    emb = _as_tensor(block_embeddings, torch).to(dtype)
    pos = torch.as_tensor(np.asarray(position_ids, dtype=np.int64)).reshape(1, -1)
    if pos.shape[1] != ctx.shape[1] + emb.shape[1]:
        raise ValueError(f"position_ids must cover context + block: {pos.shape[1]} != {ctx.shape[1]} + {emb.shape[1]}")
    with torch.inference_mode():
        hidden = model(
            position_ids=pos,
            noise_embedding=emb,
            target_hidden=ctx,
            past_key_values=cache,
            use_cache=cache is not None,
        )
        if lm_head is not None:
            weight = _as_tensor(lm_head, torch)[0].to(dtype)
            head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=dtype)
            head.weight.copy_(weight)
            hidden = model.compute_logits(hidden, head)
    return hidden.to(torch.float32).numpy().copy()


def torch_draft_logits(
    torch_model,
    target_hidden,
    block_embeddings,
    start: int | None = None,
    position_ids=None,
    lm_head=None,
) -> np.ndarray:
    """One drafter forward with no cache, as z-lab's first draft step after prefill.

    target_hidden: (1, n_ctx, len(ids) * hidden), the RAW concatenation of target
    layer outputs (z-lab applies fc + hidden_norm itself). block_embeddings:
    (1, B, hidden), target embedding rows of [last token, MASK x (B-1)].
    Positions: ``start`` is the block's first position (default n_ctx); context
    then sits at start - n_ctx .. start - 1 and the block at start .. start + B - 1.
    Or give ``position_ids`` (n_ctx + B values) explicitly.
    Returns float32 numpy (1, B, hidden): ``norm(h)`` for ALL B positions (z-lab's
    loop drops position 0). With ``lm_head`` ((vocab, hidden) weight) it returns
    z-lab's ``compute_logits`` of that instead, (1, B, vocab).
    """
    n_ctx = np.asarray(target_hidden.shape)[-2]
    n_blk = np.asarray(block_embeddings.shape)[-2]
    if position_ids is None:
        s = int(n_ctx) if start is None else int(start)
        position_ids = np.arange(s - int(n_ctx), s + int(n_blk))
    return _run_block(torch_model, target_hidden, block_embeddings, position_ids, None, lm_head)


class TorchDraftSession:
    """z-lab's drafter over a GROWING context, with z-lab's own cache handling.

    Mirrors ``dflash_generate``: the cache is made by z-lab's ``_make_cache``
    (DynamicCache + past recording); each :meth:`step` passes only the NEW context
    features, positions ``start - n_new .. start + B - 1`` where
    ``start = cache length + n_new``, then crops the cache back to ``start`` with
    z-lab's ``_crop_to`` (the block K/V are dropped, the context K/V kept).
    """

    def __init__(self, torch_model, lm_head=None):
        zm = zlab_torch_module()
        self.model = torch_model
        self.lm_head = lm_head
        self.cache = zm._make_cache(torch_model.config)
        self._crop_to = zm._crop_to
        self.start = 0

    @property
    def cache_len(self) -> int:
        return int(self.cache.get_seq_length())

    def step(self, new_target_hidden, block_embeddings) -> np.ndarray:
        """Append ``new_target_hidden`` (1, n_new, len(ids) * hidden) and draft one block.

        Returns (1, B, hidden) final-norm hidden states for all block positions
        (or logits when the session has an ``lm_head``).
        """
        n_new = int(np.asarray(new_target_hidden.shape)[-2])
        n_blk = int(np.asarray(block_embeddings.shape)[-2])
        start = self.cache_len + n_new
        positions = np.arange(start - n_new, start + n_blk)
        out = _run_block(self.model, new_target_hidden, block_embeddings, positions, self.cache, self.lm_head)
        self._crop_to(self.cache, start)
        self.start = start
        return out


def torch_draft_logits_growing(torch_model, steps, lm_head=None) -> list[np.ndarray]:
    """Run :class:`TorchDraftSession` over ``steps``: a list of
    (new_target_hidden, block_embeddings) pairs; step 0's context is the prompt's.
    Returns one (1, B_i, hidden) array per step.
    """
    session = TorchDraftSession(torch_model, lm_head=lm_head)
    return [session.step(ctx, emb) for ctx, emb in steps]


def run_dflash_generate(drafter, target, input_ids, max_new_tokens, stop_token_ids=None, block_size=None):
    """z-lab's greedy ``dflash_generate`` on CPU (``return_stats=False``); returns a list of ids."""
    import torch

    zm = zlab_torch_module()
    ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64)).reshape(1, -1)
    out = zm.dflash_generate(
        drafter.eval(),
        target.eval(),
        ids,
        int(max_new_tokens),
        stop_token_ids,
        temperature=0.0,
        block_size=block_size,
        return_stats=False,
    )
    return out[0].tolist()


def torch_select(torch_model, hidden, logits, anchor: int) -> list[int]:
    """z-lab's greedy DFlash2 draft path (``candidate_selector.select`` at temperature 0)
    for block positions 1.. of ``hidden`` (1, B, hidden) and ``logits`` (1, B, vocab),
    as :func:`torch_draft_logits` and :class:`TorchDraftSession` return them; ``anchor``
    is block token 0."""
    import torch

    with torch.inference_mode():
        path, _, _ = torch_model.candidate_selector.select(
            torch.from_numpy(np.ascontiguousarray(hidden[:, 1:])),
            torch.from_numpy(np.ascontiguousarray(logits[:, 1:])),
            torch.tensor([int(anchor)]),
            0.0,
        )
    return path[0].tolist()


def zlab_generate(model, drafter, tokenizer, prompt, max_tokens: int, block_size: int):
    """Greedy decoding with z-lab's MLX loop: (tokens, tokens committed per cycle)."""
    from dflash import model_mlx

    tokens, cycles = [], []
    for r in model_mlx.stream_generate(
        model, drafter, tokenizer, prompt, block_size=block_size, max_tokens=max_tokens, temperature=0.0
    ):
        tokens += r.tokens
        if r.accepted is not None:
            cycles.append(r.accepted)
    return tokens, cycles
