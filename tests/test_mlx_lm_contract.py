"""What this project takes from mlx-lm beyond its documented API, checked by name.

The target adapters run a model's own submodules in its own order (target.py, targets/,
kernels/decoder.py, kernels/tape.py) and undo a verify inside mlx-lm's caches
(rollback.py), so they rely on names mlx-lm may change in any release: private ones
(`RotatingKVCache._idx`, gemma-4's `_get_per_layer_inputs`), cache and model fields,
the classes our kernel paths recognise, and the call shapes of the `mlx_lm.models.*`
functions our forwards call. pyproject.toml pins mlx-lm to the minor range these were
tested with; on a new release this test says, one line per name, what moved and which of
our files use it. The names are listed here, beside how we use them: an entry that no
source file mentions any more fails too, so the list stays the list of what we use.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from dflash_mlx.kernels import decoder, tape

from tiny_targets import tiny_target

ROOT = Path(__file__).resolve().parent.parent
SOURCE = [p for package in ("dflash_mlx", "converters", "app", "benchmarks") for p in (ROOT / package).rglob("*.py")]
WORDS = {p.relative_to(ROOT).as_posix(): set(re.findall(r"\w+", p.read_text())) for p in SOURCE}

#: Names that must exist ("module:attribute"), by kind.
NAMES = {
    "mlx_lm.generate:DEFAULT_QUANTIZED_KV_START": int,
    "mlx_lm.utils:DEFAULT_ALLOW_PATTERNS": list,
    "mlx_lm.tool_parsers.json_tools:tool_call_start": str,
    "mlx_lm.tool_parsers.json_tools:tool_call_end": str,
    "mlx_lm.models.cache:KVCache": type,
    "mlx_lm.models.cache:QuantizedKVCache": type,
    "mlx_lm.models.cache:RotatingKVCache": type,
    "mlx_lm.models.cache:ArraysCache": type,
    "mlx_lm.models.rope_utils:DynamicNTKScalingRoPE": type,  # the rope a tree verify refuses
    "mlx_lm.tokenizer_utils:TokenizerWrapper.detokenizer": property,
    "mlx_lm.tokenizer_utils:TokenizerWrapper.eos_token_ids": property,
    "mlx_lm.tokenizer_utils:TokenizerWrapper.tool_parser": property,
    "mlx_lm.tokenizer_utils:TokenizerWrapper.tool_call_start": property,
    "mlx_lm.tokenizer_utils:TokenizerWrapper.tool_call_end": property,
    "mlx_lm.tokenizer_utils:TokenizerWrapper.has_thinking": property,
    "mlx_lm.tokenizer_utils:TokenizerWrapper.think_start": property,
    "mlx_lm.tokenizer_utils:TokenizerWrapper.think_end": property,
    "mlx_lm.tokenizer_utils:StreamingDetokenizer.last_segment": property,
    # a logprob's bytes are read from the piece table (`tokenmap`) of these two
    "mlx_lm.tokenizer_utils:SPMStreamingDetokenizer": type,
    "mlx_lm.tokenizer_utils:BPEStreamingDetokenizer": type,
}

#: Calls as our code makes them ("module:function"): positional arguments, then keywords
#: (`name=`); a method's shape starts with `self`.
CALLS = {
    "mlx_lm:load": "(path)",
    "mlx_lm:convert": "(hf_path=, mlx_path=, quantize=, q_group_size=, q_bits=, dtype=, revision=)",
    "mlx_lm:stream_generate": "(model, tokenizer, prompt, max_tokens=)",
    "mlx_lm.generate:generate_step": "(prompt, model, kv_bits=, kv_group_size=, quantized_kv_start=)",
    "mlx_lm:batch_generate": "(model, tokenizer, prompts, max_tokens=, return_token_ids=)",
    "mlx_lm.generate:BatchGenerator": "(model, completion_batch_size=, sampler=)",
    "mlx_lm.sample_utils:make_sampler": "(temp)",
    "mlx_lm.tool_parsers.json_tools:parse_tool_call": "(text, tools)",
    "mlx_lm.tokenizer_utils:TokenizerWrapper": "(tokenizer)",
    "mlx_lm.tokenizer_utils:StreamingDetokenizer.reset": "(self)",
    "mlx_lm.tokenizer_utils:StreamingDetokenizer.add_token": "(self, token)",
    "mlx_lm.tokenizer_utils:StreamingDetokenizer.finalize": "(self)",
    "mlx_lm.tokenizer_utils:_byte_decoder": "()",  # GPT-2's byte-level alphabet, back to bytes
    "mlx_lm.utils:sharded_load": "(path, pipeline_group=, tensor_group=)",
    "mlx_lm.utils:load_model": "(path, lazy=, strict=)",
    "mlx_lm.generate:maybe_quantize_kv_cache": "(cache, quantized_kv_start, kv_group_size, kv_bits)",
    "mlx_lm.models.cache:make_prompt_cache": "(model)",
    "mlx_lm.models.cache:trim_prompt_cache": "(cache, n)",
    "mlx_lm.models.cache:can_trim_prompt_cache": "(cache)",
    "mlx_lm.models.cache:save_prompt_cache": "(path, cache, metadata)",
    "mlx_lm.models.cache:load_prompt_cache": "(path, return_metadata=)",
    "mlx_lm.models.cache:KVCache": "()",
    "mlx_lm.models.cache:KVCache.update_and_fetch": "(self, keys, values)",
    "mlx_lm.models.cache:KVCache.trim": "(self, n)",
    "mlx_lm.models.cache:ArraysCache.advance": "(self, n)",
    "mlx_lm.models.base:create_attention_mask": "(h, cache, window_size=)",
    "mlx_lm.models.base:create_ssm_mask": "(h, cache)",
    "mlx_lm.models.base:gather_last_axis": "(x, group)",
    "mlx_lm.models.base:scaled_dot_product_attention": "(queries, keys, values, cache=, scale=, mask=)",
    "mlx_lm.models.activations:swiglu": "(gate, x)",
    "mlx_lm.models.rope_utils:initialize_rope": "(dims, base, traditional, scaling_config, max_position_embeddings)",
    "mlx_lm.models.gemma4_text:logit_softcap": "(softcap, x)",
    "mlx_lm.models.gated_delta:compute_g": "(A_log, a, dt_bias)",
    "mlx_lm.models.gated_delta:gated_delta_update": "(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=)",
    "mlx_lm.models.gated_delta:normalize_qk": "(q, k, inv_scale=, eps=)",
}

#: The name our code calls where it is not the entry's own.
VIA = {"mlx_lm.generate:BatchGenerator": "batch_generate"}  # which passes it these keywords

#: Fields of cache instances: what rollback.py, cache.py, drafter.py and tape.py read and write.
CACHES = {
    "KVCache": (KVCache, (), ("keys", "values", "offset", "update_and_fetch", "trim", "is_trimmable", "to_quantized")),
    "QuantizedKVCache": (QuantizedKVCache, (64, 8), ("keys", "values", "offset", "bits", "group_size", "trim")),
    "RotatingKVCache": (RotatingKVCache, (4,), ("keys", "values", "offset", "_idx", "is_trimmable")),
    "ArraysCache": (ArraysCache, (2,), ("cache", "lengths", "left_padding", "advance", "__getitem__", "__setitem__")),
}

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "n_heads", "n_kv_heads", "scale", "rope")
_LAYER = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
_DENSE = {"layer": _LAYER, "attn": _ATTENTION, "mlp": ("gate_proj", "up_proj", "down_proj")}
_QK_NORM = ("q_norm", "k_norm")
_PIPELINE = ("pipeline", "pipeline_rank", "pipeline_size", "start_idx")
_MIXER = (
    "conv_kernel_size",
    "conv_dim",
    "conv1d",
    "key_dim",
    "num_k_heads",
    "head_k_dim",
    "num_v_heads",
    "head_v_dim",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
    "training",
)
_HYBRID = {
    "layer": ("is_linear", "linear_attn", "input_layernorm", "post_attention_layernorm", "mlp"),
    "body": _PIPELINE,
    "mixer": _MIXER + ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "sharding_group"),
    "lm": ("sharding_group",),
    "model": ("language_model",),
}
_GEMMA4 = {
    "layer": ("layer_type",),
    "lm": ("final_logit_softcapping",),
    "body": (
        "window_size",
        "embed_scale",
        "previous_kvs",
        "hidden_size_per_layer_input",
        "_get_per_layer_inputs",
        "_project_per_layer_inputs",
    ),
}

#: Per family, the attributes our adapters read, by where they sit: "model" (what mlx-lm
#: loads), "lm" (its language model), "body" (`lm.model`), "layer" (a decoder layer;
#: for hybrids a linear one), "attn" / "mlp" (its parts), "mixer" (a gated-delta mixer).
FAMILIES: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": _DENSE,
    "mistral": _DENSE,
    "llama_swa": {**_DENSE, "layer": _LAYER + ("use_sliding",), "body": ("sliding_window",)},
    "qwen2": {**_DENSE, "body": _PIPELINE},
    "qwen3": {**_DENSE, "attn": _ATTENTION + _QK_NORM},
    "qwen3_moe": {"layer": _LAYER, "attn": _ATTENTION + _QK_NORM, "body": _PIPELINE},
    "qwen3_5": _HYBRID,
    "qwen3_5_moe": _HYBRID,
    "qwen3_next": {
        **_HYBRID,
        "mixer": _MIXER + ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering"),
        "model": (),
        "lm": (),
    },
    "gpt_oss": {"body": ("window_size", "layer_types")},
    "gemma4_text": _GEMMA4,
    "gemma4": {**_GEMMA4, "model": ("language_model",)},
}
#: Every family: what `Target` reads.
COMMON = {"lm": ("args", "model", "lm_head"), "body": ("layers", "embed_tokens", "norm")}
ARGS = ("num_hidden_layers", "hidden_size", "vocab_size")
TIED = ("gemma4_text", "gemma4")  # no lm_head: the output layer is the embedding


def users(word: str) -> str:
    """Our source files that mention `word` (a few, then how many more)."""
    found = sorted(path for path, words in WORDS.items() if word in words)
    if not found:
        return "no file of ours"
    return ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")


def resolve(name: str) -> Any:
    """The object "module:A.b" names (a class's attributes as the class holds them: a
    property, a function). AttributeError or ImportError where it is gone."""
    module, _, path = name.partition(":")
    obj = importlib.import_module(module)
    for attr in path.split("."):
        obj = inspect.getattr_static(obj, attr) if inspect.isclass(obj) else getattr(obj, attr)
    return obj


def word(name: str) -> str:
    """The name our code uses for the entry `name`."""
    return VIA.get(name, name.rpartition(".")[2].rpartition(":")[2])


def dotted(name: str) -> str:
    return name.replace(":", ".")


def binds(fn: Any, shape: str) -> bool:
    """Whether a call of `shape` ("(a, b, key=)") binds to fn's signature."""
    args = [a.strip() for a in shape.strip("()").split(",") if a.strip()]
    keywords = {a[:-1]: None for a in args if a.endswith("=")}
    positional = [None] * sum(not a.endswith("=") for a in args)
    try:
        inspect.signature(fn).bind(*positional, **keywords)
    except TypeError:
        return False
    return True


def report(problems: list[str]) -> None:
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def test_the_installed_versions_are_in_the_pinned_range():
    """pyproject.toml pins mlx and mlx-lm to the minor range this contract was checked on."""
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    pins = dict(re.findall(r'"(mlx|mlx-lm)(?:\[cpu\])?([<>=!~][^;"]*)', (ROOT / "pyproject.toml").read_text()))
    for package in ("mlx", "mlx-lm"):
        assert package in pins, f"pyproject.toml does not pin {package} to a range"
        installed = version(package)
        assert installed in SpecifierSet(pins[package]), (
            f"{package} {installed} is outside the tested range {pins[package]} (pyproject.toml): "
            "run this test and the lossless ones on it, then widen the range"
        )


def test_names_exist_with_their_kind():
    problems = []
    for name, kind in NAMES.items():
        try:
            obj = resolve(name)
        except (AttributeError, ImportError):
            problems.append(f"{dotted(name)} is gone: needed by {users(word(name))}")
            continue
        if not isinstance(obj, kind):
            problems.append(
                f"{dotted(name)} is a {type(obj).__name__}, not a {kind.__name__}: needed by {users(word(name))}"
            )
    report(problems)


def test_calls_bind_as_we_make_them():
    problems = []
    for name, shape in CALLS.items():
        try:
            fn = resolve(name)
        except (AttributeError, ImportError):
            problems.append(f"{dotted(name)} is gone: called by {users(word(name))}")
            continue
        if not binds(fn, shape):
            problems.append(f"{dotted(name)} no longer takes {shape}: called so by {users(word(name))}")
    report(problems)


def test_cache_fields():
    problems = []
    for name, (cls, args, fields) in CACHES.items():
        cache = cls(*args)
        problems += [
            f"mlx_lm.models.cache.{name}.{f} is gone: needed by {users(f)}" for f in fields if not hasattr(cache, f)
        ]
    report(problems)


def test_a_rotating_cache_is_in_order_after_a_multi_token_update():
    """rollback.py's `_drop_rotating` slices rejected tokens off the end of a
    `RotatingKVCache`: that needs a multi-token update to leave it in temporal order, its
    last `max_size - 1` old tokens then the new ones, with `_idx` at its end, after the
    window has wrapped too."""
    window = 4
    cache = RotatingKVCache(max_size=window)
    for first, count in ((0, 3), (3, 3), (6, 2)):  # the last two updates wrap a window of 4
        new = mx.arange(first, first + count, dtype=mx.float32).reshape(1, 1, count, 1)  # (1, heads, count, dim)
        cache.update_and_fetch(new, new)
        held = cache.keys[0, 0, :, 0].tolist()
        want = list(range(max(0, first - (window - 1)), first + count))
        assert cache._idx == cache.keys.shape[2] and held == want, (
            f"mlx_lm.models.cache.RotatingKVCache after a {count}-token update holds {held} with _idx "
            f"{cache._idx}, not {want} in order: {users('_idx')} cannot roll it back"
        )


def _parts(model: Any) -> dict[str, Any]:
    """Where each family's attributes sit (see FAMILIES)."""
    lm = getattr(model, "language_model", model)
    layers = lm.model.layers
    layer = next((x for x in layers if getattr(x, "is_linear", False)), layers[0])
    parts = {"model": model, "lm": lm, "body": lm.model, "layer": layer, "args": lm.args}
    for name, attr in (("attn", "self_attn"), ("mlp", "mlp"), ("mixer", "linear_attn")):
        if attr in layer:
            parts[name] = layer[attr]
    return parts


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_attributes(family):
    parts = _parts(tiny_target(family))
    wanted = {where: set(names) for where, names in FAMILIES[family].items()}
    for where, names in COMMON.items():
        wanted.setdefault(where, set()).update(n for n in names if not (n == "lm_head" and family in TIED))
    wanted.setdefault("args", set()).update(ARGS)
    problems = []
    for where, names in sorted(wanted.items()):
        obj = parts.get(where)
        for attr in sorted(names):
            if obj is None or not hasattr(obj, attr):
                owner = f"{type(obj).__module__}.{type(obj).__name__}" if obj is not None else f"{family}'s {where}"
                problems.append(f"{owner}.{attr} is gone: needed by {users(attr)}")
    report(problems)


#: The families whose decoder layers kernels/decoder.py repeats: its list that must name
#: their layer's module (a chain verify's kernel path, or a tree verify's).
DECODER_PATHS = {
    "llama": "LAYER_MODULES",
    "mistral": "LAYER_MODULES",
    "llama_swa": "LAYER_MODULES",
    "qwen2": "LAYER_MODULES",
    "qwen3": "LAYER_MODULES",
    "qwen3_moe": "TREE_MODULES",
}
HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


@pytest.mark.parametrize("family", sorted({*DECODER_PATHS, *HYBRIDS, "gemma4_text"}))
def test_layers_are_the_classes_our_forwards_know(family):
    """kernels/decoder.py repeats the forward of the layer classes it lists by module, and
    kernels/tape.py that of the mixers it lists by module and name: a class that moved
    would silently leave the kernel path (or run a forward it no longer matches). The
    hybrid and gemma-4 adapters call layers with more than (h, mask, cache)."""
    parts = _parts(tiny_target(family))
    layer = parts["layer"]
    name = f"{type(layer).__module__}.{type(layer).__name__}"
    problems = []
    if family in DECODER_PATHS:
        known = getattr(decoder, DECODER_PATHS[family])
        if type(layer).__module__ not in known:
            problems.append(f"{family}'s decoder layer is {name}, not from kernels/decoder.py's {known}")
    if family in HYBRIDS:
        mixer = f"{type(parts['mixer']).__module__}.{type(parts['mixer']).__name__}"
        if not tape.supports(layer):
            problems.append(f"{family}'s gated-delta mixer is {mixer}, not one of kernels/tape.py's MIXERS")
        if not binds(parts["mixer"], "(x, mask, cache)"):
            problems.append(f"{mixer} no longer takes (x, mask, cache): called so by dflash_mlx/targets/hybrid.py")
    gemma = "(h, mask, cache, per_layer_input=, shared_kv=, offset=)"
    if family == "gemma4_text" and not binds(layer, gemma):
        problems.append(f"{name} no longer takes {gemma}: called so by dflash_mlx/targets/gemma4.py")
    report(problems)


def test_every_entry_is_one_we_use():
    """The contract lists what we use: every name in it is mentioned by a source file."""
    names = [word(n) for n in (*NAMES, *CALLS)]
    names += [f for _, _, fields in CACHES.values() for f in fields if not f.startswith("__")]
    names += [n for family in FAMILIES.values() for group in family.values() for n in group]
    unused = sorted({n for n in names if users(n) == "no file of ours"})
    assert not unused, f"contract entries no source file mentions any more (drop them): {', '.join(unused)}"
