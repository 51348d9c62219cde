"""Checkpoints in and out of MLX: what `dflash convert` and `dflash export` do.

`convert.py` converts z-lab drafters (and, through `mlx_lm.convert`, target models) and
exports drafters back to z-lab's layout, with `checkpoint.py` (reading and validating the
source's tensors), `options.py` (the shared options and output checks) and `card.py` (the
model card). `gguf.py`, `gguf_metadata.py` and `gguf_tokenizer.py` import a llama GGUF file
as a model directory, which `default_model.py` uses for the built-in default target.
"""
