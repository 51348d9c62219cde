"""Bad input gets a clear, one-line error that names what is wrong.

* A drafter that does not fit the target (hidden size, vocabulary, number of target
  layers, feature layer ids, mask token id): ValueError naming the field, both from
  `load_draft(dir, model=target)` and from `stream_generate` (before any forward).
* Bad generation arguments: empty prompt, max_tokens <= 0, block size < 2, temp < 0.
* A target of an unsupported model family (tiny gemma / phi3 built from their ModelArgs):
  ValueError naming the supported families.
* Broken drafter directories (missing, no config.json, invalid JSON, missing fields).
* The CLI: `dflash generate` with a bad drafter, or a bad decoding option (`--top-p 2`,
  `--top-k -3`, `--block-size 999` past the drafter's, ...), exits 1 with one line naming
  it, no traceback; the Python API raises the same `DecodeOptions` error.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS preload before the first mlx import)

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from dflash_mlx import generate_step, load_draft, stream_generate
from dflash_mlx.drafter import Drafter, DrafterConfig
from dflash_mlx.drafters import save_drafter
from dflash_mlx.targets import make_target
from dflash_mlx.targets import SUPPORTED_MODEL_TYPES

from conftest import smollm2_drafter_config as smol_config
from tiny_targets import tiny_drafter_config

PROMPT = [1, 9690, 28, 905, 30]  # any short token list: the checks come before the forward


def make_drafter(config: DrafterConfig) -> Drafter:
    mx.random.seed(0)
    drafter = Drafter(config)
    mx.eval(drafter.parameters())
    return drafter


# (case id, config overrides, words the message must contain)
MISFITS = [
    (
        "hidden size",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        ["hidden_size", "64", "576"],
    ),
    ("vocab size", dict(vocab_size=32000), ["vocab_size", "32000", "49152"]),
    ("num target layers", dict(num_target_layers=24, target_layer_ids=[3, 20]), ["num_target_layers", "24", "30"]),
    ("layer id too large", dict(target_layer_ids=[3, 30]), ["target_layer_ids", "30"]),
    ("negative layer id", dict(target_layer_ids=[-1, 27]), ["target_layer_ids", "-1"]),
    ("mask id past the vocabulary", dict(mask_token_id=49152), ["mask_token_id", "49152"]),
    ("negative mask id", dict(mask_token_id=-1), ["mask_token_id", "-1"]),
]


def assert_one_line(error: BaseException, words) -> None:
    message = str(error)
    assert message.strip() and "\n" not in message.strip(), message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


@pytest.fixture(scope="module")
def misfit_dirs(tmp_path_factory):
    out = {}
    for name, overrides, _ in MISFITS:
        path = tmp_path_factory.mktemp(name.replace(" ", "-"))
        save_drafter(make_drafter(smol_config(**overrides)), path, overwrite=True)
        out[name] = path
    return out


@pytest.mark.parametrize("name,overrides,words", MISFITS, ids=[m[0] for m in MISFITS])
def test_load_draft_rejects_a_misfit(default_model, misfit_dirs, name, overrides, words):
    model, _ = default_model
    with pytest.raises(ValueError) as info:
        load_draft(str(misfit_dirs[name]), model=model)
    assert_one_line(info.value, words)
    # Without a target to check against, the same directory loads.
    assert isinstance(load_draft(str(misfit_dirs[name])), Drafter)


@pytest.mark.parametrize("name,overrides,words", MISFITS, ids=[m[0] for m in MISFITS])
def test_stream_generate_rejects_a_misfit(default_model, name, overrides, words):
    model, tokenizer = default_model
    drafter = make_drafter(smol_config(**overrides))
    with pytest.raises(ValueError) as info:
        list(stream_generate(model, tokenizer, PROMPT, drafter, max_tokens=4))
    assert_one_line(info.value, words)


def test_a_fitting_drafter_is_accepted(default_model, tmp_path):
    model, tokenizer = default_model
    save_drafter(make_drafter(smol_config()), tmp_path, overwrite=True)
    drafter = load_draft(str(tmp_path), model=model)
    tokens = [r.token for r in stream_generate(model, tokenizer, PROMPT, drafter, max_tokens=3)]
    assert len(tokens) == 3


# ---------------------------------------------------------------------------
# Generation arguments
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_drafter():
    return make_drafter(smol_config())


@pytest.mark.parametrize("prompt", [[], "", mx.array([], dtype=mx.int32)], ids=["list", "str", "mx.array"])
@pytest.mark.parametrize("with_drafter", [True, False])
def test_empty_prompt(default_model, good_drafter, prompt, with_drafter):
    model, tokenizer = default_model
    with pytest.raises(ValueError) as info:
        list(stream_generate(model, tokenizer, prompt, good_drafter if with_drafter else None, max_tokens=4))
    assert_one_line(info.value, ["prompt", "empty"])


def test_empty_prompt_generate_step(default_model, good_drafter):
    model, _ = default_model
    with pytest.raises(ValueError) as info:
        next(generate_step([], model, good_drafter))
    assert_one_line(info.value, ["prompt"])


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_max_tokens_must_be_positive(default_model, good_drafter, max_tokens):
    model, tokenizer = default_model
    for drafter in (good_drafter, None):
        with pytest.raises(ValueError) as info:
            list(stream_generate(model, tokenizer, PROMPT, drafter, max_tokens=max_tokens))
        assert_one_line(info.value, ["max_tokens", str(max_tokens)])


@pytest.mark.parametrize("block_size", [1, 0, -2])
def test_block_size_below_two(default_model, good_drafter, block_size):
    model, tokenizer = default_model
    with pytest.raises(ValueError) as info:
        list(stream_generate(model, tokenizer, PROMPT, good_drafter, max_tokens=4, block_size=block_size))
    assert_one_line(info.value, ["block_size", str(block_size)])


def test_negative_temperature(default_model, good_drafter):
    model, tokenizer = default_model
    with pytest.raises(ValueError) as info:
        list(stream_generate(model, tokenizer, PROMPT, good_drafter, max_tokens=4, temp=-0.5))
    assert_one_line(info.value, ["temp", "-0.5"])


# ---------------------------------------------------------------------------
# Unsupported model families
# ---------------------------------------------------------------------------


def tiny_model(family: str):
    """A 2-layer mlx-lm model of another family (hidden 64, vocab 256), random weights."""
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=256,
    )
    if family == "gemma":
        from mlx_lm.models import gemma as module

        args = module.ModelArgs(model_type="gemma", head_dim=16, **common)
    else:
        from mlx_lm.models import phi3 as module

        args = module.ModelArgs(model_type="phi3", **common)
    model = module.Model(args)
    mx.eval(model.parameters())
    return model


#: A drafter that would fit the tiny models by shape (2 target layers, block size 4).
FITS_TINY = tiny_drafter_config(2, 4, mask_token_id=255)


@pytest.mark.parametrize("family", ["gemma", "phi3"])
def test_unsupported_family(default_model, tmp_path, family):
    _, tokenizer = default_model
    model = tiny_model(family)
    words = [family, "not supported", *SUPPORTED_MODEL_TYPES]
    assert {"llama", "qwen3"} <= set(SUPPORTED_MODEL_TYPES)

    with pytest.raises(ValueError) as info:
        make_target(model)
    assert_one_line(info.value, words)

    drafter = make_drafter(FITS_TINY)
    with pytest.raises(ValueError) as info:
        list(stream_generate(model, tokenizer, [1, 2, 3], drafter, max_tokens=2))
    assert_one_line(info.value, words)

    save_drafter(drafter, tmp_path, overwrite=True)
    with pytest.raises(ValueError) as info:
        load_draft(str(tmp_path), model=model)
    assert_one_line(info.value, words)


# ---------------------------------------------------------------------------
# Broken drafter directories
# ---------------------------------------------------------------------------


def test_broken_drafter_directories(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_draft(str(tmp_path / "missing"))
    assert_one_line(info.value, ["missing"])

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as info:
        load_draft(str(tmp_path / "empty"))
    assert_one_line(info.value, ["config.json"])

    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ValueError) as info:
        load_draft(str(bad_json))
    assert_one_line(info.value, ["config.json", "JSON"])

    no_weights = tmp_path / "no-weights"
    save_drafter(make_drafter(FITS_TINY), no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_draft(str(no_weights))
    assert_one_line(info.value, ["safetensors"])

    for field in ("num_target_layers", "hidden_size"):
        lacking = tmp_path / f"no-{field}"
        save_drafter(make_drafter(FITS_TINY), lacking)
        config = json.loads((lacking / "config.json").read_text())
        del config[field]
        (lacking / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError) as info:
            load_draft(str(lacking))
        assert_one_line(info.value, [field])


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_drafter_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "no-config").mkdir()
    misfit = root / "misfit"
    save_drafter(make_drafter(smol_config(vocab_size=32000)), misfit)
    return {
        "missing": (root / "missing", "drafter not found"),
        "no config.json": (root / "no-config", "config.json"),
        "misfit": (misfit, "vocab_size"),
    }


def _assert_clean_failure(exit_code: int, stderr: str, words) -> None:
    assert exit_code == 1
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in stderr
    for word in words:
        assert word in lines[0]


@pytest.mark.parametrize("case", ["missing", "no config.json", "misfit"])
def test_cli_generate_bad_drafter(default_model_dir, bad_drafter_paths, case):
    from typer.testing import CliRunner

    from app.cli.main import app

    path, word = bad_drafter_paths[case]
    result = CliRunner().invoke(
        app,
        ["generate", "--prompt", "Hello", "--model", str(default_model_dir), "--draft", str(path), "--max-tokens", "4"],
    )
    assert isinstance(result.exception, SystemExit), result.exception
    _assert_clean_failure(result.exit_code, result.stderr, [word])
    assert result.stdout == ""


def test_cli_process_bad_drafter(default_model_dir, bad_drafter_paths):
    """The real process: exit status 1, one line on stderr, nothing on stdout."""
    path, word = bad_drafter_paths["missing"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "generate",
            "--prompt",
            "Hello",
            "--model",
            str(default_model_dir),
            "--draft",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    _assert_clean_failure(proc.returncode, proc.stderr, [word, str(path)])
    assert proc.stdout == ""


# Each bad decoding option: one line naming the flag, exit code 1, before any output.
BAD_OPTIONS = [
    (["--top-p", "2"], ["--top-p", "(0, 1]", "2"]),
    (["--top-p", "0"], ["--top-p", "(0, 1]", "0"]),
    (["--top-k", "-3"], ["--top-k", "-3"]),
    (["--temp", "-1"], ["--temp", "-1"]),
    (["--seed", "-1"], ["--seed", "-1"]),
    (["--block-size", "1"], ["--block-size", ">= 2", "1"]),
    (["--block-size", "999"], ["--block-size", "the drafter's block size 8", "999"]),
]


@pytest.mark.parametrize("flags,words", BAD_OPTIONS, ids=[" ".join(f) for f, _ in BAD_OPTIONS])
def test_cli_generate_bad_options(default_model_dir, flags, words):
    from typer.testing import CliRunner

    from app.cli.main import app

    result = CliRunner().invoke(
        app, ["generate", "--prompt", "Hello", "--model", str(default_model_dir), "--max-tokens", "4", *flags]
    )
    _assert_clean_failure(result.exit_code, result.stderr, words)
    assert result.stdout == ""


@pytest.mark.parametrize(
    "options,field", [(dict(top_p=2.0), "top_p"), (dict(top_k=-3), "top_k"), (dict(block_size=999), "block_size")]
)
def test_api_bad_options(default_model, good_drafter, options, field):
    """The Python API checks the same `DecodeOptions` rules, one line naming the field."""
    model, tokenizer = default_model
    with pytest.raises(ValueError) as info:
        list(stream_generate(model, tokenizer, PROMPT, good_drafter, max_tokens=4, **options))
    assert_one_line(info.value, [field, str(options[field])])
