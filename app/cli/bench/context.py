"""`dflash bench context`: decode speed and tau against the length of the context.

Drafters are trained on short contexts and their own context cache grows with the
conversation, so what a long chat or an agent sees is not what short prompts measure. Each
prompt here is real text (the standard library's documentation, as `pydoc` renders it), cut
to a given number of tokens, followed by a question about it. Plain mlx-lm and ours answer
each at every length; decode tokens/s counts the tokens after the first (prefill apart, as
time to first token), and the draft cost alone is timed at each length (`draft_milliseconds`).
"""

from __future__ import annotations

import pydoc
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from dflash_mlx import apply_chat_template, tau, user_messages

from .drafters import draft_milliseconds
from .speed import _clock

DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 7000)
MODULES = ("json", "pathlib", "collections", "functools", "itertools", "argparse", "textwrap", "datetime", "re")
QUESTIONS = (
    "Summarize what the documentation above describes, in three sentences.",
    "Write a short Python example that uses one function documented above.",
    "List five functions documented above and say what each does.",
    "Explain the most important class documented above to a beginner.",
)


def documentation(tokenizer: Any, tokens: int) -> str:
    """The first `tokens` tokens of the standard library's documentation (`MODULES`), as text."""
    ids: list[int] = []
    for name in MODULES:
        ids += tokenizer.encode(pydoc.render_doc(name, renderer=pydoc.plaintext), add_special_tokens=False)
        if len(ids) >= tokens:
            break
    return tokenizer.decode(ids[:tokens])


def _row(context: int, prompt_tokens: int, plain: list[tuple], ours: list[tuple], draft_ms: float) -> dict:
    """One context length's numbers from (tokens, ttft, decode seconds, stats) per prompt."""

    def speed(runs: list[tuple]) -> float:
        return sum(len(r[0]) - 1 for r in runs) / sum(r[2] for r in runs)

    cycles = sum(r[3].cycles for r in ours)
    return {
        "context": context,
        "prompt_tokens": prompt_tokens,
        "prompts": len(plain),
        "mlx_lm_tokens_per_second": round(speed(plain), 2),
        "ours_tokens_per_second": round(speed(ours), 2),
        "speedup": round(speed(ours) / speed(plain), 2),
        "tau": round(tau(sum(r[3].committed for r in ours), cycles), 2) if cycles else None,
        "mlx_lm_ttft_s": round(sum(r[1] for r in plain) / len(plain), 2),
        "ours_ttft_s": round(sum(r[1] for r in ours) / len(ours), 2),
        "draft_ms": draft_ms,
        "same_tokens_as_mlx_lm": all(p[0] == o[0] for p, o in zip(plain, ours)),
    }


def run_context_bench(
    model_path: Optional[str] = None,
    draft_path: Optional[str] = None,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    questions: Sequence[str] = QUESTIONS,
    max_tokens: int = 128,
    progress: Optional[Callable[[str], None]] = None,
    on_row: Optional[Callable[[dict], None]] = None,
) -> dict:
    """Plain mlx-lm and ours (default options: adaptive, one fresh policy per length) on
    every question after each length of documentation (`on_row` gets each length's row as
    it is done: long contexts take long on a CPU). Returns a JSON-able report."""
    import mlx_lm

    from dflash_mlx import default_model_path, load, load_draft, make_policy, stream_generate

    model_dir = model_path or str(default_model_path())
    model, tokenizer = load(model_dir)
    drafter = load_draft(draft_path, model=model)
    rows = []
    for context in contexts:
        text, policy, plain, ours = documentation(tokenizer, context), make_policy(model, drafter), [], []
        lengths = []
        for i, question in enumerate(questions):
            prompt = apply_chat_template(tokenizer, user_messages(f"{text}\n\n{question}"))
            lengths.append(len(prompt))
            if progress:
                progress(f"context {context}: question {i + 1}/{len(questions)}")
            stream = mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)
            chunks, seconds, _, ttft = _clock(stream, lambda r: [r.token])
            plain.append(([t for c in chunks for t in c], ttft, seconds, None))
            stream = stream_generate(model, tokenizer, prompt, drafter, max_tokens=max_tokens, policy=policy)
            chunks, seconds, last, ttft = _clock(stream, lambda r: [r.token])
            ours.append(([t for c in chunks for t in c], ttft, seconds, last.stats))
        draft_ms = draft_milliseconds(model, drafter, context)
        rows.append(_row(context, round(sum(lengths) / len(lengths)), plain, ours, draft_ms))
        if on_row:
            on_row(rows[-1])
    return {"model": model_dir, "max_tokens": max_tokens, "results": rows}


def context_header(max_tokens: int) -> list[str]:
    """The table's head (what the rows measure)."""
    return [
        f"max {max_tokens} new tokens, greedy; decode tok/s after the first token, time to first token (TTFT) apart",
        "",
        "| context (tokens) | prompt tokens | prompts | mlx-lm tok/s | ours tok/s | speedup | tau "
        "| mlx-lm TTFT s | ours TTFT s | draft ms | same tokens |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]


def context_line(r: dict) -> str:
    """One context length's row of the table."""
    return (
        f"| {r['context']} | {r['prompt_tokens']} | {r['prompts']} | {r['mlx_lm_tokens_per_second']:.1f} | "
        f"{r['ours_tokens_per_second']:.1f} | {r['speedup']:.2f}x | {r['tau'] or '-'} | {r['mlx_lm_ttft_s']:.2f} "
        f"| {r['ours_ttft_s']:.2f} | {r['draft_ms']:.1f} | {'yes' if r['same_tokens_as_mlx_lm'] else 'NO'} |"
    )


def context_table(report: dict) -> str:
    """The report as a markdown table, one row per context length."""
    return "\n".join(context_header(report["max_tokens"]) + [context_line(r) for r in report["results"]])


def plot_context(rows: Sequence[dict], path: str | Path) -> None:
    """Decode tokens/s of both (left) and tau (right) against context length, as a PNG."""
    from dflash_mlx.train.curves import pyplot

    plt = pyplot()
    rows = sorted(rows, key=lambda r: r["context"])
    x = [r["context"] for r in rows]
    fig, (speed, acceptance) = plt.subplots(1, 2, figsize=(9, 3.6))
    speed.plot(x, [r["mlx_lm_tokens_per_second"] for r in rows], "o-", label="mlx-lm")
    speed.plot(x, [r["ours_tokens_per_second"] for r in rows], "o-", label="dflash-mlx")
    speed.set_ylabel("decode tokens/s (after the first)")
    speed.set_ylim(bottom=0)
    speed.legend(fontsize=8)
    acceptance.plot(x, [r["tau"] or 0 for r in rows], "o-", color="C2")
    acceptance.set_ylabel("tau (tokens per cycle)")
    acceptance.set_ylim(bottom=1)
    for ax in (speed, acceptance):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens of documentation)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
