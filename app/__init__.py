"""The front ends of mlx-dflash, one room each:

- `app/cli/`: the `dflash` command (`main.py`); `bench/` its benchmarks, `train.py` its
  instructions, data, train, eval, curves and draft-vocab commands.
- `app/chat/`: `dflash-chat`, the terminal chat (`main.py` its command line).
- `app/server/`: `dflash serve`, the OpenAI- and Anthropic-compatible HTTP server.

Shared by them: `flags.py` (the decoding flags and slash commands, made from `DecodeOptions`'
fields), `model_thread.py` (the thread that owns the model, for the chat and the server) and
`version.py` (the `--version` line).

The engine is reached through its public API (`dflash_mlx`, its `__all__`) and these
modules only:

- `dflash_mlx.cache`: prompt cache files (`dflash cache-prompt`, `--prompt-cache-file`);
- `dflash_mlx.distributed`: ranks under `mlx.launch` (generate, serve, bench speed);
- `dflash_mlx.batch` and `dflash_mlx.text`: the server's continuous batching
  (`app/server/scheduler.py`): rows of one batch, and each request's text as its tokens come;
- `dflash_mlx.train` and `dflash_mlx.draft_vocab`: the data, train, eval and draft-vocab commands;
- `dflash_mlx.targets`, `dflash_mlx.tree`, `dflash_mlx.rollback` and `dflash_mlx.kernels`: the
  engine's parts that `dflash bench verify-cost` and `dflash bench kernels` time one by one.
"""
