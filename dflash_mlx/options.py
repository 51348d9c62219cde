"""`DecodeOptions`: how one generation decodes, checked once, in one place.

The `dflash` command, the chat, the server's request parser and the Python API each
build one `DecodeOptions` and hand it down to `generate_step`, whose `plan.Plan` reads it
once per generation (the block size and the tree budget there alone). Every field carries
its rule next to its default, and a bad value raises `OptionError`, one line naming the
field (`one_line` shows it on the command line; the server answers 400 with it). Adding
an option is one line here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Optional

from .kernels import metal_ready
from .lookup import MAX_NGRAM
from .sampling import SamplingParams, fresh_seed

__all__ = ["DecodeOptions", "OptionError"]


class OptionError(ValueError):
    """A bad decoding option: `field` names it, the message says what it must be."""

    def __init__(self, name: str, rule: str, value: Any):
        self.field, self.rule, self.value = name, rule, value
        super().__init__(self.named(name))

    def named(self, name: str, none: str = "None") -> str:
        """The message with the option called `name` (a flag, an API field) and its None
        said as `none` (how that front end asks for it: "omitted" on a command line)."""
        return f"{name} {self.rule.format(none=none)}, got {self.value!r}"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: The drafter's context window when its config has none: measured on a CPU (commit 987c3af),
#: SmolLM2's one-layer drafter drafts in 12.4 / 15.4 / 18.9 / 25.5 / 38.0 ms over 256 / 1K /
#: 2K / 4K / 7K tokens of context; 1024 keeps a draft within 1.25x its short-context cost
#: at any length, and released drafters were trained on shorter sequences than that.
DRAFT_WINDOW = 1024
#: mlx-lm's `generate.DEFAULT_QUANTIZED_KV_START` (tests/test_options.py checks they agree),
#: written out so that the options load without mlx-lm and `dflash --help` stays quick.
QUANTIZED_KV_START = 5000
#: First tokens kept beside the window (the system prompt's start: an attention sink).
DRAFT_SINK = 8

# A rule: (what the value must be, as the error says it, `{none}` where None is allowed;
# whether a value passes).
Rule = tuple[str, Callable[[Any], bool]]
NON_NEGATIVE: Rule = ("must be a number >= 0", lambda v: _number(v) and v >= 0)
PROBABILITY: Rule = ("must be in (0, 1]", lambda v: _number(v) and 0 < v <= 1)
COUNT: Rule = ("must be an integer >= 0 (0: off)", lambda v: _integer(v) and v >= 0)
SEED: Rule = ("must be an integer >= 0 or {none}", lambda v: v is None or (_integer(v) and v >= 0))
BLOCK: Rule = ("must be an integer >= 2 or {none} (adaptive)", lambda v: v is None or (_integer(v) and v >= 2))
TREE: Rule = ("must be an integer >= 0 or {none} (adaptive)", lambda v: v is None or (_integer(v) and v >= 0))
SWITCH: Rule = ("must be true, false or {none} (on where it runs)", lambda v: v is None or isinstance(v, bool))
FLAG: Rule = ("must be true or false", lambda v: isinstance(v, bool))
TOKENS: Rule = ("must be an integer >= 0", lambda v: _integer(v) and v >= 0)
# What `mx.quantize` accepts.
KV_BITS: Rule = (
    "must be 2, 3, 4, 5, 6, 8 or {none} (off)",
    lambda v: v is None or (_integer(v) and v in {2, 3, 4, 5, 6, 8}),
)
WINDOW: Rule = (
    "must be an integer >= 1, 0 (all) or {none} (the drafter's own)",
    lambda v: v is None or (_integer(v) and v >= 0),
)
KV_GROUP: Rule = ("must be 32, 64 or 128", lambda v: _integer(v) and v in (32, 64, 128))


def option(default: Any, rule: Rule, doc: str) -> Any:
    """A field with its default, its rule and what it means."""
    return field(default=default, metadata={"rule": rule, "doc": doc})


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode: sampling, block size, kernels, draft trees. Checked when built (`OptionError`)."""

    temp: float = option(0.0, NON_NEGATIVE, "sampling temperature; 0: greedy")
    top_p: float = option(1.0, PROBABILITY, "nucleus sampling threshold; 1: off")
    top_k: int = option(0, COUNT, "sample among the k most likely tokens; 0: off")
    seed: Optional[int] = option(None, SEED, "seed of the random draws (keyed by position); None: a fresh one")
    block_size: Optional[int] = option(None, BLOCK, "tokens verified per cycle, at most the drafter's; None: adaptive")
    kernels: Optional[bool] = option(None, SWITCH, "the custom Metal kernels; None: on where they run (Apple GPUs)")
    profile: bool = option(False, FLAG, "time drafting apart from verifying (one more host sync per cycle)")
    tree_budget: Optional[int] = option(
        None,
        TREE,
        "draft-tree nodes per cycle (targets with trees); 0: chains "
        "only; None: chosen per cycle when the block size is adaptive",
    )
    lookup: int = option(
        MAX_NGRAM,
        COUNT,
        "prompt lookup: longest context suffix matched; what followed it joins draft trees as a path "
        "and replaces a chain's drafts where it promises more; 0: off",
    )
    draft_window: Optional[int] = option(
        None,
        WINDOW,
        "latest context tokens the drafter attends to (drafts only: output stays exact); 0: all; "
        f"None: the drafter config's sliding window, else {DRAFT_WINDOW}",
    )
    draft_sink: int = option(DRAFT_SINK, TOKENS, "first context tokens the drafter keeps beside its window")
    kv_bits: Optional[int] = option(None, KV_BITS, "bits of the target's quantized KV cache (mlx-lm's); None: off")
    kv_group_size: int = option(64, KV_GROUP, "group size of the KV cache quantization")
    quantized_kv_start: int = option(
        QUANTIZED_KV_START, TOKENS, "tokens the target's KV cache holds before it is quantized (with kv_bits)"
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            rule, passes = f.metadata["rule"]
            value = getattr(self, f.name)
            if not passes(value):
                raise OptionError(f.name, rule, value)

    @classmethod
    def of(cls, options: Optional["DecodeOptions"] = None, **changes: Any) -> "DecodeOptions":
        """`options` (default: the defaults) with `changes`: how the keyword API builds one.
        Anything else in the place of `options` (a drafter one argument too far) is a TypeError."""
        if options is not None and not isinstance(options, cls):
            raise TypeError(
                f"options must be a DecodeOptions or None, got {type(options).__name__} "
                "(a drafter goes in draft_model, the argument before it)"
            )
        unknown = sorted(set(changes) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unknown decoding option {unknown[0]!r}")
        return replace(options or cls(), **changes)

    def sampling(self) -> SamplingParams:
        """What one generation samples and accepts with. Sampling without a seed draws a
        fresh one from MLX's global generator (so `mx.random.seed` still makes runs
        repeatable): call it once per generation. Greedy decoding draws nothing, as
        mlx-lm's does not: the caller's random stream stays where it was."""
        params = SamplingParams(self.temp, self.top_p, self.top_k, self.seed or 0)
        return params if self.seed is not None or params.greedy else replace(params, seed=fresh_seed())

    def window(self, drafter: Any) -> Optional[int]:
        """The drafter's context window (None: unbounded): `draft_window`, else the config's
        `sliding_window_size` (z-lab) or, where some of its layers slide, `sliding_window`,
        else `DRAFT_WINDOW`."""
        if self.draft_window is not None:
            return self.draft_window or None
        config = drafter.config
        own = config.sliding_window if "sliding_attention" in config.layer_types else None
        return config.extra.get("sliding_window_size") or own or DRAFT_WINDOW

    @property
    def kv_args(self) -> dict[str, Any]:
        """The KV cache quantization as mlx-lm's `generate_step` keywords (empty when off)."""
        if self.kv_bits is None:
            return {}
        return dict(kv_bits=self.kv_bits, kv_group_size=self.kv_group_size, quantized_kv_start=self.quantized_kv_start)

    @property
    def use_kernels(self) -> bool:
        """Whether the custom kernels are asked for here (None resolved for this machine)."""
        return metal_ready() if self.kernels is None else self.kernels

    def block_limit(self, drafter: Any) -> int:
        """The most tokens a cycle verifies: 1 without a drafter, else the fixed block size
        or, adaptive, the drafter's block size B. A fixed size above B is an `OptionError`."""
        if drafter is None:
            return 1
        most = drafter.config.block_size
        if self.block_size is not None and self.block_size > most:
            raise OptionError("block_size", f"must be at most the drafter's block size {most}", self.block_size)
        return self.block_size or most

    def adaptive(self, drafter: Any) -> bool:
        """Whether the block size is chosen cycle by cycle (a drafter and no fixed size)."""
        return drafter is not None and self.block_size is None

    def fixed(self, drafter: Any) -> "DecodeOptions":
        """These options with the block size pinned (to the drafter's B if adaptive)."""
        return replace(self, block_size=self.block_limit(drafter)) if self.adaptive(drafter) else self
