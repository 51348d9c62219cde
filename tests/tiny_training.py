"""The tiny world the training tests train in: a frozen tiny llama target (`tiny_target`),
a drafter for it (`tiny_drafter`), the tokenizer training asks for (`TinyTok`), eight random
sequences on disk with `load()` returning the tiny target (`random_training_data`), and the
DFlash2 training fields that fit it (`TINY2`)."""

from __future__ import annotations

import json

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from dflash_mlx.drafter import Drafter
from dflash_mlx.targets import make_target
from dflash_mlx.train.checkpoint import TrainArgs
from dflash_mlx.train.initialize import make_config
from dflash_mlx.train.features import FeatureStore
import tiny_targets

#: DFlash2 training fields for the tiny target (hidden 32: four groups of 8 channels).
TINY2 = dict(arch="dflash2", conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=4)


def tiny_target(vocab=64, layers=4, hidden=32, seed=0):
    """A frozen tiny llama (`tiny_targets.tiny_target`) of `hidden` wide (heads of
    hidden / 4), tied embeddings, a vocabulary of `vocab`: the target the drafters train on."""
    model = tiny_targets.tiny_target(
        "llama",
        seed,
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=64,
        head_dim=hidden // 4,
        rms_norm_eps=1e-5,
        attention_bias=False,
        tie_word_embeddings=True,
        max_position_embeddings=None,  # as a config without one: the drafter's default context
    )
    model.freeze()
    return model


def tiny_drafter(model, layers=2, block_size=8, ids=(0, 2), seed=1):
    cfg = make_config(
        make_target(model),
        num_layers=layers,
        target_layer_ids=list(ids),
        block_size=block_size,
        mask_token_id=model.args.vocab_size - 1,
    )
    mx.random.seed(seed)
    d = Drafter(cfg)
    mx.eval(d.parameters())
    return d


class TinyTok:
    """What training asks of a tokenizer, for the tiny target's 48-token vocabulary."""

    eos_token_id = 47
    eos_token_ids = {47}
    all_special_ids = [46, 47]
    chat_template = None

    def convert_ids_to_tokens(self, i):
        return f"<{i}>"

    def encode(self, text):  # held-out prompts (no chat template): characters as ids below the EOS
        return [ord(c) % 40 for c in text]


def random_training_data(tmp_path, monkeypatch, model, max_token: int):
    """Eight random prompt/answer sequences on disk, and `load()` returning the tiny target."""
    import dflash_mlx.loading as loading

    rng = np.random.default_rng(0)
    data = tmp_path / "train.jsonl"
    with open(data, "w") as fh:
        for i in range(8):
            fh.write(
                json.dumps(
                    {
                        "id": str(i),
                        "source": "t",
                        "prompt_ids": rng.integers(0, max_token, 5).tolist(),
                        "completion_ids": rng.integers(0, max_token, 20).tolist(),
                    }
                )
                + "\n"
            )
    monkeypatch.setattr(loading, "load", lambda path=None, **kw: (model, TinyTok()))
    return data


def tiny_train_args(data, out, **fields) -> TrainArgs:
    """A run on the tiny world (`random_training_data`, `tiny_target`): one layer reading
    layers 1 and 3, B = 4, 2 sequences of 4 blocks a step, a checkpoint every step; `fields`
    replace any of it."""
    common = dict(
        num_layers=1,
        target_layer_ids=[1, 3],
        block_size=4,
        batch_size=2,
        num_anchors=4,
        progress=False,
        checkpoint_every=1,
        seed=3,
    )
    return TrainArgs(data=str(data), out=str(out), **{**common, **fields})


def store_size(data) -> int:
    """How many sequences of `data` have features in its store (layers 1 and 3 of the tiny target)."""
    (store,) = [p for p in (data.parent / "features").iterdir() if p.is_dir()]
    return len(FeatureStore(store, [1, 3], 64, 8))


def batches_trained(data, monkeypatch) -> list[list[int]]:
    """The list that the steps' batches will be recorded in, as the data's sequence indices."""
    import dflash_mlx.train.loop as loop
    from dflash_mlx.train.data import load_sequences

    index = {tuple(t): i for i, (_, t, _) in enumerate(load_sequences(data))}
    trained: list[list[int]] = []
    make_batch = loop.make_batch

    def recording(seqs, *rest):
        trained.append(sorted(index[tuple(t)] for t, _ in seqs))
        return make_batch(seqs, *rest)

    monkeypatch.setattr(loop, "make_batch", recording)
    return trained
