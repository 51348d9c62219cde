"""The `dflash draft-vocab` command (registered in main.py): a draft vocabulary from the
target's own answers. Heavy imports happen inside it so that `dflash --help` stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from app.cli.common import check_pair, writable


def draft_vocab_command(
    data: List[Path] = typer.Option(
        ..., "--data", "-d", help="train.jsonl from `dflash data` (or its directory). Repeatable."
    ),
    out: Path = typer.Option(
        ..., "--out", "-o", help="A drafter directory (writes draft_vocab.json into it) or a file path."
    ),
    size: Optional[int] = typer.Option(
        None,
        "--size",
        help="Keep this many most frequent tokens (past the counted ones: the lowest ids, BPE's most frequent merges).",
    ),
    coverage: Optional[float] = typer.Option(
        None, "--coverage", help="Keep the most frequent tokens up to this share of all."
    ),
    model: Optional[str] = typer.Option(
        None, "--model", help="Target model, for its EOS and chat-template tokens (default: SmolLM2)."
    ),
) -> None:
    """Build a draft vocabulary from the target's own answers: the drafter then scores only
    those tokens (cheaper drafts; decoding stays lossless)."""
    from collections import Counter

    from dflash_mlx.draft_vocab import build_draft_vocab, check_vocab_choice, save_draft_vocab
    from dflash_mlx import apply_chat_template, load
    from dflash_mlx.targets import make_target
    from dflash_mlx.train.data import answer_spans, iter_records

    check_vocab_choice(size, coverage)
    if not (out.is_dir() or out.suffix == ".json"):
        raise ValueError(f"--out must be a drafter directory or a .json file, got {out}")
    writable(None if out.is_dir() else out, "--out")
    check_pair(model)
    files = [d / "train.jsonl" if d.is_dir() else d for d in data]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"--data: no training data at {file}")
    counts: Counter = Counter()
    for file in files:
        for rec in iter_records(file):  # the target-written tokens only (not a conversation's user turns)
            seq = rec["prompt_ids"] + rec["completion_ids"]
            for s, e in answer_spans(rec):
                counts.update(seq[s:e])
    target, tokenizer = load(model)
    eos = sorted(set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id]))
    turn = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    specials = set(apply_chat_template(tokenizer, turn)) & set(getattr(tokenizer, "all_special_ids", []) or [])
    ids, covered = build_draft_vocab(
        counts, size=size, coverage=coverage, required=set(eos) | specials, vocab_size=make_target(target).vocab_size
    )
    file = save_draft_vocab(ids, out, eos, covered, source=", ".join(str(d) for d in data))
    typer.echo(f"{len(ids)} tokens covering {covered:.1%} of {sum(counts.values())} answer tokens -> {file}")
