"""Self-distillation data for drafter training: prompts answered by the target itself.

The target answers every prompt (chat template applied) in batches, greedily or sampled at
a temperature. The result is a JSONL file of token sequences, one record per line::

    {"id": ..., "source": ..., "prompt_ids": [...], "completion_ids": [...], "temp": ...}

Held-out prompts (never answered, never trained on) go to a separate ``heldout.jsonl``
with their messages, for `dflash eval`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from ..messages import apply_chat_template
from .prompts import collect_prompts, split_heldout


def generate_answers(model: Any, tokenizer: Any, prompts: list[dict], max_tokens: int,
                     batch_size: int = 32, max_prompt_tokens: int = 512, temp: float = 0.0,
                     on_batch: Optional[Callable[[list[dict], float], None]] = None) -> Iterator[dict]:
    """Answer prompts with `mlx_lm.batch_generate` (greedy, or sampled at `temp`), yielding
    records. An answer that stopped at EOS ends with that EOS id, so the drafter also learns
    to predict the end. Each call hands the generator four batches of prompts: rows that
    finish early are refilled from the queue instead of idling until the batch is done."""
    from mlx_lm import batch_generate
    from mlx_lm.sample_utils import make_sampler

    eos = getattr(tokenizer, "eos_token_id", None)
    suffix = f"@t{temp:g}" if temp > 0 else ""
    chunk = 4 * batch_size
    for start in range(0, len(prompts), chunk):
        batch = prompts[start: start + chunk]
        encoded = [apply_chat_template(tokenizer, p["messages"])[-max_prompt_tokens:] for p in batch]
        t0 = time.perf_counter()
        resp = batch_generate(model, tokenizer, encoded, max_tokens=max_tokens, return_token_ids=True,
                              completion_batch_size=batch_size, sampler=make_sampler(temp))
        dt = time.perf_counter() - t0
        records = []
        for p, ids, out in zip(batch, encoded, resp.token_ids):
            out = [int(t) for t in out]
            if eos is not None and len(out) < max_tokens:
                out.append(int(eos))
            records.append({"id": p["id"] + suffix, "source": p["source"], "prompt_ids": ids,
                            "completion_ids": out, "temp": temp})
        if on_batch is not None:
            on_batch(records, dt)
        yield from records


def build_dataset(out_dir: str | Path, sources: Sequence[str] = ("chat", "math", "stdlib", "humaneval"),
                  model_path: Optional[str] = None, num_prompts: Optional[int] = None,
                  heldout: int = 40, max_tokens: int = 160, batch_size: int = 32, seed: int = 0,
                  temp: float = 0.0, log: Callable[[str], None] = print) -> dict:
    """Write ``train.jsonl`` (appended batch by batch, so training can start on partial
    data), ``heldout.jsonl`` and ``meta.json`` under out_dir. Resumes: prompts whose id is
    already in train.jsonl are skipped. Runs at several temperatures append to the same
    file (sampled answers get ids ``<prompt id>@t<temp>``)."""
    import mlx.core as mx

    from ..loading import load

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = collect_prompts(sources, seed)
    held_file = out_dir / "heldout.jsonl"
    if held_file.is_file():
        # resuming: the held-out set stays exactly as first written, and out of training
        held = [json.loads(line) for line in held_file.read_text().splitlines() if line.strip()]
        held_ids = {p["id"] for p in held}
        train, _ = split_heldout([p for p in prompts if p["id"] not in held_ids], 0, seed)
    else:
        train, held = split_heldout(prompts, heldout, seed)
        with open(held_file, "w") as fh:
            for p in held:
                fh.write(json.dumps(p) + "\n")
    if num_prompts is not None:
        train = train[:num_prompts]
    train_file = out_dir / "train.jsonl"
    done = {r["id"] for r in iter_records(train_file)} if train_file.exists() else set()
    suffix = f"@t{temp:g}" if temp > 0 else ""
    todo = [p for p in train if p["id"] + suffix not in done]
    meta = {"sources": list(sources), "model": model_path or "default", "max_tokens": max_tokens,
            "heldout": len(held), "train_prompts": len(train), "seed": seed, "temp": temp}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    log(f"{len(prompts)} prompts: {len(train)} train ({len(done)} done), {len(held)} held out")
    model, tokenizer = load(model_path)
    mx.random.seed(seed + len(done))
    stats = {"tokens": 0, "seconds": 0.0, "records": len(done)}

    def on_batch(records: list[dict], dt: float) -> None:
        n = sum(len(r["completion_ids"]) for r in records)
        stats["tokens"] += n
        stats["seconds"] += dt
        stats["records"] += len(records)
        log(f"{stats['records']}/{len(train)} answered, {n / dt:.0f} tok/s this batch, "
            f"{stats['tokens']} tokens in {stats['seconds']:.0f}s")

    with open(train_file, "a") as fh:
        for rec in generate_answers(model, tokenizer, todo, max_tokens, batch_size, temp=temp,
                                    on_batch=on_batch):
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
    return stats


def iter_records(path: str | Path) -> Iterator[dict]:
    """Records of a train.jsonl; a partly written last line is skipped."""
    with open(path) as fh:
        for line in fh:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def load_sequences(path: str | Path, min_completion: int = 2) -> list[tuple[str, list[int], int]]:
    """(record id, prompt + completion token ids, prompt length) for every usable record."""
    out = []
    for r in iter_records(path):
        if len(r["completion_ids"]) >= min_completion:
            out.append((str(r["id"]), list(r["prompt_ids"]) + list(r["completion_ids"]), len(r["prompt_ids"])))
    return out
