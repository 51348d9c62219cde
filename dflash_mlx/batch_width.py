"""The width of a batch's next cycle: a plain batched step (width 1) or a drafted block of
w tokens per row, whichever is expected to commit the most tokens per second for the
batch as it is now.

Batching and speculation spend the same spare compute: a verify of B rows x w tokens
costs more against B rows x 1 the more rows there are (on this CPU, SmolLM2-135M: 1.15x
at B = 1, w = 8, but 3.82x at B = 16, `benchmarks/concurrency/verify_rows.py`). So the
choice is made per cycle from
* what each row expects a cycle of w to commit (its `acceptance.Acceptance`, or its
  `batch_spec.Outlook`: that or prompt lookup's guess), summed over the rows;
* the cost of a cycle of (rows, width): measured cycles (`acceptance.Cost`, the slow
  running average the chain policy keeps, `policy.py`) where there are any, else the
  seed table of relative verify costs scaled by what this many rows' cycles were
  measured to cost (rows and widths between the table's entries interpolated).
Drafted widths are measured only when chosen, so while plain steps win the chooser
probes its narrowest drafted width now and then (at most `explore` of the cycles), so
that rows whose drafter turns good are noticed.

Pure Python, no MLX: unit-tested with fixed tables.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

from .acceptance import Cost, charge

#: Seconds of a verify of B rows x w tokens over B rows x 1 token, keyed (B, w); measured
#: on this project's Linux CPU (SmolLM2-135M float32, 256 tokens of context per row).
CPU_VERIFY_COST: dict[tuple[int, int], float] = {
    (1, 4): 0.96,
    (1, 8): 1.15,
    (4, 4): 1.62,
    (4, 8): 2.46,
    (8, 4): 1.87,
    (8, 8): 3.13,
    (16, 4): 2.14,
    (16, 8): 3.82,
}


class Expects(Protocol):
    """A row's prospects (an `Acceptance`, a `batch_spec.Outlook`)."""

    def expected(self, size: int) -> float:
        """Tokens a cycle of width `size` is expected to commit for the row."""
        ...


def interpolate(points: dict[int, float], x: int) -> float:
    """The piecewise-linear value at `x` through {x: y}, extended flat past the ends."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]]
    hi = next(k for k in xs if k >= x)
    lo = max(k for k in xs if k <= x)
    if hi == lo:
        return points[lo]
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


class BatchWidth:
    """Chooses each batch cycle's width from the rows' acceptance and (rows, width) costs.

    `choose(records)` before a cycle (one `Expects` per row), `update(rows, width,
    seconds)` after it. `widths`: the widths it may choose (1, a plain step, always
    among them); `table`: relative verify costs keyed (rows, width) (`CPU_VERIFY_COST`)."""

    def __init__(
        self,
        widths: Sequence[int] = (1, 4, 8),
        table: Optional[dict[tuple[int, int], float]] = None,
        *,
        memory: float = 0.9,
        explore: float = 0.02,
    ):
        if not widths or min(widths) < 1:
            raise ValueError(f"widths must be integers >= 1, got {list(widths)!r}")
        if not 0 < explore <= 1:
            raise ValueError(f"explore must be in (0, 1], got {explore!r}")
        self.widths = sorted(set(widths) | {1})
        self.table = dict(CPU_VERIFY_COST if table is None else table)
        self.memory, self.explore = memory, explore
        self.seconds: dict[tuple[int, int], Cost] = {}  # measured cycles by (rows, width)
        self.since_drafted = 0  # plain cycles chosen in a row

    def relative(self, rows: int, width: int) -> float:
        """The seed table's cost of (rows, width) over (rows, 1): interpolated between the
        table's row counts (flat past them), and between width 1 (cost 1) and its widths
        (extended along the last segment past the widest: `_extend`)."""
        if width == 1:
            return 1.0
        by_rows: dict[int, dict[int, float]] = {}
        for (b, w), ratio in self.table.items():
            by_rows.setdefault(b, {1: 1.0})[w] = ratio
        if not by_rows:
            raise ValueError("the cost table is empty: give (rows, width) costs")
        at = {b: _extend(ratios, width) for b, ratios in by_rows.items()}
        return interpolate(at, rows)

    def cost(self, rows: int, width: int) -> float:
        """Estimated cost of a cycle of (rows, width): its measured mean where measured,
        else the table's ratio times this many rows' plain step (measured, or inferred
        from a measured width; in table units where nothing of `rows` is measured)."""
        if (rows, width) in self.seconds:
            return self.seconds[rows, width].mean
        measured = {w: c.mean for (b, w), c in self.seconds.items() if b == rows}
        if 1 in measured:
            plain = measured[1]
        elif measured:
            plain = sum(t / self.relative(rows, w) for w, t in measured.items()) / len(measured)
        else:
            plain = 1.0
        return self.relative(rows, width) * plain

    def rates(self, records: Sequence[Expects]) -> dict[int, float]:
        """Expected committed tokens per unit of cost for the batch, by width."""
        rows = len(records)
        return {w: sum(r.expected(w) for r in records) / self.cost(rows, w) for w in self.widths}

    def best(self, records: Sequence[Expects]) -> int:
        """The width with the highest expected rate (the narrowest among ties)."""
        rates = self.rates(records)
        return max(self.widths, key=lambda w: (rates[w], -w))

    def choose(self, records: Sequence[Expects]) -> int:
        """The next cycle's width for rows with prospects `records` (none: a plain step);
        while plain steps win, every 1 / `explore`-th cycle probes the narrowest drafted width."""
        if not records or len(self.widths) == 1:
            return 1
        best = self.best(records)
        self.since_drafted = self.since_drafted + 1 if best == 1 else 0
        if best == 1 and self.since_drafted * self.explore >= 1:
            self.since_drafted = 0
            return self.widths[1]
        return best

    def update(self, rows: int, width: int, seconds: float) -> None:
        """Record a finished cycle of `rows` rows and `width` tokens that took `seconds`."""
        charge(self.seconds, (rows, width), seconds, self.memory)


def _extend(ratios: dict[int, float], width: int) -> float:
    """A row count's ratio at `width`, linear through its measured widths (from 1 at width 1)
    and extended along the last segment past the widest."""
    xs = sorted(ratios)
    if width <= xs[-1] or len(xs) < 2:
        return interpolate(ratios, width)
    a, b = xs[-2], xs[-1]
    return ratios[b] + (ratios[b] - ratios[a]) * (width - b) / (b - a)
