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


def launch(tmp_path: Path, *args: str) -> list[dict]:
    """Each rank's JSON line from `train_distributed_worker.py` under `mlx.launch -n 2`."""
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
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_two_ranks_train_in_lockstep(tmp_path):
    ranks = launch(tmp_path)
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert all(r["world"] == 2 for r in ranks)
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # identical weights after training
    assert ranks[0]["average_checksum"] == ranks[1]["average_checksum"] != ranks[0]["checksum"]  # and average
    losses = next(r["losses"] for r in ranks if r["rank"] == 0)
    assert losses[-1] < losses[0]
    assert (tmp_path / "drafter" / "model.safetensors").is_file()  # rank 0 wrote the drafter


def test_two_ranks_follow_rank_0s_clock_under_a_time_limit(tmp_path):
    """Under --time-limit the learning rate and the end follow the wall clock: each rank's
    own (rank 0 also logs and checkpoints) would give the ranks other learning rates, and
    one could stop a step before the other, which then waits for it forever."""
    ranks = launch(tmp_path, "3")
    assert ranks[0]["steps"] == ranks[1]["steps"] > 1
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
