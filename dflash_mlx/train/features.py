"""Target features computed once, kept on disk: the frozen target never runs twice per sequence.

Training reads, for every sequence, the outputs of the target layers the drafter uses
(float16) and the target's own top-K next-token distribution at each position (for the
distillation loss). Both come from one batched forward of the target over the whole
sequence, done before training (or while data is still being generated) and stored in
flat files that every epoch and every resumed session memory-maps:

    meta.json       {"model", "layer_ids", "width", "top_k"}
    features.f16    rows x width   (width = len(layer_ids) * hidden)
    teacher_ids.i32 rows x top_k   the target's top-K tokens for position t + 1 ...
    teacher_lg.f16  rows x top_k   ... and their logits (row t: the token after token t)
    index.jsonl     {"key", "start", "length"} per sequence, appended after its rows

A crash leaves at most rows past the last indexed sequence: the next writer cuts them
before it appends. Writers take turns under a lock (the trainer's), each opening the store
inside it; readers may open it at any time and read only indexed rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..target import Target

from ..targets import make_target
from ..topk import top_k_columns

_FILES = {
    "features": ("features.f16", np.float16),
    "teacher_ids": ("teacher_ids.i32", np.int32),
    "teacher_logits": ("teacher_lg.f16", np.float16),
}


class FeatureStore:
    """Append-only on-disk store of per-sequence target features and teacher top-K."""

    def __init__(self, path: str | Path, layer_ids: Sequence[int], width: int, top_k: int, model: str = ""):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        meta = {"model": model, "layer_ids": list(layer_ids), "width": int(width), "top_k": int(top_k)}
        meta_file = self.path / "meta.json"
        if meta_file.is_file():
            old = json.loads(meta_file.read_text())
            if {k: old.get(k) for k in ("layer_ids", "width", "top_k")} != {
                k: meta[k] for k in ("layer_ids", "width", "top_k")
            }:
                raise ValueError(f"feature cache {self.path} was built for {old}; use another --features dir")
            if model and old.get("model") and old["model"] != model:  # same shapes, another target's features
                raise ValueError(
                    f"feature cache {self.path} holds features of model {old['model']!r}, not {model!r}; "
                    "use another --features dir"
                )
        else:
            meta_file.write_text(json.dumps(meta) + "\n")
        self.width, self.top_k = int(width), int(top_k)
        self.index: dict[str, tuple[int, int]] = {}
        self.rows = 0
        self._indexed = 0  # bytes of index.jsonl up to its last whole line
        index_file = self.path / "index.jsonl"
        for line in index_file.read_bytes().splitlines(keepends=True) if index_file.is_file() else []:
            try:
                rec = json.loads(line) if line.endswith(b"\n") else None
            except json.JSONDecodeError:
                rec = None  # a line an older writer glued to a torn one: the index ends before it
            if rec is None:
                break  # a torn last line (or one still being written): that sequence is not stored
            self.index[rec["key"]] = (rec["start"], rec["length"])
            self.rows = max(self.rows, rec["start"] + rec["length"])
            self._indexed += len(line)
        self._maps: dict[str, np.ndarray] = {}
        self._cut = False  # whether this writer has cut what lies past the index (`add`)

    def _cols(self, name: str) -> int:
        return self.width if name == "features" else self.top_k

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def _map(self, name: str) -> np.ndarray:
        m = self._maps.get(name)
        if m is None or m.shape[0] < self.rows:
            file, dtype = _FILES[name]
            m = np.memmap(self.path / file, dtype=dtype, mode="r", shape=(self.rows, self._cols(name)))
            self._maps[name] = m
        return m

    def get(self, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(features (n, width) f16, teacher ids (n, K) i32, teacher logits (n, K) f16)."""
        start, n = self.index[key]
        return tuple(self._map(name)[start : start + n] for name in _FILES)  # type: ignore[return-value]

    def _cut_past_index(self) -> None:
        sizes = {
            file: self.rows * self._cols(name) * np.dtype(dtype).itemsize for name, (file, dtype) in _FILES.items()
        }
        for file, keep in {**sizes, "index.jsonl": self._indexed}.items():
            if (self.path / file).exists() and (self.path / file).stat().st_size != keep:
                with open(self.path / file, "r+b") as fh:
                    fh.truncate(keep)
        self._cut = True

    def add(self, key: str, features: np.ndarray, teacher_ids: np.ndarray, teacher_logits: np.ndarray) -> None:
        """Append one sequence; it is indexed only once all its rows are on disk. The first
        append cuts rows past the index (a killed writer's): not a reader's job, for they
        may be another writer's rows in flight."""
        if not self._cut:
            self._cut_past_index()
        n = features.shape[0]
        for name, arr in (("features", features), ("teacher_ids", teacher_ids), ("teacher_logits", teacher_logits)):
            file, dtype = _FILES[name]
            with open(self.path / file, "ab") as fh:
                fh.write(np.ascontiguousarray(arr, dtype=dtype).tobytes())
        line = json.dumps({"key": key, "start": self.rows, "length": n}) + "\n"
        with open(self.path / "index.jsonl", "a") as fh:
            fh.write(line)
        self._indexed += len(line.encode())
        self.index[key] = (self.rows, n)
        self.rows += n


def target_pass(
    target: Target, tokens: mx.array, layer_ids: Sequence[int], top_k: int
) -> tuple[mx.array, mx.array, mx.array]:
    """One forward of the target over a right-padded (S, L) batch (the causal mask keeps
    padding out of real positions). Returns the concatenated outputs of `layer_ids`
    (S, L, k * hidden), and the top-K next-token ids and their logits (S, L, K). Logits,
    not log-probabilities: the distillation loss renormalises over the K tokens anyway, and
    a logsumexp over the vocabulary costs as much as the head on MLX's CPU backend."""
    view = make_target(target.model, layer_ids)  # the adapter's own forward, capturing `layer_ids`
    hidden, features = view.forward(tokens, [None] * view.num_layers)
    logits = target.lm_head(hidden).astype(mx.float32)
    ids = top_k_columns(logits, top_k).astype(mx.int32)
    return features, ids, mx.take_along_axis(logits, ids, axis=-1)


def fill_store(
    store: FeatureStore,
    target: Target,
    seqs: dict[str, list[int]],
    layer_ids: Sequence[int],
    batch_tokens: int = 2048,
    on_progress: Optional[Callable[[int, int], None]] = None,
) -> int:
    """Compute and store the sequences of `seqs` (key -> token ids) not yet in the store,
    batched by length. Returns how many were added."""
    todo = sorted((k for k in seqs if k not in store), key=lambda k: len(seqs[k]))
    done = 0
    while todo:
        L = len(seqs[todo[0]])
        group = []
        while todo and (len(group) + 1) * max(L, len(seqs[todo[0]])) <= max(batch_tokens, L):
            key = todo.pop(0)
            L = max(L, len(seqs[key]))
            group.append(key)
        toks = np.zeros((len(group), L), dtype=np.int32)
        for r, key in enumerate(group):
            toks[r, : len(seqs[key])] = seqs[key]
        f, ids, lp = target_pass(target, mx.array(toks), layer_ids, store.top_k)
        f, ids, lp = np.array(f.astype(mx.float16)), np.array(ids), np.array(lp.astype(mx.float16))
        for r, key in enumerate(group):
            n = len(seqs[key])
            store.add(key, f[r, :n], ids[r, :n], lp[r, :n])
        done += len(group)
        if on_progress:
            on_progress(done, done + len(todo))
    return done
