"""`dflash bench`: plain mlx-lm against DFlash (`speed.py`), at long contexts (`context.py`), the
verify's cost by width (`verify.py`), the custom kernels against MLX's ops (`kernels.py`) and
`dflash serve` against `mlx_lm.server` under concurrent clients (`concurrency.py`); `commands.py`
holds the subcommands."""
