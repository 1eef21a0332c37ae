"""The HTTP access log, without secrets.

aiohttp's own access log writes the request line, query string included:
``GET /v1/sessions/S/events?after_seq=4&resume_token=...`` would put a
resume token (and a Telnyx stream's ``?token=``) in the log. This one
writes every query parameter whose name says it is a secret (``token``,
``signature``, ``secret``, ``key``, ``password``, ``auth`` in it) as
``***``, and no header (``Authorization`` stays out; so do Referer and
User-Agent). One line per request at ``DEBUG`` on the logger ``web.access``
(``log_level=DEBUG`` shows it):

    127.0.0.1 "GET /v1/sessions/S/events?after_seq=4&resume_token=*** HTTP/1.1" 200 1234 12.3 ms
"""

from __future__ import annotations

import logging
import re
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError
from multidict import MultiDict
from yarl import URL

#: the logger of the access log
ACCESS_LOG = logging.getLogger("web.access")
#: a query parameter whose name matches this has its value replaced
SECRET_PARAM = re.compile(r"token|signature|secret|key|password|auth|sig$", re.IGNORECASE)
REDACTED = "***"


def redacted_target(url: URL) -> str:
    """``url``'s path and query, secret query values replaced by ``***``."""
    if not url.query_string:
        return url.raw_path
    query = MultiDict((k, REDACTED if SECRET_PARAM.search(k) else v) for k, v in url.query.items())
    redacted = url.with_query(query)
    return f"{redacted.raw_path}?{redacted.raw_query_string}".replace("%2A%2A%2A", REDACTED)


class AccessLog(AbstractAccessLogger):
    """aiohttp's access logger with secrets left out (module doc)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        major, minor = request.version
        self.logger.debug('%s "%s %s HTTP/%d.%d" %d %d %.1f ms', request.remote, request.method,
                          redacted_target(request.rel_url), major, minor, response.status,
                          response.body_length, time * 1000)

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.DEBUG)


class ParseErrorRedaction(logging.Filter):
    """aiohttp logs a request it cannot parse at ERROR with the exception,
    whose message quotes the offending bytes (``Got more than 8190 bytes
    when reading: b'Bearer <token>...'``): such a record keeps only the
    client, the error's type and status. :func:`redact_parse_errors`
    installs it."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg, record.args = "unparsable HTTP request from %s: %s (%s)", (remote, type(exc).__name__, exc.code)
            record.exc_info, record.exc_text, record.levelno, record.levelname = None, None, logging.WARNING, "WARNING"
        return True


def redact_parse_errors() -> None:
    """Install :class:`ParseErrorRedaction` on aiohttp's server logger
    (once per process)."""
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ParseErrorRedaction) for f in server_log.filters):
        server_log.addFilter(ParseErrorRedaction())


def runner(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """An :class:`aiohttp.web.AppRunner` of ``app`` with this access log."""
    return web.AppRunner(app, access_log=ACCESS_LOG, access_log_class=AccessLog, **kwargs)
