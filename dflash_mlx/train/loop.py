"""The training loop: data order, optimiser, schedule, checkpoints, held-out tau.

The target is frozen and never runs inside a step: its features and top-K distribution
come from the on-disk `FeatureStore`, filled before each pass with what it needs
(`passes.py`: which sequences a pass covers, on a new machine too). A checkpoint (and the
resume point) is saved right before each new chunk's target pass, so that a session ending
during that long pass loses none of the epoch before it.
A step samples anchors in a batch of sequences, runs every block through the drafter in
one forward (`objective`), and takes one AdamW step. Everything a step draws at random comes from a generator seeded by
(seed, step, rank), and a pass's order from (seed, epoch, repeat): `--resume` continues exactly
where a checkpoint left off. Data-parallel over `mx.distributed` ranks (`mlx.launch`):
each rank takes its share of every batch and gradients are averaged.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..atomic import exclusive_lock
from ..drafter import Drafter
from ..drafters import load_drafter_dir
from ..targets import make_target
from .data import load_sequences
from .features import FeatureStore, fill_store
from .passes import Passes
from .threads import ThreadControl
from .average import start_average
from .initialize import new_drafter, rms_fc_init, warm_start
from .checkpoint import TrainArgs, TrainState, open_log, save_checkpoint
from .schedule import budget_spent, lr_at
from .progress import Meter, StepBar, count_bar
from .replay import Reference, references, replay_tau
from .objective import Batch, block_acceptance, loss_fn, loss_weights, make_batch


class Trainer:
    """One training run (see the module docstring). `run()` trains until its budget (steps,
    wall time or core-hours: `budget_spent`) is spent and returns the final stats."""

    def __init__(self, args: TrainArgs, log: Callable[[str], None] = print, loaded: Optional[tuple] = None):
        """`loaded`: the target and its tokenizer, already loaded from `args.model` (else loaded here)."""
        from ..loading import load  # looked up at call time: tests substitute a tiny target

        args.check()
        self.args, self.log = args, log
        self.group = mx.distributed.init()
        self.rank, self.world = self.group.rank(), self.group.size()
        if args.core_hours and self.world > 1:  # ranks' CPU times differ: they would stop apart
            raise ValueError("--core-hours is for one process; under mlx.launch use --max-steps or --time-limit")
        self.out = Path(args.out)
        model, self.tokenizer = loaded or load(args.model)
        model.freeze()
        self.model = model
        ck = self.out / "checkpoint"
        resuming = args.resume and (ck / "state.json").is_file()
        if resuming:
            self.drafter = load_drafter_dir(ck)
            saved = json.loads((ck / "state.json").read_text())
            self.state = TrainState.from_dict(saved)
        else:
            self.drafter = new_drafter(args, model, self.tokenizer)
            self.state = TrainState()
        self.cfg = self.drafter.config
        self.target = make_target(model, self.cfg.target_layer_ids)
        self.weights = loss_weights(self.cfg.block_size, args.gamma)
        features = Path(args.features) if args.features else Path(args.data).parent / "features"
        self.store_dir = features / ("L" + "-".join(map(str, self.cfg.target_layer_ids)) + f"-k{args.top_k}")
        local = args.model and Path(args.model).exists()  # the store names its target: a path resolved, or an id
        self.model_key = str(Path(args.model).resolve()) if local else args.model or "default"
        self.seqs: list[tuple[str, list[int], list[tuple[int, int]]]] = []
        self.threads = ThreadControl(args.threads)  # also for the feature pass
        self.data_seconds = 0.0  # CPU time of refresh_data during the current step (not training)
        self.passes = Passes(self.state, args.feature_chunk, lambda key: key in self.store, args.catch_up_passes)
        self.refresh_data()
        if not resuming:
            self._initialize()
        elif not self.passes.all_stored():
            self.state.pos, self.state.epoch_size = 0, 0  # a pass begun elsewhere: begin it again over what is here
        self.optimizer = optim.AdamW(
            learning_rate=args.lr, betas=[0.9, args.adam_beta2], weight_decay=args.weight_decay
        )
        if resuming and (ck / "optimizer.npz").is_file():
            self.optimizer.init(self.drafter.trainable_parameters())
            self.optimizer.state = tree_unflatten(list(mx.load(str(ck / "optimizer.npz")).items()))
        if self.world > 1:  # the same initial weights everywhere
            synced = [(k, mx.distributed.all_sum(v) / self.world) for k, v in tree_flatten(self.drafter.parameters())]
            self.drafter.load_weights(synced)
            mx.eval(self.drafter.parameters())
        # after the ranks' weights are made equal: every rank's average is the same
        quiet = self.log if self.rank == 0 else (lambda line: None)  # rank 0 speaks for the run
        self.average = start_average(args.ema, self.drafter, ck if resuming else None, quiet)
        self.total = self.steps_budgeted()
        self.value_and_grad = nn.value_and_grad(self.drafter, self._loss)
        self._references: Optional[list[Reference]] = None  # held-out answers, made at the first evaluation

    # ------------------------------------------------------------------ data

    def steps_budgeted(self) -> int:
        """The run's steps: --max-steps, else --epochs over the data as read."""
        a = self.args
        return a.max_steps or max(1, int(math.ceil(a.epochs * len(self.seqs) / a.batch_size)))

    def finished(self) -> bool:
        """Whether the run's budget is spent (a finished run resumed trains no more)."""
        return budget_spent(self.args, self.state, self.steps_budgeted()) >= 1.0

    def refresh_data(self, save_first: bool = False) -> None:
        """(Re)read the data (it may grow while training) and compute the features the coming
        pass needs (`Passes.to_feature`): rank 0 fills the store (with `save_first`, after
        saving a checkpoint where there are features to compute), the others wait for it and
        reopen it. Its CPU time goes to `data_seconds`, not to the training steps' core-hours
        (recipes compare per step's worth)."""
        a, st, cpu = self.args, self.state, time.process_time()
        seqs = []
        for k, t, spans in load_sequences(a.data):
            spans = [(s, min(e, a.max_len)) for s, e in spans if s < min(e, a.max_len) - 1]
            if spans:
                seqs.append((k, t[: a.max_len], spans))
        if not seqs:
            raise ValueError(f"no usable sequences in {a.data}")
        self.seqs = seqs  # in data order
        self.passes.set_data([k for k, _, _ in seqs])
        width = len(self.cfg.target_layer_ids) * self.cfg.hidden_size
        if self.rank == 0:
            with exclusive_lock(self.store_dir.parent / f".{self.store_dir.name}.lock"):  # one writer at a time
                self.store = FeatureStore(self.store_dir, self.cfg.target_layer_ids, width, a.top_k, self.model_key)
                wanted = [] if self.finished() else self.passes.to_feature()  # none for a pass never trained
                missing = [seqs[i][:2] for i in wanted if seqs[i][0] not in self.store][: a.feature_chunk or None]
                if missing and st.catch_up:
                    here = sum(k in self.store for k, _, _ in seqs[: st.featured])
                    self.log(f"catching up: features here for {here} of the run's {st.featured} sequences")
                if missing and save_first:
                    self.save()
                if missing:
                    with count_bar("features", len(missing), self.args.progress, self.log) as advance:
                        fill_store(
                            self.store,
                            self.target,
                            dict(missing),
                            self.cfg.target_layer_ids,
                            on_progress=lambda done, total: (advance(done), self.threads.poll()),
                        )
        if self.world > 1:  # a barrier (the store is complete) that brings rank 0's pass to every rank
            where = [int(st.catch_up), st.first, st.pos, st.epoch_size, st.repeat] if self.rank == 0 else [0] * 5
            flag, st.first, st.pos, st.epoch_size, st.repeat = mx.distributed.all_sum(mx.array(where)).tolist()
            st.catch_up = bool(flag)
        self.store = FeatureStore(self.store_dir, self.cfg.target_layer_ids, width, a.top_k, self.model_key)
        self.passes.features_done()
        self.data_seconds += time.process_time() - cpu

    def _initialize(self) -> None:
        if self.args.init_from:
            return
        if self.args.init == "warm":
            warm_start(self.drafter, self.target)
        else:  # "cold"
            sample = [self.store.get(k)[0][1:] for k, _, _ in self.seqs[: self.passes.stored_run(0, 8)]]
            rms_fc_init(self.drafter, np.concatenate(sample).astype(np.float32))

    def batch_for_step(self) -> tuple[Optional[Batch], Optional[mx.array]]:
        """The batch (and the sampled vocabulary) of the current step, on this rank."""
        a, st, B = self.args, self.state, self.cfg.block_size
        if self.passes.needs_next(a.batch_size):
            if st.epoch_size:  # this pass is used up: the next, once its features are stored
                self.passes.advance()
                self.refresh_data(save_first=True)
            self.passes.begin()
        idx = self.passes.take(a.batch_size, a.seed)[self.rank :: self.world]
        rng = np.random.default_rng([a.seed, st.step, self.rank])
        seqs = [self.seqs[i] for i in idx]
        batch, kept, pos = make_batch([(t, p) for _, t, p in seqs], B, a.num_anchors, self.cfg.mask_token_id, rng)
        if batch is None:
            return None, None
        stored = [self.store.get(seqs[i][0]) for i in kept]
        S, L = len(kept), batch.tokens.shape[1]
        feats = np.zeros((S, L, stored[0][0].shape[1]), dtype=np.float16)
        for r, (f, _, _) in enumerate(stored):
            n = min(len(f), L)
            feats[r, :n] = f[:n]
        batch.features = mx.array(feats).astype(mx.float32)
        prev = np.maximum(pos - 1, 0)  # row t of the teacher holds the distribution of token t + 1
        t_ids = np.stack([s[1][np.minimum(prev[r], len(s[1]) - 1)] for r, s in enumerate(stored)])
        t_lg = np.stack([s[2][np.minimum(prev[r], len(s[2]) - 1)] for r, s in enumerate(stored)])
        t_ids, t_lg = t_ids.reshape(-1, B, a.top_k), t_lg.reshape(-1, B, a.top_k).astype(np.float32)
        labels = np.array(batch.labels)
        vocab = None
        if a.loss_vocab == "sampled":
            extra = rng.choice(self.cfg.vocab_size, size=min(a.negatives, self.cfg.vocab_size), replace=False)
            v = np.union1d(np.union1d(labels.ravel(), t_ids.ravel()), extra).astype(np.int32)
            labels, t_ids = np.searchsorted(v, labels), np.searchsorted(v, t_ids)
            vocab = mx.array(v)
        batch.labels = mx.array(labels.astype(np.int32))
        batch.teacher_ids, batch.teacher_logits = mx.array(t_ids.astype(np.int32)), mx.array(t_lg)
        return batch, vocab

    # ------------------------------------------------------------------ steps

    def _loss(self, drafter: Drafter, batch: Batch, vocab: Optional[mx.array]):
        return loss_fn(drafter, self.target, batch, self.weights, self.args.distill, vocab, self.args.selector_weight)

    def step(self) -> Optional[dict]:
        """One optimiser step; returns its numbers (None for an empty batch)."""
        st = self.state
        self.optimizer.learning_rate = lr_at(self.args, budget_spent(self.args, st, self.total))
        batch, vocab = self.batch_for_step()
        st.step += 1
        if batch is None:
            return None
        (loss, (correct, valid)), grads = self.value_and_grad(self.drafter, batch, vocab)
        if self.world > 1:
            grads = nn.average_gradients(grads)
            loss = mx.distributed.all_sum(loss) / self.world
        grads, gnorm = optim.clip_grad_norm(grads, self.args.grad_clip)
        self.optimizer.update(self.drafter, grads)
        mx.eval(self.drafter.parameters(), self.optimizer.state, loss, correct, gnorm)
        if self.average is not None:
            self.average.update(self.drafter)
        st.seen += batch.tokens.shape[0] * self.world
        B = self.cfg.block_size
        c, v = np.array(correct).reshape(-1, B), np.array(valid).reshape(-1, B)
        st.positions += int(v.sum()) * self.world
        tau_sum, blocks = block_acceptance(c, v, B)
        stats = {"loss": loss.item(), "grad_norm": gnorm.item(), "correct": c.sum(0), "count": v.sum(0)}
        return {**stats, "tau_sum": tau_sum, "blocks": blocks}

    def heldout_tau(self) -> dict:
        """Greedy tau of the current drafter on the first held-out prompts, all and per kind,
        by replay along the target's own answers (`replay.py`: what real decoding gives, at a
        fraction of its cost; the answers are made once and kept beside the data)."""
        held = Path(self.args.data).parent / "heldout.jsonl"
        if not held.is_file() or self.args.eval_prompts <= 0:
            return {"heldout_tau": None}
        B, n = self.cfg.block_size, self.args.eval_tokens
        if self._references is None:
            from ..messages import read_prompt_file

            prompts = read_prompt_file(held)[: self.args.eval_prompts]
            answers = held.parent / f"heldout_answers_{n}.json"
            self._references = references(
                self.model,
                self.tokenizer,
                prompts,
                self.cfg.target_layer_ids,
                max_tokens=n,
                block_size=B,
                answers=answers,
            )
        res = replay_tau(self.drafter, self.model, self._references, max_tokens=n, block_size=B)
        kinds = {k: r["tau"] for k, r in res.items() if k != "all"}
        return {"heldout_tau": res["all"]["tau"], "heldout_kinds": kinds}

    def describe(self) -> str:
        """One line on the run about to start: data, drafter, schedule, threads."""
        a, cfg = self.args, self.cfg
        n_params = sum(v.size for _, v in tree_flatten(self.drafter.parameters()))
        return (
            f"{len(self.seqs)} sequences, {sum(len(t) for _, t, _ in self.seqs)} tokens; drafter "
            f"{cfg.num_hidden_layers} layers, {n_params / 1e6:.1f}M params, features "
            f"{cfg.target_layer_ids}, B={cfg.block_size}, mask {cfg.mask_token_id}, {cfg.architecture}, "
            f"init {a.init_from or a.init}; "
            + (f"{self.total} steps" if self.by_steps() else "steps")
            + f" of {a.batch_size} sequences x {a.num_anchors} blocks"
            + ("" if self.by_steps() else f" for {self.budget()}")
            + (f"; {self.world} ranks" if self.world > 1 else "")
            + f"; {self.threads.describe()}, {self.state.core_seconds / 3600:.3f} core-hours so far"
        )

    def evaluation(self) -> dict:
        """A point of the run's curve: where it is (step, time, core-hours) and its held-out tau,
        that of the weight average while --ema is on (`"weights": "ema"`)."""
        st = self.state
        where = {"step": st.step, "elapsed": round(st.elapsed, 1), "core_hours": st.core_seconds / 3600}
        if self.average is None:
            return {**where, **self.heldout_tau()}
        with self.average.in_use(self.drafter):
            return {**where, **self.heldout_tau(), "weights": "ema"}

    def by_steps(self) -> bool:
        """Whether the run's budget is counted in steps (else in time or core-hours)."""
        return bool(self.args.max_steps) or not (self.args.time_limit or self.args.core_hours)

    def budget(self) -> str:
        """The run's budget of time or core-hours, in words ("3 minutes or 2 core-hours")."""
        a = self.args
        limits = [f"{a.time_limit / 60:g} minutes"] if a.time_limit else []
        return " or ".join(limits + ([f"{a.core_hours:g} core-hours"] if a.core_hours else []))

    def progress(self) -> tuple[int, int]:
        """How far the run is, for its bar and log lines: (step, steps) where steps are its
        budget, else (per mille of its time or core-hours spent, 1000)."""
        if self.by_steps():
            return self.state.step, self.total
        return round(1000 * min(1.0, budget_spent(self.args, self.state, self.total))), 1000

    def save(self, resume_point: bool = True) -> None:
        """The checkpoint, the delivered drafter and (`resume_point`) the resume point (`save_checkpoint`)."""
        save_checkpoint(self.out, self.drafter, self.optimizer, self.state, self.args, self.average, resume_point)

    def run(self) -> dict:
        """Train until the budget is spent, logging, evaluating and checkpointing on the way;
        the final stats (step, elapsed, core seconds, the log's records, the drafter and its
        weight average: None without --ema)."""
        a, st = self.args, self.state
        ended = self.finished()  # a finished run resumed: its resume point stays as it is
        if self.rank == 0:
            self.log(self.describe())
        log_file, logged = open_log(self.out, st.step) if self.rank == 0 else (None, [])
        meter = Meter(self.cfg.block_size)
        t_start = time.perf_counter() - st.elapsed
        last_ck = last_eval = time.perf_counter()
        history: list[dict] = []
        done, total = self.progress()
        with StepBar(total, done, enabled=a.progress and self.rank == 0, percent=not self.by_steps()) as bar:
            try:
                while budget_spent(a, st, self.total) < 1.0:
                    cpu, self.data_seconds = time.process_time(), 0.0  # every thread's: a paused job is not charged
                    out = self.step()
                    st.core_seconds += time.process_time() - cpu - self.data_seconds
                    st.elapsed = time.perf_counter() - t_start
                    if self.world > 1:  # rank 0's clock: the ranks keep one learning rate and stop together
                        st.elapsed = mx.distributed.all_sum(mx.array(st.elapsed if self.rank == 0 else 0.0)).item()
                    self.threads.poll()
                    if out is not None:
                        meter.add(out)
                    if self.rank != 0:
                        continue
                    rec = None
                    if a.eval_minutes and time.perf_counter() - last_eval > a.eval_minutes * 60:
                        tic = time.perf_counter()
                        rec = self.evaluation()
                        meter.heldout = rec["heldout_tau"]
                        last_eval = time.perf_counter()
                        t_start += last_eval - tic  # measuring is not training time
                    bar.update(self.progress()[0], meter.describe(st, self.optimizer.learning_rate.item()))
                    if st.step % a.log_every == 0 or (st.step == self.total and self.by_steps()):
                        rec = {**(rec or {}), **meter.record(st, self.optimizer.learning_rate.item())}
                        meter.reset()
                        if not a.progress:
                            done, total = self.progress()
                            where = f"/{total}" if self.by_steps() else f" ({done / total:.0%})"
                            self.log(f"step {st.step}{where} {st.elapsed:.0f}s {meter.last}")
                    if rec:
                        history.append(rec)
                        log_file.write(json.dumps(rec) + "\n")
                        log_file.flush()
                    if st.step % a.checkpoint_every == 0 or time.perf_counter() - last_ck > a.checkpoint_minutes * 60:
                        self.save()
                        last_ck = time.perf_counter()
                last = (logged + history)[-1:]  # a finished run resumed again steps no more: its end is logged
                evaluated = bool(last) and last[0]["step"] == st.step and "heldout_tau" in last[0]
                if self.rank == 0 and a.eval_minutes and not evaluated:
                    # the curve's last point: the drafter this run ends with
                    rec = self.evaluation()
                    history.append(rec)
                    log_file.write(json.dumps(rec) + "\n")
            finally:
                if log_file:
                    log_file.close()
        if self.rank == 0:
            self.save(resume_point=not ended)
            self.log(f"{st.core_seconds / 3600:.3f} core-hours of training in all ({st.elapsed:.0f}s)")
        return {
            "step": st.step,
            "elapsed": st.elapsed,
            "core_seconds": st.core_seconds,
            "history": history,
            "drafter": self.drafter,
            "average": self.average,
        }


def train(args: TrainArgs, log: Callable[[str], None] = print) -> dict:
    """Train a drafter; returns the final stats. Writes `args.out` (config.json +
    model.safetensors, loadable by `load_draft`), `args.out/checkpoint/` and `train_log.jsonl`."""
    return Trainer(args, log).run()
