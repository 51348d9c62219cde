"""What a training run is asked to do (`TrainArgs`, checked before any work), where it
stands (`TrainState`), and the checkpoint that records both beside the drafter
(`save_checkpoint`), so that `--resume` continues exactly where a run left off, its log
(`open_log`) included; and the compact resume point a new machine restores it from."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional, TextIO

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from ..atomic import atomic_directory, write_text_atomic
from ..drafter import Drafter
from ..drafter2 import DFLASH2_FIELDS
from ..drafters import drafter_files, write_drafter_files
from .average import AVERAGE_FILE, WeightAverage

RESUME_AVERAGE = "average.safetensors"  # the weight average in the resume point (float16)


@dataclass
class TrainArgs:
    """What a training run is asked to do (`dflash train`'s flags, as fields); saved with
    every checkpoint."""

    data: str
    out: str
    model: Optional[str] = None
    num_layers: int = 5
    target_layer_ids: Optional[list[int]] = None
    block_size: int = 16
    mask_token_id: Optional[int] = None
    intermediate_size: Optional[int] = None
    gamma: Optional[float] = None
    init: str = "warm"  # "warm": copy target layers; "cold": random + data-dependent fc
    init_from: Optional[str] = None  # start from this trained drafter's weights instead (shape: its)
    arch: str = "dflash1"  # or "dflash2": dynamic causal convolutions and the candidate selector
    conv_kernel_size: int = 2  # DFlash2 fields (z-lab's Qwen3.8-27B drafter: 2, 16, 256, 16)
    conv_group_size: int = 16
    selector_rank: int = 32
    selector_top_k: int = 8
    selector_weight: float = 1.0  # weight of the selector's loss term
    distill: float = 0.5  # weight of the distillation term (0: hard labels only)
    top_k: int = 8  # teacher tokens kept per position
    features: Optional[str] = None  # feature cache directory (default: beside the data)
    feature_chunk: int = 0  # features computed per epoch at most (0: all before the first step)
    catch_up_passes: int = 1  # passes over each catch-up slice, in a row (`passes.py`)
    batch_size: int = 4  # sequences per step (over all ranks)
    num_anchors: int = 32  # blocks per sequence
    max_len: int = 1024
    epochs: float = 1.0
    max_steps: Optional[int] = None
    time_limit: Optional[float] = None  # wall seconds; the schedule follows the first budget to end
    core_hours: Optional[float] = None  # CPU time of the steps (all threads), over every session
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup: float = 0.04
    weight_decay: float = 0.01
    adam_beta2: float = 0.95  # 0.999 lets the huge first gradients freeze later steps
    grad_clip: float = 1.0
    ema: Optional[float] = None  # decay of the weights' moving average (see `average`); None: none
    loss_vocab: str = "full"  # "full", or "sampled": the batch's labels + teacher tokens + negatives
    negatives: int = 2048  # with loss_vocab "sampled": other tokens drawn afresh each step
    checkpoint_every: int = 200  # steps
    checkpoint_minutes: float = 5.0
    eval_minutes: float = 0.0  # held-out greedy tau every this many minutes (0: never)
    eval_prompts: int = 8
    eval_tokens: int = 64
    seed: int = 0
    resume: bool = False
    resume_point: Optional[str] = None  # a compact copy of every checkpoint, kept in git (see `save_resume_point`)
    log_every: int = 10
    progress: bool = True
    threads: Optional[int | str] = None  # OpenBLAS threads: a count, "auto" (see `threads`), None: as set

    def dflash2_fields(self) -> Optional[dict]:
        """The DFlash2 config fields under --arch dflash2, None under dflash1."""
        return {k: getattr(self, k) for k in DFLASH2_FIELDS} if self.arch == "dflash2" else None

    def check(self) -> None:
        """Refuse a value no run can use before any work (nothing loaded, read or written):
        a one-line ValueError naming its flag (the field's name, dashed). NaN passes no bound."""
        for name, value in asdict(self).items():
            flag = "--" + name.replace("_", "-")
            if name in _CHOICES and value not in _CHOICES[name]:
                raise ValueError(f"{flag} must be one of {', '.join(_CHOICES[name])}, got {value!r}")
            if value is None:
                continue
            if name in _AT_LEAST and not value >= _AT_LEAST[name]:
                raise ValueError(f"{flag} must be at least {_AT_LEAST[name]}, got {value}")
            if name in _ABOVE and not value > _ABOVE[name]:
                raise ValueError(f"{flag} must be above {_ABOVE[name]}, got {value}")
            if name in _WITHIN and not _WITHIN[name][0] <= value <= _WITHIN[name][1]:
                raise ValueError(f"{flag} must be within [{_WITHIN[name][0]}, {_WITHIN[name][1]}], got {value}")
            if name in _BELOW and not value < _BELOW[name]:
                raise ValueError(f"{flag} must be below {_BELOW[name]}, got {value}")
        if self.feature_chunk and self.feature_chunk < self.batch_size:
            raise ValueError(f"--feature-chunk must be 0 or at least --batch-size ({self.batch_size})")


_CHOICES = {"init": ("warm", "cold"), "arch": ("dflash1", "dflash2"), "loss_vocab": ("full", "sampled")}
_AT_LEAST = {  # the least value (0 for eval_prompts and eval_minutes: no evaluation)
    **dict.fromkeys(("num_layers", "intermediate_size", "top_k", "batch_size", "num_anchors", "max_steps"), 1),
    **dict.fromkeys(("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"), 1),
    **dict.fromkeys(("checkpoint_every", "eval_tokens", "log_every", "catch_up_passes"), 1),
    **dict.fromkeys(("mask_token_id", "feature_chunk", "negatives", "seed", "eval_prompts"), 0),
    **dict.fromkeys(("selector_weight", "weight_decay", "eval_minutes"), 0),
    "block_size": 2,
    "max_len": 2,
}
_ABOVE = dict.fromkeys(
    ("gamma", "epochs", "time_limit", "core_hours", "lr", "grad_clip", "checkpoint_minutes", "ema"), 0
)
_WITHIN = dict.fromkeys(("distill", "warmup", "min_lr_ratio", "adam_beta2"), (0, 1))
# 1: AdamW's second moments never move from zero; the weight average never moves from its start
_BELOW = {"adam_beta2": 1, "ema": 1}


@dataclass
class TrainState:
    """Where a run is; saved with every checkpoint."""

    step: int = 0
    epoch: int = 0
    pos: int = 0  # sequences of this epoch already used
    epoch_size: int = 0
    first: int = 0  # the pass's first sequence (0 but while data grows), or a catch-up pass's slice number
    catch_up: bool = False  # a catch-up pass: every n-th sequence the run had, from `first` (`passes.py`)
    repeat: int = 0  # passes over this catch-up slice done before this one (--catch-up-passes)
    featured: int = 0  # sequences the run has had features for (on whichever machine)
    seen: int = 0  # sequences
    positions: int = 0  # labelled block positions trained on
    elapsed: float = 0.0
    core_seconds: float = 0.0  # CPU seconds of the training steps (all threads), over every session

    @classmethod
    def from_dict(cls, d: dict) -> "TrainState":
        """The state saved in a checkpoint's state.json (keys it does not know are ignored)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def save_checkpoint(
    out: Path,
    drafter: Drafter,
    optimizer: optim.Optimizer,
    state: TrainState,
    args: TrainArgs,
    average: Optional[WeightAverage] = None,
    resume_point: bool = True,
) -> None:
    """`out` stays a loadable drafter (with `average`, `--ema`: the average, in the drafter's
    dtype); `out/checkpoint` (also a drafter: the raw weights, which training goes on from)
    adds the optimiser, the average and the state. The checkpoint directory is replaced
    whole, so a crash mid-write leaves the previous one. With `resume_point` and
    --resume-point, the resume point follows."""
    weights, config = drafter_files(drafter)
    with atomic_directory(out / "checkpoint", overwrite=True) as tmp:
        write_drafter_files(tmp, weights, config)
        # not *.safetensors: the checkpoint directory itself stays a loadable drafter
        mx.savez(str(tmp / "optimizer.npz"), **dict(tree_flatten(optimizer.state)))
        if average is not None:
            average.save(tmp / AVERAGE_FILE)
        (tmp / "state.json").write_text(json.dumps({**asdict(state), "args": asdict(args)}, indent=2) + "\n")
    with tempfile.TemporaryDirectory(prefix=".drafter-", dir=out) as staged:  # each file replaced whole
        write_drafter_files(Path(staged), average.delivered(weights) if average else weights, config)
        for name in ("config.json", "model.safetensors"):
            os.replace(Path(staged) / name, out / name)
    if resume_point and args.resume_point:
        save_resume_point(out, Path(args.resume_point))


def open_log(out: Path, step: int) -> tuple[TextIO, list[dict]]:
    """`out/train_log.jsonl` opened to append, and the records it keeps: those up to `step`
    (where the run starts: its checkpoint, or 0), not those of a session that ended after
    its last checkpoint, whose steps the resumed run trains and logs again, nor a line torn
    by a crash."""
    log = out / "train_log.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    lines = log.read_text().splitlines(keepends=True) if log.is_file() else []
    kept = [line for line in lines if line.endswith("\n") and json.loads(line)["step"] <= step]
    if len(kept) < len(lines):
        write_text_atomic(log, "".join(kept))
    return open(log, "a"), [json.loads(line) for line in kept]


def save_resume_point(out: Path, dest: Path) -> None:
    """Copy `out`'s checkpoint into `dest` compactly, for a run that must survive a new
    machine: the weights and the weight average (`--ema`) in float16, AdamW's second
    moments in bfloat16 (float16 would flush them, ~1e-10, to zero), the state, and the
    run's log (its held-out tau against core-hours). Not the first moments: a run restored
    from it starts them at zero, which makes its first ~10 steps smaller (beta1 0.9), where
    second moments at zero would make them larger; the average carried instead keeps the
    evaluations after a move measuring a mature average. About 3/4 smaller than the
    checkpoint; `restore_resume_point` turns it back into one. Replaced whole, like the
    checkpoint."""
    ck = out / "checkpoint"
    weights = {k: v.astype(mx.float16) for k, v in mx.load(str(ck / "model.safetensors")).items()}
    moments = {
        k: v.astype(mx.bfloat16) if v.size > 1 else v
        for k, v in mx.load(str(ck / "optimizer.npz")).items()
        if not k.endswith(".m")
    }
    with atomic_directory(dest, overwrite=True) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), moments)
        if (ck / AVERAGE_FILE).is_file():
            average = {k: v.astype(mx.float16) for k, v in mx.load(str(ck / AVERAGE_FILE)).items()}
            mx.save_safetensors(str(tmp / RESUME_AVERAGE), average)
        for name in ("config.json", "state.json"):
            shutil.copyfile(ck / name, tmp / name)
        if (out / "train_log.jsonl").is_file():
            shutil.copyfile(out / "train_log.jsonl", tmp / "train_log.jsonl")


def restore_resume_point(src: Path, out: Path) -> None:
    """Make `out/checkpoint` (and `out`'s log) from the resume point `src`, in float32, so
    that `--resume` continues from it. Refuses to overwrite a checkpoint that exists."""
    if (out / "checkpoint" / "state.json").is_file():
        raise FileExistsError(f"--resume-from: {out}/checkpoint exists; resume it with --resume alone")
    if not (src / "state.json").is_file():
        raise FileNotFoundError(f"--resume-from: no resume point at {src} (state.json missing)")
    narrowed = (mx.float16, mx.bfloat16)  # by `save_resume_point`; not AdamW's step count (uint64)
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(src / "model.safetensors")).items()}
    moments = {
        k: v.astype(mx.float32) if v.dtype in narrowed else v
        for k, v in mx.load(str(src / "optimizer.safetensors")).items()
    }
    for k in [k for k in moments if k.endswith(".v") and k[:-2] + ".m" not in moments]:
        moments[k[:-2] + ".m"] = mx.zeros_like(moments[k])  # first moments re-warm (see `save_resume_point`)
    with atomic_directory(out / "checkpoint") as tmp:
        write_drafter_files(tmp, weights, json.loads((src / "config.json").read_text()))
        mx.savez(str(tmp / "optimizer.npz"), **moments)
        if (src / RESUME_AVERAGE).is_file():
            average = {k: v.astype(mx.float32) for k, v in mx.load(str(src / RESUME_AVERAGE)).items()}
            mx.savez(str(tmp / AVERAGE_FILE), **average)
        shutil.copyfile(src / "state.json", tmp / "state.json")
    if (src / "train_log.jsonl").is_file():  # a log in OUT without a checkpoint is no run's to continue
        write_text_atomic(out / "train_log.jsonl", (src / "train_log.jsonl").read_text())
