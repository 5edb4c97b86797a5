"""One exception type for user-facing failures, and the process exit codes."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes shared by every command."""

    OK = 0
    CHECK_FAILED = 1  # a gate or an accuracy check failed
    BAD_INPUT = 2  # bad input or usage: the user must act
    INTERNAL = 70  # a bug in qtool: traceback shown, please report


class QtoolError(Exception):
    """A failure the user can fix: bad input, bad usage or an unsupported model.

    The message says what went wrong and where (file, tensor, YAML line); ``hint``
    says how to fix it. The CLI renders it as one line without a traceback.
    """

    exit_code: ExitCode = ExitCode.BAD_INPUT

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class CheckFailedError(QtoolError):
    """A requested check or gate did not pass; exit code 1."""

    exit_code = ExitCode.CHECK_FAILED
