"""Functions to complete, like HumanEval's: the ``round6-code`` source.

HumanEval gives a signature and a docstring with examples and asks for the body; the
held-out code prompts are ten of its problems, and only 154 code sequences had been
trained on. The prompts here are of two kinds:

- the written tasks (`code_tasks.TASKS`), each with examples its reference solution
  computes on random inputs, four variants per parameter value;
- stubs of the standard library's pure-Python functions: their real signature and
  docstring, the body left to write.

Most use HumanEval's own wording ("Complete the following Python function."), the rest
other requests for the same function.
"""

from __future__ import annotations

import inspect
import random
import textwrap
from typing import Callable

from .code_tasks import TASKS
from .docstrings import module_members
from .fresh_prompts import ROUND6_MODULES
from .prompts import STDLIB_MODULES


_FRAMES = (
    "Complete the following Python function.\n\n```python\n{stub}```",
    "Implement this Python function:\n\n```python\n{stub}```",
    "Fill in the body of this function.\n\n```python\n{stub}```",
    "Write a Python function `{name}({args})`. {doc}\n\nFor example:\n{examples}",
)
_FRAME_WEIGHTS = (6, 1, 1, 2)


def _prompt(rng: random.Random, prompt_id: str, name: str, args: str, doc: list[str], examples: str = "") -> dict:
    """A prompt asking for function `name` (docstring lines `doc`, then the `examples`),
    framed as HumanEval does most of the time."""
    lines = doc + examples.split("\n") if examples else doc
    body = "\n".join("    " + line if line.strip() else "" for line in lines)
    stub = f'\ndef {name}({args}):\n    """{body.strip()}\n    """\n'
    frame = rng.choices(_FRAMES, weights=_FRAME_WEIGHTS)[0] if examples else _FRAMES[0]
    text = frame.format(stub=stub, name=name, args=args, doc=" ".join(doc), examples=examples)
    return {"id": prompt_id, "source": "round6-code", "messages": [{"role": "user", "content": text}]}


def _examples(rng: random.Random, name: str, solve: Callable, inputs: Callable, n: int = 3) -> str:
    """Doctest lines for up to `n` calls on random inputs (a call once; no None results,
    which a doctest would show as nothing)."""
    calls: dict[str, str] = {}
    for _ in range(n * 4):
        args = inputs(rng)
        call = f"{name}({', '.join(map(repr, args))})"
        result = solve(*args)
        if call not in calls and result is not None:
            calls[call] = repr(result)
        if len(calls) == n:
            break
    return "\n".join(f">>> {call}\n{result}" for call, result in calls.items())


def task_prompts(rng: random.Random, variants: int = 4) -> list[dict]:
    """`variants` prompts for each written task and parameter (one more for a task
    without one), each with its own examples and framing."""
    out = []
    for task in TASKS:
        for k in task.params:
            doc = task.doc.format(k=k, nth={2: "second", 3: "third"}.get(k, k))
            for v in range(variants + (k is None)):
                examples = _examples(rng, task.name, task.solve(k), task.inputs)
                suffix = ("" if k is None else f"/{k}".replace(" ", "-")) + f"/{v}"
                prompt_id = f"round6-code/{task.name}{suffix}"
                out.append(_prompt(rng, prompt_id, task.name, task.args, textwrap.wrap(doc, 76), examples))
    return out


def stub_prompts(rng: random.Random, max_doc: int = 700) -> list[dict]:
    """One prompt for each pure-Python function of the `stdlib` source's modules and
    `ROUND6_MODULES` whose docstring is 60 to `max_doc` characters: its signature and
    docstring, to complete."""
    out = []
    for mod_name in STDLIB_MODULES + ROUND6_MODULES:
        for attr, obj, doc in module_members(mod_name):
            if not inspect.isfunction(obj) or obj.__module__ != mod_name or not 60 <= len(doc) <= max_doc:
                continue
            try:
                args = str(inspect.signature(obj).replace(return_annotation=inspect.Signature.empty))[1:-1]
            except (TypeError, ValueError):
                continue
            if "<" in args or '"""' in doc or "\\" in doc:
                continue  # an unprintable default, or a docstring a stub cannot hold as written
            out.append(_prompt(rng, f"round6-code/{mod_name}.{attr}", attr, args, doc.split("\n")))
    return out


def round6_code(seed: int = 0) -> list[dict]:
    """The ``round6-code`` source: the written tasks' prompts, then the stubs'."""
    rng = random.Random(f"round6-code/{seed}")
    return task_prompts(rng) + stub_prompts(rng)
