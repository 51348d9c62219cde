"""Adaptive chains only (what hybrid, sliding-window and sharded targets run): ours with prompt
lookup in the chains and without, beside plain mlx-lm, on the held-out prompts of the kinds
named (default: chat, code). Writes the bench report; BENCHMARKS.md renders it.

    python -m benchmarks.chains OUT.json [KIND ...]   # from the repository root
"""

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

import sys
from pathlib import Path

from app.cli.bench.commands import read_prompts
from app.cli.common import write_json
from app.cli.bench.speed import markdown_table, run_bench
from dflash_mlx.options import DecodeOptions


def main(out: Path, kinds: list[str]) -> None:
    prompts, prompt_kinds = read_prompts(kinds)
    report = run_bench(
        prompts=prompts,
        kinds=prompt_kinds,
        max_tokens=128,
        reference=False,
        options=DecodeOptions(tree_budget=0),
        fixed_lookups=[0],
    )
    print(markdown_table(report))
    write_json(report, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or ["chat", "code"])
