"""Round 6's prompts: more of the held-out kinds, and none of the held-out prompts.

The long run's drafter reached tau 2.46 on text like its training data but stayed at 2.16
on the 40 held-out prompts (BENCHMARKS.md, "seen/unseen"): three quarters of its data is
self-instruct chat, and the held-out kinds (templated chat, HumanEval code, word problems,
standard-library questions) had 412, 154, 1,490 and 1,068 sequences. These sources write
more of those kinds, each text new:

- ``round6-chat``: the `chat` source's templates over longer topic lists, and new templates
  with slots of their own (places, jobs, dishes, ...);
- ``round6-math``: nineteen new kinds of word problem, and the `math` source's ten with
  other numbers and names;
- ``round6-stdlib``: questions on standard-library modules the `stdlib` source left out,
  on the methods of classes (its modules' and the builtins'), and on numpy's functions;
- ``round6-code``: functions to complete (`code_prompts`).

`fresh` is the guard every one of them passes: no prompt that repeats a held-out prompt
exactly or nearly (word 3-gram Jaccard >= 0.5: `instructions.NearDuplicates`), names a
held-out prompt's subject (a `name` in backticks, a `def name(`) or repeats a prompt the
first sources already wrote (`sources`: the committed answers').
"""

from __future__ import annotations

import random
import re
from typing import Iterable

from .docstrings import class_methods, module_members, summary
from .instructions import NearDuplicates, normalize
from .prompts import ACTIVITIES, CHAT_TEMPLATES, STDLIB_MODULES, STDLIB_TEMPLATES, SUBJECTS, TOPICS, math_problem
from .word_problems import word_problem


def _words(text: str) -> tuple[str, ...]:
    """A word list written as `|`-separated items over several lines."""
    return tuple(w.strip() for w in text.split("|") if w.strip())


_CHAT_SLOTS = {
    "topic": TOPICS
    + _words("""an old bridge | a thunderstorm | the first day of school | a quiet library | a lost key | the desert |
    a busy market | fireflies | a snowy village | an empty beach | a paper boat | the last train home | grandparents |
    a hot air balloon | an old photograph | the spring rain | a river at dawn | a small bakery | a fox | sunflowers"""),
    "subject": SUBJECTS
    + _words("""plate tectonics | the greenhouse effect | antibiotics | blockchain | the Roman Empire | nuclear fusion |
    supply and demand | the human heart | bees and pollination | cloud computing | the printing press | evolution |
    the speed of light | hurricanes | credit scores | the Renaissance | encryption | coral reefs | batteries |
    the Olympic Games | the periodic table | sleep cycles | GPS | wind turbines | the Silk Road | taxes |
    the human brain | glaciers | 3D printing | the scientific method | magnets | bacteria | the Great Wall of China |
    the Industrial Revolution | migration of birds | open source software | the ozone layer | jet engines"""),
    "activity": ACTIVITIES
    + _words("""learning to play the guitar | training a puppy | growing tomatoes | writing a resume |
    preparing for a job interview | organizing a small apartment | learning to swim | drinking more water |
    reading more books | waking up early | learning to draw | running a team meeting | packing for a trip |
    decluttering a closet | learning to code in Python | budgeting for groceries | making new habits stick"""),
    "place": _words("""Paris | Tokyo | a national park | the mountains | a small fishing village | Rome | the seaside |
    New York | a rainforest | Iceland | a farm | Istanbul | a ski resort | Cairo | Lisbon | a desert oasis"""),
    "job": _words("""a nurse | a firefighter | a librarian | a pilot | a chef | a teacher | a software engineer |
    a farmer | an astronaut | a carpenter | a marine biologist | a journalist | a bus driver | a beekeeper"""),
    "dish": _words("""pancakes | vegetable soup | fried rice | a tomato pasta | banana bread | guacamole | an omelette |
    lentil curry | a fruit salad | roasted potatoes | hummus | chocolate chip cookies | a simple pizza"""),
    "thing": _words("""a refrigerator | a bicycle | a microwave oven | a smartphone camera | a compass | a thermostat |
    a water filter | noise-cancelling headphones | an electric car | a zipper | a barcode scanner | a solar lamp"""),
    "animal": _words("""an octopus | a penguin | an elephant | a honeybee | a dolphin | an owl | a hedgehog |
    a tortoise | a kangaroo | a chameleon | a wolf | a hummingbird | a giraffe | an ant colony"""),
    "country": _words("""Japan | Brazil | Canada | Kenya | Norway | India | Mexico | Egypt | Australia | Peru |
    Vietnam | Morocco | Italy | New Zealand | Argentina | Finland"""),
    "pair": _words("""weather and climate | a virus and a bacterium | a lake and a pond | speed and velocity |
    a crocodile and an alligator | RAM and storage | mass and weight | a comet and an asteroid | empathy and sympathy |
    a democracy and a republic | baking soda and baking powder | an ocean and a sea | a simile and a metaphor"""),
    "friend": _words("""my neighbour | my teacher | my grandmother | a colleague | my landlord | my best friend |
    my team | a customer | my coach | my sister"""),
    "casual": _words("""hey, can u send me the file asap | we gotta talk about the budget thing |
    sorry i'm late, traffic was crazy | that meeting was kinda pointless | can't make it tmrw, something came up |
    the app keeps crashing, no idea why"""),
}
_NEW_CHAT_TEMPLATES = _words("""Write a limerick about {topic}. | Write a four-line rhyming poem about {topic}. |
Write the opening paragraph of a mystery story set in {place}. | Describe a day in the life of {job}. |
What skills does {job} need? | Write a short dialogue between {job} and a child who asks about the work. |
Explain how {subject} works, step by step. | What are common misconceptions about {subject}? |
Explain {subject} using an everyday analogy. | Write three quiz questions about {subject}, with answers. |
What are the pros and cons of {activity}? | Make a one-week plan for {activity}. |
What mistakes do beginners make when {activity}? | Write a motivational message for someone who is {activity}. |
Give me a simple recipe for {dish}. | What drinks go well with {dish}? | Plan a weekend trip to {place}. |
What should I pack for a trip to {place}? | Describe {place} to someone who has never been there. |
How does {thing} work? | Write a product description for {thing}. | Tell me three fun facts about {animal}. |
Write a short story about {animal} that gets lost. | Why is {animal} well suited to where it lives? |
Tell me three things about {country}. | What food is {country} known for? |
Explain the difference between {pair}. | Write a thank-you note to {friend} for a birthday gift. |
Write a polite message to {friend} asking to reschedule our meeting. |
Rewrite this message to sound professional: "{casual}" | Write a tweet about {subject}. |
Summarize the main ideas of {subject} in five bullet points.""")


def round6_chat(n: int = 1200, seed: int = 0) -> list[dict]:
    """Chat requests: the first `chat` templates over longer topic lists and new templates
    with slots of their own, half each; no text twice."""
    rng = random.Random(f"round6-chat/{seed}")
    out, seen = [], set()
    for _ in range(n * 8):
        if len(out) >= n:
            break
        slots = {k: rng.choice(v) for k, v in _CHAT_SLOTS.items()}
        slots["subject2"] = rng.choice([s for s in _CHAT_SLOTS["subject"] if s != slots["subject"]])
        text = rng.choice(CHAT_TEMPLATES if rng.random() < 0.5 else _NEW_CHAT_TEMPLATES).format(**slots)
        if text not in seen:
            seen.add(text)
            out.append(_prompt(f"round6-chat/{len(out)}", text))
    return out


_MATH_ENDINGS = ("", " Explain step by step.", " Show your work.", "", " Explain your answer.", " Think step by step.")


def round6_math(n: int = 1200, seed: int = 0) -> list[dict]:
    """Word problems: three quarters of the new kinds (`word_problems`), a quarter of the
    `math` source's kinds with other numbers; no text twice."""
    rng = random.Random(f"round6-math/{seed}")
    out, seen = [], set()
    for _ in range(n * 8):
        if len(out) >= n:
            break
        text = (word_problem(rng) if rng.random() < 0.75 else math_problem(rng)) + rng.choice(_MATH_ENDINGS)
        if text not in seen:
            seen.add(text)
            out.append(_prompt(f"round6-math/{len(out)}", text))
    return out


#: Standard-library modules the `stdlib` source did not ask about.
ROUND6_MODULES = _words("""ast | bz2 | cmath | codecs | colorsys | configparser | concurrent.futures | filecmp |
getpass | graphlib | gettext | hmac | http.client | http.cookies | inspect | ipaddress | keyword | linecache | lzma |
mimetypes | multiprocessing | numbers | pickle | pkgutil | plistlib | quopri | reprlib | sched | selectors | shelve |
signal | smtplib | socket | stat | tarfile | timeit | tokenize | tomllib | traceback | types | unittest |
urllib.request | warnings | wave | weakref | xml.etree.ElementTree | zlib | zoneinfo | binascii | errno | gc |
atexit | sysconfig | dis | pdb | cProfile | pstats | doctest | socketserver | ftplib | wsgiref.util |
xml.dom.minidom | html.parser | http.server | email.message | email.utils | mailbox | posixpath | builtins""")
#: Modules of the project's dependencies whose functions are asked about too.
PACKAGE_MODULES = ("numpy", "numpy.linalg", "numpy.random")
_NEW_STDLIB_TEMPLATES = _words("""What arguments does `{name}` take, and what does it return? |
Show me how to use `{name}` in a short script, with comments. | What is a common mistake when using `{name}`? |
Here is the docstring of `{name}`: "{doc}" Give an example of calling it. |
Can you explain `{name}` and when I would need it? | Write a Python snippet that demonstrates `{name}`.""")


def round6_stdlib(n: int = 1100, seed: int = 0) -> list[dict]:
    """Questions on `n` of the documented names of `ROUND6_MODULES` and `PACKAGE_MODULES`
    and the methods of classes of the `stdlib` source's modules and these (2,700 here,
    drawn at random); the first templates for two thirds, new ones for the rest."""
    rng = random.Random(f"round6-stdlib/{seed}")
    out, seen = [], set()
    for mod_name in STDLIB_MODULES + ROUND6_MODULES + PACKAGE_MODULES:
        new_module = mod_name not in STDLIB_MODULES
        prefix = "" if mod_name == "builtins" else mod_name + "."
        for attr, obj, doc in module_members(mod_name):
            if _package(getattr(obj, "__module__", None) or mod_name) != _package(mod_name):
                continue  # imported from another package: asked about at home
            named = [(prefix + attr, doc)] if new_module else []
            if isinstance(obj, type):
                named += [(f"{prefix}{attr}.{m}", d) for m, _, d in class_methods(obj)]
            for name, text in named:
                first = summary(text)
                if 20 <= len(first) <= 300 and first not in seen:
                    seen.add(first)  # a docstring shared by aliases is asked about once
                    templates = STDLIB_TEMPLATES if rng.random() < 2 / 3 else _NEW_STDLIB_TEMPLATES
                    out.append(_prompt(f"round6-stdlib/{name}", rng.choice(templates).format(name=name, doc=first)))
    drawn = set(rng.sample(range(len(out)), min(n, len(out))))
    return [p for i, p in enumerate(out) if i in drawn]


def _package(module_name: str) -> str:
    """A module's top-level package, its C module's leading underscore dropped."""
    return module_name.split(".")[0].lstrip("_")


def _prompt(prompt_id: str, text: str) -> dict:
    """A one-turn prompt record of the source its id names."""
    return {"id": prompt_id, "source": prompt_id.split("/")[0], "messages": [{"role": "user", "content": text}]}


_SUBJECT = re.compile(r"`([A-Za-z_][\w.]*)`|\bdef (\w+)\(")


def subjects(text: str) -> set[str]:
    """The names a prompt is about: each `name` in backticks with its dotted prefixes, and
    each function it defines."""
    out = set()
    for quoted, defined in _SUBJECT.findall(text):
        parts = (quoted or defined).split(".")
        out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return out


def fresh(prompts: Iterable[dict], heldout: list[dict], earlier: Iterable[dict]) -> list[dict]:
    """`prompts` less those that repeat (exactly or nearly) a `heldout` prompt, are about
    a held-out subject (a held-out prompt's own names, not their prefixes), repeat an
    `earlier` prompt's text or one kept before them."""
    held_texts = [m["content"] for p in heldout for m in p["messages"] if m["role"] == "user"]
    near = NearDuplicates(held_texts)
    held_subjects = {n for t in held_texts for q, d in _SUBJECT.findall(t) for n in (q or d,)}
    seen = {normalize(m["content"]) for p in earlier for m in p["messages"] if m["role"] == "user"}
    out = []
    for p in prompts:
        text = p["messages"][-1]["content"]
        key = normalize(text)
        if key in seen or near.match(text) or subjects(text) & held_subjects:
            continue
        seen.add(key)
        out.append(p)
    return out
