"""The decoding loop reads the device only through `dflash_mlx.host`, and as rarely as its
design says: one blocking read a cycle, plain step, chain or tree (the tree grown on the
device, `tree.grow_tree`, walked there, and read once).

Counted two ways over the cycles after the first (the prefill's reads are one-offs): the
engine's own `host.watching()`, and MLX's public blocking calls (`mx.eval`, `.item()`,
`.tolist()`) wrapped here, so that a read made past `host.py` (by the engine, or by mlx-lm
code it runs) is caught too. And no engine module calls them directly, outside the
one-offs listed here with their reasons.
"""

from __future__ import annotations

import ast
from contextlib import closing
from pathlib import Path
from typing import Iterator

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import pytest

from dflash_mlx.speculative import generate_step
from dflash_mlx.targets import make_target
from tiny_drafters import BLOCK, ScriptedDrafter, prompt_of
from tiny_targets import tiny_target
from references import greedy_reference

ENGINE = Path(dflash_mlx.__file__).parent

#: Blocking calls the engine makes outside `host.py`, by (module, function): each a one-off
#: outside the decoding cycle, or not a device read.
ONE_OFFS = {
    ("distributed.py", "sharded_load"): "ranks agree once, at load",
    ("distributed.py", "leaders_seconds"): "under mlx.launch only: rank 0's cycle time, one scalar a cycle",
    ("distributed.py", "lockstep"): "under mlx.launch with --check-ranks only: the ranks' tokens compared",
    ("draft_vocab.py", "check_draft_vocab"): "a numpy array, not a device read",
    ("drafter.py", "head"): "the draft vocabulary's head rows, sliced once per target",
    ("drafter.py", "activation_peak"): "a drafter's check at load",
    ("drafters.py", "build_drafter"): "a drafter's weights, made once",
    ("drafters.py", "average_drafters"): "averaging checkpoints (dflash average)",
    ("kernels/choice.py", "evaluated"): "a kernel timed once per machine and shape",
    ("kernels/choice.py", "compare_outputs"): "a kernel checked once per machine and shape",
    ("lookup.py", "lookup"): "a numpy array of host tokens, not a device read",
    ("sampling.py", "fresh_seed"): "a seed, once per sampled generation without one",
    ("text.py", "token_ids"): "the prompt's ids, before decoding",
}


def _blocking_calls(path: Path) -> Iterator[tuple[str, int]]:
    """(enclosing function, line) of each `.item()`, `.tolist()`, `mx.eval(...)` and
    `mx.async_eval(...)` in the module at `path`."""
    tree = ast.parse(path.read_text())
    for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name, owner = node.func.attr, node.func.value
                module_call = isinstance(owner, ast.Name) and owner.id == "mx" and name in ("eval", "async_eval")
                if name in ("item", "tolist") or module_call:
                    yield func.name, node.lineno


def test_the_engine_reads_the_device_only_through_host():
    found = set()
    for path in sorted(ENGINE.rglob("*.py")):
        relative = path.relative_to(ENGINE).as_posix()
        if relative.startswith("train/") or relative == "host.py":
            continue
        for function, line in _blocking_calls(path):
            found.add((relative, function))
            assert (relative, function) in ONE_OFFS, f"{relative}:{line} ({function}) reads the device past host.py"
    assert found == set(ONE_OFFS), f"one-offs no longer there: {set(ONE_OFFS) - found}"


def reads_per_cycle(calls, model, drafter, cycles: int, **options) -> float:
    """The engine's blocking reads per cycle over `cycles` cycles after the first (none
    made past host.py); the tokens equal mlx-lm's greedy ones."""
    prompt = prompt_of(7, 11)
    tokens = []
    with closing(generate_step(prompt, model, drafter, max_tokens=None, **options)) as steps:
        tokens += next(steps)[0]  # the prefill and its token
        with calls.counting() as watch:
            for _ in range(cycles):
                tokens += next(steps)[0]
    assert tokens == greedy_reference(model, prompt, len(tokens))
    assert not calls.strays, f"blocking calls outside host.py: {calls.strays}"
    assert calls.reads == watch.reads, (calls.reads, watch.reads)
    return watch.reads / cycles


@pytest.fixture(scope="module")
def pair():
    model = tiny_target("llama", seed=2, scale=2.0)
    truth = prompt_of(7, 11) + greedy_reference(model, prompt_of(7, 11), 200) + [0] * BLOCK
    # drafts right up to block position 3, then wrong: chains accept 2, trees walk further
    return model, ScriptedDrafter(make_target(model, (1,)), truth, lambda cycle, k: k == 3)


@pytest.mark.parametrize(
    "kind, options, most",
    [
        ("plain", None, 1),
        ("chain", dict(block_size=BLOCK, tree_budget=0), 1),
        ("tree", dict(block_size=BLOCK, tree_budget=8), 1),
        ("defaults", dict(), 1),
    ],
)
def test_blocking_reads_per_cycle(calls, pair, kind, options, most):
    model, drafter = pair
    per_cycle = reads_per_cycle(calls, model, drafter if options is not None else None, 24, **options or {})
    assert per_cycle == most, (kind, per_cycle)
