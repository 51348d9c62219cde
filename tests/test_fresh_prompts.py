"""Round 6's prompt sources (`fresh_prompts`, `word_problems`, `code_tasks`, `code_prompts`,
`sources`): balanced over the held-out kinds, varied, new, and right where they state facts
(the examples of a written code task, the numbers of a word problem). Their guard against
the held-out prompts is checked with the shipped set in tests/test_heldout_prompts.py."""

from __future__ import annotations

import ast
import random
import re
from collections import Counter

import pytest

from dflash_mlx.train.code_prompts import round6_code
from dflash_mlx.train.code_tasks import TASKS
from dflash_mlx.train.fresh_prompts import fresh, round6_chat, round6_math, subjects
from dflash_mlx.train.sources import collect_prompts
from dflash_mlx.train.word_problems import word_problem

TASK = {task.name: task for task in TASKS}
SOLVE = {task.name: task.solve for task in TASKS}


def test_round6_is_a_few_thousand_prompts_of_the_four_kinds_each_text_once():
    prompts = collect_prompts(["round6"])
    by_source = Counter(p["source"] for p in prompts)
    assert set(by_source) == {"round6-chat", "round6-math", "round6-stdlib", "round6-code"}
    assert all(800 <= n <= 1600 for n in by_source.values()), by_source
    texts = [p["messages"][-1]["content"] for p in prompts]
    assert len(set(texts)) == len(texts) and len({p["id"] for p in prompts}) == len(prompts)
    assert collect_prompts(["round6-math"]) == [p for p in prompts if p["source"] == "round6-math"]


def test_the_sources_are_seeded_and_varied():
    chat = round6_chat(300)
    assert chat == round6_chat(300) and chat != round6_chat(300, seed=1)
    openings = Counter(" ".join(p["messages"][0]["content"].split()[:3]) for p in chat)
    assert len(openings) > 80 and openings.most_common(1)[0][1] < 40  # not one template x 300
    maths = [p["messages"][0]["content"] for p in round6_math(300)]
    assert len({re.sub(r"\d+", "N", t.split(".")[0]) for t in maths}) > 60


def test_word_problems_make_sense():
    """Change comes from a bill that covers the price; a ratio's known side divides evenly;
    the leftovers of a packing problem are fewer than a bag."""
    rng = random.Random(0)
    problems = [word_problem(rng) for _ in range(3000)]
    change = [re.search(r"buys (\d+) .* at \$(\d+) each and pays with a \$(\d+) bill", t) for t in problems]
    assert sum(m is not None for m in change) > 50
    assert all(int(n) * int(p) <= int(bill) for n, p, bill in (m.groups() for m in change if m))
    ratios = [re.search(r"is (\d+):\d+\. If there are (\d+) cats", t) for t in problems]
    assert all(int(c) % int(p) == 0 for p, c in (m.groups() for m in ratios if m))
    packs = [re.search(r"^(\d+) .* bags of (\d+)\.", t) for t in problems]
    assert all(int(n) % int(k) for n, k in (m.groups() for m in packs if m))


def test_the_reference_solutions_give_the_right_answers():
    """The facts the written tasks' examples teach, checked by hand."""
    assert SOLVE["to_base"](2)(10) == "1010" and SOLVE["to_base"](8)(64) == "100"
    assert SOLVE["run_length"](None)("aaabcc") == "a3b1c2"
    assert SOLVE["balanced_brackets"](None)("a[(b)]{}") and not SOLVE["balanced_brackets"](None)("([)]")
    assert SOLVE["triangle_kind"](None)(2, 2, 3) == "isosceles" and SOLVE["triangle_kind"](None)(1, 2, 3) == "invalid"
    assert SOLVE["nearest_multiple"](5)(12) == 10 and SOLVE["nearest_multiple"](10)(25) == 30
    assert SOLVE["alternate_case"]("upper")("ab cd") == "Ab Cd"
    assert SOLVE["collatz_steps"](None)(6) == 8 and SOLVE["is_power_of"](3)(243)
    assert SOLVE["nth_largest"](2)([5, 9, 9, 1]) == 5 and SOLVE["nth_largest"](3)([4, 4]) is None
    assert SOLVE["rotate_right"](2)([1, 2, 3, 4, 5]) == [4, 5, 1, 2, 3]
    assert SOLVE["leap_years"](None)(1896, 1912) == [1896, 1904, 1908, 1912]
    assert SOLVE["missing_number"](None)([3, 1, 4]) == 2 and SOLVE["digital_root"](None)(9875) == 2
    assert SOLVE["seconds_to_clock"](None)(3725) == "1:02:05"


def test_every_code_prompt_is_python_that_parses_and_its_examples_hold():
    """Each stub (written task or standard-library function) is a function definition that
    parses; each written task's doctest lines hold for its reference solution."""
    prompts = round6_code()
    assert sum("Complete the following Python function." in p["messages"][0]["content"] for p in prompts) > 500
    checked = 0
    for p in prompts:
        text = p["messages"][0]["content"]
        code = re.search(r"```python\n(.*)```", text, re.S)
        if code:
            assert isinstance(ast.parse(code.group(1)).body[0], ast.FunctionDef), p["id"]
        name, *rest = p["id"].split("/")[1:]  # round6-code/NAME[/PARAM]/VARIANT for a written task
        if name in TASK:
            k = next(k for k in TASK[name].params if rest[:-1] == ([] if k is None else [str(k).replace(" ", "-")]))
            for call, result in re.findall(r">>> (\w+\(.*\))\n\s*(.+)", text):
                args = [ast.literal_eval(a) for a in ast.parse(call, mode="eval").body.args]
                assert repr(TASK[name].solve(k)(*args)) == result.strip(), (p["id"], call)
                checked += 1
    assert checked > 1000


def test_fresh_keeps_out_held_out_prompts_their_subjects_and_earlier_texts():
    def prompt(text: str) -> dict:
        return {"id": text, "source": "t", "messages": [{"role": "user", "content": text}]}

    held = [prompt("What does `os.uname` do in Python?"), prompt("Tell me a short story about rain.")]
    earlier = [prompt("Write a haiku about the sea.")]
    candidates = [
        prompt("what does `os.uname` do in python"),  # the held-out text, normalised
        prompt("Tell me a short story about rain!!"),  # the same words
        prompt("Show me `os.uname` with comments."),  # a held-out subject
        prompt("Write a haiku about the sea."),  # an earlier text
        prompt("What does `os.uname_result.count` do?"),  # a subject under a held-out one
        prompt("What does `os.umask` do in Python, and when would I call it?"),
        prompt("What does `os.umask` do in Python, and when would I call it?"),  # twice
    ]
    kept = fresh(candidates, held, earlier)
    assert [p["messages"][0]["content"] for p in kept] == [
        "What does `os.uname_result.count` do?",
        "What does `os.umask` do in Python, and when would I call it?",
    ]
    assert subjects("Use `a.b.c` and def f(x): ...") == {"a", "a.b", "a.b.c", "f"}


def test_an_unknown_source_is_one_line_naming_the_flag():
    with pytest.raises(
        ValueError, match=r"^--source: unknown prompt source 'round7' \(built-in: .*round6-code, round6;"
    ):
        collect_prompts(["round7"])
