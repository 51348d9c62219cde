"""Self-distillation data for drafter training: prompts answered by the target itself.

The target answers every prompt (chat template applied) in batches, greedily or sampled at
a temperature. The result is a JSONL file of token sequences, one record per line::

    {"id": ..., "source": ..., "prompt_ids": [...], "completion_ids": [...], "temp": ...}

A conversation (``--turns``, `conversations`) is one record whose sequence holds several
answers; its ``answer_spans`` say which tokens the target wrote. Held-out prompts (never
answered, never trained on) go to a separate ``heldout.jsonl`` with their messages, for
`dflash eval`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from ..atomic import write_text_atomic
from .answers import generate_answers
from .conversations import answer_conversations
from .instructions import NearDuplicates, normalize
from .prompts import split_heldout
from .sources import collect_prompts


def split_prompts(out_dir: Path, prompts: list[dict], heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held out) prompts. The first run writes ``heldout.jsonl``; later runs (a
    resume, another temperature, seed or sources) keep exactly that held-out set, and out
    of training by id and by text (another seed draws other texts under the same ids)."""
    held_file = out_dir / "heldout.jsonl"
    if held_file.is_file():
        held = [json.loads(line) for line in held_file.read_text().splitlines() if line.strip()]
        held_ids, held_texts = {p["id"] for p in held}, set().union(*map(_user_texts, held))
        kept = [p for p in prompts if p["id"] not in held_ids and not _user_texts(p) & held_texts]
        train, _ = split_heldout(kept, 0, seed)
        return train, held
    train, held = split_heldout(prompts, heldout, seed)
    write_text_atomic(held_file, "".join(json.dumps(p) + "\n" for p in held))  # a partial set would leak the rest
    return train, held


def _user_texts(prompt: dict) -> set[str]:
    """A prompt's user messages, normalised (`instructions.normalize`)."""
    return {normalize(str(m["content"])) for m in prompt["messages"] if m["role"] == "user"}


def build_dataset(
    out_dir: str | Path,
    sources: Sequence[str] = ("chat", "math", "stdlib", "humaneval"),
    model_path: Optional[str] = None,
    num_prompts: Optional[int] = None,
    heldout: int = 40,
    max_tokens: int = 160,
    batch_size: int = 32,
    seed: int = 0,
    temp: float = 0.0,
    log: Callable[[str], None] = print,
    *,
    turns: int = 1,
    threads: Optional[int | str] = None,
    progress: bool = False,
) -> dict:
    """Write ``train.jsonl`` (appended batch by batch, so training can start on partial
    data), ``heldout.jsonl`` and ``meta.json`` under out_dir. Resumes: prompts whose id is
    already in train.jsonl are skipped. Runs at several temperatures append to the same
    file (sampled answers get ids ``<prompt id>@t<temp>``). With `turns` > 1 every prompt
    becomes a conversation (`conversations`; ids ``<prompt id>/turns<N>``)."""
    import mlx.core as mx

    from ..loading import load
    from .threads import ThreadControl

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = collect_prompts(sources, seed)
    train, held = split_prompts(out_dir, prompts, heldout, seed)
    if num_prompts is not None:
        train = train[:num_prompts]
    train_file = out_dir / "train.jsonl"
    done = {r["id"] for r in iter_records(train_file)} if train_file.exists() else set()
    suffix = (f"/turns{turns}" if turns > 1 else "") + (f"@t{temp:g}" if temp > 0 else "")
    todo = [p for p in train if p["id"] + suffix not in done]
    meta = {
        "sources": list(sources),
        "model": model_path or "default",
        "max_tokens": max_tokens,
        "heldout": len(held),
        "train_prompts": len(train),
        "seed": seed,
        "temp": temp,
        "turns": turns,
    }
    write_text_atomic(out_dir / "meta.json", json.dumps(meta, indent=2) + "\n")
    model, tokenizer = load(model_path)
    control = ThreadControl(threads)
    log(
        f"{len(prompts)} prompts: {len(train)} train ({len(train) - len(todo)} done), {len(held)} held out; "
        f"{control.describe()}"
    )
    mx.random.seed(seed + len(done))

    def answer(on_batch: Callable[[list[dict], float], None]) -> Iterator[dict]:
        return _answers(model, tokenizer, todo, held, turns, max_tokens, batch_size, temp, seed, on_batch, control.poll)

    return write_answers(train_file, answer, len(train), len(train) - len(todo), progress, log)


def write_answers(
    train_file: Path,
    answer: Callable[[Callable[[list[dict], float], None]], Iterator[dict]],
    total: int,
    done: int,
    progress: bool,
    log: Callable[[str], None],
) -> dict:
    """Append the records `answer(on_batch)` yields to `train_file`, one line each, flushed
    as they come (a run stopped midway keeps every whole line), showing progress over
    `total` records of which `done` were written before (a bar, or a log line per batch).
    Returns {"records", "tokens", "seconds", "line"}."""
    from .progress import StepBar

    stats: dict = {"tokens": 0, "seconds": 0.0, "records": done, "line": ""}
    bar = StepBar(total, done, progress, "answers")

    def on_batch(records: list[dict], dt: float) -> None:
        n = sum(len(r["completion_ids"]) for r in records)
        stats["tokens"] += n
        stats["seconds"] += dt
        stats["line"] = f"{n / dt:.0f} tok/s this batch, {stats['tokens']} tokens in {stats['seconds']:.0f}s"
        bar.update(stats["records"], stats["line"])
        if not progress:
            log(f"{stats['records'] + len(records)}/{total} answered, {stats['line']}")

    with bar, open(train_file, "a") as fh:
        for rec in answer(on_batch):
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            stats["records"] += 1
            bar.update(stats["records"], stats["line"])
    return stats


def _answers(model, tokenizer, todo, held, turns, max_tokens, batch_size, temp, seed, on_batch, poll) -> Iterator[dict]:
    """The target's answers to `todo` (see `build_dataset`): one each, or with `turns` > 1
    whole conversations, whose later user turns keep clear of the held-out prompts."""
    if turns <= 1:
        return generate_answers(model, tokenizer, todo, max_tokens, batch_size, temp=temp, on_batch=on_batch, poll=poll)
    held_users = NearDuplicates(m["content"] for p in held for m in p["messages"] if m["role"] == "user")
    return answer_conversations(
        model, tokenizer, todo, turns, max_tokens, batch_size, temp, held_users, seed, on_batch=on_batch, poll=poll
    )


def iter_records(path: str | Path) -> Iterator[dict]:
    """Records of a train.jsonl; a partly written last line is skipped."""
    with open(path) as fh:
        for line in fh:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def answer_spans(record: dict) -> list[tuple[int, int]]:
    """The target-written [start, end) spans of a record's token sequence (prompt +
    completion): one per assistant turn of a conversation (``answer_spans``), else the
    whole completion."""
    if "answer_spans" in record:
        return [(int(s), int(e)) for s, e in record["answer_spans"]]
    n = len(record["prompt_ids"])
    return [(n, n + len(record["completion_ids"]))]


def load_sequences(path: str | Path, min_completion: int = 2) -> list[tuple[str, list[int], list[tuple[int, int]]]]:
    """(record id, prompt + completion token ids, target-written spans) for every usable
    record."""
    out = []
    for r in iter_records(path):
        spans = [(s, e) for s, e in answer_spans(r) if e - s >= min_completion]
        if spans:
            out.append((str(r["id"]), list(r["prompt_ids"]) + list(r["completion_ids"]), spans))
    return out
