"""How a turn's failure is recognised and described, for voice and text
turns alike."""

from __future__ import annotations

from turn.stopped import TurnStopped


def stopped_by(exc: BaseException) -> bool:
    """True if ``exc`` is (or a TaskGroup's group holds only) TurnStopped."""
    if isinstance(exc, TurnStopped):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(stopped_by(e) for e in exc.exceptions)
    return False


def first_error(exc: BaseException) -> BaseException:
    """The first real error, looking inside the ExceptionGroups that
    TaskGroups wrap errors in."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def describe_error(exc: BaseException) -> str:
    """``"Type: message"`` of the first real error (:func:`first_error`)."""
    exc = first_error(exc)
    return f"{type(exc).__name__}: {exc}"
