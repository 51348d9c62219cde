"""Side-by-side benchmark: plain mlx-lm vs DFlash (ours) vs z-lab's MLX loop, in one run.

Every method decodes the same chat prompts greedily; tokens/s counts the tokens after
the first (prefill excluded, as mlx-lm reports it). Methods run interleaved per prompt,
in a rotating order, so that machine noise hits them alike; their outputs are compared
token for token.

Ours runs with the options given (adaptive block size by default), and once more per
fixed block size, per fixed tree budget, per prompt-lookup length, per further draft
vocabulary and per further drafter asked for (with tree budgets and an adaptive block size, also with the
chain-only policy, beside the default that weighs trees); each row says what its cycles
verified (widths) and how many draft nodes per cycle. Prompts of several kinds (the `set`
of a prompt file's records) get a table per kind too.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from dflash_mlx import DecodeOptions, apply_chat_template, histogram, tau, user_messages

from .drafters import draft_milliseconds, random_drafter

#: The fixed block sizes ours also runs with by default, those up to the drafter's B.
DEFAULT_FIXED = (4, 8, 16)
DEFAULT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a binary search does, step by step.",
    "Tom has 12 apples and gives 5 to his friend. How many apples does he have left?",
    "Give three tips for writing clear emails.",
    "Write a short story about a robot who learns to paint.",
]


@dataclass
class MethodResult:
    """One method's (row's) totals over the prompts, and each prompt's run for `subset`."""

    name: str
    tokens: int = 0  # generated tokens after the first
    seconds: float = 0.0
    cycles: int = 0
    committed: int = 0  # tokens committed by draft/verify cycles
    outputs: list[list[int]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # block size of every cycle (ours)
    draft_ms: Optional[float] = None  # one draft at the drafter's block size (ours)
    nodes: int = 0  # draft tokens (chain drafts or tree nodes) verified (ours)
    widths: dict[str, int] = field(default_factory=dict)  # cycles by width: "plain", "chain b", "tree n" (ours)
    runs: list[tuple] = field(default_factory=list)  # each prompt's `add` arguments, for `subset`

    def add(
        self,
        chunks: list[list[int]],
        seconds: float,
        cycles: int,
        committed: int,
        sizes: Sequence[int] = (),
        view: Optional[dict] = None,
    ) -> None:
        """Count one prompt's run: its tokens per yield, time, draft/verify cycles, block
        sizes, and (ours) the stats view's nodes verified and widths."""
        self.runs.append((chunks, seconds, cycles, committed, sizes, view))
        tokens = [t for c in chunks for t in c]
        self.tokens += len(tokens) - len(chunks[0])
        self.seconds += seconds
        self.cycles += cycles
        self.committed += committed
        self.outputs.append(tokens)
        self.sizes += sizes
        if view is not None:
            self.nodes += view["drafted_tokens"]
            for width, n in view["widths"].items():
                self.widths[width] = self.widths.get(width, 0) + n

    def subset(self, prompts: Sequence[int]) -> "MethodResult":
        """This method's result on some of the prompts (by index)."""
        out = MethodResult(self.name, draft_ms=self.draft_ms)
        for i in prompts:
            out.add(*self.runs[i])
        return out

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens after the first per second (0 before any run)."""
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> Optional[float]:
        """Tokens committed per draft/verify cycle (None without cycles: plain mlx-lm)."""
        return tau(self.committed, self.cycles) if self.cycles else None


def _clock(stream: Iterator, tokens_of: Callable) -> tuple[list[list[int]], float, object, float]:
    """Drain a generator: per-yield token lists, seconds after the first yield, last item,
    and seconds to the first yield (the prefill)."""
    chunks: list[list[int]] = []
    tic, first, last = time.perf_counter(), None, None
    for last in stream:
        if first is None:
            first = time.perf_counter()
        chunks.append(tokens_of(last))
    return chunks, time.perf_counter() - first, last, first - tic


@contextmanager
def _local_draft_dir(module, path: Path):
    """z-lab's `load_draft` only takes Hub ids; let it read a local directory."""
    original = module.snapshot_download
    module.snapshot_download = lambda repo_id, **_: str(path)
    try:
        yield
    finally:
        module.snapshot_download = original


def _zlab_method(model_dir: str, draft_dir: Path, block: int, max_tokens: int) -> Optional[Callable]:
    """z-lab's MLX loop (dflash 0.1.0), if installed. It patches the target it is given,
    so it gets its own copy. It yields one item per cycle (the first token alone first)."""
    try:
        import mlx_lm
        from dflash import model_mlx
    except ImportError:
        return None
    model, tokenizer = mlx_lm.load(model_dir)
    with _local_draft_dir(model_mlx, draft_dir):
        draft = model_mlx.load_draft("local")

    def run(prompt: list[int]) -> tuple[list[list[int]], float, int, int]:
        chunks, seconds, *_ = _clock(
            model_mlx.stream_generate(model, draft, tokenizer, prompt, block_size=block, max_tokens=max_tokens),
            lambda r: list(r.tokens),
        )
        cycles = [c for c in chunks[1:] if c]
        return chunks, seconds, len(cycles), sum(map(len, cycles))

    return run


def _vocab_label(drafter) -> str:
    vocab = drafter.draft_vocab
    return "full" if vocab is None else f"{vocab.size}"


def _run_interleaved(
    methods: dict[str, Callable], prompts: list[list[int]], warmup: list[int], progress: Optional[Callable]
) -> list[MethodResult]:
    """Every method on every prompt, interleaved so that machine noise hits them alike
    (who goes first rotates per prompt), after one warm-up run each."""
    results = {name: MethodResult(name) for name in methods}
    for run in methods.values():
        run(warmup)
    for i, prompt in enumerate(prompts):
        order = list(methods.items())
        for name, run in order[i % len(order) :] + order[: i % len(order)]:
            if progress:
                progress(f"prompt {i + 1}/{len(prompts)}: {name}")
            results[name].add(*run(prompt))
    return list(results.values())


def _rows(results: list[MethodResult]) -> list[dict]:
    """One report row per method; the first (mlx-lm) is the baseline for speed and tokens."""
    base = results[0]
    return [
        {
            "method": r.name,
            "tokens": r.tokens,
            "seconds": round(r.seconds, 3),
            "tokens_per_second": round(r.tokens_per_second, 2),
            "speedup": round(r.tokens_per_second / base.tokens_per_second, 2),
            "tau": round(r.tau, 2) if r.tau else None,
            "same_tokens_as_mlx_lm": all(a[: len(b)] == b[: len(a)] for a, b in zip(r.outputs, base.outputs)),
            "block_sizes": histogram(r.sizes) if r.sizes else None,
            "draft_ms": r.draft_ms,
            "nodes_per_cycle": round(r.nodes / r.cycles, 2) if r.nodes and r.cycles else None,
            "widths": dict(sorted(r.widths.items(), key=lambda kv: -kv[1])) if r.widths else None,
        }
        for r in results
    ]


def run_bench(
    model_path: Optional[str] = None,
    draft_path: Optional[str] = None,
    prompts: Optional[list[str]] = None,
    max_tokens: int = 128,
    options: DecodeOptions = DecodeOptions(),
    reference: bool = True,
    progress: Optional[Callable[[str], None]] = None,
    fixed_sizes: Optional[Sequence[int]] = (),
    draft_vocab: Optional[str] = None,
    fixed_trees: Sequence[int] = (),
    kinds: Optional[Sequence[str]] = None,
    sharding: Optional[str] = None,
    fixed_lookups: Sequence[int] = (),
    other_drafts: Sequence[str] = (),
) -> dict:
    """Benchmark and return a JSON-able report with one row per method (and, where
    `kinds` gives the prompts more than one kind, the rows of each kind). `draft_path`
    "random" measures the loop's overhead with an untrained drafter. Ours decodes with
    `options` (adaptive block size: one policy across the prompts, as a chat keeps one),
    once more with each of `fixed_sizes` (each 2..B, else a ValueError naming --fixed; None:
    those of `DEFAULT_FIXED` up to B), and once more for each further draft vocabulary
    of `draft_vocab` (comma-separated files or 'none'; the first is ours'), and once more
    with each tree budget of `fixed_trees` at a fixed block (`options`' or the drafter's;
    0: the chain), and once more with each prompt-lookup length of `fixed_lookups` (0: off),
    and once more with each drafter of `other_drafts` (paths; with `options`), to compare
    drafters of one target side by side. `sharding`: the target sharded under mlx.launch (`load`'s), without
    z-lab's loop, which runs in one process."""
    from dflash_mlx import default_model_path, load, load_draft, shipped_drafter_dir

    prompts = prompts or DEFAULT_PROMPTS
    model_dir = model_path or str(default_model_path())
    model, tokenizer = load(model_dir, sharding=sharding)
    reference = reference and sharding is None
    with contextlib.ExitStack() as scratch:
        if draft_path == "random":  # an untrained drafter, written for this run only
            tmp = scratch.enter_context(tempfile.TemporaryDirectory(prefix="dflash-random-drafter-"))
            draft_path = str(random_drafter(model, tokenizer, Path(tmp) / "drafter"))
        draft_dir = Path(draft_path) if draft_path else shipped_drafter_dir()
        vocabs = [v.strip() for v in draft_vocab.split(",")] if draft_vocab else [None]
        drafter, *vocab_drafters = [load_draft(draft_path, model=model, draft_vocab=v) for v in vocabs]
        others = {f"dflash-mlx vocab {_vocab_label(d)}": d for d in vocab_drafters}
        others.update({f"dflash-mlx draft {path}": load_draft(path, model=model) for path in other_drafts})
        most = drafter.config.block_size  # what --fixed may ask for, known once the drafter is
        if fixed_sizes is None:
            fixed_sizes = [size for size in DEFAULT_FIXED if size <= most]
        elif any(not 2 <= size <= most for size in fixed_sizes):
            sizes = ",".join(map(str, fixed_sizes))
            raise ValueError(f"--fixed takes block sizes 2..{most} (this drafter's B), got {sizes}")
        fixed = (fixed_sizes, fixed_trees, fixed_lookups)
        methods, timed = _methods(model, tokenizer, drafter, others, options, max_tokens, *fixed)
        zlab = _zlab_method(model_dir, draft_dir, options.block_limit(drafter), max_tokens) if reference else None
        if zlab is not None:
            methods["z-lab MLX (reference)"] = zlab

        def chat(text: str) -> list[int]:
            return apply_chat_template(tokenizer, user_messages(text))

        results = _run_interleaved(methods, [chat(text) for text in prompts], chat("Hi"), progress)
        for result in results:
            if result.name in timed:
                result.draft_ms = draft_milliseconds(model, timed[result.name])
    return {
        "model": model_dir,
        "draft": str(draft_dir),
        "other_drafts": list(other_drafts),
        "block_size": options.block_size or "adaptive",
        "draft_vocab": _vocab_label(drafter),
        "max_tokens": max_tokens,
        "prompts": len(prompts),
        "results": _rows(results),
        "by_kind": _kind_rows(results, kinds),
    }


def _kind_rows(results: list[MethodResult], kinds: Optional[Sequence[str]]) -> dict:
    """The rows of each prompt kind, where the prompts have more than one."""
    if not kinds or len(set(kinds)) < 2:
        return {}
    picked = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in sorted(set(kinds))}
    return {k: {"prompts": len(ids), "results": _rows([r.subset(ids) for r in results])} for k, ids in picked.items()}


def _methods(
    model,
    tokenizer,
    drafter,
    others: dict[str, Any],
    options: DecodeOptions,
    max_tokens: int,
    fixed_sizes: Sequence[int],
    fixed_trees: Sequence[int] = (),
    fixed_lookups: Sequence[int] = (),
) -> tuple[dict[str, Callable], dict[str, object]]:
    """Plain mlx-lm and our runs by name (with `options`, each fixed size, each fixed tree
    budget, each prompt-lookup length, and each of `others`: further drafters by row name),
    and the drafter of each row that gets a draft time."""
    import mlx_lm

    from dflash_mlx import make_policy, stream_generate

    def plain(prompt):
        stream = mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **options.kv_args)
        chunks, seconds, *_ = _clock(stream, lambda r: [r.token])
        return chunks, seconds, 0, 0

    def ours(options: DecodeOptions, drafter=drafter, trees: bool = True) -> Callable:
        # as API users call it: one call a prompt, learning in the pair's policy; the
        # chain-only row learns in its own
        chains = options.adaptive(drafter) and not trees
        policy = make_policy(model, drafter, trees=False) if chains else None

        def run(prompt):
            stream = stream_generate(model, tokenizer, prompt, drafter, options, max_tokens=max_tokens, policy=policy)
            chunks, seconds, last, _ = _clock(stream, lambda r: [r.token])
            view = last.stats.to_dict()
            return chunks, seconds, view["cycles"], view["committed_tokens"], view["block_sizes"], view

        return run

    options.block_limit(drafter)  # a fixed size the drafter cannot verify: one line, before any run
    methods = {"mlx-lm": plain, "dflash-mlx (ours)": ours(options)}
    for size in fixed_sizes:
        if size != options.block_size:
            methods[f"dflash-mlx B={size}"] = ours(replace(options, block_size=size))
    block = options.block_limit(drafter)
    if fixed_trees and options.adaptive(drafter) and options.tree_budget is None:
        methods["dflash-mlx adaptive, chains"] = ours(options, trees=False)
    for budget in fixed_trees:
        name = f"dflash-mlx B={block} " + (f"tree {budget}" if budget else "chain")
        methods[name] = ours(replace(options, block_size=block, tree_budget=budget))
    for n in fixed_lookups:
        if n != options.lookup:
            methods[f"dflash-mlx lookup {n}" if n else "dflash-mlx no lookup"] = ours(replace(options, lookup=n))
    timed = {"dflash-mlx (ours)": drafter, **others}
    methods.update({name: ours(options, other) for name, other in others.items()})
    return methods, timed


def markdown_table(report: dict) -> str:
    """The report as a markdown table."""
    lines = [
        f"model `{Path(report['model']).name}`, draft `{Path(report['draft']).name}` "
        f"(draft vocabulary: {report.get('draft_vocab', 'full')}), block {report['block_size']}, "
        f"{report['prompts']} prompts x {report['max_tokens']} max new tokens, greedy",
        "",
        "| method | tokens | tok/s | speedup | tau | draft ms | nodes/cycle | widths (cycles) "
        "| block sizes (size: cycles) | same tokens as mlx-lm |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in report["results"]:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        draft_ms = f"{r['draft_ms']:.1f}" if r.get("draft_ms") else "-"
        sizes = " ".join(f"{b}:{n}" for b, n in enumerate(r.get("block_sizes") or [], 1) if n) or "-"
        nodes = f"{r['nodes_per_cycle']:.1f}" if r.get("nodes_per_cycle") else "-"
        widths = ", ".join(f"{w}: {n}" for w, n in (r.get("widths") or {}).items()) or "-"
        lines.append(
            f"| {r['method']} | {r['tokens']} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | {tau} "
            f"| {draft_ms} | {nodes} | {widths} | {sizes} | "
            f"{'yes' if r['same_tokens_as_mlx_lm'] else 'NO'} |"
        )
    return "\n".join(lines + _kind_table(report))


def _kind_table(report: dict) -> list[str]:
    """Speedup over mlx-lm and tau per prompt kind (rows) and method (columns), "all" last."""
    by_kind = report.get("by_kind")
    if not by_kind:
        return []
    names = [r["method"] for r in report["results"]]
    head = "| kind | prompts | mlx-lm tok/s | " + " | ".join(names[1:]) + " |"
    lines = ["", head, "|---|---:|---:|" + "---:|" * (len(names) - 1)]
    kinds = list(by_kind.items()) + [("**all**", {"prompts": report["prompts"], "results": report["results"]})]
    for kind, entry in kinds:
        rows = entry["results"]
        cells = [f"{r['speedup']:.2f}x" + (f", tau {r['tau']:.2f}" if r["tau"] else "") for r in rows[1:]]
        base = f"| {kind} | {entry['prompts']} | {rows[0]['tokens_per_second']:.1f} | "
        lines.append(base + " | ".join(cells) + " |")
    return lines
