"""`dflash adapt`: a drafter fine-tuned on the user's own conversations, kept only where it
drafts better on those held back (`dflash_mlx.train.adapt`). Registered in main.py."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from app.cli.common import check_pair, positive
from app.cli.train import THREADS_HELP


def adapt_command(
    sources: List[str] = typer.Argument(
        ...,
        metavar="SOURCE",
        help="Directories of chat transcripts (what /save writes, *.md) and conversation logs "
        "(conversations-*.jsonl), or prompt files (JSONL or text, one prompt a line).",
    ),
    out: Optional[Path] = typer.Option(
        None,
        "--out",
        "-o",
        help="The new drafter's directory (default: <drafter>-adapted beside the drafter, or in the cache's "
        "drafters/ for the shipped one); written only where tau rose.",
    ),
    draft: Optional[str] = typer.Option(None, "--draft", help="The drafter to adapt (default: the shipped one)."),
    model: Optional[str] = typer.Option(None, "--model", help="Target model (default: SmolLM2-135M-Instruct)."),
    minutes: float = typer.Option(
        10.0, "--minutes", help="Wall time of training (the answers and features come first)."
    ),
    heldback: float = typer.Option(
        0.2, "--heldback", help="Share of the conversations held back to measure tau on (at least one)."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Insist on resuming an interrupted run (one of the same conversations resumes anyway)."
    ),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Also stop after this many steps."),
    lr: float = typer.Option(2e-4, "--lr", help="Peak learning rate (small: the drafter is trained already)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", help="Tokens of each answer the target writes."),
    seed: int = typer.Option(0, "--seed", help="Which conversations are held back, and the training order."),
    threads: Optional[str] = typer.Option(None, "--threads", help=THREADS_HELP),
    no_progress: bool = typer.Option(False, "--no-progress", help="Log lines instead of progress bars."),
) -> None:
    """Fine-tune a drafter on your own conversations for a few minutes; keep it only where
    its tau on held-back conversations rose. Decoding stays lossless whichever drafter is used."""
    from dflash_mlx.train.adapt import adapt
    from dflash_mlx.train.adapt_plan import AdaptArgs
    from dflash_mlx.train.threads import parse_threads

    positive(max_steps, "--max-steps")
    check_pair(model)
    args = AdaptArgs(
        sources=list(sources),
        out=str(out) if out else None,
        draft=draft,
        model=model,
        minutes=minutes,
        heldback=heldback,
        resume=resume,
        max_steps=max_steps,
        lr=lr,
        max_tokens=max_tokens,
        seed=seed,
        progress=not no_progress,
        threads=parse_threads(threads),
    )
    adapt(args, log=lambda line: typer.echo(line))
