"""`dflash_mlx.atomic.atomic_directory`, what an adapted drafter, a converted one and a
checkpoint are written with: a writer killed (SIGKILL, no clean-up) while it writes leaves
the old directory as it was, never half of the new one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

WRITER = """
import sys, time
from pathlib import Path
from dflash_mlx.atomic import atomic_directory
with atomic_directory(sys.argv[1], overwrite=True) as tmp:
    (Path(tmp) / "config.json").write_text("new")
    Path(sys.argv[2]).write_text("half written")  # tell the test: killed from here on
    time.sleep(60)
    (Path(tmp) / "model.safetensors").write_text("new")
"""


def test_a_writer_killed_mid_write_leaves_the_old_directory(tmp_path):
    out, signal_file = tmp_path / "drafter", tmp_path / "ready"
    out.mkdir()
    (out / "config.json").write_text("old")
    (out / "model.safetensors").write_text("old")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(out), str(signal_file)])
    deadline = time.monotonic() + 60
    while not signal_file.exists():
        assert writer.poll() is None and time.monotonic() < deadline, "the writer did not start writing"
        time.sleep(0.05)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(10)
    assert {p.name: p.read_text() for p in out.iterdir()} == {"config.json": "old", "model.safetensors": "old"}
