"""Write a directory all at once or not at all, and take turns writing shared files.

Converting a drafter, exporting one, importing a GGUF model and saving a training
checkpoint all write a directory of several files that is only useful complete. They
build it in a hidden temporary sibling and rename it into place at the end, so a failure
or an interrupt leaves the old directory (or nothing) behind, never half of a new one.
Single files (held-out answers kept for evaluation, prompt cache files) are renamed into
place the same way.
Files that several processes append to (the training feature cache) or build once (the
imported default model) are written under an exclusive lock.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_directory", "atomic_file", "exclusive_lock", "write_text_atomic"]


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a hidden sibling of `path` to write; on success it is renamed over `path`, on
    any failure removed. It keeps `path`'s suffix, for writers that add one (mlx's
    `save_safetensors` appends ".safetensors" to a name without it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{uuid.uuid4().hex[:8]}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write a file whole or not at all: a hidden sibling, renamed over `path`."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)


@contextmanager
def atomic_directory(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory next to `path`; on success it becomes `path`.

    An existing `path` is replaced only with `overwrite` (swapped out and back in if the
    final rename fails); without it, FileExistsError, also when another process created
    `path` meanwhile. On any failure or interrupt the temporary directory is removed, as
    are the parent directories this call created.
    """
    out = Path(path).expanduser().absolute()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists")
    created = [p for p in out.parents if not p.exists()]  # innermost first
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; give it mkdir's mode
        yield tmp
        _move_into_place(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in created:
            try:
                d.rmdir()
            except OSError:
                break
        raise


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    if not (out.exists() or out.is_symlink()):
        os.replace(tmp, out)
        return
    if not overwrite:  # someone else finished first
        raise FileExistsError(f"{out} already exists")
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)


@contextmanager
def exclusive_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive advisory lock on the file `path` (created if missing) while the
    block runs; other processes asking for it wait. A no-op where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a platform MLX runs on
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
