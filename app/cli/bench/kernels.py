"""`dflash bench kernels`: the verify kernel against `mx.quantized_matmul`, M = 1..16 rows.

So that a Mac user can check the kernel's gain on their own target with one command: for
each M, one decoder layer's projections (`mx.quantized_matmul` vs `verify_qmm`) and a
whole verify forward of M tokens with the logits (the model's own modules vs the kernel
path), which is the part of a DFlash cycle the kernel changes. For a hybrid gated-delta
target also one rollback of every gated-delta layer after a 16-token verify, keeping
1..15 tokens: the module replay (kernels off) against the tape replay through the
`gated_delta_replay` kernel. Where Metal cannot run (Linux), the report says so plainly:
the verify kernel's column is empty and the replay is not measured.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from dflash_mlx.kernels.choice import seconds as _seconds

ROWS = range(1, 17)
PREFIX = 64  # tokens in the cache before each timed verify
REPEATS = 5
REPLAY_BLOCK = 16  # the verify a timed rollback undoes
REPLAY_KEEP = (1, 4, 8, 15)  # tokens it keeps


def _quantized_target(model_path: Optional[str]):
    """The target, with its layers quantized (4 bits, group 64) if they are not already."""
    import mlx.nn as nn

    from dflash_mlx import load
    from dflash_mlx.kernels import decoder

    model, _ = load(model_path)
    layers = model.model.layers
    note = "quantized as loaded"
    if not any(decoder.kernel_takes(p) for layer in layers for p in decoder.projections(layer)):
        nn.quantize(model, group_size=64, bits=4)  # our own loaded copy, for the timing only
        note = "not quantized as loaded: quantized here to 4 bits, group 64"
    return model, note


def replay_times(model: Any, repeats: int = REPEATS) -> tuple[Optional[list[dict]], str]:
    """(ms per rollback of all gated-delta layers for each kept count in REPLAY_KEEP, module
    replay vs tape + replay kernel, or None; why not measured, or "")."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    from dflash_mlx.kernels import metal_ready
    from dflash_mlx.rollback import Checkpoint
    from dflash_mlx.targets import make_target

    own, taped = make_target(model), make_target(model).use_kernels()
    if not metal_ready():
        return None, "not measured: no Metal GPU here (the replay kernel runs only on a Mac)"
    if not taped.kernels:
        return None, "not measured: the target has no gated-delta layers the tape path knows"
    marks = {}
    for target in (own, taped):  # the same verify twice: recorded inputs (own), tapes (taped)
        cache = make_prompt_cache(model)
        target.forward(mx.array([[1] * PREFIX]), cache, capture=False)
        marks[target] = Checkpoint(cache, target.replay)
        target.forward(mx.array([[2] * REPLAY_BLOCK]), cache, capture=False, checkpoint=marks[target])
        mark = marks[target]
        mx.eval(mark.states, mark.inputs, [vars(t) for t in mark.tapes.values()])
    layers = sorted(marks[taped].tapes)

    def rollback(kernel: bool, keep: int) -> Callable[[], None]:
        def step():
            caches = []
            for i in layers:
                mark, c = marks[taped if kernel else own], ArraysCache(2)
                c.cache = list(mark.states[i])
                if kernel:
                    mark.tapes[i].rewind(c, REPLAY_BLOCK - keep)
                else:
                    own.replay(i, mark.inputs[i][:, :keep], c)
                caches.append(c.cache)
            mx.eval(caches)

        return step

    return [
        {
            "tokens": keep,
            "module_ms": 1e3 * _seconds(rollback(False, keep), repeats),
            "kernel_ms": 1e3 * _seconds(rollback(True, keep), repeats),
        }
        for keep in REPLAY_KEEP
    ], ""


def run_kernel_bench(
    model_path: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
    rows: Sequence[int] = ROWS,
    repeats: int = REPEATS,
) -> dict:
    """Time one layer's projections and a verify forward for each M in `rows`; a JSON-able report."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from dflash_mlx import default_model_path
    from dflash_mlx.kernels import decoder, metal_ready, verify_qmm
    from dflash_mlx.targets import make_target

    model, note = _quantized_target(model_path)
    metal = metal_ready()
    layer = model.model.layers[0]
    projections = [p for p in decoder.projections(layer) if decoder.kernel_takes(p)]
    dtype = projections[0].scales.dtype if projections else mx.float16
    targets = {False: make_target(model), True: make_target(model).use_kernels()}
    caches = {}
    for kernels, target in targets.items():
        caches[kernels] = make_prompt_cache(model)
        target.forward(mx.array([[1] * PREFIX]), caches[kernels], capture=False)

    def products(rows: int, kernel: bool) -> Callable[[], None]:
        inputs = [mx.random.normal((rows, p.scales.shape[1] * p.group_size)).astype(dtype) for p in projections]
        mx.eval(inputs)
        if kernel:
            return lambda: mx.eval(
                [
                    verify_qmm(x, p.weight, p.scales, p.biases, p.group_size, p.bits, use_kernel=True)
                    for x, p in zip(inputs, projections)
                ]
            )
        return lambda: mx.eval(
            [
                mx.quantized_matmul(x, p.weight, p.scales, p.biases, group_size=p.group_size, bits=p.bits)
                for x, p in zip(inputs, projections)
            ]
        )

    def verify(rows: int, kernels: bool) -> Callable[[], None]:
        tokens, target, cache = mx.array([[1] * rows]), targets[kernels], caches[kernels]

        def step():
            hidden, _ = target.forward(tokens, cache, capture=False)
            mx.eval(target.lm_head(hidden))
            trim_prompt_cache(cache, rows)

        return step

    results = []
    for m in rows:
        if progress:
            progress(f"timing M = {m}")
        results.append(
            {
                "m": m,
                "quantized_matmul_us": 1e6 * _seconds(products(m, False), repeats),
                "kernel_us": 1e6 * _seconds(products(m, True), repeats) if metal and projections else None,
                "verify_ms_own": 1e3 * _seconds(verify(m, False), repeats),
                "verify_ms_kernel_path": 1e3 * _seconds(verify(m, True), repeats),
            }
        )
    replay, replay_note = replay_times(model, repeats)
    return {
        "choice": targets[True].kernel_choice,
        "model": str(model_path or default_model_path()),
        "quantization": note,
        "metal": metal,
        "kernel_path_used": targets[True].kernels,
        "projections_per_layer": len(projections),
        "rows": results,
        "replay": replay,
        "replay_note": replay_note,
    }


def kernel_table(report: dict) -> str:
    """The report as a markdown table, with what was and was not measured said plainly."""
    lines = [
        f"model `{report['model']}` ({report['quantization']}); one layer = "
        f"{report['projections_per_layer']} projections; verify = forward of M tokens + logits"
    ]
    if not report["metal"]:
        lines.append(
            "No Metal GPU here: the kernel cannot run, so its column is empty and the kernel path "
            "times its exact fallback (mx.quantized_matmul); run this on a Mac for the real numbers."
        )
    if not report["kernel_path_used"]:
        lines.append(
            "This target's layers are not a kind the kernel path handles: both verify columns run "
            "the model's own modules."
        )
    lines += [
        "",
        "| M | mx.quantized_matmul us/layer | verify_qmm kernel us/layer | kernel speed-up "
        "| verify ms, own modules | verify ms, kernel path | cycle speed-up |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        kernel = f"{r['kernel_us']:.0f}" if r["kernel_us"] is not None else "-"
        gain = f"{r['quantized_matmul_us'] / r['kernel_us']:.2f}x" if r["kernel_us"] else "-"
        lines.append(
            f"| {r['m']} | {r['quantized_matmul_us']:.0f} | {kernel} | {gain} | {r['verify_ms_own']:.2f} "
            f"| {r['verify_ms_kernel_path']:.2f} | {r['verify_ms_own'] / r['verify_ms_kernel_path']:.2f}x |"
        )
    return "\n".join(lines + _replay_lines(report) + choice_lines(report.get("choice") or {}))


def choice_lines(timings: dict[str, dict]) -> list[str]:
    """The kernel-or-MLX choice for this model on this machine (kernels/choice.py), as a table."""
    head = "Kernel or MLX, per shape and rows (timed on first use, cached per chip, MLX version and model)"
    if not timings:
        return ["", f"{head}: nothing to choose here (no Metal GPU: MLX's own ops run)."]
    lines = ["", head + ":", "", "| shape, rows | kernel us | MLX us | runs |", "|---|---:|---:|---|"]
    for key, t in timings.items():
        runs = "kernel" if t["kernel"] else "MLX"
        lines.append(f"| {key} | {1e6 * t['kernel_s']:.0f} | {1e6 * t['mlx_s']:.0f} | {runs} |")
    return lines


def _replay_lines(report: dict) -> list[str]:
    """The gated-delta rollback part of the report: a table, or why there is none."""
    head = f"Gated-delta rollback after a {REPLAY_BLOCK}-token verify (all gated-delta layers)"
    if report.get("replay") is None:
        return ["", f"{head}: {report.get('replay_note') or 'not measured'}."]
    lines = [
        "",
        head + ":",
        "",
        "| tokens kept | module replay ms | replay kernel ms | speed-up |",
        "|---:|---:|---:|---:|",
    ]
    for r in report["replay"]:
        lines.append(
            f"| {r['tokens']} | {r['module_ms']:.3f} | {r['kernel_ms']:.3f} | {r['module_ms'] / r['kernel_ms']:.2f}x |"
        )
    return lines
