"""`dflash`: the command line. `main.py` is the typer app (generate, cache-prompt, convert, export,
serve), `bench/` the `dflash bench` commands, `train.py` the instructions, data, train, eval, curves and draft-vocab
commands."""
