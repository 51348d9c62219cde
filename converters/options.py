"""The options `dflash convert` shares between drafters and target models, and the checks
every conversion makes before it reads or downloads anything. It imports nothing heavy:
`dflash --help` reads it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["FLOAT_DTYPES", "Q_BITS", "Q_GROUP_SIZES", "ConvertOptions", "check_output"]

#: The dtypes `--dtype` accepts.
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
Q_BITS = (2, 3, 4, 5, 6, 8)
Q_GROUP_SIZES = (32, 64, 128)


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
    """Which revision to read, the output dtype (None: the source's), quantization, and
    whether an existing OUTPUT_DIR may be replaced."""

    revision: Optional[str] = None
    dtype: Optional[str] = None
    quantize: bool = False
    q_bits: int = 4
    q_group_size: int = 64
    force: bool = False

    @property
    def quantization(self) -> Optional[dict]:
        """MLX's ``{"group_size", "bits"}`` when quantizing, else None."""
        return {"group_size": self.q_group_size, "bits": self.q_bits} if self.quantize else None

    def check(self, source: str, out: Path) -> None:
        """The option and output checks made before anything is read (one-line errors)."""
        if self.dtype is not None and self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(FLOAT_DTYPES)}, got {self.dtype!r}")
        if self.quantize and self.q_bits not in Q_BITS:
            raise ValueError(f"--q-bits must be one of {', '.join(map(str, Q_BITS))}, got {self.q_bits}")
        if self.quantize and self.q_group_size not in Q_GROUP_SIZES:
            sizes = ", ".join(map(str, Q_GROUP_SIZES))
            raise ValueError(f"--q-group-size must be one of {sizes}, got {self.q_group_size}")
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
        if self.quantize:
            args += ["-q", "--q-bits", str(self.q_bits), "--q-group-size", str(self.q_group_size)]
        if target:
            args += ["--target", target]
        if target_layer_ids:
            args += ["--target-layer-ids", ",".join(map(str, target_layer_ids))]
        return shlex.join(args)
