"""How far a run is through its budget, and the learning rate there (warmup, then cosine)."""

from __future__ import annotations

import math

from .checkpoint import TrainArgs, TrainState


def budget_spent(args: TrainArgs, state: TrainState, total: int) -> float:
    """How far a run is through its budget (1: done): its steps, or its `time_limit` (wall
    seconds) and `core_hours` (CPU time of its steps), whichever ends first; with
    `max_steps` as well, that too."""
    limits = [state.elapsed / args.time_limit] if args.time_limit else []
    limits += [state.core_seconds / (args.core_hours * 3600)] if args.core_hours else []
    if not limits:
        return state.step / total
    return max([state.step / total] + limits) if args.max_steps else max(limits)


def lr_at(args: TrainArgs, spent: float) -> float:
    """Warmup then cosine over the run's progress `spent` (see `budget_spent`)."""
    frac = min(spent, 1.0)
    if frac < args.warmup:
        return args.lr * max(frac / args.warmup, 0.01)
    t = (frac - args.warmup) / max(1e-9, 1 - args.warmup)
    lo = args.lr * args.min_lr_ratio
    return lo + 0.5 * (args.lr - lo) * (1 + math.cos(math.pi * t))
