"""`dflash adapt`: a short fine-tune of a drafter on the user's own conversations.

A drafter only changes speed, never output (the target verifies every token), so a drafter
tuned to the user's kind of text is safe to use: at worst it is slower, and then it is not
kept. `adapt_plan.plan` checks the run before any work; `adapt` runs it:

1. **Conversations** (`transcripts.read_conversations`): chat transcripts, conversation logs,
   prompt files. Every user turn, with the conversation before it, is a prompt. A share of
   the conversations (`--heldback`, at least one) is held back, whole, to measure on.
2. **The target answers every prompt again**, greedily, through the data writer
   (`data.write_answers`, `answers.generate_answers`). The answers already in a transcript
   are not trained on, even where it names this target: a drafter learns to predict the
   target's greedy tokens, the ones it is verified against, while a transcript's answers may
   be sampled (`/temp`), stopped, cut at `/max`, written under another system prompt or by
   another model (its model line is a display name, not proof), and a log's reply may come
   from any server. The held-back measurement needs the greedy answers anyway, and a user's
   conversations are few. What the conversations give is the user's text: the prompts and
   the context each turn had, earlier replies included.
3. **Training** is `dflash train --init-from` the drafter (`loop.Trainer`): the target's
   features once into the trainer's store, a small learning rate, `--minutes` of wall time,
   checkpoints a minute apart in the scratch directory (an interrupted run resumes there).
4. **A paired measurement** (`replay`): greedy tau of the old drafter and of the new one,
   replayed along the same held-back answers. The new drafter is written (all at once) only
   where tau rose; the scratch is removed either way.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

from .adapt_plan import AdaptArgs, Plan, make_record, plan, save_manifest, verdict, write_adapted
from .transcripts import prompt_id

#: Prompts the target answers together (and how often the answers' progress moves).
ANSWER_BATCH = 8


def adapt(args: AdaptArgs, log: Callable[[str], None] = print) -> dict:
    """Adapt a drafter to conversations (see the module docstring). Returns {"kept",
    "tau_before", "tau_after", "out" (None where nothing was written), "line" (the verdict)}."""
    p = plan(args, log)
    log(p.describe())
    try:
        return run_plan(p, log)
    except KeyboardInterrupt:
        log(f"interrupted: the same command resumes from {p.scratch}")
        raise


def run_plan(p: Plan, log: Callable[[str], None] = print) -> dict:
    """Run a checked adapt run: answers, the old drafter's tau, training, the new drafter's
    tau, and the new drafter written where tau rose."""
    from ..drafter2 import Drafter2Config
    from ..loading import load, load_draft
    from .loop import Trainer
    from .threads import ThreadControl

    model, tokenizer = load(p.args.model)
    old = load_draft(str(p.draft_dir), model=model)
    train, held, counts = fitting_prompts(p, tokenizer)
    save_manifest(p)  # the scratch is there from now on
    control = ThreadControl(p.args.threads)
    train_records = answer(p, model, tokenizer, train, p.scratch / "train.jsonl", control, log)
    held_records = answer(p, model, tokenizer, held, p.scratch / "heldback.jsonl", control, log)
    refs = held_references(model, tokenizer, old, held_records, p.args.max_tokens)
    if "tau_before" not in p.manifest:
        log(f"measuring the old drafter on {len(refs)} held-back prompts")
        p.manifest["tau_before"] = replayed_tau(old, model, refs, p.args.max_tokens)
        save_manifest(p)
    before = p.manifest["tau_before"]
    log(f"old drafter: tau {before:.2f}; training on {len(train_records)} answers")
    arch = "dflash2" if isinstance(old.config, Drafter2Config) else "dflash1"
    args = p.args.train_args(p.scratch, p.draft_dir, arch, old.config.block_size)
    trained = Trainer(args, log, loaded=(model, tokenizer)).run()
    new = trained["drafter"]
    new.use_draft_vocab(old.draft_vocab)  # measured as it will decode: with the old drafter's vocabulary
    log(f"measuring the new drafter on {len(refs)} held-back prompts")
    after = replayed_tau(new, model, refs, p.args.max_tokens)
    kept = after > before
    if kept:
        write_adapted(p, new, make_record(p, counts, before, after, trained))
    shutil.rmtree(p.scratch)
    line = verdict(p, before, after)
    log(line)
    return {"kept": kept, "tau_before": before, "tau_after": after, "out": str(p.out) if kept else None, "line": line}


def fitting_prompts(p: Plan, tokenizer: Any) -> tuple[list[dict], list[dict], dict]:
    """(training prompt records, held-back prompt records, counts): every prompt whose
    chat-templated tokens leave room for an answer of `max_tokens` within `max_len`. Raises a
    one-line error when no training or no held-back prompt fits."""
    from ..messages import apply_chat_template

    room = p.args.max_len - p.args.max_tokens
    kept: dict[str, list[dict]] = {"train": [], "heldback": []}
    left_out = 0
    for part, conversations in (("train", p.train), ("heldback", p.heldback)):
        for c in conversations:
            for messages in c.prompts:
                if len(apply_chat_template(tokenizer, messages)) > room:
                    left_out += 1
                    continue
                kept[part].append({"id": prompt_id(messages), "source": c.kind, "messages": list(messages)})
        if not kept[part]:
            which = "to train on" if part == "train" else "held back"
            raise ValueError(f"SOURCE: no prompt {which} is shorter than {room} tokens (--max-tokens leaves that room)")
    return kept["train"], kept["heldback"], {**{k: len(v) for k, v in kept.items()}, "left_out": left_out}


def answer(
    p: Plan, model: Any, tokenizer: Any, prompts: list[dict], path: Path, control: Any, log: Callable[[str], None]
) -> list[dict]:
    """The target's greedy answers to `prompts`, written to `path` by the data writer (those
    already there, from an interrupted run, are kept), in the prompts' order."""
    from .answers import generate_answers
    from .data import iter_records, write_answers

    done = {r["id"] for r in iter_records(path)} if path.is_file() else set()
    todo = [r for r in prompts if r["id"] not in done]
    a = p.args

    def batches(on_batch: Callable[[list[dict], float], None]) -> Iterator[dict]:
        for i in range(0, len(todo), ANSWER_BATCH):  # a batch at a time: progress after each
            batch = todo[i : i + ANSWER_BATCH]
            yield from generate_answers(
                model, tokenizer, batch, a.max_tokens, ANSWER_BATCH, a.max_len, on_batch=on_batch, poll=control.poll
            )

    if todo:
        log(f"the target answers {len(todo)} prompts ({path.name})")
        write_answers(path, batches, len(prompts), len(prompts) - len(todo), a.progress, log)
    records = {r["id"]: r for r in iter_records(path)}
    return [records[r["id"]] for r in prompts]


def held_references(model: Any, tokenizer: Any, drafter: Any, records: list[dict], max_tokens: int) -> list:
    """The replay references (`replay.reference`) of the held-back answers: each prompt, the
    target's answer and the target's features along both, at the drafter's layers."""
    from ..targets import make_target
    from .replay import reference

    target = make_target(model, drafter.config.target_layer_ids)
    eos = set(tokenizer.eos_token_ids)
    return [reference(target, r["source"], r["prompt_ids"], r["completion_ids"], eos, max_tokens) for r in records]


def replayed_tau(drafter: Any, model: Any, refs: list, max_tokens: int) -> float:
    """Greedy tau of `drafter` on the held-back references, at its own block size."""
    from .replay import replay_tau

    block = drafter.config.block_size
    return replay_tau(drafter, model, refs, max_tokens=max_tokens, block_size=block)["all"]["tau"]
