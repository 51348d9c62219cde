"""Data-parallel drafter training with MLX's own distributed layer: two local processes
started by `mlx.launch --backend ring` stay in lockstep (gradients averaged by all-sum)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_two_ranks_train_in_lockstep(tmp_path):
    bindir = Path(sys.executable).parent
    launcher = shutil.which("mlx.launch", path=str(bindir)) or shutil.which("mlx.launch")
    if launcher is None:
        pytest.skip("mlx.launch is not installed")
    # The checkout's packages, not whichever the venv has installed (the script's own
    # folder, tests/, is what Python puts first on its path).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONPATH=path)
    proc = subprocess.run(
        [
            launcher,
            "-n",
            "2",
            "--backend",
            "ring",
            sys.executable,
            str(ROOT / "tests" / "train_distributed_worker.py"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert all(r["world"] == 2 for r in ranks)
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # identical weights after training
    losses = next(r["losses"] for r in ranks if r["rank"] == 0)
    assert losses[-1] < losses[0]
    assert (tmp_path / "drafter" / "model.safetensors").is_file()  # rank 0 wrote the drafter
