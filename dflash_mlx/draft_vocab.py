"""A draft vocabulary: the tokens a drafter may propose (FR-Spec's frequency-ranked drafting).

The drafter borrows the target's LM head, the biggest single cost of a draft (for
SmolLM2, 15 rows x 49,152 tokens is two thirds of a 16-position draft). Nearly every
accepted draft is one of a few thousand frequent tokens, so the drafter scores only
those: the rows of the head for the subset ids are sliced once, and every other token
gets -inf. Decoding stays lossless because the target still verifies with its full head:
a token outside the subset is simply never proposed (under sampling the draft is a
sample of the softmax over the subset), and acceptance only compares tokens.

On disk: ``draft_vocab.json`` beside the drafter's weights, ``{"ids": [sorted ids],
"eos_token_ids": [...], ...}``; present means used (``--draft-vocab none`` turns it off).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np

DRAFT_VOCAB_FILE = "draft_vocab.json"


def check_draft_vocab(
    ids: Sequence[int], vocab_size: int, eos_token_ids: Iterable[int], where: str = "draft vocab"
) -> np.ndarray:
    """The ids as a sorted int32 array; a one-line ValueError for an empty, unsorted,
    repeated or out-of-range list, or one that lacks an EOS id."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{where}: ids must be a non-empty list of integers")
    if (np.diff(arr) <= 0).any():
        what = "repeated" if len(np.unique(arr)) < arr.size else "unsorted"
        raise ValueError(f"{where}: ids are {what} (need strictly increasing token ids)")
    if arr[0] < 0 or arr[-1] >= vocab_size:
        bad = int(arr[0] if arr[0] < 0 else arr[-1])
        raise ValueError(f"{where}: id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    missing = sorted(set(int(e) for e in eos_token_ids) - set(arr.tolist()))
    if missing:
        raise ValueError(f"{where}: EOS id {missing[0]} is missing (a drafter must be able to propose the end)")
    return arr.astype(np.int32)


def load_draft_vocab(path: str | Path, vocab_size: int) -> mx.array:
    """Read and check a draft_vocab.json (a file, or a drafter directory holding one)."""
    path = Path(path)
    file = path / DRAFT_VOCAB_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no draft vocabulary at {file}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e.msg})") from None
    if not isinstance(data, dict) or "ids" not in data:
        raise ValueError(f"{file}: needs an 'ids' list")
    return mx.array(check_draft_vocab(data["ids"], vocab_size, data.get("eos_token_ids", []), str(file)))


def check_vocab_choice(size: Optional[int], coverage: Optional[float]) -> None:
    """Refuse a choice `build_draft_vocab` cannot make (one line naming --size or --coverage),
    so that a command checks it before the counting."""
    if (size is None) == (coverage is None):
        raise ValueError("give exactly one of --size and --coverage")
    if size is not None and size < 1:
        raise ValueError(f"--size must be positive, got {size}")
    if coverage is not None and not 0 < coverage <= 1:
        raise ValueError(f"--coverage must be in (0, 1], got {coverage}")


def build_draft_vocab(
    counts: Counter,
    *,
    size: Optional[int] = None,
    coverage: Optional[float] = None,
    required: Iterable[int] = (),
    vocab_size: Optional[int] = None,
) -> tuple[np.ndarray, float]:
    """The most frequent tokens of `counts`, up to `size` tokens or until they cover
    `coverage` of all counted tokens, plus the `required` ids (EOS, chat-template
    specials). Returns (sorted ids, coverage of the counted tokens).

    When `size` asks for more tokens than were counted and `vocab_size` is given, the rest
    are the lowest unseen ids: in a BPE vocabulary ids follow merge order, which follows
    the tokenizer corpus's frequencies, the best prior for tokens the data never showed."""
    check_vocab_choice(size, coverage)
    total = sum(counts.values())
    if total == 0:
        raise ValueError("no tokens to count: the data is empty")
    chosen = set(int(i) for i in required)
    covered = 0
    for token, n in counts.most_common():
        if size is not None and len(chosen) >= size:
            break
        if coverage is not None and covered >= coverage * total:
            break
        if token not in chosen:
            chosen.add(int(token))
        covered += n
    if size is not None and vocab_size is not None and len(chosen) < size:
        unseen = (i for i in range(vocab_size) if i not in chosen)
        chosen.update(next(unseen) for _ in range(min(size, vocab_size) - len(chosen)))
    covered = sum(counts[t] for t in chosen)
    return np.array(sorted(chosen), dtype=np.int32), covered / total


def save_draft_vocab(
    ids: np.ndarray, path: str | Path, eos_token_ids: Sequence[int], coverage: float, source: str = ""
) -> Path:
    """Write draft_vocab.json (into a drafter directory, or to a file path)."""
    path = Path(path)
    file = path / DRAFT_VOCAB_FILE if path.is_dir() else path
    file.write_text(
        json.dumps(
            {
                "ids": [int(i) for i in ids],
                "eos_token_ids": sorted(int(e) for e in eos_token_ids),
                "size": len(ids),
                "coverage": round(coverage, 5),
                "source": source,
            }
        )
        + "\n"
    )
    return file
