"""Speculation inside the batch (`dflash_mlx/batch_spec.py`): each row's text equals its solo text.

Rows of different prompt lengths and max_tokens join between speculative cycles and leave
at their own ends; cycles of several widths (and plain steps) alternate. Each row drafts
with a scripted drafter that knows that row's true continuation and corrupts it where the
row's pattern says (the row told by its own context cache), so the rows accept different
lengths in the same verify and every per-row rollback runs: each row's tokens must equal
* greedy: mlx-lm's own `generate_step` on that prompt alone;
* seeded T > 0: our one-sequence loop on that request alone, same seed.
On tiny random llama, qwen3 and hybrid qwen3_5 targets, and on the real SmolLM2 target.
A sliding-window family and a row without drafter context take plain steps, exactly; a
row extracted with its context continues exactly in another batch. Rows guessing with
prompt lookup (some cycles every row, some a few) keep their solo text too, and a cycle
where every row guesses its whole block runs no drafter. The width chooser
(`batch_width.py`) is tested on fixed cost tables.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.acceptance import Acceptance, GuessRecord, Records
from dflash_mlx.batch_spec import BatchSpeculator, propose_rows, rows_draft_together, speculation_refusal
from dflash_mlx.batch_width import CPU_VERIFY_COST, BatchWidth
from dflash_mlx.drafter import Drafter
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.targets import make_target

from references import dflash_tokens, greedy_reference, target_alone
from batch_rows import BLOCK, PATTERNS, SAMPLED, join_row, prefill, row_prompt, scripted_drafter
from tiny_targets import VOCAB, tiny_drafter_config, tiny_target

#: (prompt length, max tokens, cycle it joins at)
REQUESTS = [(5, 20, 0), (13, 9, 0), (1, 16, 2), (9, 12, 5)]
#: a one-token prompt opens the batch (its KV layers merge from empty caches), then one joins
ONE_TOKEN_FIRST = [(1, 16, 0), (9, 12, 1)]
#: the widths of successive cycles (1: a plain batched step)
WIDTHS = [4, 6, 1, 3, 6, 2, 1, 5, 6, 4]


def run(model, drafter, samplings, solo, vocab: int = VOCAB, requests=REQUESTS) -> dict[int, list[int]]:
    """Decode `requests` in one speculating batch with `drafter` scripted by the `solo` texts;
    each request's first max_tokens tokens by its index."""
    spec, out, owner, accepted = BatchSpeculator(model, drafter), {}, {}, []
    for cycle, width in enumerate(WIDTHS * 4):
        for k, (length, _, joins) in enumerate(requests):
            if joins == cycle:
                prompt = row_prompt(length, k, vocab)
                uid, draft = join_row(spec, model, drafter, prompt, samplings[k])
                drafter.watch(draft, prompt + solo[k], PATTERNS[k])
                owner[uid], out[k] = k, []
        if not len(spec):
            # the rows of one verify accepted different lengths: every per-row rollback ran
            assert sum(len(a) > 1 for a in accepted) >= 4 and max(max(a) for a in accepted) >= 3
            return out
        # a one-token prompt has no drafter context yet: its first cycle is a plain step
        speculates = width > 1 and spec.speculation_refusal() is None
        cycle_out = spec.speculate(width) if speculates else spec.cycle()
        accepted.append({c.accepted for c in cycle_out})
        for c in cycle_out:
            k = owner[c.uid]
            out[k] += c.tokens
            if len(out[k]) >= requests[k][1]:
                out[k] = out[k][: requests[k][1]]
                spec.remove(c.uid)
    raise AssertionError("the requests did not finish")


@pytest.fixture(scope="module")
def models():
    return {f: tiny_target(f, scale=2.0) for f in ("llama", "qwen3", "qwen3_5", "gpt_oss")}


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_greedy_rows_equal_their_solo_text(models, family):
    model = models[family]
    assert speculation_refusal(model, scripted_drafter(model)) is None
    solo = [greedy_reference(model, row_prompt(length, k), n + BLOCK) for k, (length, n, _) in enumerate(REQUESTS)]
    out = run(model, scripted_drafter(model), [SamplingParams()] * len(REQUESTS), solo)
    for k, (_, n, _) in enumerate(REQUESTS):
        assert out[k] == solo[k][:n], f"{family} request {k}: batched text differs from mlx-lm's"


def test_a_one_token_prompt_can_open_the_batch(models):
    """Its empty KV caches still merge into hole caches: the rows roll back one by one."""
    model = models["llama"]
    solo = [
        greedy_reference(model, row_prompt(length, k), n + BLOCK) for k, (length, n, _) in enumerate(ONE_TOKEN_FIRST)
    ]
    out = run(model, scripted_drafter(model), [SamplingParams()] * len(ONE_TOKEN_FIRST), solo, requests=ONE_TOKEN_FIRST)
    for k, (_, n, _) in enumerate(ONE_TOKEN_FIRST):
        assert out[k] == solo[k][:n], f"request {k}: batched text differs from mlx-lm's"


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_seeded_rows_equal_their_solo_text(models, family):
    model = models[family]
    samplings = [SAMPLED[k % len(SAMPLED)] for k in range(len(REQUESTS))]
    samplings[3] = SamplingParams()  # a greedy row among sampled ones
    solo = [
        dflash_tokens(model, row_prompt(n_p, k), None, n + BLOCK, sampling=samplings[k])[0]
        for k, (n_p, n, _) in enumerate(REQUESTS)
    ]
    out = run(model, scripted_drafter(model), samplings, solo)
    for k, (_, n, _) in enumerate(REQUESTS):
        assert out[k] == solo[k][:n], f"{family} request {k}: batched text differs from its solo text"


def test_smollm2_rows_equal_their_solo_text(default_model):
    """The real target, greedy and seeded rows in one batch."""
    model, tokenizer = default_model
    vocab = model.args.vocab_size
    samplings = [SamplingParams(), SAMPLED[0], SamplingParams(), SAMPLED[1]]
    prompts = [row_prompt(length, k, vocab) for k, (length, *_) in enumerate(REQUESTS)]
    solo = [target_alone(model, p, n + BLOCK, s) for p, (_, n, _), s in zip(prompts, REQUESTS, samplings)]
    out = run(model, scripted_drafter(model, vocab), samplings, solo, vocab)
    for k, (_, n, _) in enumerate(REQUESTS):
        assert out[k] == solo[k][:n], f"SmolLM2 request {k}: batched text differs from its solo text"


def test_one_drafter_forward_drafts_for_every_row(models):
    """A DFlash v1 drafter drafts every row's block in one forward (context caches side by
    side, left-padded): each row's logits are its own forward's, and the batch stays exact."""
    model = models["qwen3"]
    mx.random.seed(5)
    drafter = Drafter(tiny_drafter_config(make_target(model).num_layers, BLOCK, mask_token_id=VOCAB - 1))
    spec = BatchSpeculator(model, drafter)
    prompts = [row_prompt(n, k) for k, (n, *_) in enumerate(REQUESTS)]
    uids = [join_row(spec, model, drafter, p, SamplingParams())[0] for p in prompts]
    out = {uid: [] for uid in uids}
    for width in WIDTHS:
        for c in spec.speculate(width) if width > 1 and spec.speculation_refusal() is None else spec.cycle():
            out[c.uid] += c.tokens
    contexts = [spec.context(uid) for uid in uids]
    assert rows_draft_together(drafter, contexts) and len({c[0].offset for c in contexts}) == len(uids)
    blocks = mx.array([[spec.rows[i].last] + [VOCAB - 1] * (BLOCK - 1) for i in range(len(uids))])
    together = propose_rows(drafter, spec.pair.target, blocks, contexts)
    for i, context in enumerate(contexts):
        alone = drafter.propose(blocks[i : i + 1], context, spec.pair.target)
        assert mx.allclose(together[i], alone, atol=1e-4).item(), f"row {i}'s drafts differ from its own forward's"
    for k, uid in enumerate(uids):
        assert out[uid] == greedy_reference(model, prompts[k], len(out[uid]))


def test_sliding_window_targets_take_plain_steps(models):
    """gpt-oss's windowed layers cannot give back one row's tokens: the batch says so, refuses
    `speculate` and steps plainly in `cycle`, every text still its solo text."""
    model = models["gpt_oss"]
    drafter = scripted_drafter(model)
    assert "RotatingKVCache" in speculation_refusal(model, drafter)
    spec = BatchSpeculator(model, drafter)
    uids = [join_row(spec, model, drafter, row_prompt(n, k), SamplingParams())[0] for k, (n, *_) in enumerate(REQUESTS)]
    with pytest.raises(ValueError, match="RotatingKVCache"):
        spec.speculate(4)
    out = {uid: [] for uid in uids}
    for _ in range(10):
        for c in spec.cycle():
            out[c.uid] += c.tokens
    for k, uid in enumerate(uids):
        assert out[uid] == greedy_reference(model, row_prompt(REQUESTS[k][0], k), 10)


def test_a_row_without_context_and_a_handed_over_row(models):
    """A row that joins without drafter context makes the batch step plainly until it
    leaves; a row extracted with its context (`extract`, `context`) continues exactly in
    another batch, speculating."""
    model = models["qwen3"]
    drafter = scripted_drafter(model)
    prompts = [row_prompt(7, 1), row_prompt(4, 2)]
    solo = [greedy_reference(model, p, 30) for p in prompts]
    spec = BatchSpeculator(model, drafter)
    a, draft = join_row(spec, model, drafter, prompts[0], SamplingParams())
    drafter.watch(draft, prompts[0] + solo[0], PATTERNS[2])
    cache = make_prompt_cache(model)
    list(prefill(model, prompts[1][:-1], cache))
    b = spec.add(cache, prompts[1][-1], SamplingParams())
    assert "without drafter context" in spec.speculation_refusal()
    got = {a: [], b: []}
    for _ in range(4):
        for c in spec.cycle():
            got[c.uid] += c.tokens
    spec.remove(b)
    assert spec.speculation_refusal() is None and got[b] == solo[1][:4]
    for c in spec.speculate(5) + spec.speculate(3):
        got[a] += c.tokens
    (cache, last), context = spec.extract(a), spec.context(a)
    other, record = BatchSpeculator(model, drafter), Acceptance(BLOCK)  # what the row learned before
    c = other.add(cache, last, SamplingParams(), logprobs=True, draft=context, records=Records(record))
    for width in (6, 1, 4):
        (done,) = other.speculate(width) if width > 1 else other.cycle()
        assert len(done.logprobs) == len(done.tokens) and done.logprobs[0].shape == (VOCAB,)
        got[a] += done.tokens
    assert got[a] == solo[0][: len(got[a])] and c == 0
    assert other.outlooks(BLOCK)[0].records.drafts is record and record.trials[1] > 0  # the row's own record learns on
    with pytest.raises(ValueError, match="draft holds"):
        other.add(make_prompt_cache(model), 1, SamplingParams(), draft=context)
    with pytest.raises(ValueError, match="records cover a block of 3"):
        other.add(*spec.extract(a), SamplingParams(), records=Records(Acceptance(3)))


class CountingDrafter(Drafter):
    """A random drafter that counts its forwards."""

    calls = 0

    def __call__(self, block_embeddings, cache):
        self.calls += 1
        return super().__call__(block_embeddings, cache)


def test_lookup_guesses_keep_each_rows_text(models):
    """Rows whose prompts repeat a pattern verify prompt lookup's guesses (their records
    trust guesses, not the random drafter): a first cycle where every row guesses its whole
    block runs no drafter forward, later cycles mix guessing rows and drafting ones, and
    every row's tokens are its solo text, greedy or seeded."""
    model = models["qwen3"]
    mx.random.seed(7)
    drafter = CountingDrafter(tiny_drafter_config(make_target(model).num_layers, BLOCK, mask_token_id=VOCAB - 1))
    mx.eval(drafter.parameters())
    prompts = [[5, 9, 2] * 6, [11, 4, 30] * 5 + [11], [8, 8, 3] * 4]
    samplings = [SamplingParams(), SAMPLED[0], SamplingParams()]
    spec, uids = BatchSpeculator(model, drafter), []
    for prompt, sampling in zip(prompts, samplings):
        cache, draft = make_prompt_cache(model), drafter.make_cache()
        list(prefill(model, prompt[:-1], cache, draft=(drafter, draft)))
        trusting = Records(Acceptance(BLOCK), GuessRecord(hits=50.0, tries=50.0))
        uids.append(spec.add(cache, prompt[-1], sampling, draft=draft, records=trusting, history=prompt[:-1], lookup=4))
    got, guessed, kept = {uid: [] for uid in uids}, [], []
    for width in [4] + WIDTHS:
        out = spec.speculate(width) if width > 1 else spec.cycle()
        guessed.append([c.guessed for c in out])
        kept += [c.accepted for c in out if c.guessed]
        for c in out:
            got[c.uid] += c.tokens
        if len(guessed) == 1:
            assert all(guessed[0]) and drafter.calls == 0  # the whole batch guessed: no drafter forward
    assert any(any(g) and not all(g) for g in guessed)  # rows guessing beside rows drafting
    assert max(kept) >= 2  # guessed tokens were accepted
    for uid, prompt, sampling in zip(uids, prompts, samplings):
        solo = target_alone(model, prompt, len(got[uid]), sampling)
        assert got[uid] == solo, f"row {uid}: batched text with lookup differs from its solo text"
    with pytest.raises(ValueError, match="lookup must be"):
        spec.add(make_prompt_cache(model), 1, SamplingParams(), lookup=-1)


def _records(rate: float, rows: int) -> list[Acceptance]:
    """`rows` acceptance records that have seen drafts accepted at `rate` (per position)."""
    records = []
    for _ in range(rows):
        record = Acceptance(8)
        for cycle in range(40):
            accepted = next((k for k in range(7) if ((cycle * 7 + k * 3) % 100) / 100 >= rate), 7)
            record.learn(8, accepted)
        records.append(record)
    return records


def test_width_chooser_on_fixed_tables():
    chooser = BatchWidth((1, 4, 8))
    assert chooser.relative(4, 8) == pytest.approx(2.46) and chooser.relative(6, 4) == pytest.approx(1.745)
    assert chooser.relative(32, 8) == pytest.approx(3.82) and chooser.relative(1, 6) == pytest.approx(1.055)
    # rows dear (16 rows) and drafts poor: plain steps; one cheap row with good drafts: the block
    assert chooser.best(_records(0.2, 16)) == 1
    assert chooser.best(_records(0.9, 1)) == 8
    # on a table where rows cost nothing extra, even middling drafts are worth a block
    flat = BatchWidth((1, 4, 8), {(b, w): 1.0 for b in (1, 16) for w in (4, 8)})
    assert flat.best(_records(0.5, 16)) > 1
    assert BatchWidth((1, 4), CPU_VERIFY_COST).best([]) == 1


def test_width_chooser_learns_measured_costs_and_probes():
    chooser = BatchWidth((1, 4, 8), explore=0.25)
    good = _records(0.9, 4)
    assert chooser.choose(good) == 8
    for _ in range(10):  # a machine on which wide cycles turn out far dearer than the table says
        chooser.update(4, 8, 10.0)
        chooser.update(4, 4, 10.0)
        chooser.update(4, 1, 1.0)
    assert chooser.cost(4, 8) == pytest.approx(10.0) and chooser.cost(4, 1) == pytest.approx(1.0)
    assert chooser.cost(8, 8) == pytest.approx(3.13)  # rows never measured: the table's units
    picks = [chooser.choose(good) for _ in range(8)]
    assert picks.count(1) == 6 and picks.count(4) == 2  # plain steps, probing every 4th cycle
    with pytest.raises(ValueError, match="widths"):
        BatchWidth((0, 4))
