"""The Python API takes arguments as an mlx-lm user passes them, or names what is wrong.

* `stop` given as one string is one stop string (not one per character), None is none;
  anything but a string or a list of strings is a one-line error naming `stop`, before
  the prefill.
* A prompt as a 1-D NumPy or MLX array decodes as its token list does (as in mlx-lm),
  through `generate_step` too (mlx-lm's takes an `mx.array`); a prompt of other shapes or
  of non-integers is a one-line error naming `prompt`.
* A drafter goes where mlx-lm's `stream_generate` takes its draft model (the 4th argument).
  Arguments in places that mean something else here (mlx-lm's `max_tokens` or `verbose`
  given positionally land on `draft_model`, a drafter one place further on `options`,
  mlx-lm's list of KV caches as `prompt_cache`) and a `max_tokens` that is not an
  integer: one line naming the argument.
* `prompt_progress_callback` is called as mlx-lm calls it: (0, total) before the prefill,
  then as it goes, ending at (total, total).
* `max_tokens=-1` is no limit, as in mlx-lm: the text runs to EOS, token for token mlx-lm's;
  `generate_step` drafts as with no `max_tokens` (not one plain step a cycle).
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS preload before the first mlx import)

import mlx.core as mx
import numpy as np
import pytest
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache

from dflash_mlx import (
    GenerationStats,
    apply_chat_template,
    generate,
    generate_step,
    load_draft,
    make_prompt_cache,
    stream_generate,
    user_messages,
)

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def counting(default_model):
    """A prompt whose greedy continuation counts on, and that continuation (target alone)."""
    model, tokenizer = default_model
    prompt = tokenizer.encode("Count: one, two, three,")
    text = generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)
    assert "seven" in text, text
    return prompt, text


def one_line_naming(error: BaseException, *words: str) -> None:
    message = str(error).strip()
    assert message and "\n" not in message, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_a_stop_string_given_alone_is_one_stop_string(default_model, counting):
    model, tokenizer = default_model
    prompt, text = counting
    assert generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, stop="seven") == text[: text.index("seven")]
    assert generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, stop=None) == text
    assert generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, stop=("seven",)) == text[: text.index("seven")]


@pytest.mark.parametrize("stop", [5, [5], ["a", None], [["a"]], b"a"], ids=["int", "ints", "none", "lists", "bytes"])
def test_a_bad_stop_is_named(default_model, counting, stop):
    model, tokenizer = default_model
    prefilled = []
    with pytest.raises(TypeError) as info:
        generate(model, tokenizer, counting[0], stop=stop, prompt_progress_callback=lambda *n: prefilled.append(n))
    one_line_naming(info.value, "stop", type(stop).__name__)
    assert not prefilled


@pytest.mark.parametrize("as_prompt", [np.array, lambda p: np.array(p, dtype=np.int32)], ids=["int64", "int32"])
def test_array_prompts_decode_as_their_token_lists(default_model, counting, as_prompt):
    model, tokenizer = default_model
    prompt, text = counting
    assert generate(model, tokenizer, as_prompt(prompt), max_tokens=MAX_TOKENS) == text


@pytest.mark.parametrize("as_prompt", [mx.array, np.array], ids=["mlx", "numpy"])
def test_generate_step_takes_array_prompts(default_model, counting, as_prompt):
    model, _ = default_model
    drafter = load_draft(model=model)

    def first_tokens(prompt):
        sequence = make_prompt_cache(model, drafter)
        tokens = []
        for committed, _, _ in generate_step(prompt, model, drafter, block_size=4, prompt_cache=sequence):
            tokens += committed
            if len(tokens) >= 6:
                return tokens[:6], sequence.tokens

    tokens, held = first_tokens(as_prompt(counting[0]))
    assert (tokens, held) == first_tokens(counting[0])
    assert all(type(t) is int for t in held)  # what prefix reuse and prompt lookup compare
    with pytest.raises(ValueError) as info:
        next(generate_step(as_prompt([counting[0]]), model))
    one_line_naming(info.value, "prompt")


@pytest.mark.parametrize(
    "prompt", [mx.array([[1, 2, 3]]), np.zeros((2, 2), dtype=np.int64), [1.5, 2.0], [1, "a"], mx.array([0.5])]
)
def test_a_prompt_of_other_shapes_or_values_is_named(default_model, prompt):
    model, tokenizer = default_model
    with pytest.raises(ValueError) as info:
        list(stream_generate(model, tokenizer, prompt, max_tokens=2))
    one_line_naming(info.value, "prompt")


@pytest.mark.parametrize("misplaced", [5, True], ids=["max_tokens", "verbose"])
def test_mlx_lm_positional_arguments_are_not_a_drafter(default_model, counting, misplaced):
    model, tokenizer = default_model
    with pytest.raises(TypeError) as info:
        generate(model, tokenizer, counting[0], misplaced)
    one_line_naming(info.value, "draft_model", type(misplaced).__name__)


def test_a_drafter_in_the_place_of_options_is_named(default_model, counting):
    model, tokenizer = default_model
    drafter = load_draft(model=model)
    assert generate(model, tokenizer, counting[0], drafter, max_tokens=MAX_TOKENS) == counting[1]  # mlx-lm's place
    for call in (
        lambda: generate(model, tokenizer, counting[0], None, drafter),
        lambda: next(stream_generate(model, tokenizer, counting[0], None, drafter)),
        lambda: next(generate_step(counting[0], model, None, drafter)),
    ):
        with pytest.raises(TypeError) as info:
            call()
        one_line_naming(info.value, "options", "Drafter", "draft_model")


def test_mlx_lm_prompt_cache_is_named(default_model, counting):
    model, tokenizer = default_model
    with pytest.raises(TypeError) as info:
        generate(model, tokenizer, counting[0], max_tokens=2, prompt_cache=mlx_lm_cache(model))
    one_line_naming(info.value, "prompt_cache", "make_prompt_cache")


@pytest.mark.parametrize("max_tokens", ["5", 5.0, -2])
def test_max_tokens_must_be_an_integer(default_model, counting, max_tokens):
    model, tokenizer = default_model
    with pytest.raises(ValueError) as info:
        list(stream_generate(model, tokenizer, counting[0], max_tokens=max_tokens))
    one_line_naming(info.value, "max_tokens", repr(max_tokens))


def test_prompt_progress_goes_from_zero_to_the_total_as_in_mlx_lm(default_model, counting):
    model, tokenizer = default_model
    calls = {}
    for name, stream in (("mlx-lm", mlx_lm.stream_generate), ("ours", stream_generate)):
        calls[name] = []
        progress = lambda done, total, seen=calls[name]: seen.append((done, total))  # noqa: E731
        list(stream(model, tokenizer, counting[0], max_tokens=1, prompt_progress_callback=progress))
    total = len(counting[0])
    for seen in calls.values():
        assert seen[0] == (0, total) and seen[-1] == (total, total), calls
        assert [done for done, _ in seen] == sorted(done for done, _ in seen)


def test_max_tokens_minus_one_is_no_limit(default_model):
    model, tokenizer = default_model
    prompt = apply_chat_template(tokenizer, user_messages("Say just: ok"))
    theirs = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=-1)]
    ours = list(stream_generate(model, tokenizer, prompt, load_draft(model=model), max_tokens=-1))
    assert len(theirs) < 64 and theirs[-1] in tokenizer.eos_token_ids  # the prompt ends soon
    assert [r.token for r in ours] == theirs and ours[-1].finish_reason == "stop"


def test_generate_step_takes_mlx_lm_max_tokens(default_model, counting):
    model, _ = default_model
    drafter = load_draft(model=model)

    def widths(max_tokens):
        stats = GenerationStats()
        steps = generate_step(counting[0], model, drafter, block_size=4, max_tokens=max_tokens, stats=stats)
        for _ in zip(range(4), steps):
            pass
        return stats.block_sizes

    unlimited = widths(None)
    assert 4 in unlimited, unlimited
    assert widths(-1) == unlimited  # not the shortest chains, as at the end of a budget
    with pytest.raises(ValueError) as info:
        widths(0)
    one_line_naming(info.value, "max_tokens", "0")
