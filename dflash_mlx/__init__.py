"""mlx-dflash: DFlash block-diffusion speculative decoding on MLX."""

from .blas import preload as _preload_blas

_preload_blas()  # must run before the first `import mlx`
