"""BENCHMARKS.md's rendered tables are what benchmarks/*.json render to (`python -m
benchmarks.render --consistency`), and the check catches a number changed by hand; `--check`
also fails on a table whose measured files changed after its commit (benchmarks/stale.py),
tried here on tiny git repositories made for the test."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.render import main, plain_table, render
from benchmarks.stale import covers

ROOT = Path(__file__).resolve().parent.parent
TABLE = {"commands": ["bench"], "when": "today", "columns": [{"name": "tok/s", "align": "r"}], "rows": [[12]]}


def test_benchmarks_md_matches_its_json():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.render", "--consistency"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_every_real_table_has_a_staleness_line():
    """The real tables' staleness is reported, not asserted: a table measured before a commit to
    the engine is stale until someone measures it again, and failing CI on it would make every
    engine commit red. So this only runs `--stale` and checks it says one line per table (or,
    in a clone without the history, e.g. a shallow one, the one line that says so)."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.render", "--stale"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    if len(lines) == 1 and lines[0].startswith("staleness not checked: "):
        return
    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.json"))
    assert [line.split(": ")[0] for line in lines] == names
    assert all(line.split(": ")[1].split(" (")[0] in ("current", "stale", "historical") for line in lines)


def test_a_number_edited_by_hand_fails_the_check(tmp_path, capsys):
    text = (ROOT / "BENCHMARKS.md").read_text()
    data = json.loads((ROOT / "benchmarks" / "training-long-run.json").read_text())
    row = "| " + " | ".join(f"{v:,}" if i == 0 else f"{v:.2f}" for i, v in enumerate(data["rows"][-1])) + " |"
    assert row in text
    edited = tmp_path / "BENCHMARKS.md"
    edited.write_text(text.replace(row, row.replace(f"{data['rows'][-1][2]:.2f}", "9.99", 1)))
    assert main(["--consistency", "--file", str(edited)]) == 1
    assert "training-long-run" in capsys.readouterr().err
    assert main(["--write", "--file", str(edited)]) == 0
    assert edited.read_text() == text


def test_plain_table_formats_and_checks_its_rows():
    columns = [{"name": "step", "align": "r", "format": ","}, {"name": "tau", "align": "r", "format": ".2f"}]
    assert plain_table({"columns": columns, "rows": [[1108, 1.4], [2, None]]}).splitlines() == [
        "| step | tau |",
        "|---:|---:|",
        "| 1,108 | 1.40 |",
        "| 2 | - |",
    ]
    with pytest.raises(ValueError, match="row 0 has 1 cells for 2 columns"):
        plain_table({"columns": columns, "rows": [[1]]})


def _git(repo: Path, *args: str) -> str:
    """`git ARGS` in `repo` with a fixed author and no signing; its output, stripped."""
    config = ["-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "commit.gpgsign=false"]
    done = subprocess.run(["git", *config, *args], cwd=repo, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _commit(repo: Path, files: dict[str, str]) -> str:
    """Write `files` (path: text) into `repo` and commit them; the commit's short hash."""
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"change {', '.join(files)}")
    return _git(repo, "rev-parse", "--short", "HEAD")


def _table(repo: Path, measured: dict) -> None:
    """Commit table `speed` with `measured`, rendered into the repository's BENCHMARKS.md."""
    data = {**TABLE, "measured": measured}
    text = f"<!-- render: speed -->\n{render('speed', data)}<!-- /render -->\n"
    _commit(repo, {"benchmarks/speed.json": json.dumps(data), "BENCHMARKS.md": text})


def _run(repo: Path, mode: str = "--check") -> int:
    """`python -m benchmarks.render MODE` on `repo`'s BENCHMARKS.md and benchmarks/."""
    return main([mode, "--file", str(repo / "BENCHMARKS.md"), "--benchmarks", str(repo / "benchmarks")])


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str]:
    """A git repository with table `speed` measured at its first commit A, which it names:
    the table measures engine/ but not engine/train/. (repository, A)"""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    first = _commit(repo, {"engine/core.py": "x = 1\n", "engine/train/loop.py": "y = 1\n", "docs/notes.md": "a\n"})
    _table(repo, {"commit": first, "files": ["engine/", "!engine/train/"]})
    return repo, first


def test_a_change_to_a_measured_file_makes_its_table_stale(repo, capsys):
    repo, first = repo
    assert _run(repo) == 0
    later = _commit(repo, {"engine/core.py": "x = 2\n"})
    _commit(repo, {"docs/notes.md": "b\n"})
    assert _run(repo) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("speed: stale")
    assert first in err[0] and later in err[0] and "engine/core.py" in err[0]
    assert _run(repo, "--consistency") == 0  # what CI runs: an engine commit does not fail it
    assert _run(repo, "--stale") == 0
    assert capsys.readouterr().out.startswith("speed: stale")


def test_a_change_outside_what_it_measures_leaves_it_current(repo, capsys):
    repo, first = repo
    _commit(repo, {"docs/notes.md": "b\n", "engine/train/loop.py": "y = 2\n"})
    assert _run(repo) == 0
    assert _run(repo, "--stale") == 0
    assert capsys.readouterr().out == f"speed: current (measured at {first}; nothing it measures changed since)\n"


def test_a_commit_outside_heads_history_counts_as_stale(repo, capsys):
    repo, _ = repo
    _git(repo, "checkout", "-q", "-b", "side")
    side = _commit(repo, {"docs/notes.md": "b\n"})  # then rebased away: main never has it
    _git(repo, "checkout", "-q", "-")
    _table(repo, {"commit": side, "files": ["engine/"]})
    assert _run(repo) == 1
    assert (
        capsys.readouterr().err == f"speed: stale (measured at {side}, which is not in HEAD's history: rebased away?)\n"
    )
    _table(repo, {"commit": "0000000", "files": ["engine/"]})  # in no history at all
    assert _run(repo) == 1


def test_a_historical_table_never_goes_stale(repo):
    repo, first = repo
    _table(repo, {"commit": first, "historical": "a finished run's log"})
    _commit(repo, {"engine/core.py": "x = 2\n"})
    assert _run(repo) == 0


def test_without_the_history_the_check_says_so_in_one_line(repo, tmp_path, capsys, monkeypatch):
    repo, first = repo
    _commit(repo, {"engine/core.py": "x = 2\n"})
    plain = tmp_path / "plain"
    shutil.copytree(repo, plain, ignore=shutil.ignore_patterns(".git"))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above it either
    assert _run(plain) == 0
    assert (
        capsys.readouterr().err
        == f"staleness not checked: {plain / 'benchmarks'} is not in a git checkout (or git is not installed)\n"
    )
    shallow = tmp_path / "shallow"
    _git(tmp_path, "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow))
    assert _run(shallow) == 0
    err = capsys.readouterr().err
    assert err == f"staleness not checked: this shallow clone lacks commit {first} (benchmarks/speed.json)\n"


@pytest.mark.parametrize(
    "measured, field",
    [
        (lambda first: None, "measured: missing or not an object"),
        (lambda first: {"commit": "HEAD", "files": ["engine/"]}, "measured.commit: 'HEAD' is not a commit hash"),
        (lambda first: {"files": ["engine/"]}, "measured.commit: None"),
        (lambda first: {"commit": first, "files": ["engine/"], "file": "x"}, "measured.file: not a field"),
        (lambda first: {"commit": first}, "measured: needs either 'files'"),
        (lambda first: {"commit": first, "files": ["!engine/"]}, "measured.files: the first pattern"),
        (lambda first: {"commit": first, "files": ["engin/"]}, "measured.files: 'engin/' matches no file"),
    ],
    ids=["none", "not-a-hash", "no-commit", "unknown-key", "no-files", "negation-first", "typo"],
)
def test_a_bad_measured_field_is_a_one_line_error_naming_it(repo, capsys, measured, field):
    repo, first = repo
    _table(repo, measured(first))
    assert _run(repo) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: benchmarks/speed.json: {field}") and err.count("\n") == 1


def test_the_last_pattern_that_matches_a_path_decides():
    patterns = ["engine/", "!engine/train/", "engine/train/replay.py", "*.md"]
    assert covers(patterns, "engine/core.py") and covers(patterns, "engine/train/replay.py")
    assert covers(patterns, "docs/notes.md")
    assert not covers(patterns, "engine/train/loop.py") and not covers(patterns, "app/main.py")
