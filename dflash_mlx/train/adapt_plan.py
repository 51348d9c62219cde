"""An adapt run planned and checked before any work (`plan`), and what it leaves behind.

`plan` checks the flags, the drafter, OUT and the conversations, splits them into those
trained on and those held back, and finds the scratch directory beside OUT
(``.<OUT name>.adapt``): its manifest (`MANIFEST`) fingerprints the conversations and
settings, so that a run stopped midway resumes when started again on the same ones. At the
end a kept drafter is written all at once (`write_adapted`), its config.json saying what it
was adapted on (`RECORD`), and `verdict` says in one line whether it was kept. The run
itself: `adapt.py`.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..atomic import atomic_directory, write_text_atomic
from ..defaults import SHIPPED_DRAFTER, cache_dir, shipped_drafter_dir
from ..draft_vocab import DRAFT_VOCAB_FILE
from ..drafters import read_config
from .checkpoint import TrainArgs
from .transcripts import Conversation, prompt_id, read_conversations

MANIFEST = "adapt.json"  # in the scratch directory: what the run is of (`Plan.fingerprint`)
RECORD = "adapted"  # the key of the adaptation record in the new drafter's config.json


@dataclass
class AdaptArgs:
    """What an adapt run is asked to do (`dflash adapt`'s flags, as fields)."""

    sources: list[str]
    out: Optional[str] = None  # default: beside the drafter (`default_out`)
    draft: Optional[str] = None  # a drafter directory or Hub repo; default: the shipped one
    model: Optional[str] = None
    minutes: Optional[float] = 10.0  # wall time of training; None: --max-steps alone
    heldback: float = 0.2  # share of the conversations held back to measure on (at least one)
    resume: bool = False  # insist on resuming an interrupted run (it resumes anyway when there is one)
    max_steps: Optional[int] = None
    lr: float = 2e-4  # a tenth of a from-scratch run's peak: the drafter is trained already
    max_tokens: int = 256  # tokens of each answer (and of each held-back replay)
    max_len: int = 2048  # tokens of a prompt and its answer: longer prompts are left out
    batch_size: int = 4
    num_anchors: int = 32
    seed: int = 0
    checkpoint_every: int = 50
    log_every: int = 10
    progress: bool = True
    threads: Optional[int | str] = None

    def check(self) -> None:
        """Refuse a value no run can use, in one line naming its flag, before any work."""
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError(f"--minutes must be above 0, got {self.minutes:g}")
        if self.minutes is None and self.max_steps is None:
            raise ValueError("give --minutes or --max-steps: training needs a budget")
        if not 0 < self.heldback < 1:
            raise ValueError(f"--heldback must be a fraction within (0, 1), got {self.heldback:g}")
        if not 2 <= self.max_tokens < self.max_len:
            raise ValueError(f"--max-tokens must be within [2, {self.max_len}) (the room of a prompt and its answer)")
        if not self.sources:
            raise ValueError("SOURCE: give at least one directory or file of conversations")
        self.train_args(Path("."), Path("."), "dflash1", 2).check()  # the flags adapt shares with `dflash train`

    def train_args(self, scratch: Path, draft_dir: Path, arch: str, block_size: int) -> TrainArgs:
        """The `dflash train --init-from draft_dir` run that adapts the drafter in `scratch`."""
        return TrainArgs(
            data=str(scratch / "train.jsonl"),
            out=str(scratch / "run"),
            model=self.model,
            init_from=str(draft_dir),
            arch=arch,
            block_size=block_size,
            batch_size=self.batch_size,
            num_anchors=self.num_anchors,
            max_len=self.max_len,
            max_steps=self.max_steps,
            time_limit=self.minutes * 60 if self.minutes else None,
            lr=self.lr,
            warmup=0.05,
            loss_vocab="sampled",
            checkpoint_every=self.checkpoint_every,
            checkpoint_minutes=1.0,
            eval_minutes=0.0,  # the measurement that counts comes at the end, on the held-back conversations
            seed=self.seed,
            resume=True,  # from the scratch's checkpoint when there is one
            log_every=self.log_every,
            progress=self.progress,
            threads=self.threads,
        )


@dataclass
class Plan:
    """An adapt run, checked: the drafter it starts from, where the new one goes, the
    conversations trained on and held back, and the scratch directory."""

    args: AdaptArgs
    draft_dir: Path
    out: Path
    train: list[Conversation]
    heldback: list[Conversation]
    fingerprint: str
    manifest: dict = field(default_factory=dict)  # the scratch's, where the run resumes

    @property
    def scratch(self) -> Path:
        """Where the run keeps its answers, features, checkpoint and manifest."""
        return self.out.parent / f".{self.out.name}.adapt"

    def describe(self) -> str:
        """One line on the run about to start."""
        n = len(self.train) + len(self.heldback)
        prompts = sum(len(c.prompts) for c in self.train)
        return (
            f"{n} conversations: {len(self.train)} to train on ({prompts} prompts), {len(self.heldback)} held back "
            f"to measure on; from {self.draft_dir} to {self.out}"
        )


def resolve_draft(draft: Optional[str]) -> Path:
    """The directory of the drafter `draft` names (a directory or a Hub repo; None: the
    shipped drafter), as `load_draft` resolves it."""
    if draft is None:
        path = shipped_drafter_dir()
        if not path.is_dir():
            raise FileNotFoundError(f"--draft: no default drafter at {path}; pass --draft DIR")
        return path
    from ..errors import one_line
    from ..hub import SAFETENSORS_PATTERNS, resolve_source

    try:
        return resolve_source(draft, patterns=SAFETENSORS_PATTERNS, fallback_patterns=None).path
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"--draft: {one_line(e)}") from None


def default_out(draft: Optional[str], draft_dir: Path) -> Path:
    """Where the new drafter goes by default: ``<drafter>-adapted`` beside a drafter
    directory of the user's; for the shipped drafter or a Hub repo (a package's data, a
    download cache) in ``drafters/`` of the cache directory (`defaults.cache_dir`)."""
    if draft is not None and Path(draft).expanduser().is_dir():
        return draft_dir.parent / f"{draft_dir.name}-adapted"
    name = SHIPPED_DRAFTER if draft is None else draft.replace("/", "--")
    return cache_dir() / "drafters" / f"{name}-adapted"


def adapted_record(path: Path) -> Optional[dict]:
    """The adaptation record of the drafter at `path` (`RECORD` in its config.json), or None."""
    try:
        record = json.loads((path / "config.json").read_text()).get(RECORD)
    except (OSError, ValueError, AttributeError):
        return None
    return record if isinstance(record, dict) else None


def split_conversations(
    conversations: list[Conversation], fraction: float, seed: int
) -> tuple[list[Conversation], list[Conversation]]:
    """(trained on, held back): `fraction` of the conversations held back, at least one, and
    at least one left to train on; the same conversations give the same split."""
    if len(conversations) < 2:
        raise ValueError(
            f"SOURCE: adapt needs at least 2 conversations (one to train on, one held back to measure on); "
            f"found {len(conversations)}"
        )
    order = sorted(conversations, key=lambda c: c.key)
    random.Random(seed).shuffle(order)
    n = min(len(order) - 1, max(1, round(fraction * len(order))))
    return order[n:], order[:n]


def plan(args: AdaptArgs, log: Callable[[str], None] = print) -> Plan:
    """Check an adapt run before any work (one line naming the flag, else nothing touched
    but a stale scratch): the flags, the drafter, OUT, the conversations, and whether it
    resumes an interrupted run."""
    args.check()
    conversations = read_conversations(args.sources)
    draft_dir = resolve_draft(args.draft)
    config = read_config(draft_dir)
    if "quantization" in config:
        raise ValueError(f"--draft: {draft_dir} is quantized; adapt a float drafter")
    out = Path(args.out).expanduser() if args.out else default_out(args.draft, draft_dir)
    if draft_dir.resolve() in (out.resolve(), *out.resolve().parents):
        raise ValueError(f"--out {out} is in the drafter being adapted: the new drafter goes to a new directory")
    if out.exists() and adapted_record(out) is None:
        raise FileExistsError(f"--out {out} exists and is not a drafter written by dflash adapt; choose another --out")
    train, held = split_conversations(conversations, args.heldback, args.seed)
    settings = {k: getattr(args, k) for k in ("model", "heldback", "seed", "max_tokens", "max_len")}
    what = {
        "draft": str(draft_dir.resolve()),
        "train": [prompt_id(p) for c in train for p in c.prompts],
        "heldback": [prompt_id(p) for c in held for p in c.prompts],
        **settings,
    }
    fingerprint = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    p = Plan(args, draft_dir, out, train, held, fingerprint)
    _open_scratch(p, log)
    return p


def _open_scratch(p: Plan, log: Callable[[str], None]) -> None:
    """Resume the scratch's run when it is of the same conversations and settings; else
    start afresh (refused under --resume, which asks to resume)."""
    manifest = p.scratch / MANIFEST
    saved = json.loads(manifest.read_text()) if manifest.is_file() else None
    if saved is not None and saved.get("fingerprint") == p.fingerprint:
        p.manifest = saved
        log(f"resuming the interrupted run in {p.scratch}")
        return
    if p.args.resume:
        why = "is of other conversations or settings" if saved else "holds none"
        raise ValueError(f"--resume: {p.scratch} {why}; drop --resume to start afresh")
    if p.scratch.exists():
        log(f"an interrupted run of other conversations in {p.scratch}: starting afresh")
        shutil.rmtree(p.scratch)
    p.manifest = {"fingerprint": p.fingerprint, "started": _now()}


def save_manifest(p: Plan) -> None:
    """Write the scratch's manifest (whole or not at all)."""
    p.scratch.mkdir(parents=True, exist_ok=True)
    write_text_atomic(p.scratch / MANIFEST, json.dumps(p.manifest, indent=2) + "\n")


def write_adapted(p: Plan, drafter: Any, record: dict) -> None:
    """Write the new drafter to OUT all at once (an earlier adapt run's drafter there is
    replaced), its config.json carrying `record`, with the old drafter's draft vocabulary."""
    from ..drafters import drafter_files, write_drafter_files

    weights, config = drafter_files(drafter)
    with atomic_directory(p.out, overwrite=True) as tmp:
        write_drafter_files(tmp, weights, {**config, RECORD: record})
        if (p.draft_dir / DRAFT_VOCAB_FILE).is_file():
            shutil.copyfile(p.draft_dir / DRAFT_VOCAB_FILE, tmp / DRAFT_VOCAB_FILE)


def make_record(p: Plan, counts: dict, before: float, after: float, trained: dict) -> dict:
    """What a drafter was adapted on, for its config.json (`RECORD`)."""
    return {
        "from": str(p.draft_dir),
        "model": p.args.model or "default",
        "sources": [str(Path(s).expanduser().resolve()) for s in p.args.sources],
        "conversations": {"trained": len(p.train), "heldback": len(p.heldback)},
        "prompts": counts,
        "minutes": p.args.minutes,
        "steps": trained["step"],
        "trained_seconds": round(trained["elapsed"], 1),
        "tau": {"before": before, "after": after},
        "settings": {k: v for k, v in asdict(p.args).items() if k in ("heldback", "lr", "max_tokens", "seed")},
        "fingerprint": p.fingerprint,
        "date": _now(),
    }


def verdict(p: Plan, before: float, after: float) -> str:
    """The one line that ends a run: kept or not, and the two taus."""
    digits = 2 if round(before, 2) != round(after, 2) else 3
    n = len(p.heldback)
    taus = f"tau {before:.{digits}f} -> {after:.{digits}f} on {n} held-back conversation{'s' * (n != 1)}"
    if after > before:
        return f"kept: {taus} -> {p.out}"
    return f"not kept: {taus}; {p.draft_dir} unchanged, nothing written"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
