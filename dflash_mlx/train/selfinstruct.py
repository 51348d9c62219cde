"""Self-instruct: the target writes the chat prompts it is then asked to answer.

Chat is where the drafter is weakest, and the built-in chat prompts come from a few dozen
templates. Here the target itself writes user messages: each request names a kind
(question, email, recipe, story, ...), a topic from that kind's pool and a style, all
drawn from a seeded generator, and asks for one message "a user might send to an AI
assistant". A 135M target mostly answers such a request instead of writing one, so the
assistant's reply is prefilled with ``Here is the message: "`` and the message's first
words (an opener of that kind); the target writes the rest (measured on SmolLM2-135M:
without the prefill most replies were answers, with it most are usable messages).

Outputs are cleaned to one message and deduplicated (`instructions`), and kept out of
the evaluation: a message that equals or nearly equals any held-out user message is
dropped. The result is a
prompt JSONL that `dflash data --source FILE` answers; a log beside it records every
request (kept or why not), which makes the writer resumable.
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Optional

from .answers import answer_text, generate_answers
from .data import iter_records
from .instructions import NearDuplicates, clean_instruction

_TOPICS = (
    "volcanoes",
    "black holes",
    "the human heart",
    "bees",
    "the Roman Empire",
    "electric cars",
    "sleep",
    "the ocean floor",
    "money and banks",
    "the weather",
    "dinosaurs",
    "the printing press",
    "coral reefs",
    "how airplanes fly",
    "vitamins",
    "the solar system",
    "chess",
    "photography",
    "music theory",
    "the history of the bicycle",
    "password security",
    "spreadsheets",
    "learning to swim",
    "recycling",
    "the brain",
    "earthquakes",
    "trees",
    "the Olympics",
    "penguins",
    "renting an apartment",
    "taxes",
    "ancient Egypt",
    "batteries",
    "the moon landing",
    "coffee",
    "bread",
    "wind energy",
    "memory",
    "friendship",
    "video games",
    "the immune system",
    "maps",
    "clouds",
    "the alphabet",
    "elections",
)
_DISHES = (
    "chicken and rice",
    "a quick breakfast",
    "vegetable soup",
    "banana bread",
    "pancakes",
    "a lentil curry",
    "pasta with tomato sauce",
    "a green salad",
    "fried rice",
    "chocolate chip cookies",
    "a simple omelette",
    "roast potatoes",
    "a fruit smoothie",
    "tacos",
    "a vegan dinner",
    "a birthday cake",
    "hummus",
    "a packed school lunch",
    "leftover rice",
    "a one-pot dinner",
)
_SITUATIONS = (
    "a late delivery",
    "asking a neighbour to water my plants",
    "thanking a teacher",
    "asking for a day off",
    "a broken heater in my flat",
    "inviting friends to a picnic",
    "cancelling a meeting",
    "a job application",
    "asking my landlord to fix a leak",
    "a refund for a faulty kettle",
    "welcoming a new colleague",
    "a group project deadline",
    "asking for a letter of recommendation",
    "a noisy neighbour",
    "rescheduling a dentist appointment",
    "a school trip",
    "saying goodbye to my team",
    "a lost package",
)
_GOALS = (
    "a first job interview",
    "saving money for a car",
    "learning to cook",
    "waking up earlier",
    "moving to a new city",
    "training for a 10k run",
    "studying for a maths exam",
    "keeping a plant alive",
    "starting a vegetable garden",
    "learning the guitar",
    "making new friends at school",
    "reading more books",
    "a birthday party for a child",
    "a weekend trip to the mountains",
    "organising my desk",
    "drinking more water",
    "a long flight",
    "speaking in front of my class",
    "a first week at university",
    "getting my dog to stop barking",
    "learning to code",
    "eating less sugar",
)
_STORY = (
    "a lighthouse keeper",
    "a robot learning to paint",
    "a lost key",
    "a dragon who is afraid of fire",
    "two friends on a train",
    "a talking cat",
    "the last day of summer",
    "a city under the sea",
    "a girl who finds a map",
    "an old clock",
    "a snowman in spring",
    "a detective mouse",
    "a kind giant",
    "a boy and his kite",
    "a shop that sells dreams",
    "a space station cook",
)

#: kind -> (what the user asks for, with {x}; the pool of {x}; openers the message starts with)
KINDS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "question": (
        "an answer to a question about {x}",
        _TOPICS,
        ("What", "Why", "How", "Is it true that", "Can you tell me", "Which"),
    ),
    "explanation": (
        "an explanation of {x}",
        _TOPICS,
        ("Can you explain", "Explain", "I don't understand", "Help me understand", "How does"),
    ),
    "list": ("a list about {x}", _TOPICS, ("List", "Give me a list of", "Name five", "What are some")),
    "email": (
        "help writing an email about {x}",
        _SITUATIONS,
        ("Write an email", "Can you write an email", "Help me write an email", "Draft a short email"),
    ),
    "recipe": (
        "a recipe for {x}",
        _DISHES,
        ("Could you give me a recipe for", "How do I make", "What can I cook", "I want to make"),
    ),
    "story": (
        "a short story about {x}",
        _STORY,
        ("Write a short story about", "Tell me a story where", "Write a bedtime story", "Can you write a story"),
    ),
    "poem": (
        "a poem about {x}",
        _TOPICS + _STORY,
        ("Write a poem about", "Write a short poem", "Can you write a limerick about", "Write a rhyming poem"),
    ),
    "advice": (
        "advice about {x}",
        _GOALS,
        ("I need advice on", "What should I do", "I'm nervous about", "Any tips for", "How can I"),
    ),
    "plan": (
        "a plan for {x}",
        _GOALS,
        ("Help me plan", "Make a plan for", "Can you make a schedule", "Create a checklist"),
    ),
}
STYLES = (
    "short and simple",
    "polite",
    "casual, like a text message",
    "written by a beginner",
    "written by a student",
    "written by a busy parent",
    "a little worried",
    "very specific",
    "curious",
    "friendly",
)

_REQUEST = (
    "Write a message that a user might send to an AI assistant, asking for {ask}. "
    "The message should be {style}. Write only the user's message."
)
_PREFILL = 'Here is the message:\n\n"'


def instruction_request(i: int, seed: int = 0) -> dict:
    """Request number `i`: a prompt record (with a ``prefill``) asking the target to write
    one user message of a seeded kind, topic, style and opener."""
    rng = random.Random(f"selfinstruct/{seed}/{i}")
    kind = rng.choice(sorted(KINDS))
    ask, pool, openers = KINDS[kind]
    topic, style, opener = rng.choice(pool), rng.choice(STYLES), rng.choice(openers)
    text = _REQUEST.format(ask=ask.format(x=topic), style=style)
    return {
        "id": f"si-request/{i}",
        "source": "selfinstruct",
        "kind": kind,
        "topic": topic,
        "opener": opener,
        "messages": [{"role": "user", "content": text}],
        "prefill": _PREFILL + opener,
    }


def heldout_user_texts(path: str | Path) -> list[str]:
    """Every user message of a held-out prompt file (a ``heldout.jsonl``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--heldout: no held-out prompt file at {path}")
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out += [m["content"] for m in rec.get("messages", []) if m.get("role") == "user"]
            out += [str(rec[k]) for k in ("prompt", "text", "question") if k in rec]
    return out


class InstructionFilter:
    """Keeps held-out prompts (exact and near duplicates) and repeats out of the set."""

    def __init__(self, heldout: Iterable[str], threshold: float = 0.5):
        self.heldout = NearDuplicates(heldout, threshold)
        self.kept = NearDuplicates((), threshold)

    def reason(self, text: str) -> Optional[str]:
        """Why `text` may not be kept ('heldout-exact', 'heldout-near', 'duplicate-...'),
        or None when it may."""
        hit = self.heldout.match(text)
        if hit:
            return f"heldout-{hit}"
        hit = self.kept.match(text)
        return f"duplicate-{hit}" if hit else None

    def keep(self, text: str) -> None:
        """Remember `text` as kept: a later text that repeats it is a duplicate."""
        self.kept.add(text)


def write_instructions(
    out_file: str | Path,
    heldout_file: str | Path,
    n: int,
    model_path: Optional[str] = None,
    batch_size: int = 32,
    seed: int = 0,
    temp: float = 0.8,
    max_tokens: int = 48,
    threshold: float = 0.5,
    threads: Optional[int | str] = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Have the target write until `out_file` holds `n` kept user messages (prompt records
    ``{"id": "si/<seed>/<request>", "source": "selfinstruct", "kind", "messages"}``, appended
    as they come; another seed writes other requests under other ids), or
    until 8 n requests are spent. Every request's raw output and fate go to
    ``<stem>.log.jsonl`` beside it; a rerun skips the requests its seed logged and those
    before its last kept one (the log may be lost), and continues. Returns
    the counts of kept and dropped messages (by reason)."""
    import mlx.core as mx

    from ..loading import load
    from .progress import StepBar
    from .threads import ThreadControl

    if n < 1:
        raise ValueError(f"--num-instructions must be >= 1, got {n}")
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / f"{out.stem}.log.jsonl"
    filt = InstructionFilter(heldout_user_texts(heldout_file), threshold)
    kept = list(iter_records(out)) if out.is_file() else []
    for rec in kept:
        filt.keep(rec["messages"][0]["content"])
    i, tried = _resume_point(kept, log_path, seed)
    limit = 8 * n
    stats: dict[str, int] = defaultdict(int)
    model, tokenizer = load(model_path)
    control = ThreadControl(threads)
    log(f"{len(kept)} of {n} instructions written, {len(tried)} requests tried; {control.describe()}")
    mx.random.seed(seed + len(tried))
    with open(out, "a") as fo, open(log_path, "a") as fl, StepBar(n, len(kept), progress, "instructions") as bar:
        while len(kept) < n and i < limit:
            # a round asks for about what is still needed at the share kept so far (4 batches at most)
            share = (stats["kept"] + 1) / (sum(stats.values()) + 2)
            count = min(4 * batch_size, math.ceil((n - len(kept)) / share))
            requests, i = _next_requests(i, tried, limit, count, seed)
            for req, rec in zip(
                requests,
                generate_answers(model, tokenizer, requests, max_tokens, batch_size, temp=temp, poll=control.poll),
            ):
                raw = req["opener"] + answer_text(tokenizer, rec["completion_ids"])
                text = clean_instruction(raw)
                reason = "unclean" if text is None else filt.reason(text)
                if reason is None and len(kept) >= n:
                    continue  # not logged: asked again if a later run wants more
                if reason is None:
                    filt.keep(text)
                    kept.append(_instruction_record(seed, req, text))
                    fo.write(json.dumps(kept[-1]) + "\n")
                fate = {
                    "request": req["request"],
                    "seed": seed,
                    "kind": req["kind"],
                    "raw": raw,
                    "kept": reason is None,
                }
                fl.write(json.dumps({**fate, "reason": reason}) + "\n")
                stats[reason or "kept"] += 1
            fo.flush()
            fl.flush()
            summary = ", ".join(f"{k} {v}" for k, v in sorted(stats.items()))
            bar.update(len(kept), summary)
            if not progress:
                log(f"{len(kept)}/{n} instructions ({summary})")
    return {"instructions": len(kept), **stats}


def _resume_point(kept: list[dict], log_path: Path, seed: int) -> tuple[int, set[int]]:
    """(the next request to ask, the requests tried) of a rerun with `seed` (requests are
    numbered per seed; a log line without its seed counts for every seed). Requests go in
    order, so every one before the last kept was tried, even where the log is lost (only
    the kept file is committed): asking them again would write duplicates."""
    logged = iter_records(log_path) if log_path.is_file() else []
    tried = {r["request"] for r in logged if r.get("seed", seed) == seed}
    ours = [int(r["id"].rsplit("/", 1)[1]) for r in kept if r["id"].startswith(f"si/{seed}/")]
    start = max(ours, default=-1) + 1
    return start, tried | set(range(start))


def _next_requests(i: int, tried: set[int], limit: int, count: int, seed: int) -> tuple[list[dict], int]:
    """Up to `count` untried requests from number `i` on (below `limit`), and where the next batch starts."""
    requests = []
    while len(requests) < count and i < limit:
        if i not in tried:
            requests.append({**instruction_request(i, seed), "request": i})
        i += 1
    return requests, i


def _instruction_record(seed: int, request: dict, text: str) -> dict:
    """A kept instruction as a prompt record."""
    return {
        "id": f"si/{seed}/{request['request']}",
        "source": "selfinstruct",
        "kind": request["kind"],
        "messages": [{"role": "user", "content": text}],
    }
