"""The model card (README.md) `dflash convert` writes beside a converted drafter: where
it came from, what it is, the command that made it and how to use it."""

from __future__ import annotations

from pathlib import Path

from dflash_mlx.drafter import DrafterConfig
from dflash_mlx.hub import ResolvedSource

__all__ = ["model_card", "size_text"]

_CARD = """\
---
library_name: mlx
tags:
- mlx
- dflash
- speculative-decoding
{base}---

# {title}

A DFlash block-diffusion drafter for speculative decoding with mlx-dflash
(`pip install mlx-dflash`), converted to MLX from z-lab's checkpoint layout.

| | |
|---|---|
| Source | {source} |
| Revision | {revision} |
| Source format | {fmt} ({src_dtype}) |
| Weights | {weights} |
| Drafter | {layers} layers, hidden {hidden}, block size {block} |
| Target features | layers {ids} of a {n_target}-layer target, mask token {mask} |

Made with:

```bash
{command}
```

Use it with its target:

```python
import dflash_mlx
from dflash_mlx import load, load_draft, generate

model, tokenizer = load("<target model>")
draft = load_draft("<this directory or repo>", model=model)
print(generate(model, tokenizer, "Hello", draft, max_tokens=128))
```

`dflash export <this directory> <out>` turns it back into z-lab's PyTorch layout
(for SGLang / vLLM).
"""


def model_card(
    *, out: Path, src: ResolvedSource, fmt: str, src_dtype: str, weights: str, cfg: DrafterConfig, command: str
) -> str:
    """The card for drafter `cfg` converted from `src` into `out`."""
    source = src.repo_id if src.is_hub else str(src.path.resolve())
    if src.is_hub:
        commit = f" (commit {src.commit})" if src.commit and src.commit != src.revision else ""
        revision = (src.revision or "main") + commit
    else:
        revision = "local directory"
    base = f"base_model: {source}\n" if "/" in source and not Path(source).exists() else ""
    return _CARD.format(
        base=base,
        title=f"{out.name} (MLX DFlash drafter)",
        source=source,
        revision=revision,
        fmt=fmt,
        src_dtype=src_dtype,
        weights=weights,
        layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        block=cfg.block_size,
        ids=", ".join(map(str, cfg.target_layer_ids)),
        n_target=cfg.num_target_layers,
        mask=cfg.mask_token_id,
        command=command,
    )


def size_text(n_bytes: int) -> str:
    """A byte count for people: "812 B", "3.4 MB"."""
    for unit in ("B", "KB", "MB", "GB"):
        if n_bytes < 1024 or unit == "GB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024
    return ""
