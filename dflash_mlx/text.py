"""The text a stream of tokens adds, as mlx-lm's `stream_generate` gives it.

`TokenText` turns tokens into text segments token by token (EOS is yielded but adds no
text; text that could start a stop string waits, `StopStrings`); `as_tokens` reads a
prompt given as text, token ids or a 1-D array (MLX or NumPy), as mlx-lm takes it
(`token_ids`: the ids alone, as `generate_step` takes them).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

#: What `stop` may be: stop strings, one stop string, or None (none).
Stops = Union[Sequence[str], str, None]


def stop_strings(stop: Stops) -> list[str]:
    """`stop` as a list: a str is one stop string (not its characters), None none; anything
    but those and a list or tuple of strings is a TypeError naming `stop`."""
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise TypeError(f"stop must be a string or a list of strings, got {_describe(stop)}")
    return list(stops)


def _describe(stop: object) -> str:
    """The type of `stop`, with the first element that is not a string where it is a list."""
    if isinstance(stop, (list, tuple)):
        bad = next(s for s in stop if not isinstance(s, str))
        return f"a {type(stop).__name__} holding {type(bad).__name__} {bad!r}"
    return f"{type(stop).__name__} {stop!r}"


class StopStrings:
    """Holds back text that could be the start of a stop string."""

    def __init__(self, stop: Stops):
        self.stop = [s for s in stop_strings(stop) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0

    def push(self, segment: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit)."""
        self.text += segment
        hits = [i for i in (self.text.find(s, max(0, self.sent - self.hold)) for s in self.stop) if i >= 0]
        if hits:
            out, self.sent = self.text[self.sent : min(hits)], len(self.text)
            return out, True
        end = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : end], end
        return out, False

    def flush(self) -> str:
        """All the text held back (the stream ended without a stop string)."""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


class TokenText:
    """The text a stream of tokens adds, token by token, as mlx-lm gives it: EOS is
    yielded but adds no text, and text that could start a stop string waits."""

    def __init__(self, tokenizer: TokenizerWrapper, stop: Stops, max_tokens: Optional[int]):
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stops, self.eos, self.max_tokens = StopStrings(stop), tokenizer.eos_token_ids, max_tokens

    def push(self, token: int, n: int) -> tuple[str, Optional[str]]:
        """The text that token number `n` (from 1) releases, and the finish reason where the
        stream ends with it ("stop": EOS or a stop string, "length": `max_tokens`, None: no limit)."""
        eos = token in self.eos
        if not eos:
            self.detokenizer.add_token(token)
        last = eos or n == self.max_tokens
        if last:
            self.detokenizer.finalize()
        text, hit = self.stops.push(self.detokenizer.last_segment)
        if last and not hit:
            text += self.stops.flush()
        return text, "stop" if hit or eos else "length" if last else None


def as_tokens(tokenizer: TokenizerWrapper, prompt: Union[str, Sequence[int], mx.array, np.ndarray]) -> list[int]:
    """The prompt's token ids (text is encoded, with BOS unless it starts with it; ids as
    `token_ids` reads them)."""
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    return token_ids(prompt)


def token_ids(prompt: Union[Sequence[int], mx.array, np.ndarray]) -> list[int]:
    """Token ids given as a list, an MLX or a NumPy array, as Python ints (what the caches'
    token lists compare); they must be integers in one dimension (a ValueError naming
    `prompt` otherwise)."""
    ids = np.array(prompt) if isinstance(prompt, mx.array) else np.asarray(prompt)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(
            f"prompt must be text or a 1-D sequence of integer token ids, got shape {ids.shape} of {ids.dtype}"
        )
    return ids.tolist()
