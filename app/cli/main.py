"""The `dflash` command line: generate, bench, serve, convert, export, data, train, eval.

Each command parses its options, calls the engine (`dflash_mlx`) or the converters, and
prints. Expected failures (`dflash_mlx.errors.EXPECTED_ERRORS`) become one line on
stderr and exit code 1. Heavy imports happen inside the commands so that `dflash --help`
stays quick.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional

import typer

from converters.convert import ConvertOptions, convert_drafter, convert_target_model, export_drafter
from converters.options import Q_BITS, Q_GROUP_SIZES
from dflash_mlx.config import parse_layer_ids
from dflash_mlx.errors import EXPECTED_ERRORS, one_line
from dflash_mlx.options import DecodeOptions, OptionError

#: The decoding defaults, which the options below show (`DecodeOptions` owns them).
DEFAULTS = DecodeOptions()
TREE_HELP = (
    "Draft-tree nodes per cycle (plain attention targets; 0: chains only; "
    "default: chosen per cycle when the block size is adaptive)."
)
LOOKUP_HELP = (
    "Prompt lookup: the longest context suffix matched; what followed it before joins each draft tree "
    "as a path, and replaces a chain's drafts where it promises more (0: off)."
)
OUTPUT_HELP = "Directory to create (must not exist unless --force)."
SHARDING_HELP = "Under mlx.launch: shard the target by mlx-lm's tensor or pipeline parallelism (default: auto)."


def kv_options() -> tuple:
    """--kv-bits, --kv-group-size, --quantized-kv-start (mlx-lm's flags), for a command's signature."""
    return (
        typer.Option(DEFAULTS.kv_bits, "--kv-bits", help="Quantize the target's KV cache to 2-8 bits (default: off)."),
        typer.Option(DEFAULTS.kv_group_size, "--kv-group-size", help="Group size of the KV cache quantization."),
        typer.Option(
            DEFAULTS.quantized_kv_start, "--quantized-kv-start", help="Tokens cached before the KV cache is quantized."
        ),
    )


KV_BITS, KV_GROUP, KV_START = kv_options()

# Plain (click-style) help, not typer's Rich panels: typer >= 0.29 prints a value type after
# every flag there (`--force <bool>`, even `--help <bool>`), and the plain formatter rewraps
# docstring paragraphs to the terminal instead of keeping their source line breaks.
app = typer.Typer(
    add_completion=False, no_args_is_help=True, rich_markup_mode=None, help="DFlash speculative decoding on MLX."
)


@app.callback()
def _group() -> None:
    """DFlash speculative decoding on MLX."""


def one_line_errors(fn: Callable) -> Callable:
    """Turn expected failures into one clear line on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OptionError as e:  # named by its flag: --top-p, --block-size, ...
            typer.secho(f"error: {e.named('--' + e.field.replace('_', '-'))}", err=True, fg="red")
            raise typer.Exit(1) from None
        except EXPECTED_ERRORS as e:
            typer.secho(f"error: {one_line(e)}", err=True, fg="red")
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            typer.secho("interrupted", err=True, fg="red")
            raise typer.Exit(130) from None

    return wrapper


def _kernels(no_kernels: bool) -> Optional[bool]:
    """--no-kernels as `DecodeOptions.kernels` (None: on where they run)."""
    return False if no_kernels else None


@app.command()
@one_line_errors
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt (chat template applied)."),
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
    temp: float = typer.Option(DEFAULTS.temp, "--temp", help="Sampling temperature (0: greedy)."),
    top_p: float = typer.Option(DEFAULTS.top_p, "--top-p", help="Nucleus sampling threshold in (0, 1]."),
    top_k: int = typer.Option(DEFAULTS.top_k, "--top-k", help="Sample among the k most likely tokens (0: off)."),
    seed: Optional[int] = typer.Option(DEFAULTS.seed, "--seed"),
    block_size: Optional[int] = typer.Option(
        DEFAULTS.block_size, "--block-size", help="Tokens verified per cycle, 2 .. the drafter's (default: adaptive)."
    ),
    tree_budget: Optional[int] = typer.Option(DEFAULTS.tree_budget, "--tree-budget", help=TREE_HELP),
    lookup: int = typer.Option(DEFAULTS.lookup, "--lookup", help=LOOKUP_HELP),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    no_kernels: bool = typer.Option(
        False, "--no-kernels", help="Do not use the custom Metal kernels (default: used on Apple GPUs)."
    ),
    sharding: Optional[str] = typer.Option(None, "--sharding", help=SHARDING_HELP),
    check_ranks: bool = typer.Option(
        False, "--check-ranks", help="Under mlx.launch: check after every token that all ranks agree (debug)."
    ),
    kv_bits: Optional[int] = KV_BITS,
    kv_group_size: int = KV_GROUP,
    quantized_kv_start: int = KV_START,
    draft_window: Optional[int] = typer.Option(
        DEFAULTS.draft_window, "--draft-window", help="Latest context tokens the drafter reads (0: all)."
    ),
    draft_sink: int = typer.Option(DEFAULTS.draft_sink, "--draft-sink", help="First context tokens it keeps too."),
    prompt_cache_file: Optional[Path] = typer.Option(
        None, "--prompt-cache-file", help="A prefix saved by cache-prompt: --prompt is appended to it, raw."
    ),
) -> None:
    """Generate text with DFlash speculative decoding and print the stats (rank 0 only under mlx.launch)."""
    from dflash_mlx import load, load_draft, stream_generate
    from dflash_mlx.distributed import choose_sharding, is_leader, lockstep
    from dflash_mlx.messages import apply_chat_template, user_messages
    from dflash_mlx.speculative import format_stats

    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be positive, got {max_tokens}")
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start)
    kv.update(draft_window=draft_window, draft_sink=draft_sink)
    cache = None
    options = DecodeOptions(
        temp,
        top_p,
        top_k,
        seed,
        block_size,
        kernels=_kernels(no_kernels),
        profile=True,
        tree_budget=tree_budget,
        lookup=lookup,
        **kv,
    )
    target, tokenizer = load(model, sharding=choose_sharding(sharding))
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


@app.command("cache-prompt")
@one_line_errors
def cache_prompt(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prefix, raw text ('-': read stdin)."),
    output: Path = typer.Option(..., "--output", "-o", help="The .safetensors file to write."),
    model: Optional[str] = typer.Option(None, "--model", help="Target (default: SmolLM2-135M-Instruct)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter (default: the shipped one)."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Save the target's cache alone."),
) -> None:
    """Prefill a long prefix (system prompt, document, tools) once and save the target's
    and drafter's caches, as mlx_lm.cache_prompt does: `generate --prompt-cache-file`."""
    from dflash_mlx import load, load_draft
    from dflash_mlx.cache import PromptCache, cache_ids, save_file
    from dflash_mlx.speculative import generate_step

    text = sys.stdin.read() if prompt == "-" else prompt
    target, tokenizer = load(model)
    drafter = None if no_draft else load_draft(draft, model=target)
    tokens = tokenizer.encode(text)
    cache = PromptCache(target, drafter)
    for _ in generate_step(tokens + tokens[-1:], target, drafter, max_tokens=1, prompt_cache=cache):
        break
    cache.reuse(tokens + tokens[-1:], with_drafter=drafter is not None)  # the prefix alone
    save_file(str(output), cache, *cache_ids(model, draft, no_draft))
    print(f"saved {len(cache.tokens)} tokens to {output}")


@app.command()
@one_line_errors
def bench(
    model: Optional[str] = typer.Option(None, "--model", help="Target (default: SmolLM2-135M-Instruct)."),
    draft: Optional[str] = typer.Option(
        None,
        "--draft",
        help="Drafter (default: the shipped one; 'random': an untrained one, to measure the loop's overhead).",
    ),
    prompts: Optional[List[str]] = typer.Option(
        None,
        "--prompts",
        help="A prompt file (one prompt a line, or JSONL), or a shipped held-out set: heldout (all 40), chat, "
        "code, math, stdlib. Repeatable; a table per kind where the prompts have several "
        "(default: six built-in prompts). With --context: the questions asked after the documentation.",
    ),
    max_tokens: int = typer.Option(128, "--max-tokens", "-m"),
    block_size: Optional[int] = typer.Option(
        None, "--block-size", help="Ours verifies this many tokens (default: adaptive)."
    ),
    fixed: str = typer.Option("4,8,16", "--fixed", help="Also run ours with these fixed block sizes ('' for none)."),
    tree_budget: str = typer.Option(
        "",
        "--tree-budget",
        help="Also run ours with these fixed tree budgets at the block size (0: the chain), e.g. 0,4,8,16,32.",
    ),
    lookup: int = typer.Option(DEFAULTS.lookup, "--lookup", help=LOOKUP_HELP),
    lookup_rows: str = typer.Option(
        "", "--lookup-rows", help="Also run ours with these prompt-lookup lengths (0: off), e.g. 0."
    ),
    verify_cost: bool = typer.Option(
        False, "--verify-cost", help="Time a verify of n = 1..64 rows against a plain step instead (T(n)/T(1))."
    ),
    context: str = typer.Option(
        "",
        "--context",
        help="Instead: decode speed and tau after this many tokens of documentation, e.g. 512,1024,2048,4096,7000.",
    ),
    draft_vocab: Optional[str] = typer.Option(
        None,
        "--draft-vocab",
        help="Draft vocabulary file, or 'none' (default: the drafter's own, if any). Several, comma-separated: "
        "ours also runs with each further one.",
    ),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="Also run z-lab's MLX loop if installed."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report as JSON here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="With --context: also draw it into this PNG."),
    kernels: Optional[bool] = typer.Option(
        None,
        "--kernels/--no-kernels",
        help="The first times the verify kernel against mx.quantized_matmul (M = 1..16) instead; the "
        "second runs ours without the custom kernels (default: used on Apple GPUs).",
    ),
    sharding: Optional[str] = typer.Option(None, "--sharding", help=SHARDING_HELP + " No z-lab loop then."),
    kv_bits: Optional[int] = KV_BITS,
    kv_group_size: int = KV_GROUP,
    quantized_kv_start: int = KV_START,
) -> None:
    """Plain mlx-lm vs DFlash (vs z-lab's loop) on the same prompts, side by side."""
    from rich.console import Console

    from dflash_mlx.distributed import choose_sharding, is_leader

    from app.cli.bench.speed import markdown_table, read_prompts, run_bench, write_json

    console = Console(stderr=True)
    if verify_cost:
        from app.cli.bench.verify import run_verify_cost, verify_cost_table

        with console.status("timing verifies") as status:
            report = run_verify_cost(model, progress=lambda msg: status.update(msg))
        print(verify_cost_table(report))
        if json_out:
            write_json(report, json_out)
        return
    if context:
        from app.cli.bench.context import QUESTIONS, context_header, context_line, plot_context, run_context_bench

        lengths = [int(n) for n in context.split(",") if n.strip()]
        questions = read_prompts(prompts)[0] if prompts else QUESTIONS
        print("\n".join(context_header(max_tokens)), flush=True)
        with console.status("benchmarking long contexts") as status:
            report = run_context_bench(
                model,
                draft,
                lengths,
                questions,
                max_tokens=max_tokens,
                progress=status.update,
                on_row=lambda row: print(context_line(row), flush=True),
            )
        if json_out:
            write_json(report, json_out)
        if plot:
            plot_context(report["results"], plot)
        return
    if kernels:
        from app.cli.bench.kernels import kernel_table, run_kernel_bench

        with console.status("timing the verify kernel") as status:
            report = run_kernel_bench(model, progress=lambda msg: status.update(msg))
        print(kernel_table(report))
        if json_out:
            write_json(report, json_out)
        return
    options = DecodeOptions(
        block_size=block_size,
        kernels=kernels,
        lookup=lookup,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
    )
    texts, kinds = read_prompts(prompts) if prompts else (None, None)
    with console.status("benchmarking") as status:
        report = run_bench(
            model,
            draft,
            texts,
            max_tokens,
            options,
            reference,
            progress=lambda msg: status.update(msg),
            fixed_sizes=[int(b) for b in fixed.split(",") if b.strip()],
            draft_vocab=draft_vocab,
            fixed_trees=[int(n) for n in tree_budget.split(",") if n.strip()],
            kinds=kinds,
            fixed_lookups=[int(n) for n in lookup_rows.split(",") if n.strip()],
            sharding=choose_sharding(sharding),
        )
    if not is_leader():  # every rank ran the same bench; rank 0 reports it
        return
    print(markdown_table(report))
    if json_out:
        write_json(report, json_out)


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
    q_bits: int = typer.Option(4, "--q-bits", help=f"Bits per weight with -q ({', '.join(map(str, Q_BITS))})."),
    q_group_size: int = typer.Option(
        64, "--q-group-size", help=f"Quantization group size with -q ({', '.join(map(str, Q_GROUP_SIZES))})."
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
    export_drafter(draft_dir, output_dir, dtype=dtype, revision=revision, force=force)


@app.command()
@one_line_errors
def serve(
    model: Optional[str] = typer.Option(None, "--model", help="Target (default: SmolLM2-135M-Instruct)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter (default: the shipped one)."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Decode with the target alone."),
    draft_vocab: Optional[str] = typer.Option(
        None, "--draft-vocab", help="Draft vocabulary file, or 'none' (default: the drafter's own, if any)."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, "--port"),
    block_size: Optional[int] = typer.Option(
        DEFAULTS.block_size, "--block-size", help="Fixed block size (default: adaptive)."
    ),
    tree_budget: Optional[int] = typer.Option(DEFAULTS.tree_budget, "--tree-budget", help=TREE_HELP),
    lookup: int = typer.Option(DEFAULTS.lookup, "--lookup", help=LOOKUP_HELP),
    max_tokens: int = typer.Option(512, "--max-tokens", help="For requests that do not set max_tokens."),
    no_kernels: bool = typer.Option(
        False, "--no-kernels", help="Do not use the custom Metal kernels (default: used on Apple GPUs)."
    ),
    sharding: Optional[str] = typer.Option(None, "--sharding", help=SHARDING_HELP + " Rank 0 alone listens."),
    kv_bits: Optional[int] = KV_BITS,
    kv_group_size: int = KV_GROUP,
    quantized_kv_start: int = KV_START,
) -> None:
    """An OpenAI-compatible server (/v1/chat/completions, /v1/completions) decoding with DFlash."""
    from dflash_mlx.distributed import choose_sharding, world_size

    from app.server.ranks import Ranks, follow
    from app.server.worker import Worker
    from app.server.routes import run_server

    options = DecodeOptions(
        block_size=block_size,
        kernels=_kernels(no_kernels),
        tree_budget=tree_budget,
        lookup=lookup,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
    )
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be positive, got {max_tokens}")
    sharding = choose_sharding(sharding)
    ranks = Ranks() if world_size() > 1 else None
    worker = Worker(
        model,
        draft,
        options=options,
        default_max_tokens=max_tokens,
        no_draft=no_draft,
        draft_vocab=draft_vocab,
        sharding=sharding,
        ranks=ranks,
        log=None if ranks is None or ranks.leader else lambda line: None,  # rank 0 logs for all
    )
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


from app.cli.train import (  # noqa: E402
    curves_command,
    data_command,
    draft_vocab_command,
    eval_command,
    instructions_command,
    train_command,
)

app.command("instructions")(one_line_errors(instructions_command))
app.command("data")(one_line_errors(data_command))
app.command("train")(one_line_errors(train_command))
app.command("eval")(one_line_errors(eval_command))
app.command("curves")(one_line_errors(curves_command))
app.command("draft-vocab")(one_line_errors(draft_vocab_command))


def main() -> None:
    """The `dflash` console script."""
    app()


if __name__ == "__main__":
    main()
