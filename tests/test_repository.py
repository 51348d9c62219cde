"""The repository itself: a merge that leaves conflict markers in a tracked file once
reached a branch unnoticed (README.md), so every tracked text file is checked."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^(<{7}|>{7})( |$)", re.MULTILINE)


def test_no_conflict_markers_in_tracked_files():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert files, "git ls-files listed nothing"
    bad = []
    for name in files:
        path = ROOT / name
        if path.suffix in {".safetensors", ".npz", ".png", ".gguf"} or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        bad += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in MARKER.finditer(text)]
    assert not bad, f"conflict markers at {bad}"
