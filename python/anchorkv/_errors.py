"""Exceptions: one AnchorKVError subclass per akv_status, carrying .status and the message."""
from __future__ import annotations

from . import _capi
from ._enums import Status


class AnchorKVError(Exception):
    """A call failed. `status` is the akv_status, `message` the library's detail."""

    status = Status.INTERNAL

    def __init__(self, message: str = "", status: Status | int | None = None):
        if status is not None:
            try:
                self.status = Status(status)
            except ValueError:  # a code from a newer library: keep the number
                self.status = int(status)
        self.message = message
        name = getattr(self.status, "name", f"status {self.status}")
        super().__init__(f"{name}: {message}" if message else name)


class InvalidArgumentError(AnchorKVError, ValueError):
    status = Status.INVALID_ARGUMENT


class UnsupportedError(AnchorKVError, NotImplementedError):
    status = Status.UNSUPPORTED


class BudgetError(AnchorKVError, ValueError):
    status = Status.BUDGET


class NonFiniteError(AnchorKVError, ValueError):
    status = Status.NON_FINITE


class OutOfMemoryError(AnchorKVError, MemoryError):
    status = Status.OUT_OF_MEMORY


class CorruptDataError(AnchorKVError, ValueError):
    status = Status.CORRUPT_DATA


class VersionError(AnchorKVError):
    status = Status.VERSION


class BackendUnavailableError(AnchorKVError, RuntimeError):
    status = Status.BACKEND_UNAVAILABLE


class BackendError(AnchorKVError, RuntimeError):
    status = Status.BACKEND


class MismatchError(AnchorKVError, ValueError):
    status = Status.MISMATCH


class CapacityError(AnchorKVError, ValueError):
    status = Status.CAPACITY


class InternalError(AnchorKVError, RuntimeError):
    status = Status.INTERNAL


ERROR_CLASSES = {cls.status: cls for cls in (
    InvalidArgumentError, UnsupportedError, BudgetError, NonFiniteError, OutOfMemoryError,
    CorruptDataError, VersionError, BackendUnavailableError, BackendError, MismatchError,
    CapacityError, InternalError)}


def error_for(status: int, message: str) -> AnchorKVError:
    """The exception for a status; an unknown code (newer library) becomes AnchorKVError."""
    try:
        return ERROR_CLASSES[Status(status)](message)
    except (ValueError, KeyError):
        return AnchorKVError(message, status)


def check(status: int) -> None:
    """Raise the matching AnchorKVError when a C call did not return AKV_OK.

    Must run right after the failing call, on the same thread: the message is thread-local.
    """
    if status != Status.OK:
        raw = _capi.akv_last_error_message()
        raise error_for(status, raw.decode("utf-8", "replace") if raw else "")
