"""The options `dflash convert` shares between drafters and target models, and the checks
every conversion makes before it reads or downloads anything. It imports nothing heavy:
`dflash --help` reads it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

__all__ = [
    "FLOAT_DTYPES",
    "Q_BITS",
    "Q_GROUP_SIZES",
    "DEFAULT_Q_BITS",
    "DEFAULT_Q_GROUP_SIZE",
    "ConvertOptions",
    "check_output",
]

#: The dtypes `--dtype` accepts.
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
Q_BITS = (2, 3, 4, 5, 6, 8)
Q_GROUP_SIZES = (32, 64, 128)
DEFAULT_Q_BITS, DEFAULT_Q_GROUP_SIZE = 4, 64  # mlx-lm's


def check_output(output_dir: Path, force: bool, sources: Sequence[Path] = ()) -> None:
    """Fail early (before any download) if OUTPUT_DIR exists without --force, or would
    replace one of the inputs (OUTPUT_DIR equal to an input, or an input inside it)."""
    out = Path(output_dir).expanduser()
    if out.exists() and not force:
        raise FileExistsError(f"{output_dir} already exists (pass --force to replace it)")
    o = out.resolve()
    for s in sources:
        s = Path(s).resolve()
        if o == s or s.is_relative_to(o):
            raise ValueError(f"OUTPUT_DIR {output_dir} would replace the input {s}: choose another directory")


@dataclass(frozen=True)
class ConvertOptions:
    """Which revision to read, the output dtype (None: the source's), quantization (bits and
    group size None: not given, mlx-lm's defaults with `quantize`), and whether an existing
    OUTPUT_DIR may be replaced."""

    revision: Optional[str] = None
    dtype: Optional[str] = None
    quantize: bool = False
    q_bits: Optional[int] = None
    q_group_size: Optional[int] = None
    force: bool = False

    @property
    def quantization(self) -> Optional[dict]:
        """MLX's ``{"group_size", "bits"}`` when quantizing, else None."""
        if not self.quantize:
            return None
        group_size = DEFAULT_Q_GROUP_SIZE if self.q_group_size is None else self.q_group_size
        return {"group_size": group_size, "bits": DEFAULT_Q_BITS if self.q_bits is None else self.q_bits}

    def check(self, source: str, out: Path) -> None:
        """The option and output checks made before anything is read (one-line errors)."""
        if self.dtype is not None and self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(FLOAT_DTYPES)}, got {self.dtype!r}")
        for flag, value in (("--q-bits", self.q_bits), ("--q-group-size", self.q_group_size)):
            if value is not None and not self.quantize:  # else it would be ignored silently
                raise ValueError(f"{flag} applies with -q/--quantize only: add -q or drop {flag}")
        q = self.quantization or {}
        if q and q["bits"] not in Q_BITS:
            raise ValueError(f"--q-bits must be one of {', '.join(map(str, Q_BITS))}, got {q['bits']}")
        if q and q["group_size"] not in Q_GROUP_SIZES:
            sizes = ", ".join(map(str, Q_GROUP_SIZES))
            raise ValueError(f"--q-group-size must be one of {sizes}, got {q['group_size']}")
        local = Path(source).expanduser()
        check_output(out, self.force, [local] if local.exists() else [])

    def command_line(
        self,
        source: str,
        output_dir: str,
        *,
        target: Optional[str] = None,
        target_layer_ids: Optional[Sequence[int]] = None,
        target_model: bool = False,
    ) -> str:
        """The canonical `dflash convert` command for these options (for the model card)."""
        args = ["dflash", "convert", source, output_dir] + (["--target-model"] if target_model else [])
        if self.revision:
            args += ["--revision", self.revision]
        if self.dtype:
            args += ["--dtype", self.dtype]
        if self.quantization:
            q = self.quantization
            args += ["-q", "--q-bits", str(q["bits"]), "--q-group-size", str(q["group_size"])]
        if target:
            args += ["--target", target]
        if target_layer_ids:
            args += ["--target-layer-ids", ",".join(map(str, target_layer_ids))]
        return shlex.join(args)
