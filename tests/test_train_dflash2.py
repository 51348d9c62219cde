"""Training a DFlash2 drafter (`dflash train --arch dflash2`): the selector's loss, gradients
that reach the convolutions and the selector, a DFlash2 drafter started from a trained v1
drafter that drafts exactly as it does, and the command end to end (a drafter that
`load_draft` loads as DFlash2 and that decodes losslessly)."""

from __future__ import annotations

import json

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten
from tiny_training import TINY2, random_training_data, tiny_target

from dflash_mlx import stream_generate
from dflash_mlx.drafter2 import CandidateSelector, Drafter2, Drafter2Config
from dflash_mlx.loading import DEFAULT_DRAFT_DIR, load_draft
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.targets import make_target
from dflash_mlx.train.initialize import init_from
from dflash_mlx.train.loop import TrainArgs, Trainer
from dflash_mlx.train.objective import block_forward, loss_fn, selector_loss

GREEDY = SamplingParams().draws(0)  # greedy choices: positions do not matter

#: and for the default target (hidden 576).
SMOL2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=8)


def tiny_selector(vocab: int = 10, hidden: int = 4, rank: int = 3, top_k: int = 3) -> CandidateSelector:
    cfg = Drafter2Config(
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        intermediate_size=8,
        vocab_size=vocab,
        num_target_layers=2,
        target_layer_ids=[0],
        mask_token_id=vocab - 1,
        conv_kernel_size=2,
        conv_group_size=2,
        selector_rank=rank,
        selector_top_k=top_k,
    )
    mx.random.seed(3)
    selector = CandidateSelector(cfg)
    mx.eval(selector.parameters())
    return selector


def test_selector_loss_is_cross_entropy_over_the_candidates_and_masked_without_the_label():
    """Hand computed over a sampled vocabulary (columns = token ids 0 2 3 5 7 8): position 0's
    label is among the top 3, position 1's is not (loss 0 there)."""
    sel = tiny_selector()
    rng = np.random.default_rng(0)
    ids = np.array([0, 2, 3, 5, 7, 8])
    hidden = rng.normal(size=(1, 2, 4)).astype(np.float32)
    logits = np.array([[[0.5, 2.0, -1.0, 1.5, 0.1, 1.0], [3.0, 2.0, 1.0, -2.0, 0.0, -1.0]]], dtype=np.float32)
    predecessors, labels = np.array([[4, 7]]), np.array([[3, 5]])  # column 3 is a top-3 of row 0; 5 is not of row 1
    loss, pick = selector_loss(
        sel, mx.array(hidden), mx.array(logits), mx.array(predecessors), mx.array(labels), mx.array(ids)
    )
    P, S = np.array(sel.predecessor_codebook), np.array(sel.successor_codebook)
    W = np.array(sel.hidden_projection.weight)
    for i in range(2):
        top = np.argsort(-logits[0, i])[:3]
        scores = logits[0, i, top] + S[ids[top]] @ ((W @ hidden[0, i]) * P[predecessors[0, i]])
        assert pick[0, i].item() == top[np.argmax(scores)]
        if labels[0, i] in top:
            want = np.log(np.exp(scores).sum()) - scores[list(top).index(labels[0, i])]
            np.testing.assert_allclose(loss[0, i].item(), want, rtol=1e-5)
        else:
            assert loss[0, i].item() == 0
    assert 0 < loss[0, 0].item()


def test_teacher_forced_picks_are_the_inference_path():
    """Fed the path inference chose as predecessors, the training scores pick that path."""
    sel = tiny_selector(vocab=40, hidden=8, rank=4, top_k=5)
    rng = np.random.default_rng(1)
    hidden = mx.array(rng.normal(size=(6, 8)).astype(np.float32))
    logits = mx.array(rng.normal(size=(6, 40)).astype(np.float32))
    path = sel.select(hidden, logits, mx.array(11), GREEDY)
    predecessors = mx.concatenate([mx.array([11]), path[:-1]])
    _, pick = selector_loss(sel, hidden[None], logits[None], predecessors[None], path[None])
    assert pick[0].tolist() == path.tolist()


def flat_params(module) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(module.parameters())}


def dflash2_params(params: dict) -> list[str]:
    return [k for k in params if "conv" in k or k.startswith("candidate_selector")]


def test_gradients_reach_convolutions_and_selector_and_training_lowers_the_loss(tmp_path, monkeypatch):
    """The neutral start (identity convolutions, zero selector projection) still gets
    gradients everywhere: the codebooks from the second step on (their edge is 0 until the
    projection moves)."""
    model = tiny_target(vocab=48)
    data = random_training_data(tmp_path, monkeypatch, model, max_token=40)
    trainer = Trainer(
        TrainArgs(
            data=str(data),
            out=str(tmp_path / "d"),
            num_layers=1,
            target_layer_ids=[1, 3],
            block_size=4,
            batch_size=4,
            num_anchors=8,
            lr=3e-3,
            max_steps=40,
            log_every=10,
            progress=False,
            checkpoint_every=1000,
            loss_vocab="sampled",
            negatives=8,
            **TINY2,
        ),
        log=lambda s: None,
    )
    assert isinstance(trainer.drafter, Drafter2)
    start = flat_params(trainer.drafter)
    names = dflash2_params(start)
    assert len(names) == 7  # 2 convolutions x (base kernel, projection) + projection + 2 codebooks

    def grads() -> dict:
        batch, vocab = trainer.batch_for_step()
        return dict(tree_flatten(trainer.value_and_grad(trainer.drafter, batch, vocab)[1]))

    first = grads()
    for k in names:
        assert (np.abs(np.array(first[k])).max() > 0) == ("codebook" not in k), k
    trainer.step()
    second = grads()
    assert all(np.abs(np.array(second[k])).max() > 0 for k in names)
    hist = trainer.run()["history"]
    assert hist[-1]["loss"] < 0.95 * hist[0]["loss"] and hist[-1]["acc"][0] > 2 * hist[0]["acc"][0], hist
    end = flat_params(trainer.drafter)
    for k in names:  # moved by Adam steps, not only by weight decay
        assert np.abs(end[k] - start[k]).max() > 1e-3, k
    assert_selector_term_is_teacher_forced(trainer)


def assert_selector_term_is_teacher_forced(trainer: Trainer) -> None:
    """loss_fn's selector term is `selector_loss` with predecessors [block token 0, true
    tokens of positions 1..B-2] (as token ids of the sampled vocabulary), under w_k."""
    batch, vocab = trainer.batch_for_step()
    drafter, target, w = trainer.drafter, trainer.target, trainer.weights
    with_term, without = (loss_fn(drafter, target, batch, w, 0.5, vocab, s)[0].item() for s in (1.0, 0.0))
    labels, v = np.array(batch.labels), np.array(vocab)
    predecessors = np.repeat(np.array(batch.block_tokens)[:, :1], labels.shape[1], axis=1)
    predecessors[:, 2:] = v[labels[:, 1:-1]]
    h = block_forward(drafter, batch.features, target.embed(batch.block_tokens), batch.anchors)
    logits = h @ target.head_rows(vocab).T
    term, _ = selector_loss(drafter.candidate_selector, h, logits, mx.array(predecessors), batch.labels, vocab)
    weights = np.array(w)[None] * np.array(batch.valid)
    assert term.max().item() > 0
    np.testing.assert_allclose(with_term - without, (np.array(term) * weights).sum() / weights.sum(), rtol=1e-4)


def chat(tokenizer, text: str = "List the numbers from 1 to 20, one per line.") -> list[int]:
    """A chat prompt on which the shipped drafter gets drafts accepted."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def real_block(model, tokenizer, drafter):
    """Hidden states and greedy draft of the first block after a real chat prompt."""
    prompt = chat(tokenizer, "Name three colours.")
    target = make_target(model, drafter.config.target_layer_ids)
    _, feats = target.forward(mx.array([prompt]), [None] * target.num_layers)
    cache = drafter.make_cache()
    drafter.append_context(feats[:, :-1], cache)
    block = mx.array([[prompt[-1]] + [drafter.config.mask_token_id] * (drafter.config.block_size - 1)])
    hidden = drafter.hidden(block, cache, target)
    return hidden, drafter.draft(block, cache, target, GREEDY)


def test_dflash2_from_v1_drafts_exactly_as_v1(default_model):
    """The shipped v1 drafter turned into DFlash2: same hidden states and draft on a real
    block, and the same tokens and accepted lengths over a real generation."""
    model, tokenizer = default_model
    v1 = load_draft(str(DEFAULT_DRAFT_DIR), draft_vocab="none")  # as init_from: the whole vocabulary
    v2 = init_from(str(DEFAULT_DRAFT_DIR), v1.config.block_size, SMOL2)
    assert isinstance(v2, Drafter2) and v2.config.target_layer_ids == v1.config.target_layer_ids
    (h1, t1), (h2, t2) = real_block(model, tokenizer, v1), real_block(model, tokenizer, v2)
    assert mx.abs(h1 - h2).max().item() < 1e-5
    assert t1.tolist() == t2.tolist()
    prompt = chat(tokenizer)
    runs = [list(stream_generate(model, tokenizer, prompt, d, max_tokens=32, block_size=8)) for d in (v1, v2)]
    assert [r.token for r in runs[0]] == [r.token for r in runs[1]]
    assert runs[0][-1].stats.accepted_lengths == runs[1][-1].stats.accepted_lengths
    assert max(runs[0][-1].stats.accepted_lengths) > 1  # it drafts something right


def test_train_cli_dflash2_from_v1_loads_and_decodes_losslessly(tmp_path, default_model, default_model_dir):
    """`dflash train --arch dflash2 --init-from` the shipped v1 drafter, a few steps on the
    real target; `load_draft` gives a DFlash2 drafter whose greedy output is mlx-lm's."""
    from convert_helpers import cli

    model, tokenizer = default_model
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "train.jsonl", "w") as fh:
        for i in range(4):
            fh.write(
                json.dumps(
                    {
                        "id": str(i),
                        "source": "t",
                        "prompt_ids": rng.integers(100, 9000, 6).tolist(),
                        "completion_ids": rng.integers(100, 9000, 24).tolist(),
                    }
                )
                + "\n"
            )
    out = tmp_path / "d2"
    result = cli(
        "train",
        "--arch",
        "dflash2",
        "--init-from",
        DEFAULT_DRAFT_DIR,
        "--data",
        data,
        "--out",
        out,
        "--model",
        default_model_dir,
        "--block-size",
        "8",
        "--batch-size",
        "2",
        "--num-anchors",
        "4",
        "--loss-vocab",
        "sampled",
        "--negatives",
        "64",
        "--max-steps",
        "3",
        "--eval-minutes",
        "0",
        "--no-progress",
        *[a for k, v in SMOL2.items() for a in (f"--{k.replace('_', '-')}", v)],
    )
    assert result.exit_code == 0, result.output
    assert "DFlash2DraftModel, init " in result.output
    drafter = load_draft(str(out), model=model)
    assert isinstance(drafter, Drafter2) and drafter.config.selector_rank == 32
    prompt = chat(tokenizer)
    want = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=32)]
    got = list(stream_generate(model, tokenizer, prompt, drafter, max_tokens=32, block_size=8))
    assert [r.token for r in got] == want
    assert max(got[-1].stats.accepted_lengths) > 1
    exported = cli("export", out, tmp_path / "zlab", "--dtype", "float32")  # z-lab's layout, same tensors
    assert exported.exit_code == 0, exported.output
    assert json.loads((tmp_path / "zlab" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    again = dict(tree_flatten(load_draft(str(tmp_path / "zlab")).parameters()))
    assert all(mx.array_equal(again[k], v).item() for k, v in tree_flatten(drafter.parameters()))
