"""The target answers prompts: the chat template applied, `mlx_lm.batch_generate` in batches.

The single-turn data (`data`), the conversations (`conversations`) and the self-instruct
writer (`selfinstruct`) all have the target answer prompt records
(``{"id", "source", "messages", "prefill"?}``); this is the one place that does it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Optional, Sequence

from ..messages import apply_chat_template


def encode_prompt(tokenizer: Any, prompt: dict) -> list[int]:
    """The model input for a prompt record: its messages through the chat template (the
    assistant's turn opened), then its optional ``prefill``, text that the assistant's
    reply starts with (the instruction writer uses it to steer a small target)."""
    ids = apply_chat_template(tokenizer, prompt["messages"])
    if prompt.get("prefill"):
        ids = ids + list(tokenizer.encode(prompt["prefill"], add_special_tokens=False))
    return ids


def answer_text(tokenizer: Any, completion_ids: Sequence[int]) -> str:
    """The text of an answer, without its closing EOS."""
    ids = list(completion_ids)
    if ids and ids[-1] == getattr(tokenizer, "eos_token_id", None):
        ids = ids[:-1]
    return tokenizer.decode(ids)


def generate_answers(
    model: Any,
    tokenizer: Any,
    prompts: list[dict],
    max_tokens: int,
    batch_size: int = 32,
    max_prompt_tokens: int = 512,
    temp: float = 0.0,
    on_batch: Optional[Callable[[list[dict], float], None]] = None,
    poll: Optional[Callable[[], Any]] = None,
) -> Iterator[dict]:
    """Answer prompts with `mlx_lm.batch_generate` (greedy, or sampled at `temp`), yielding
    records. An answer that stopped at EOS ends with that EOS id, so the drafter also learns
    to predict the end. Each call hands the generator four batches of prompts: rows that
    finish early are refilled from the queue instead of idling until the batch is done.
    `poll` runs before every decode step (the thread control: see `threads`)."""
    from mlx_lm import batch_generate
    from mlx_lm.sample_utils import make_sampler

    eos = getattr(tokenizer, "eos_token_id", None)
    suffix = f"@t{temp:g}" if temp > 0 else ""
    chunk = 4 * batch_size
    sample = make_sampler(temp)

    def sampler(logits: Any) -> Any:
        if poll is not None:
            poll()
        return sample(logits)

    for start in range(0, len(prompts), chunk):
        batch = prompts[start : start + chunk]
        encoded = [encode_prompt(tokenizer, p)[-max_prompt_tokens:] for p in batch]
        t0 = time.perf_counter()
        resp = batch_generate(
            model,
            tokenizer,
            encoded,
            max_tokens=max_tokens,
            return_token_ids=True,
            completion_batch_size=batch_size,
            sampler=sampler,
        )
        dt = time.perf_counter() - t0
        records = []
        for p, ids, out in zip(batch, encoded, resp.token_ids):
            out = [int(t) for t in out]
            if eos is not None and len(out) < max_tokens:
                out.append(int(eos))
            records.append(
                {"id": p["id"] + suffix, "source": p["source"], "prompt_ids": ids, "completion_ids": out, "temp": temp}
            )
        if on_batch is not None:
            on_batch(records, dt)
        yield from records
