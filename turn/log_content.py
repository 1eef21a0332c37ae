"""Content in logs: what people said and were told stays out of them.

Logs and error messages carry ids, states, codes, counts and times. What a
user said or typed (a transcript, a wake word, the keys they pressed), what
the agent answered (the reply, the prompt), what a tool was called with,
and the text of exceptions (which may quote any of these) appear only when
the ``log_content`` setting is on (a debugging aid; off by default).
Secrets (API, device and resume tokens, telephony signatures and tokens)
never appear, whatever the setting.

The switch is per process: :func:`set_log_content` (``web.app.create_app``
calls it with the setting). It lives in ``turn/`` so that every layer that
logs content (turn, voice, web, the demo shop) can import it.

Exceptions: with content off, a traceback logged by one of the product's
loggers (``exc_info``) keeps its frames (code, not content) but each
exception's message is replaced by ``(message withheld: log_content is
off)``; use :func:`error_text` for an exception put in a message's
arguments.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

#: the loggers whose tracebacks are redacted (these packages and below)
PRODUCT_LOGGERS = ("clock", "turn", "media", "voice", "web", "demo_shop", "client")
WITHHELD = "(message withheld: log_content is off)"

_on = False
_installed = False


def set_log_content(on: bool) -> None:
    """Turn content in logs on or off for the process (and make sure the
    product's tracebacks are redacted while it is off)."""
    global _on
    _on = bool(on)
    _install_record_factory()


def log_content_on() -> bool:
    """Whether content may be logged."""
    return _on


def content(text: object) -> str:
    """``text`` for a log message: itself (quoted) with content on, else
    only its length, e.g. ``<12 chars withheld>``."""
    s = "" if text is None else str(text)
    if _on:
        return repr(s)
    return f"<{len(s)} chars withheld>"


def error_text(exc: BaseException) -> str:
    """An exception for a log message or a client: ``"Type: message"``
    with content on, else ``"Type"`` (a message may quote what the user
    said, a reply or a tool's arguments). The first real error of an
    ``ExceptionGroup`` is the one described."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    name = type(exc).__name__
    return f"{name}: {exc}" if _on else name


def redacted_traceback(exc: BaseException) -> str:
    """``exc``'s traceback (its chain and groups too) with every message
    replaced by :data:`WITHHELD`: the frames, types and chaining stay."""
    out: list[str] = []
    seen: set[int] = set()

    def walk(e: BaseException, indent: str) -> None:
        if id(e) in seen:
            return
        seen.add(id(e))
        if e.__cause__ is not None:
            walk(e.__cause__, indent)
            out.append(f"\n{indent}The above exception was the direct cause of the following exception:\n\n")
        elif e.__context__ is not None and not e.__suppress_context__:
            walk(e.__context__, indent)
            out.append(f"\n{indent}During handling of the above exception, another exception occurred:\n\n")
        if e.__traceback__ is not None:
            out.append(f"{indent}Traceback (most recent call last):\n")
            out.extend(indent + line for line in traceback.format_tb(e.__traceback__))
        kind = type(e)
        name = kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__qualname__}"
        out.append(f"{indent}{name}: {WITHHELD}\n")
        if isinstance(e, BaseExceptionGroup):
            for i, sub in enumerate(e.exceptions, 1):
                out.append(f"{indent}+---------------- {i} ----------------\n")
                walk(sub, indent + "    ")

    walk(exc, "")
    return "".join(out).rstrip("\n")


def _install_record_factory() -> None:
    """Once per process: records of the product's loggers that carry an
    exception get their traceback text redacted while content is off
    (``exc_text`` set before any handler formats it, whichever handler)."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if not _on and record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            name = record.name
            if any(name == p or name.startswith(p + ".") for p in PRODUCT_LOGGERS):
                record.exc_text = redacted_traceback(record.exc_info[1])
        return record

    logging.setLogRecordFactory(factory)
