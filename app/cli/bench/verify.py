"""`dflash bench verify-cost`: what a verify of n rows costs next to a plain step, T(n)/T(1).

A tree of n - 1 nodes (or a chain of n) costs one target forward over n rows; whether
trees pay depends on how that cost grows with n on this machine (on a CPU, OpenBLAS
switches from gemv to gemm at 2 rows; on Apple GPUs it is nearly flat to 16). Each n is
timed as the decoding loop runs it: a tree verify (ancestor mask, per-node positions)
plus the LM head over its rows, on a KV cache of `context` tokens, taken back out after
each run; n = 1 is a plain step. The median of `repeats` runs, after two warm-ups.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

DEFAULT_SIZES = tuple(range(1, 65))


def run_verify_cost(
    model_path: Optional[str] = None,
    sizes: Sequence[int] = DEFAULT_SIZES,
    context: int = 300,
    repeats: int = 7,
    progress: Optional[Callable[[str], None]] = None,
) -> dict:
    """Time a verify of each of `sizes` rows on the target (default: the default model).
    Returns a JSON-able report: one row per n with milliseconds and the ratio to n = 1."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from dflash_mlx import default_model_path, load
    from dflash_mlx.kernels.choice import seconds
    from dflash_mlx.targets import make_target
    from dflash_mlx.tree import Tree

    model_dir = model_path or str(default_model_path())
    model, _ = load(model_dir)
    target = make_target(model)
    cache = make_prompt_cache(model)
    target.forward(mx.array([[1 + i % 100 for i in range(context)]]), cache, capture=False)
    mx.eval([c.state for c in cache])
    if not target.supports_trees(cache):
        raise ValueError(f"{model_dir}: this target verifies chains only (no draft trees to time)")

    def verify(n: int) -> None:
        # a chain-shaped tree: the cost of n rows does not depend on the shape (the mask is dense)
        tree = Tree(list(range(1, n + 1)), [-1] + list(range(n - 1)), list(range(n)), [0.0] * n)
        if n == 1:
            hidden, _ = target.forward(mx.array([[1]]), cache, capture=False)
        else:
            hidden, _ = target.tree_forward(
                mx.array(tree.tokens)[None], cache, tree.positions(context), tree.ancestor_mask(context)
            )
        mx.eval(target.lm_head(hidden))
        for c in cache:
            c.trim(n)

    rows = []
    for n in sizes:
        if progress:
            progress(f"verify of {n} rows")
        rows.append({"rows": n, "ms": round(1000 * seconds(lambda n=n: verify(n), repeats), 2)})
    base = next((r["ms"] for r in rows if r["rows"] == 1), rows[0]["ms"])
    for r in rows:
        r["ratio"] = round(r["ms"] / base, 2)
    return {"model": model_dir, "context": context, "repeats": repeats, "results": rows}


def verify_cost_table(report: dict) -> str:
    """The report as a markdown table: rows verified, ms, T(n)/T(1)."""
    lines = [
        f"verify cost, target `{report['model']}`, KV cache of {report['context']} tokens, "
        f"median of {report['repeats']}",
        "",
        "| n (rows) | ms | T(n)/T(1) |",
        "|---:|---:|---:|",
    ]
    lines += [f"| {r['rows']} | {r['ms']:.2f} | {r['ratio']:.2f} |" for r in report["results"]]
    return "\n".join(lines)
