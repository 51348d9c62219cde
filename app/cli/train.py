"""The `dflash instructions`, `data`, `train`, `eval` and `curves` commands (registered in main.py).
Heavy imports happen inside the commands so that `dflash --help` stays fast."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, List, Optional, Sequence

import typer

from app.cli.common import check_pair, not_negative, plottable, positive, writable, write_json
from app.flags import decode_flags, typer_parameter
from dflash_mlx import DecodeOptions

THREADS_HELP = "OpenBLAS threads: a number, or 'auto' (2 while /tmp/dflash-cpu.lock is free, 1 while it is held)."


def instructions_command(
    out: Path = typer.Option(
        ..., "--out", "-o", help="Prompt JSONL to write (appended; resumes), for `dflash data --source`."
    ),
    heldout: Path = typer.Option(
        ..., "--heldout", help="heldout.jsonl whose user messages stay out (exact and near duplicates)."
    ),
    num: int = typer.Option(..., "--num-instructions", "-n", help="Stop when this many instructions are kept."),
    model: Optional[str] = typer.Option(None, "--model", help="Target model (default: SmolLM2-135M-Instruct)."),
    max_tokens: int = typer.Option(48, "--max-tokens", "-m", help="Tokens the target may write per instruction."),
    batch_size: int = typer.Option(32, "--batch-size", "-b"),
    temp: float = typer.Option(0.8, "--temp", help="Sampling temperature of the writer."),
    threshold: float = typer.Option(
        0.5, "--near", help="Word 3-gram Jaccard from which two texts are near duplicates."
    ),
    seed: int = typer.Option(0, "--seed"),
    threads: Optional[str] = typer.Option(None, "--threads", help=THREADS_HELP),
    no_progress: bool = typer.Option(False, "--no-progress", help="Log lines instead of a progress bar."),
) -> None:
    """Self-instruct: the target writes varied chat prompts (deduplicated, held-out prompts kept out)."""
    from dflash_mlx.train.selfinstruct import write_instructions
    from dflash_mlx.train.threads import parse_threads

    positive(max_tokens, "--max-tokens")  # --num-instructions: write_instructions' own first check
    positive(batch_size, "--batch-size")
    not_negative(temp, "--temp")
    if not 0 < threshold <= 1:
        raise ValueError(f"--near must be within (0, 1], got {threshold}")
    stats = write_instructions(
        out,
        heldout,
        num,
        model,
        batch_size,
        seed,
        temp,
        max_tokens,
        threshold,
        parse_threads(threads),
        not no_progress,
        log=lambda s: typer.echo(s),
    )
    typer.echo("done: " + ", ".join(f"{k} {v}" for k, v in stats.items()) + f" -> {out}")


def options_signature(rows: Sequence[tuple[str, Any, Any, list[str], str]]) -> inspect.Signature:
    """A command's typer options from a table of (name, type, default, flags, help) rows:
    a command with dozens of options stays a short function over its values."""
    return inspect.Signature([typer_parameter(*row) for row in rows])


def data_command(
    out: Path = typer.Option(..., "--out", "-o", help="Output directory (train.jsonl, heldout.jsonl, meta.json)."),
    source: List[str] = typer.Option(
        ["chat", "math", "stdlib", "humaneval"],
        "--source",
        "-s",
        help="Prompt source: chat, math, stdlib, humaneval; round6 (or round6-chat, round6-math, round6-stdlib, "
        "round6-code); or a JSONL file of prompts / chat transcripts. Repeatable.",
    ),
    model: Optional[str] = typer.Option(None, "--model", help="Target model (default: SmolLM2-135M-Instruct)."),
    num_prompts: Optional[int] = typer.Option(
        None, "--num-prompts", "-n", help="Answer at most this many training prompts."
    ),
    heldout: int = typer.Option(40, "--heldout", help="Prompts kept out of training, for `dflash eval`."),
    max_tokens: int = typer.Option(160, "--max-tokens", "-m", help="New tokens per answer."),
    batch_size: int = typer.Option(32, "--batch-size", "-b", help="Prompts answered together."),
    seed: int = typer.Option(0, "--seed"),
    temp: float = typer.Option(
        0.0,
        "--temp",
        help="Sampling temperature of the answers (0: greedy). "
        "Run again with another --temp to add sampled answers to the same set.",
    ),
    turns: int = typer.Option(
        1,
        "--turns",
        help="User turns per conversation: the target writes each follow-up and answers with the whole "
        "conversation as context.",
    ),
    threads: Optional[str] = typer.Option(None, "--threads", help=THREADS_HELP),
    no_progress: bool = typer.Option(False, "--no-progress", help="Log lines instead of a progress bar."),
) -> None:
    """Build a self-distillation set: prompts answered greedily by the target itself."""
    from dflash_mlx.train.data import build_dataset
    from dflash_mlx.train.threads import parse_threads

    for value, flag in ((num_prompts, "--num-prompts"), (max_tokens, "--max-tokens"), (batch_size, "--batch-size")):
        positive(value, flag)
    positive(turns, "--turns")
    not_negative(heldout, "--heldout")
    not_negative(temp, "--temp")
    stats = build_dataset(
        out,
        source,
        model,
        num_prompts,
        heldout,
        max_tokens,
        batch_size,
        seed,
        temp=temp,
        log=lambda s: typer.echo(s),
        turns=turns,
        threads=parse_threads(threads),
        progress=not no_progress,
    )
    typer.echo(f"done: {stats['records']} answers, {stats['tokens']} new tokens in {stats['seconds']:.0f}s -> {out}")


#: `dflash train`'s options, one row each: (name, type, default, flags, help). Each goes unchanged to
#: the `TrainArgs` field of its name but data, out, target_layer_ids, init_from, features, resume_point,
#: threads (converted first), resume_from (restored into OUT; turns resume on), no_progress (`progress`).
TRAIN_OPTIONS = [
    ("data", Path, ..., ["--data", "-d"], "train.jsonl from `dflash data` (or its directory)."),
    ("out", Path, ..., ["--out", "-o"], "Drafter directory to write (loadable by load_draft)."),
    ("model", Optional[str], None, ["--model"], "Target model (default: SmolLM2-135M-Instruct)."),
    ("num_layers", int, 5, ["--num-layers"], "Drafter decoder layers (paper: 5)."),
    (
        "target_layer_ids",
        Optional[str],
        None,
        ["--target-layer-ids"],
        "Comma-separated target layers to read (default: spread like z-lab's).",
    ),
    ("block_size", int, 16, ["--block-size"], "Block size B (paper: 16)."),
    ("mask_token_id", Optional[int], None, ["--mask-token-id"], "MASK token (default: an unused special token)."),
    ("intermediate_size", Optional[int], None, ["--intermediate-size"], "Drafter MLP width (default: the target's)."),
    ("gamma", Optional[float], None, ["--gamma"], "Loss decay (default 7 for B=16, 5 for 10, 4 for 8)."),
    (
        "init",
        str,
        "warm",
        ["--init"],
        "'warm': start from the target's layers after the deepest feature; 'cold': random.",
    ),
    (
        "init_from",
        Optional[Path],
        None,
        ["--init-from"],
        "Start from this trained drafter instead of --init (its shape; a v1 drafter under --arch dflash2 "
        "starts as exactly the same drafter).",
    ),
    (
        "arch",
        str,
        "dflash1",
        ["--arch"],
        "'dflash1', or 'dflash2': dynamic causal convolutions and a candidate selector.",
    ),
    ("conv_kernel_size", int, 2, ["--conv-kernel-size"], "DFlash2: convolution taps along the block."),
    ("conv_group_size", int, 16, ["--conv-group-size"], "DFlash2: channels sharing one per-token kernel."),
    ("selector_rank", int, 32, ["--selector-rank"], "DFlash2: rank of the selector's token codebooks."),
    ("selector_top_k", int, 8, ["--selector-top-k"], "DFlash2: candidates per block position."),
    ("selector_weight", float, 1.0, ["--selector-weight"], "DFlash2: weight of the selector's loss term."),
    (
        "distill",
        float,
        0.5,
        ["--distill"],
        "Weight of distillation from the target's top-k distribution (0: hard labels only).",
    ),
    ("top_k", int, 8, ["--top-k"], "Teacher tokens kept per position in the feature cache."),
    ("features", Optional[Path], None, ["--features"], "Feature cache directory (default: DATA/features)."),
    (
        "feature_chunk",
        int,
        0,
        ["--feature-chunk"],
        "Train on the features already stored and compute at most this many more per epoch "
        "(0: all before the first step); resumed where fewer are stored, each new chunk is "
        "trained on alone, until the store has caught up.",
    ),
    (
        "catch_up_passes",
        int,
        1,
        ["--catch-up-passes"],
        "Passes over each chunk of a catch-up, in a row (with 2 cores, a chunk's features cost "
        "about as much CPU as 3 passes of training on it).",
    ),
    ("batch_size", int, 4, ["--batch-size"], "Sequences per step (over all ranks)."),
    ("num_anchors", int, 32, ["--num-anchors"], "Blocks sampled per sequence."),
    ("max_len", int, 1024, ["--max-len"], "Truncate sequences to this many tokens."),
    (
        "epochs",
        float,
        1.0,
        ["--epochs"],
        "Passes over the data, the step budget without --max-steps: counted from the data's size at each "
        "start, so data added before a --resume lengthens the schedule.",
    ),
    ("max_steps", Optional[int], None, ["--max-steps"], None),
    ("time_limit", Optional[float], None, ["--time-limit"], "Wall seconds to train for; the schedule follows them."),
    (
        "core_hours",
        Optional[float],
        None,
        ["--core-hours"],
        "Stop after this much CPU time of training (all threads, summed over --resume); the schedule follows it.",
    ),
    ("lr", float, 0.0006, ["--lr"], None),
    ("warmup", float, 0.04, ["--warmup"], "Warmup fraction of the run's budget (steps, seconds or core-hours)."),
    ("weight_decay", float, 0.01, ["--weight-decay"], None),
    ("adam_beta2", float, 0.95, ["--adam-beta2"], "AdamW beta2 (0.95: short runs escape the unigram plateau)."),
    ("grad_clip", float, 1.0, ["--grad-clip"], None),
    (
        "ema",
        Optional[float],
        None,
        ["--ema"],
        "Keep an exponential moving average of the weights with this decay, in (0, 1) (0.998 for the long "
        "run): the held-out evaluations measure it and OUT's drafter is it; the checkpoint keeps the raw "
        "weights beside it. Off by default.",
    ),
    (
        "loss_vocab",
        str,
        "full",
        ["--loss-vocab"],
        "'full' vocabulary, or 'sampled': the batch's labels and teacher tokens plus --negatives others "
        "each step (cheaper).",
    ),
    ("negatives", int, 2048, ["--negatives"], "With --loss-vocab sampled: other tokens drawn each step."),
    ("checkpoint_every", int, 200, ["--checkpoint-every"], "Steps between checkpoints."),
    ("checkpoint_minutes", float, 5.0, ["--checkpoint-minutes"], "Also checkpoint after this many minutes."),
    ("eval_minutes", float, 10.0, ["--eval-minutes"], "Held-out greedy tau every this many minutes (0: off)."),
    ("eval_prompts", int, 8, ["--eval-prompts"], "Held-out prompts per periodic evaluation."),
    ("seed", int, 0, ["--seed"], None),
    ("resume", bool, False, ["--resume"], "Continue from OUT/checkpoint (a fresh start where there is none)."),
    (
        "resume_from",
        Optional[Path],
        None,
        ["--resume-from"],
        "Continue from this compact resume point (see --resume-point) when OUT has no checkpoint yet.",
    ),
    (
        "resume_point",
        Optional[Path],
        None,
        ["--resume-point"],
        "With every checkpoint, also write a compact copy here (float16 weights, bfloat16 AdamW moments, "
        "state and log) to commit, so that a new machine can --resume-from it.",
    ),
    ("no_progress", bool, False, ["--no-progress"], "Log lines instead of a progress bar."),
    ("threads", Optional[str], None, ["--threads"], THREADS_HELP),
]


def train_command(**values) -> None:
    """Train a DFlash (or DFlash2) drafter for a (frozen) target. Data-parallel under `mlx.launch`."""
    from dflash_mlx import parse_layer_ids
    from dflash_mlx.train.checkpoint import restore_resume_point
    from dflash_mlx.train.loop import TrainArgs, train
    from dflash_mlx.train.threads import parse_threads

    data, out, init_from, features = (values.pop(k) for k in ("data", "out", "init_from", "features"))
    resume_from, resume_point = values.pop("resume_from"), values.pop("resume_point")
    data_file = data / "train.jsonl" if data.is_dir() else data
    values["resume"] = values["resume"] or bool(resume_from)
    args = TrainArgs(
        data=str(data_file),
        out=str(out),
        target_layer_ids=parse_layer_ids(values.pop("target_layer_ids")),
        init_from=str(init_from) if init_from else None,
        features=str(features) if features else None,
        resume_point=str(resume_point) if resume_point else None,
        progress=not values.pop("no_progress"),
        threads=parse_threads(values.pop("threads")),
        **values,
    )
    args.check()  # before the data, the resume point or the model is looked at
    if not data_file.is_file():
        raise FileNotFoundError(f"no training data at {data_file}")
    if resume_from and not (out / "checkpoint" / "state.json").is_file():
        try:
            restore_resume_point(resume_from, out)
        except FileExistsError:  # under mlx.launch on one filesystem, another rank restored it first
            if not (out / "checkpoint" / "state.json").is_file():
                raise
    result = train(args, log=lambda s: typer.echo(s))
    typer.echo(
        f"trained {result['step']} steps in {result['elapsed']:.0f}s "
        f"({result['core_seconds'] / 3600:.3f} core-hours in all) -> {out}"
    )


train_command.__signature__ = options_signature(TRAIN_OPTIONS)  # what typer reads the options from


@decode_flags("block_size")
def eval_command(
    prompts: List[str] = typer.Option(
        ["heldout"],
        "--prompts",
        "-p",
        help="A prompt file (heldout.jsonl from `dflash data`, any JSONL or text), or a shipped held-out set: "
        "heldout (all 40), chat, code, math, stdlib. Repeatable.",
    ),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter (default: the shipped one)."),
    draft_vocab: Optional[str] = typer.Option(
        None, "--draft-vocab", help="Draft vocabulary file, or 'none' (default: the drafter's own, if any)."
    ),
    model: Optional[str] = typer.Option(None, "--model", help="Target model (default: SmolLM2-135M-Instruct)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-m"),
    temp: Optional[List[float]] = typer.Option(None, "--temp", help="Temperatures (repeatable; default 0 and 1)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use only the first N prompts."),
    seed: Optional[int] = typer.Option(None, "--seed", help="For the sampled temperatures (default 0)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the results here."),
    replay: bool = typer.Option(
        False,
        "--replay",
        help="Greedy tau only, by replaying the drafter along the target's greedy answers (what `dflash train` "
        "measures: same cycles, no decoding, no speed).",
    ),
    answers: Optional[Path] = typer.Option(
        None, "--answers", help="With --replay: keep the target's answers in this JSON file (made once, then read)."
    ),
    options: DecodeOptions = DecodeOptions(),
) -> None:
    """Mean acceptance length tau per prompt set, and the histogram of accepted lengths."""
    from dflash_mlx import load, load_draft, read_prompt_sources
    from dflash_mlx.train.evaluate import evaluate, format_results

    positive(max_tokens, "--max-tokens")
    positive(limit, "--limit")
    not_negative(seed, "--seed")
    writable(json_out, "--json")
    if answers is not None and not replay:  # else it would be silently ignored
        raise ValueError("--answers applies to --replay only")
    if replay and any(temp or []):  # --replay measures greedy tau: a sampled temperature would be ignored
        raise ValueError(f"--replay measures greedy tau only: drop --temp {max(temp):g}")
    if replay and seed is not None:
        raise ValueError("--seed applies to sampled temperatures, not to --replay (greedy): drop --seed")
    writable(answers, "--answers")
    check_pair(model)
    items = read_prompt_sources(prompts)[:limit]
    target, tokenizer = load(model)
    drafter = load_draft(draft, model=target, draft_vocab=draft_vocab)
    if replay:
        results = {"0": _replayed(target, tokenizer, drafter, items, max_tokens, options, answers)}
    else:
        results = evaluate(
            target,
            tokenizer,
            drafter,
            items,
            max_tokens=max_tokens,
            temps=temp or [0.0, 1.0],
            block_size=options.block_size,
            seed=seed or 0,
        )
    typer.echo(format_results(results))
    write_json(results, json_out)


def _replayed(target, tokenizer, drafter, items, max_tokens: int, options: DecodeOptions, answers) -> dict:
    """`dflash eval --replay`'s greedy results per kind (`train.replay`)."""
    from dflash_mlx.train.replay import references, replay_tau

    B = options.fixed(drafter).block_size
    layers = drafter.config.target_layer_ids
    refs = references(target, tokenizer, items, layers, max_tokens=max_tokens, block_size=B, answers=answers)
    return replay_tau(drafter, target, refs, max_tokens=max_tokens, block_size=B)


def curves_command(
    runs: List[Path] = typer.Argument(..., help="Training run directories (each with train_log.jsonl)."),
    target_tau: float = typer.Option(2.6, "--target-tau", help="Say what each run's line needs for this tau."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw the curves into this PNG (needs matplotlib)."),
) -> None:
    """Held-out tau against core-hours per run, fitted per doubling of compute: which recipe learns fastest."""
    from dflash_mlx.train.curves import curves_table, plot as draw, read_curve

    plottable(plot, "--plot")
    curves = {run.name: read_curve(run) for run in runs}
    typer.echo(curves_table(curves, target_tau))
    if plot:
        draw(curves, plot)
        typer.echo(f"plot -> {plot}")
