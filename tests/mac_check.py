"""`make mac-check`: what a contributor with a Mac runs, in one JSON report.

CI runs on Linux CPUs, where the Metal kernels only run in the emulator. On a Mac this
runs the kernel tests on the real GPU (test_kernel*.py), the lossless and chi-square
suites, the whole loop on bfloat16 and 4-/8-bit targets (test_dtypes.py),
`dflash bench kernels` and `benchmarks/top_k.py` (whether `top_k_columns` wins on Metal too),
and writes every outcome and timing to one JSON file that
BENCHMARKS.md can quote. Exits non-zero if any test failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SUITES = {
    "metal_kernels": ["test_kernels.py", "test_kernel_replay.py", "test_kernel_loop.py", "test_kernel_choice.py"],
    "lossless": ["test_lossless.py"],
    "chi_square": ["test_sampling.py"],
    "bfloat16_and_quantized_targets": ["test_dtypes.py"],
    "top_k_columns": ["test_topk.py"],
}
HERE = Path(__file__).parent


class Outcomes:
    """A pytest plugin that keeps each test's outcome (a failed setup counts as failed)."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        """Record the call's outcome, or the setup's where it did not pass."""
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.outcomes[report.nodeid] = report.outcome


def run_suite(files: list[str]) -> dict:
    """Run the test files; their exit code, counts and the failed tests' ids."""
    plugin = Outcomes()
    code = pytest.main(["-q", "-p", "no:cacheprovider", *(str(HERE / f) for f in files)], plugins=[plugin])
    values = list(plugin.outcomes.values())
    failed = [test for test, outcome in plugin.outcomes.items() if outcome == "failed"]
    counts = {"passed": values.count("passed"), "skipped": values.count("skipped")}
    return {"exit_code": int(code), **counts, "failed": failed}


def top_k_table() -> dict:
    """`python -m benchmarks.top_k`'s table (benchmarks/ is not an installed package)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "top_k.json"
        subprocess.run([sys.executable, "-m", "benchmarks.top_k", "--json", str(out)], cwd=HERE.parent, check=True)
        return json.loads(out.read_text())


def main(out: str = "mac-check.json") -> int:
    """Run every suite and the kernel bench, write the report to `out`; 1 if a test failed."""
    from app.cli.bench.kernels import kernel_table, run_kernel_bench
    from dflash_mlx.kernels import metal_ready
    from dflash_mlx.kernels.choice import machine

    report = {"machine": machine(), "metal": metal_ready(), "suites": {}}
    for name, files in SUITES.items():
        report["suites"][name] = run_suite(files)
    report["bench_kernels"] = run_kernel_bench()
    print(kernel_table(report["bench_kernels"]))
    report["top_k"] = top_k_table()
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    failed = [name for name, suite in report["suites"].items() if suite["exit_code"] not in (0, 5)]
    print(f"report: {out}; " + (f"failed: {', '.join(failed)}" if failed else "every suite passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
