"""Where a SmolLM2 verify's extra time over a one-token step goes: the transcendental ops
(SiLU, softmax: MLX's CPU `exp` is not vectorised) against the rest, at the shapes of a
16-token verify after a 300-token context; and `mx.exp` against `np.exp` per element.

    python -m benchmarks.verify_exp   # from the repository root, on an idle machine
"""

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from dflash_mlx import load, load_draft
from dflash_mlx.kernels.choice import seconds
from dflash_mlx.targets import make_target

CONTEXT, HEAD_DIM = 300, 64


def median_ms(fn: Callable[[], object], repeats: int = 15) -> float:
    """The median wall time of `fn` in milliseconds (`kernels.choice.seconds`)."""
    return seconds(fn, repeats) * 1e3


def op_costs(layers: int, heads: int, kv_heads: int, width: int, b: int) -> tuple[float, float, float]:
    """ms of `layers` SiLUs over (1, b, width), softmaxes over (1, heads, b, CONTEXT + b) (each
    less the same adds alone), and attentions of b queries over CONTEXT + b keys."""
    x = mx.random.normal((1, b, width))
    q = mx.random.normal((1, heads, b, HEAD_DIM))
    k = mx.random.normal((1, kv_heads, CONTEXT + b, HEAD_DIM))
    v = mx.random.normal((1, kv_heads, CONTEXT + b, HEAD_DIM))
    s = mx.random.normal((1, heads, b, CONTEXT + b))
    mx.eval(x, q, k, v, s)
    adds_x = median_ms(lambda: mx.eval([x + i for i in range(layers)]))
    adds_s = median_ms(lambda: mx.eval([s + i for i in range(layers)]))
    silu = median_ms(lambda: mx.eval([nn.silu(x + i) for i in range(layers)])) - adds_x
    soft = median_ms(lambda: mx.eval([mx.softmax(s + i, axis=-1) for i in range(layers)])) - adds_s
    mask = "causal" if b > 1 else None
    sdpa = median_ms(
        lambda: mx.eval(
            [mx.fast.scaled_dot_product_attention(q + i, k, v, scale=HEAD_DIM**-0.5, mask=mask) for i in range(layers)]
        )
    )
    return silu, soft, sdpa


def verify_ms(target, cache, tokens: mx.array) -> float:
    """ms of one verify of `tokens` (1, b): the forward with its captured features and the LM
    head, the cache trimmed back after each."""

    def verify() -> None:
        hidden, features = target.forward(tokens, cache)
        mx.eval(target.lm_head(hidden), features)
        trim_prompt_cache(cache, tokens.shape[1])

    return median_ms(verify)


def main() -> None:
    model, tokenizer = load()
    drafter = load_draft(None, model=model)
    target = make_target(model, drafter.config.target_layer_ids)
    cache = make_prompt_cache(model)  # the target's own KV cache
    context = tokenizer.encode("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 12)[:CONTEXT]
    target.forward(mx.array(context)[None], cache)
    mx.eval([c.state for c in cache])
    args = model.args
    for b in (1, 16):
        verify = verify_ms(target, cache, mx.array([context[-b:]]))  # (1, b)
        layers = args.num_hidden_layers
        heads = (args.num_attention_heads, args.num_key_value_heads)
        silu, soft, sdpa = op_costs(layers, *heads, args.intermediate_size, b)
        print(f"b={b}: verify {verify:.1f} ms | {layers} x: SiLU {silu:.1f}, softmax {soft:.1f}, sdpa {sdpa:.1f} ms")
    e = mx.random.normal((1 << 20,))
    mx.eval(e)
    a = np.array(e)
    print(f"mx.exp {median_ms(lambda: mx.eval(mx.exp(e))) * 1e6 / e.size:.1f} ns/element")
    print(f"np.exp {median_ms(lambda: np.exp(a)) * 1e6 / a.size:.1f} ns/element")


if __name__ == "__main__":
    main()
