"""The `dflash` command line: generate, cache-prompt, bench, serve, convert, export, and the training
commands (instructions, data, train, eval, curves: `train.py`; draft-vocab: `draft_vocab.py`;
average: `average.py`; adapt: `adapt.py`).

Each command parses its options, calls the engine (`dflash_mlx`) or the converters, and
prints. Expected failures (`dflash_mlx.errors.EXPECTED_ERRORS`) become one line on
stderr and exit code 1. Heavy imports happen inside the commands so that `dflash --help`
stays quick.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from app.cli.adapt import adapt_command
from app.cli.bench.commands import bench_app
from app.cli.average import average_command
from app.cli.common import (
    SHARDING_HELP,
    check_pair,
    one_line_errors,
    positive,
    prompt_text,
    writable,
    writable_directory,
)
from app.cli.draft_vocab import draft_vocab_command
from app.cli.train import (
    curves_command,
    data_command,
    eval_command,
    instructions_command,
    train_command,
)
from app.flags import DRAFTING, KV_CACHE, SAMPLING, WINDOW, decode_flags
from app.server import MAX_BATCH
from app.version import version_line
from converters.options import DEFAULT_Q_BITS, DEFAULT_Q_GROUP_SIZE, Q_BITS, Q_GROUP_SIZES
from dflash_mlx import DecodeOptions

OUTPUT_HELP = "Directory to create (must not exist unless --force)."

# Plain (click-style) help, not typer's Rich panels: typer >= 0.29 prints a value type after
# every flag there (`--force <bool>`, even `--help <bool>`), and the plain formatter rewraps
# docstring paragraphs to the terminal instead of keeping their source line breaks.
# `-h` as well as `--help`: click hands the names down to every command and subcommand.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="DFlash speculative decoding on MLX.",
)
app.add_typer(bench_app, name="bench")


def _show_version(asked: bool) -> None:
    if asked:
        print(version_line())
        raise typer.Exit()


@app.callback()
def _group(
    version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """DFlash speculative decoding on MLX."""


@app.command()
@one_line_errors
@decode_flags(*SAMPLING, *DRAFTING, "profile", *WINDOW, *KV_CACHE)
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt (chat template applied; '-': read stdin)."),
    model: Optional[str] = typer.Option(
        None, "--model", help="Target model path or Hub repo (default: SmolLM2-135M-Instruct)."
    ),
    draft: Optional[str] = typer.Option(
        None, "--draft", help="Drafter path or Hub repo (default: the shipped one for the default model)."
    ),
    no_draft: bool = typer.Option(False, "--no-draft", help="Decode with the target alone."),
    draft_vocab: Optional[str] = typer.Option(
        None, "--draft-vocab", help="Draft vocabulary file, or 'none' (default: the drafter's own, if any)."
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m"),
    system: Optional[str] = typer.Option(
        None, "--system", help="System prompt (in the chat template: not with --raw or --prompt-cache-file)."
    ),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    sharding: Optional[str] = typer.Option(None, "--sharding", help=SHARDING_HELP),
    check_ranks: bool = typer.Option(
        False, "--check-ranks", help="Under mlx.launch: check after every token that all ranks agree (debug)."
    ),
    prompt_cache_file: Optional[Path] = typer.Option(
        None, "--prompt-cache-file", help="A prefix saved by cache-prompt: --prompt is appended to it, raw."
    ),
    options: DecodeOptions = DecodeOptions(),
) -> None:
    """Generate text with DFlash speculative decoding and print the stats (rank 0 only under mlx.launch)."""
    from dflash_mlx import (
        apply_chat_template,
        context_length,
        format_stats,
        load,
        load_draft,
        stream_generate,
        user_messages,
    )
    from dflash_mlx.distributed import choose_sharding, is_leader, lockstep

    positive(max_tokens, "--max-tokens")
    check_pair(model, draft, no_draft, draft_vocab)
    _check_system(system, raw, prompt_cache_file)
    prompt = prompt_text(prompt)
    cache = None
    target, tokenizer = load(model, sharding=choose_sharding(sharding))
    context = context_length(target, tokenizer)
    if max_tokens > context:  # as the server checks a request's max_tokens
        raise ValueError(f"--max-tokens must be at most the model's context, {context} tokens; got {max_tokens}")
    if system is not None and not tokenizer.chat_template:
        raise ValueError(f"--system goes into the chat template, and {model or 'the model'} has none: drop --system")
    drafter = None if no_draft else load_draft(draft, model=target, draft_vocab=draft_vocab)
    if prompt_cache_file is not None:  # the prefix's tokens, then the prompt's, raw
        from dflash_mlx.cache import cache_ids, load_file

        cache = load_file(str(prompt_cache_file), target, drafter, *cache_ids(model, draft, no_draft))
        prompt = cache.tokens + tokenizer.encode(prompt, add_special_tokens=False)
    elif not raw and tokenizer.chat_template:
        prompt = apply_chat_template(tokenizer, user_messages(prompt, system), tokenize=False)
    last, leader = None, is_leader()
    responses = stream_generate(target, tokenizer, prompt, drafter, options, max_tokens=max_tokens, prompt_cache=cache)
    for last in lockstep(responses, check=check_ranks):
        if leader:  # the other ranks decode the same tokens silently
            sys.stdout.write(last.text)
            sys.stdout.flush()
    if not leader:
        return
    print()
    if last is not None:  # the stats go to stderr, as mlx_lm.generate's verbose output does
        print("=" * 10, file=sys.stderr)
        print(format_stats(last), file=sys.stderr)


def _check_system(system: Optional[str], raw: bool, prompt_cache_file: Optional[Path]) -> None:
    """Refuse --system where no chat template is applied (it would be dropped silently)."""
    if system is not None and raw:
        raise ValueError("--system goes into the chat template, which --raw leaves out: drop --system or --raw")
    if system is not None and prompt_cache_file is not None:
        raise ValueError(
            "--system does not apply with --prompt-cache-file (--prompt follows the saved prefix, raw): "
            "put the system prompt in cache-prompt's prefix"
        )


@app.command("cache-prompt")
@one_line_errors
def cache_prompt(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prefix, raw text ('-': read stdin)."),
    output: Path = typer.Option(..., "--output", "-o", help="The .safetensors file to write (NAME.safetensors)."),
    model: Optional[str] = typer.Option(None, "--model", help="Target (default: SmolLM2-135M-Instruct)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter (default: the shipped one)."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Save the target's cache alone."),
) -> None:
    """Prefill a long prefix (system prompt, document, tools) once and save the target's
    and drafter's caches, as mlx_lm.cache_prompt does: `generate --prompt-cache-file`."""
    from dflash_mlx import PromptCache, generate_step, load, load_draft
    from dflash_mlx.cache import cache_ids, save_file

    check_pair(model, draft, no_draft)
    writable(output, "--output")
    if output.suffix != ".safetensors":  # mlx would add it: the file would not be where the user said
        raise ValueError(f"--output must name a .safetensors file, got {output}")
    text = prompt_text(prompt)
    target, tokenizer = load(model)
    drafter = None if no_draft else load_draft(draft, model=target)
    tokens = tokenizer.encode(text)
    cache = PromptCache(target, drafter)
    for _ in generate_step(tokens + tokens[-1:], target, drafter, max_tokens=1, prompt_cache=cache):
        break
    cache.reuse(tokens + tokens[-1:], with_drafter=drafter is not None)  # the prefix alone
    save_file(str(output), cache, *cache_ids(model, draft, no_draft))
    print(f"saved {len(cache.tokens)} tokens to {output}")


@app.command("convert")
@one_line_errors
def convert_command(
    source: str = typer.Argument(..., metavar="SOURCE", help="Hub repo id (owner/name) or local checkpoint directory."),
    output_dir: Path = typer.Argument(..., metavar="OUTPUT_DIR", help=OUTPUT_HELP),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub branch, tag or commit."),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="float16, bfloat16 or float32 (default: the checkpoint's)."
    ),
    quantize: bool = typer.Option(False, "-q", "--quantize", help="Quantize the linear layers."),
    q_bits: Optional[int] = typer.Option(
        None, "--q-bits", help=f"Bits per weight with -q ({', '.join(map(str, Q_BITS))}; default {DEFAULT_Q_BITS})."
    ),
    q_group_size: Optional[int] = typer.Option(
        None,
        "--q-group-size",
        help=f"Quantization group size with -q ({', '.join(map(str, Q_GROUP_SIZES))}; default {DEFAULT_Q_GROUP_SIZE}).",
    ),
    target: Optional[str] = typer.Option(
        None, "--target", help="Also check the drafter fits this target model (path, Hub repo or 'default')."
    ),
    target_layer_ids: Optional[str] = typer.Option(
        None,
        "--target-layer-ids",
        help="Target layers the drafter reads, e.g. 1,9,17,25,33 (only for configs that lack them).",
    ),
    target_model: bool = typer.Option(
        False, "--target-model", help="SOURCE is a target LLM: convert it with mlx_lm.convert."
    ),
    force: bool = typer.Option(False, "--force", help="Replace OUTPUT_DIR if it exists."),
) -> None:
    """Convert a z-lab DFlash drafter (Hub repo or local directory; model.safetensors, sharded
    safetensors or a PyTorch .bin / .pt state dict) into an MLX drafter directory.

    Everything is checked before anything is written: the config, every tensor's name,
    shape and dtype, and with --target the drafter/target pair. A config without
    target_layer_ids is rejected (the ids are not guessed): pass --target-layer-ids.
    Hub downloads use the Hugging Face cache and token; HF_HUB_OFFLINE=1 works from the
    cache. With --target-model, SOURCE is a target LLM and mlx_lm.convert does the work.
    """
    from converters.convert import ConvertOptions, convert_drafter, convert_target_model
    from dflash_mlx import parse_layer_ids

    options = ConvertOptions(revision, dtype, quantize, q_bits, q_group_size, force)
    if target_model:
        if target or target_layer_ids:
            raise ValueError("--target and --target-layer-ids apply to drafters, not to --target-model")
        convert_target_model(source, output_dir, options)
    else:
        convert_drafter(source, output_dir, options, target=target, target_layer_ids=parse_layer_ids(target_layer_ids))


@app.command("export")
@one_line_errors
def export_command(
    draft_dir: str = typer.Argument(..., metavar="DRAFT_DIR", help="MLX drafter directory (or Hub repo id)."),
    output_dir: Path = typer.Argument(..., metavar="OUTPUT_DIR", help=OUTPUT_HELP),
    dtype: str = typer.Option("bfloat16", "--dtype", help="float16, bfloat16 or float32."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub branch, tag or commit."),
    force: bool = typer.Option(False, "--force", help="Replace OUTPUT_DIR if it exists."),
) -> None:
    """Export an MLX drafter to z-lab's PyTorch layout (for SGLang / vLLM / z-lab's loader)."""
    from converters.convert import export_drafter

    export_drafter(draft_dir, output_dir, dtype=dtype, revision=revision, force=force)


@app.command()
@one_line_errors
@decode_flags(*DRAFTING, *KV_CACHE)
def serve(
    model: Optional[str] = typer.Option(None, "--model", help="Target (default: SmolLM2-135M-Instruct)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter (default: the shipped one)."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Decode with the target alone."),
    draft_vocab: Optional[str] = typer.Option(
        None, "--draft-vocab", help="Draft vocabulary file, or 'none' (default: the drafter's own, if any)."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, "--port"),
    max_tokens: int = typer.Option(512, "--max-tokens", help="For requests that do not set max_tokens."),
    sharding: Optional[str] = typer.Option(None, "--sharding", help=SHARDING_HELP + " Rank 0 alone listens."),
    max_batch: int = typer.Option(
        MAX_BATCH, "--max-batch", help="Requests decoded together at most (continuous batching; 1: one at a time)."
    ),
    keep_conversations: Optional[Path] = typer.Option(
        None,
        "--keep-conversations",
        help="Append each chat request's messages and reply to DIR/conversations-YYYYMMDD.jsonl, for "
        "dflash adapt (off by default; local files only).",
    ),
    options: DecodeOptions = DecodeOptions(),
) -> None:
    """An OpenAI- and Anthropic-compatible server (/v1/chat/completions, /v1/completions, /v1/messages)
    decoding with DFlash."""
    from dflash_mlx.distributed import choose_sharding, world_size

    from app.server.ranks import Ranks, follow
    from app.server.worker import Worker, print_log
    from app.server.routes import run_server

    positive(max_tokens, "--max-tokens")
    check_pair(model, draft, no_draft, draft_vocab)
    keeps = None if keep_conversations is None else str(writable_directory(keep_conversations, "--keep-conversations"))
    sharding = choose_sharding(sharding)
    ranks = Ranks() if world_size() > 1 else None
    worker = Worker(
        model,
        draft,
        options=options,
        default_max_tokens=max_tokens,
        max_batch=max_batch,
        no_draft=no_draft,
        draft_vocab=draft_vocab,
        sharding=sharding,
        ranks=ranks,
        log=None if ranks is None or ranks.leader else lambda line: None,  # rank 0 logs for all
        keep_conversations=keeps,
    )
    with print_log():
        if ranks is None or ranks.leader:
            run_server(worker, host, port)
        else:  # under mlx.launch: run what rank 0's server receives
            follow(worker)
    # Stopped cleanly. MLX can abort in interpreter teardown while arrays of the ended
    # worker thread are freed ("terminate called without an active exception"), more
    # often on a loaded machine: leave without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


app.command("instructions")(one_line_errors(instructions_command))
app.command("data")(one_line_errors(data_command))
app.command("train")(one_line_errors(train_command))
app.command("eval")(one_line_errors(eval_command))
app.command("curves")(one_line_errors(curves_command))
app.command("draft-vocab")(one_line_errors(draft_vocab_command))
app.command("average")(one_line_errors(average_command))
app.command("adapt")(one_line_errors(adapt_command))


def main() -> None:
    """The `dflash` console script."""
    app()


if __name__ == "__main__":
    main()
