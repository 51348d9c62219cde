"""Errors a person reads: one line that names what is wrong.

Every layer raises ordinary exceptions (ValueError, FileNotFoundError, ...) whose first
line says what to fix; the entry points (the `dflash` command, the chat) show
`one_line(error)` instead of a traceback. This is the one place that rule is written.
"""

from __future__ import annotations

__all__ = ["UserError", "EXPECTED_ERRORS", "one_line"]


class UserError(Exception):
    """An error caused by the user's input: shown as one line, never as a traceback."""


#: What the entry points report as one line; anything else is a bug and keeps its traceback.
EXPECTED_ERRORS = (UserError, ValueError, FileNotFoundError, FileExistsError, RuntimeError, OSError)


def one_line(error: BaseException) -> str:
    """The first non-empty line of `error`'s message, or its type's name if it has none."""
    text = str(error).strip()
    return text.splitlines()[0].strip() if text else type(error).__name__
