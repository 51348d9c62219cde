"""Which of BENCHMARKS.md's tables measured files that have changed since (issue 61): a
regression once hid behind a four-day-old table because nothing said that the code under it
had moved on.

Each ``benchmarks/NAME.json`` says what its numbers measured in ``"measured"``, one of:

- ``{"commit": C, "files": [PATTERN, ...]}``: the commit the numbers came from and the files
  they depend on (what the commands run and read). A pattern is a path from the repository
  root: one ending in ``/`` is a folder and covers what lies under it, any other a file or an
  ``fnmatch`` glob; ``!PATTERN`` leaves out what it matches, and the last pattern matching a
  path decides (``["dflash_mlx/", "!dflash_mlx/train/", "dflash_mlx/train/replay.py"]``:
  the engine and replay, not the rest of training); each matches a file at C or at HEAD (a
  typo would never go stale). The table is stale once a commit after C changes one of those
  files (``git log C..HEAD`` lists one), a move to where a pattern looks included, or once C
  is not in HEAD's history (a branch's commit rebased away: name the new one);
- ``{"commit": C, "historical": WHY}``: a record that no later change alters (a finished
  run's log, a past decision), never stale; WHY says so in one line.

``python -m benchmarks.render --check`` fails on a stale table and ``--stale`` gives every
table's state; without the git history to compare (not a checkout, or a shallow clone that
lacks a commit) both say so in one line and check no staleness.
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

FIELDS = ("commit", "files", "historical")


class NoHistory(Exception):
    """The git history that staleness is judged against is not here (the message says why)."""


@dataclass(frozen=True)
class Measured:
    """A table's ``"measured"``: its commit, and the patterns of the files it measures or why
    it is a historical record ("" for a measured table)."""

    commit: str
    files: tuple[str, ...] = ()
    historical: str = ""


@dataclass(frozen=True)
class Status:
    """A table's staleness: `line` says it in one line (name, state, commits)."""

    stale: bool
    line: str


def measured(name: str, data: dict) -> Measured:
    """The ``"measured"`` field of benchmarks/NAME.json, checked; a one-line ValueError naming
    the field where it is missing or malformed."""
    where = f"benchmarks/{name}.json: measured"
    spec = data.get("measured")
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: missing or not an object with 'commit' and 'files' or 'historical'")
    unknown = sorted(set(spec) - set(FIELDS))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: not a field ({', '.join(FIELDS)})")
    commit = spec.get("commit")
    if not (isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{7,40}", commit)):
        raise ValueError(f"{where}.commit: {commit!r} is not a commit hash (7 to 40 hex digits)")
    if ("files" in spec) == ("historical" in spec):
        raise ValueError(f"{where}: needs either 'files' (what it measures) or 'historical' (why it never goes stale)")
    if "historical" in spec:
        why = spec["historical"]
        if not (isinstance(why, str) and why.strip() and "\n" not in why):
            raise ValueError(f"{where}.historical: not a one-line reason")
        return Measured(commit, historical=why)
    files = spec["files"]
    if not (isinstance(files, list) and files and all(isinstance(p, str) and p.lstrip("!") for p in files)):
        raise ValueError(f"{where}.files: not a list of paths")
    if files[0].startswith("!"):
        raise ValueError(f"{where}.files: the first pattern, {files[0]!r}, leaves out from nothing")
    return Measured(commit, files=tuple(files))


def _matches(pattern: str, path: str) -> bool:
    """Whether one pattern (no "!") matches a path: a folder's prefix, else fnmatch."""
    return path.startswith(pattern) if pattern.endswith("/") else fnmatch.fnmatchcase(path, pattern)


def covers(patterns: Sequence[str], path: str) -> bool:
    """Whether `patterns` measure `path`: the last pattern that matches it decides."""
    inside = False
    for pattern in patterns:
        if _matches(pattern.removeprefix("!"), path):
            inside = not pattern.startswith("!")
    return inside


def _git(root: Path, *args: str) -> str | None:
    """`git ARGS` run in `root`: its output (paths unquoted), or None where it fails or git is missing."""
    try:
        done = subprocess.run(["git", "-c", "core.quotePath=false", *args], cwd=root, capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout if done.returncode == 0 else None


class History:
    """The git history of the checkout that holds `directory` (NoHistory where there is none)."""

    def __init__(self, directory: Path) -> None:
        top = _git(directory, "rev-parse", "--show-toplevel")
        if top is None:
            raise NoHistory(f"{directory} is not in a git checkout (or git is not installed)")
        self.root = Path(top.strip())
        self.shallow = (_git(self.root, "rev-parse", "--is-shallow-repository") or "").strip() == "true"

    def commit(self, name: str, short: str) -> str | None:
        """The full hash of benchmarks/NAME.json's measured commit, or None where it is not in
        HEAD's history (a branch's commit rebased away, say)."""
        full = _git(self.root, "rev-parse", "--verify", "--quiet", f"{short}^{{commit}}")
        if full is None and self.shallow:
            raise NoHistory(f"this shallow clone lacks commit {short} (benchmarks/{name}.json)")
        if full is None or _git(self.root, "merge-base", "--is-ancestor", full.strip(), "HEAD") is None:
            return None
        return full.strip()

    def files(self, commit: str) -> list[str]:
        """The paths of every file at `commit`."""
        return (_git(self.root, "ls-tree", "-r", "--name-only", commit) or "").splitlines()

    def changes(self, commit: str) -> list[tuple[str, list[str]]]:
        """The commits after `commit` up to HEAD, newest first, each with the paths it changed."""
        out: list[tuple[str, list[str]]] = []
        log = _git(self.root, "log", "--no-renames", "--name-only", "--format=\x01%h", f"{commit}..HEAD") or ""
        for entry in log.split("\x01")[1:]:
            lines = entry.splitlines()
            out.append((lines[0], [line for line in lines[1:] if line]))
        return out


def status(history: History, name: str, table: Measured) -> Status:
    """One table's state: historical, current, or stale (with the commits that changed its files,
    or a commit not in HEAD's history)."""
    if table.historical:
        return Status(False, f"{name}: historical (measured at {table.commit}): {table.historical}")
    commit = history.commit(name, table.commit)
    if commit is None:  # what changed since cannot be told: as good as stale
        return Status(
            True, f"{name}: stale (measured at {table.commit}, which is not in HEAD's history: rebased away?)"
        )
    present = history.files(commit) + history.files("HEAD")  # a file moved since is named by its path now
    for pattern in table.files:
        if not any(_matches(pattern.removeprefix("!"), path) for path in present):
            raise ValueError(
                f"benchmarks/{name}.json: measured.files: {pattern!r} matches no file at {table.commit} or HEAD"
            )
    changed = [(sha, paths) for sha, paths in history.changes(commit) if any(covers(table.files, p) for p in paths)]
    if not changed:
        return Status(False, f"{name}: current (measured at {table.commit}; nothing it measures changed since)")
    newest, paths = changed[0]
    first = next(p for p in paths if covers(table.files, p))
    return Status(
        True,
        f"{name}: stale (measured at {table.commit}; {len(changed)} commit(s) since changed what it measures, "
        f"the newest {newest}: {first})",
    )


def statuses(directory: Path) -> tuple[list[Status], str]:
    """The state of every table in `directory` (benchmarks/*.json) by name, and "": or, where
    the git history is missing, none and the one line that says so. A one-line ValueError for
    a bad ``"measured"``."""
    tables = {
        path.stem: measured(path.stem, json.loads(path.read_text()))
        for path in sorted(directory.glob("*.json"), key=lambda p: p.stem)
    }
    try:
        history = History(directory)
        return [status(history, name, table) for name, table in tables.items()], ""
    except NoHistory as exc:
        return [], f"staleness not checked: {exc}"


def head_commit(root: Path) -> str:
    """HEAD's short hash in `root`, for a script that writes a table's ``"measured"``."""
    commit = _git(root, "rev-parse", "--short", "HEAD")
    if commit is None:
        raise NoHistory(f"{root} is not in a git checkout")
    return commit.strip()
