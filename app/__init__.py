"""The front ends of mlx-dflash, one room each:

- `app/cli/`: the `dflash` command (`main.py`); `bench/` its benchmarks, `train.py` its
  instructions, data, train, eval, curves and draft-vocab commands.
- `app/chat/`: `dflash-chat`, the terminal chat (`main.py` its command line).
- `app/server/`: `dflash serve`, the OpenAI- and Anthropic-compatible HTTP server.

Shared by them: `flags.py` (the decoding flags and slash commands, made from `DecodeOptions`'
fields), `model_thread.py` (the thread that owns the model, for the chat and the server) and
`version.py` (the `--version` line).

The engine is reached through its public API (`dflash_mlx`, its `__all__`) and these
modules only (`tests/test_code_shape.py` checks the list):

- `dflash_mlx.cache`: prompt cache files (`dflash cache-prompt`, `--prompt-cache-file`);
- `dflash_mlx.distributed`: ranks under `mlx.launch` (generate, serve, bench speed);
- `dflash_mlx.batch`, `batch_spec`, `batch_width`, `acceptance` and `text`: the server's
  continuous batching (`app/server/scheduler.py`): rows of one batch, their records, and
  each request's text as its tokens come; `dflash_mlx.topk`: the server's logprobs;
- `dflash_mlx.train`, `dflash_mlx.draft_vocab`, `dflash_mlx.drafters` and `dflash_mlx.atomic`:
  the data, train, adapt, eval, average and draft-vocab commands; `dflash_mlx.loading`: the
  model-directory check of every command;
- `dflash_mlx.targets`, `dflash_mlx.tree`, `dflash_mlx.rollback`, `dflash_mlx.kernels` and
  `dflash_mlx.host`: the engine's parts that `dflash bench verify-cost`, `dflash bench
  kernels` and `dflash bench host` time one by one.
"""
