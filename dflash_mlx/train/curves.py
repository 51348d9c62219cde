"""Learning curves: held-out tau against the compute spent, per run, and the fit that ranks recipes.

Each training run logs its periodic held-out tau beside the core-hours spent so far
(`train_log.jsonl`). At the compute this machine has, tau grows about linearly in log
compute (+0.2 per doubling for the shipped drafter's recipe), so a run is summed up by
the line tau = a + b * log2(core-hours): b, tau per doubling, says which recipe learns
fastest for its compute, and the line, carried on, what a wanted tau would cost.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

from ..policy import fit_line

Curve = list[tuple[float, float]]  # (core-hours, held-out tau), in log order


def read_curve(run: str | Path) -> Curve:
    """The (core-hours, held-out tau) points of a run directory's `train_log.jsonl`."""
    log = Path(run) / "train_log.jsonl"
    if not log.is_file():
        raise FileNotFoundError(f"no train_log.jsonl in {run}")
    points = []
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("heldout_tau") is not None and rec.get("core_hours"):
            points.append((float(rec["core_hours"]), float(rec["heldout_tau"])))
    return points


def fit(curve: Curve) -> Optional[tuple[float, float]]:
    """Least-squares (a, b) of tau = a + b * log2(core-hours); None with fewer than two
    distinct points."""
    points = {math.log2(h): t for h, t in curve}
    return fit_line(points) if len(points) > 1 else None


def hours_for(line: tuple[float, float], tau: float) -> float:
    """Core-hours at which a fitted line reaches `tau` (inf if it does not rise)."""
    a, b = line
    return 2 ** ((tau - a) / b) if b > 0 else math.inf


def curves_table(curves: dict[str, Curve], target_tau: float) -> str:
    """A Markdown table: each run's last point, its slope per doubling, and the core-hours
    its line needs for `target_tau`; steepest first."""
    rows = []
    for name, curve in curves.items():
        line = fit(curve)
        slope = line[1] if line else float("nan")
        need = hours_for(line, target_tau) if line else math.inf
        last = curve[-1] if curve else (0.0, float("nan"))
        rows.append((slope, f"| {name} | {len(curve)} | {last[0]:.3f} | {last[1]:.2f} | {slope:+.3f} | {need:,.0f} |"))
    rows.sort(key=lambda r: -r[0] if not math.isnan(r[0]) else math.inf)
    head = f"| run | points | core-hours | tau | tau per doubling | core-hours for tau {target_tau:g} |"
    return "\n".join([head, "|---|---:|---:|---:|---:|---:|"] + [r for _, r in rows])


def pyplot() -> Any:
    """matplotlib's pyplot, drawing off-screen (a one-line error where it is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib (pip install matplotlib)") from exc
    return plt


def plot(curves: dict[str, Curve], path: str | Path, names: Optional[Sequence[str]] = None) -> None:
    """Held-out tau against core-hours (log scale), points and fitted lines, as a PNG."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names or list(curves):
        curve = curves[name]
        (dots,) = ax.plot([h for h, _ in curve], [t for _, t in curve], "o", ms=3, label=name)
        line = fit(curve)
        if line:
            hs = [curve[0][0], curve[-1][0]]
            ax.plot(hs, [line[0] + line[1] * math.log2(h) for h in hs], "-", color=dots.get_color(), lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("core-hours of training")
    ax.set_ylabel("held-out greedy tau (B = block size)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
