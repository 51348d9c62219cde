"""Resolve a model or drafter reference (a local directory or a Hugging Face Hub repo id)
to a local directory: the one place these rules live.

Hub repos are fetched with `huggingface_hub.snapshot_download` into the normal Hugging Face
cache (``HF_HUB_CACHE`` / ``HF_HOME``), with its progress bars. The token comes from the
usual places (``HF_TOKEN``, ``huggingface-cli login``); ``HF_HUB_OFFLINE=1`` serves the
request from the cache alone. Every failure becomes a one-line exception.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .errors import one_line

__all__ = ["ResolvedSource", "resolve_source", "looks_like_repo_id", "SAFETENSORS_PATTERNS", "TORCH_PATTERNS"]

#: What a drafter download needs first (safetensors checkpoints, plain or sharded).
SAFETENSORS_PATTERNS = ["*.json", "*.safetensors", "*.md"]
#: Fetched only when a repo has no safetensors: PyTorch state dicts.
TORCH_PATTERNS = ["*.json", "*.bin", "*.pt", "*.pth"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass
class ResolvedSource:
    """Where a SOURCE's files are on this machine, and where they came from."""

    path: Path
    repo_id: Optional[str] = None  # None for a local directory
    revision: Optional[str] = None  # as asked (branch, tag or commit), Hub only
    commit: Optional[str] = None  # the snapshot's commit hash, Hub only

    @property
    def is_hub(self) -> bool:
        """Whether the files came from the Hub (else a local directory)."""
        return self.repo_id is not None

    def describe(self) -> str:
        """The source as a person reads it: the path, or ``repo@revision (commit)``."""
        if not self.is_hub:
            return str(self.path)
        rev = self.revision or "main"
        return f"{self.repo_id}@{rev}" + (f" ({self.commit[:12]})" if self.commit and self.commit != rev else "")


def looks_like_repo_id(source: str) -> bool:
    """`owner/name` with no path-like prefix (``.``, ``/``, ``~``)."""
    return bool(_REPO_ID.match(source)) and not source.startswith((".", "/", "~")) and ".." not in source


def _download(repo_id: str, revision: Optional[str], patterns: Sequence[str], progress: bool) -> Path:
    import huggingface_hub
    from huggingface_hub import errors

    if not progress:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    where = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns)))
    except errors.RevisionNotFoundError:
        raise ValueError(f"revision {revision!r} not found in Hub repo {repo_id}") from None
    except errors.GatedRepoError:
        raise ValueError(
            f"Hub repo {repo_id} is gated: accept its terms on huggingface.co and log in "
            "(huggingface-cli login or HF_TOKEN)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise FileNotFoundError(
            f"Hub repo {repo_id} not found (or private: log in with huggingface-cli login or set HF_TOKEN)"
        ) from None
    except errors.LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{where} is not in the Hugging Face cache and the Hub cannot be "
            "reached (HF_HUB_OFFLINE is set or there is no network)"
        ) from None
    except errors.IncompleteSnapshotError:
        raise FileNotFoundError(
            f"the cached snapshot of {where} is incomplete and the Hub cannot be "
            "reached: download it again with network access"
        ) from None
    except errors.HFValidationError as e:
        raise ValueError(f"{repo_id!r} is not a valid Hub repo id ({one_line(e)})") from None
    except errors.HfHubHTTPError as e:
        raise OSError(f"could not download {where}: {one_line(e)}") from None


def resolve_source(
    source: str,
    revision: Optional[str] = None,
    *,
    what: str = "drafter",
    progress: bool = True,
    patterns: Sequence[str] = SAFETENSORS_PATTERNS,
    fallback_patterns: Optional[Sequence[str]] = TORCH_PATTERNS,
) -> ResolvedSource:
    """A local directory as is, or a Hub repo id downloaded (cache first) to its snapshot folder.

    Hub downloads fetch `patterns`; if the snapshot then holds no ``*.safetensors``, the
    `fallback_patterns` (PyTorch state dicts) are fetched too, so a repo that has both
    formats costs only the safetensors download. `what` names the thing in errors.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        if revision:
            raise ValueError("--revision applies to Hub repos, not to a local directory")
        return ResolvedSource(path=path)
    if path.exists():
        raise ValueError(f"{source} is a file: a {what} is a directory (config.json + weights) or a Hub repo id")
    if not looks_like_repo_id(source):
        raise FileNotFoundError(
            f"{what} not found: {source} (no such directory, and not a Hub repo id like owner/name)"
        )
    snapshot = _download(source, revision, patterns, progress)
    if fallback_patterns and not any(snapshot.glob("*.safetensors")):
        snapshot = _download(source, revision, fallback_patterns, progress)
    commit = snapshot.name if _COMMIT.match(snapshot.name) else None
    return ResolvedSource(path=snapshot, repo_id=source, revision=revision, commit=commit)
