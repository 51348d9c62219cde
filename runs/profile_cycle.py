"""Per-part cost of one DFlash cycle at b = 1, 4, 8, 16 (SmolLM2-135M float32, shipped drafter,
~300-token context); each part is forced with mx.eval so that it can be timed alone."""
import statistics, time
import dflash_mlx  # noqa: F401
import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache
from dflash_mlx import load, load_draft, make_prompt_cache
from dflash_mlx.sampling import greedy_accept
from dflash_mlx.targets import make_target

model, tok = load()
draft = load_draft(None, model=model)
target = make_target(model, draft.config.target_layer_ids)
cache = make_prompt_cache(model, draft)
ctx = tok.encode("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 12)[:300]
_, feats = target.forward(mx.array(ctx)[None], cache.target)
draft.append_context(feats, cache.draft)
mx.eval([c.state for c in cache.target] + [c.keys for c in cache.draft])
REPS = 15

def timed(fn):
    out = []
    for _ in range(REPS):
        tic = time.perf_counter(); fn(); out.append(time.perf_counter() - tic)
    return statistics.median(out) * 1000

rows = {}
for b in (1, 4, 8, 16):
    block = mx.array([[ctx[-1]] + [draft.config.mask_token_id] * (b - 1)])
    parts = {}
    if b > 1:
        parts["drafter forward"] = timed(lambda: mx.eval(mx.argmax(draft.propose(block, cache.draft, target), axis=-1)))
        drafts = mx.argmax(draft.propose(block, cache.draft, target), axis=-1)
        mx.eval(drafts)
        tokens = mx.concatenate([block[0, :1], drafts])[None]
    else:
        tokens = block
    def verify():
        h, f = target.forward(tokens, cache.target, capture=True)
        logits = target.lm_head(h)[0]
        mx.eval(logits, f)
        trim_prompt_cache(cache.target, b)
        return logits, f
    parts["target verify"] = timed(verify)
    logits, f = verify()
    trim_prompt_cache(cache.target, 0)
    if b > 1:
        parts["acceptance + host sync"] = timed(lambda: greedy_accept(drafts, logits)[0].item())
    else:
        parts["argmax + host sync"] = timed(lambda: mx.argmax(logits[-1]).item())
    h, f = target.forward(tokens, cache.target, capture=True)
    mx.eval(h, f)
    parts["cache trim"] = timed(lambda: trim_prompt_cache(cache.target, 0))
    trim_prompt_cache(cache.target, b)
    def append():
        draft.append_context(f[:, :1], cache.draft)
        mx.eval([c.keys for c in cache.draft])
        trim_prompt_cache(cache.draft, 1)
    parts["context append (1 token)"] = timed(append)
    rows[b] = parts
base = rows[1]["target verify"]
for b, parts in rows.items():
    total = sum(parts.values())
    print(f"b={b}: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + f" | sum {total:.1f} ms, verify/T1 {parts['target verify'] / base:.2f}, sum/T1 {total / base:.2f}")
