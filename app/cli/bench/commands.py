"""`dflash bench`: six benchmarks, one subcommand each.

    dflash bench speed [...]                 plain mlx-lm vs ours (vs z-lab's loop), one table
    dflash bench context --lengths 512,... [...]   decode speed and tau after long contexts
    dflash bench verify-cost [...]           a verify of n = 1..64 rows against a plain step
    dflash bench kernels [...]               the verify kernel against mx.quantized_matmul
    dflash bench concurrency 1,2,4,8 [...]   dflash serve against mlx_lm.server under N clients
    dflash bench host [...]                  blocking reads and the host's idle ms per kind of cycle

`dflash bench` alone runs `speed` with its defaults, and `dflash bench -m 32 ...` (options
first, no subcommand: as `git stash -p` is `git stash push -p`) runs `speed` with them.
Each parses its options, runs the
benchmark in its module (`speed.py`, `context.py`, `verify.py`, `kernels.py`, `concurrency.py`,
`host.py`) under a
status line on stderr, and prints its table (`--json`: the report too).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

import typer
from typer.core import TyperGroup

from app.cli.common import (
    SHARDING_HELP,
    check_pair,
    counts,
    integers,
    one_line_errors,
    option_values,
    plottable,
    positive,
    writable,
    write_json,
)
from app.flags import KV_CACHE, decode_flags
from dflash_mlx import DecodeOptions, read_prompt_sources

from .context import DEFAULT_CONTEXTS


class _SpeedByDefault(TyperGroup):
    """`bench` followed by an option (not --help) is `bench speed` followed by it."""

    default_command = "speed"

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if args and args[0].startswith("-") and args[0] not in self.get_help_option_names(ctx):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


bench_app = typer.Typer(cls=_SpeedByDefault, add_completion=False, rich_markup_mode=None)

MODEL_HELP = "Target (default: SmolLM2-135M-Instruct)."
JSON_HELP = "Write the report as JSON here."
HELDOUT_PROMPTS = typer.Option(
    ["heldout"], "--prompts", help="Prompt files or shipped held-out sets (default: the 40 held-out prompts)."
)


def read_prompts(sources: Sequence[str]) -> tuple[list[str], list[str]]:
    """The user prompts of prompt files or shipped held-out sets
    (`dflash_mlx.messages.read_prompt_sources`) and the kind of each."""
    records = read_prompt_sources(sources)
    return [r["messages"][-1]["content"] for r in records], [r["set"] for r in records]


@bench_app.callback(invoke_without_command=True)
def bench(ctx: typer.Context) -> None:
    """Benchmarks: speed (plain mlx-lm vs DFlash, the default), context, verify-cost, kernels, concurrency, host."""
    if ctx.invoked_subcommand is None:
        command = ctx.command.get_command(ctx, "speed")
        with command.make_context("speed", [], parent=ctx) as speed_ctx:  # its defaults, parsed
            command.invoke(speed_ctx)


@bench_app.command()
@one_line_errors
@decode_flags("block_size", "kernels", "lookup", *KV_CACHE)
def speed(
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    draft: Optional[List[str]] = typer.Option(
        None,
        "--draft",
        help="Drafter (default: the shipped one; 'random': an untrained one, to measure the loop's overhead). "
        "Repeatable: ours also runs with each further drafter, side by side (to compare two drafters).",
    ),
    prompts: Optional[List[str]] = typer.Option(
        None,
        "--prompts",
        help="A prompt file (one prompt a line, or JSONL), or a shipped held-out set: heldout (all 40), chat, "
        "code, math, stdlib. Repeatable; a table per kind where the prompts have several "
        "(default: six built-in prompts).",
    ),
    max_tokens: int = typer.Option(128, "--max-tokens", "-m"),
    fixed: Optional[str] = typer.Option(
        None,
        "--fixed",
        help="Also run ours with these fixed block sizes, 2..the drafter's B ('' for none; default: 4,8,16 up to B).",
    ),
    tree_budget: str = typer.Option(
        "",
        "--tree-budget",
        help="Also run ours with these fixed tree budgets at the block size (0: the chain), e.g. 0,4,8,16,32.",
    ),
    lookup_rows: str = typer.Option(
        "", "--lookup-rows", help="Also run ours with these prompt-lookup lengths (0: off), e.g. 0."
    ),
    draft_vocab: Optional[str] = typer.Option(
        None,
        "--draft-vocab",
        help="Draft vocabulary file, or 'none' (default: the drafter's own, if any). Several, comma-separated: "
        "ours also runs with each further one.",
    ),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="Also run z-lab's MLX loop if installed."),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
    sharding: Optional[str] = typer.Option(None, "--sharding", help=SHARDING_HELP + " No z-lab loop then."),
    options: DecodeOptions = DecodeOptions(),
) -> None:
    """Plain mlx-lm vs DFlash (vs z-lab's loop) on the same prompts, side by side."""
    from rich.console import Console

    from dflash_mlx.distributed import choose_sharding, is_leader

    from .speed import markdown_table, run_bench

    positive(max_tokens, "--max-tokens")
    writable(json_out, "--json")
    check_pair(model)
    sizes = None if fixed is None else integers(fixed, "--fixed")
    trees = option_values(tree_budget, "--tree-budget", "tree_budget")
    lookups = option_values(lookup_rows, "--lookup-rows", "lookup")
    texts, kinds = read_prompts(prompts) if prompts else (None, None)
    with Console(stderr=True).status("benchmarking") as status:
        report = run_bench(
            model,
            draft[0] if draft else None,
            texts,
            max_tokens,
            options,
            reference,
            progress=status.update,
            fixed_sizes=sizes,
            draft_vocab=draft_vocab,
            fixed_trees=trees,
            kinds=kinds,
            fixed_lookups=lookups,
            sharding=choose_sharding(sharding),
            other_drafts=(draft or [])[1:],
        )
    if not is_leader():  # every rank ran the same bench; rank 0 reports it
        return
    print(markdown_table(report))
    write_json(report, json_out)


@bench_app.command()
@one_line_errors
def context(
    lengths: str = typer.Option(
        ",".join(map(str, DEFAULT_CONTEXTS)),
        "--lengths",
        help="Tokens of documentation before each question, comma-separated.",
    ),
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter (default: the shipped one)."),
    prompts: Optional[List[str]] = typer.Option(
        None,
        "--prompts",
        help="The questions asked after the documentation: prompt files or shipped held-out sets "
        "(default: four about the documentation).",
    ),
    max_tokens: int = typer.Option(128, "--max-tokens", "-m"),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw it into this PNG."),
) -> None:
    """Decode speed, tau, time to first token and draft cost after this many tokens of
    documentation (pydoc text), plain mlx-lm beside ours."""
    from rich.console import Console

    from .context import QUESTIONS, context_header, context_line, plot_context, run_context_bench

    positive(max_tokens, "--max-tokens")
    writable(json_out, "--json")
    plottable(plot, "--plot")
    check_pair(model)
    sizes = counts(lengths, "--lengths")
    questions = read_prompts(prompts)[0] if prompts else QUESTIONS
    print("\n".join(context_header(max_tokens)), flush=True)
    with Console(stderr=True).status("benchmarking long contexts") as status:
        report = run_context_bench(
            model,
            draft,
            sizes,
            questions,
            max_tokens=max_tokens,
            progress=status.update,
            on_row=lambda row: print(context_line(row), flush=True),
        )
    write_json(report, json_out)
    if plot:
        plot_context(report["results"], plot)


@bench_app.command("verify-cost")
@one_line_errors
def verify_cost(
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Time a verify of n = 1..64 rows against a plain step (T(n)/T(1)): whether trees can pay here."""
    from rich.console import Console

    from .verify import run_verify_cost, verify_cost_table

    writable(json_out, "--json")
    check_pair(model)

    with Console(stderr=True).status("timing verifies") as status:
        report = run_verify_cost(model, progress=status.update)
    print(verify_cost_table(report))
    write_json(report, json_out)


@bench_app.command()
@one_line_errors
def kernels(
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Time the verify kernel against mx.quantized_matmul (M = 1..16 rows), and on a hybrid
    target the gated-delta rollback (module replay against the tape replay kernel)."""
    from rich.console import Console

    from .kernels import kernel_table, run_kernel_bench

    writable(json_out, "--json")
    check_pair(model)

    with Console(stderr=True).status("timing the verify kernel") as status:
        report = run_kernel_bench(model, progress=status.update)
    print(kernel_table(report))
    write_json(report, json_out)


@bench_app.command()
@one_line_errors
def concurrency(
    levels: str = typer.Argument("1,2,4,8", help="Concurrent clients, comma-separated (1 always runs first)."),
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter for dflash serve (default: the shipped one)."),
    prompts: List[str] = HELDOUT_PROMPTS,
    limit: int = typer.Option(32, "--limit", help="Use the first this many prompts."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-m"),
    mlx_lm_batch: int = typer.Option(
        8, "--mlx-lm-batch", help="mlx_lm.server's batch: its decode and prompt concurrency."
    ),
    burst: bool = typer.Option(
        False, "--burst", help="Fire N requests at the same moment, the next N once they are answered."
    ),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw tokens/s against clients into this PNG."),
) -> None:
    """dflash serve against mlx_lm.server (batched) under N concurrent clients: aggregate tokens/s,
    latency and time to first token side by side, every answer checked against its solo answer."""
    from rich.console import Console

    from .concurrency import concurrency_table, plot_concurrency, run_concurrency_bench

    clients = counts(levels, "LEVELS")
    for flag, value in (("--limit", limit), ("--max-tokens", max_tokens), ("--mlx-lm-batch", mlx_lm_batch)):
        positive(value, flag)
    writable(json_out, "--json")
    plottable(plot, "--plot")
    texts = read_prompts(prompts)[0][:limit]
    with Console(stderr=True).status("benchmarking concurrency") as status:
        report = run_concurrency_bench(
            clients,
            texts,
            model=model,
            draft=draft,
            max_tokens=max_tokens,
            mlx_lm_batch=mlx_lm_batch,
            burst=burst,
            progress=status.update,
        )
    print(concurrency_table(report))
    write_json(report, json_out)
    if plot:
        plot_concurrency(report, plot)


@bench_app.command()
@one_line_errors
def host(
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter (default: the shipped one)."),
    prompts: List[str] = HELDOUT_PROMPTS,
    limit: int = typer.Option(8, "--limit", help="Use the first this many prompts."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-m"),
    json_out: Optional[Path] = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Blocking host reads per cycle and the host's milliseconds with nothing queued on the
    device, for plain steps, chains, trees and the default policy (what a GPU would wait)."""
    from rich.console import Console

    from .host import host_table, run_host_bench

    for flag, value in (("--limit", limit), ("--max-tokens", max_tokens)):
        positive(value, flag)
    writable(json_out, "--json")
    check_pair(model)
    texts = read_prompts(prompts)[0][:limit]
    with Console(stderr=True).status("timing the host") as status:
        report = run_host_bench(model, draft, texts, max_tokens=max_tokens, progress=status.update)
    print(host_table(report))
    write_json(report, json_out)
