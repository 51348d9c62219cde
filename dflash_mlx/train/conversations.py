"""Multi-turn self-distillation: the target answers, writes the user's follow-up, answers again.

The chat keeps its KV cache across turns, so drafts run at long contexts with earlier
answers in them; single-turn data never shows the drafter that. Here each prompt becomes
a conversation of N user turns. After every answer the target writes the user's next
message (asked like the self-instruct writer, with the transcript so far; a follow-up
template when what it wrote is unusable or overlaps a held-out prompt), and then answers
with the whole conversation as context, exactly as the chat builds it: the chat template
over all messages, earlier answers as their text.

One record per conversation: its token sequence (the last context + the last answer) and
``answer_spans``, the [start, end) positions of every assistant turn's tokens written by
the target, so that training learns every answer and none of the user's turns. An
earlier answer whose tokens do not come back unchanged when the conversation is
re-encoded (rare: BPE does not always round-trip text) gets no span.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Iterator, Optional, Sequence

from .answers import answer_text, generate_answers
from .instructions import NearDuplicates, clean_instruction

FOLLOW_UPS = (
    "Can you give me an example?",
    "Can you explain that in simpler words?",
    "Thanks! Can you make it shorter?",
    "Why is that?",
    "What else should I know?",
    "Can you put that in a list?",
    "Could you add one more detail?",
    "That helps. What should I do first?",
    "Can you say more about the first point?",
    "Is there anything I should avoid?",
    "How would you say that to a child?",
    "Can you summarize that in one sentence?",
)
_OPENERS = ("Can you", "What", "How", "Why", "Could you", "Thanks! Can you", "I see. What", "Great, now")
_ASK = (
    "Here is a conversation between a user and an AI assistant.\n\n{transcript}\n\n"
    "Write the user's next message: a short follow-up question or request about the assistant's "
    "last reply. Write only the user's message."
)
_PREFILL = 'Here is the message:\n\n"'
FOLLOW_UP_TOKENS = 40  # a follow-up is one or two sentences


def follow_up_request(messages: Sequence[dict], rng: random.Random, max_chars: int = 600) -> dict:
    """A prompt record asking the target for the user's next message after `messages`
    (each message cut to its last `max_chars` characters), with a prefilled opener."""
    lines = [
        f"{m['role'].capitalize()}: {m['content'][-max_chars:].strip()}"
        for m in messages
        if m["role"] in ("user", "assistant")
    ]
    opener = rng.choice(_OPENERS)
    return {
        "id": "follow-up",
        "source": "follow-up",
        "opener": opener,
        "prefill": _PREFILL + opener,
        "messages": [{"role": "user", "content": _ASK.format(transcript="\n".join(lines))}],
    }


def conversation_record(prompt: dict, turns: Sequence[tuple[list[int], list[int]]], temp: float) -> dict:
    """The training record of a conversation from its (context ids, answer ids) per turn."""
    ctx, ans = turns[-1]
    full = list(ctx) + list(ans)
    spans = [[len(c), len(c) + len(a)] for c, a in turns if full[len(c) : len(c) + len(a)] == list(a)]
    first = spans[0][0]
    suffix = f"@t{temp:g}" if temp > 0 else ""
    return {
        "id": f"{prompt['id']}/turns{len(turns)}{suffix}",
        "source": prompt["source"],
        "prompt_ids": full[:first],
        "completion_ids": full[first:],
        "temp": temp,
        "turns": len(turns),
        "answer_spans": spans,
    }


def answer_conversations(
    model: Any,
    tokenizer: Any,
    prompts: list[dict],
    turns: int,
    max_tokens: int,
    batch_size: int = 32,
    temp: float = 0.0,
    heldout: Optional[NearDuplicates] = None,
    seed: int = 0,
    on_batch: Optional[Callable[[list[dict], float], None]] = None,
    poll: Optional[Callable[[], Any]] = None,
) -> Iterator[dict]:
    """Conversations of `turns` user turns from `prompts` (see the module docstring),
    four batches at a time, turn by turn; yields one record per conversation. Follow-ups
    are sampled at T=0.8 whatever `temp` the answers use; `heldout` keeps held-out user
    messages out of them."""
    if turns < 1:
        raise ValueError(f"--turns must be >= 1, got {turns}")
    chunk = 4 * batch_size
    for start in range(0, len(prompts), chunk):
        group = prompts[start : start + chunk]
        rng = random.Random(f"{seed}/{group[0]['id']}")
        convs = [list(p["messages"]) for p in group]
        done: list[list[tuple[list[int], list[int]]]] = [[] for _ in group]
        for turn in range(turns):
            if turn:
                _add_follow_ups(model, tokenizer, convs, batch_size, heldout, rng, poll)
            asks = [{"id": p["id"], "source": p["source"], "messages": c} for p, c in zip(group, convs)]
            for conv, past, rec in zip(
                convs,
                done,
                generate_answers(
                    model,
                    tokenizer,
                    asks,
                    max_tokens,
                    batch_size,
                    max_prompt_tokens=1 << 16,
                    temp=temp,
                    on_batch=on_batch,
                    poll=poll,
                ),
            ):
                past.append((rec["prompt_ids"], rec["completion_ids"]))
                conv.append({"role": "assistant", "content": answer_text(tokenizer, rec["completion_ids"])})
        for p, past in zip(group, done):
            yield conversation_record(p, past, temp)


def _add_follow_ups(
    model: Any,
    tokenizer: Any,
    convs: list[list[dict]],
    batch_size: int,
    heldout: Optional[NearDuplicates],
    rng: random.Random,
    poll: Optional[Callable[[], Any]],
) -> None:
    """Append the user's next message to every conversation (target-written or a template)."""
    asks = [follow_up_request(c, rng) for c in convs]
    outs = generate_answers(model, tokenizer, asks, FOLLOW_UP_TOKENS, batch_size, temp=0.8, poll=poll)
    for conv, ask, rec in zip(convs, asks, outs):
        text = clean_instruction(ask["opener"] + answer_text(tokenizer, rec["completion_ids"]))
        if text is None or (heldout is not None and heldout.match(text)):
            text = rng.choice(FOLLOW_UPS)
        conv.append({"role": "user", "content": text})
