"""`dflash bench`: plain mlx-lm against DFlash (`speed.py`), at long contexts (`context.py`), the
verify's cost by width (`verify.py`) and the custom kernels against MLX's ops (`kernels.py`)."""
