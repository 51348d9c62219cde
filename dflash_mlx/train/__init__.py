"""Drafter training: self-distillation data, cached target features, the objective, the loop.

- `prompts`: offline prompt sources and the held-out split;
- `sources`: the prompt sources by name (`dflash data --source`), read;
- `docstrings`: documented names of installed modules, what documentation prompts ask about;
- `fresh_prompts`, `word_problems`, `code_tasks`, `code_prompts`: round 6's sources, more of
  the held-out kinds and none of the held-out prompts (`--source round6`);
- `answers`: the target answers prompt records in batches (the one place that generates);
- `data`: the target answers its own prompts (`dflash data`);
- `instructions`: user messages the target wrote, cleaned and deduplicated;
- `selfinstruct`: the target writes chat prompts (`dflash instructions`);
- `conversations`: multi-turn answers, every assistant turn trained on (`dflash data --turns`);
- `features`: target features and top-K distributions, computed once, kept on disk;
- `initialize`: the drafter's config and first weights (warm start from the target);
- `objective`: anchored blocks, the block-parallel forward, the losses;
- `loop`: optimiser, schedule, checkpoints and exact resume (`dflash train`);
- `checkpoint`: the run's arguments and state, its checkpoint and compact resume point;
- `average`: the moving average of the drafter's weights (`dflash train --ema`);
- `progress`: the running numbers between log lines and the progress bars;
- `threads`: OpenBLAS threads, fixed or following the shared CPU lock (`--threads auto`);
- `evaluate`: acceptance length on held-out prompts (`dflash eval`);
- `replay`: held-out greedy tau by replaying a drafter along the target's own answers;
- `curves`: held-out tau against core-hours per run, and the fit that ranks recipes;
- `transcripts`: the user's conversations on disk (chat transcripts, conversation logs);
- `adapt_plan`, `adapt`: a drafter fine-tuned on those, kept where held-back tau rose (`dflash adapt`).
"""

from .initialize import default_mask_token_id, make_config, warm_start
from .loop import TrainArgs, Trainer, train

__all__ = ["TrainArgs", "Trainer", "default_mask_token_id", "make_config", "train", "warm_start"]
