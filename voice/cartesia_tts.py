"""Speech synthesis by Cartesia's TTS WebSocket (``tts.provider =
"cartesia"``): one WebSocket per session, one Cartesia *context* per reply
(shared/reference/speech-providers.md, section 2.3; Cartesia's docs pages
"TTS WebSocket", "Contexts" and "Context flushing and flush IDs";
Pipecat's ``services/cartesia/tts.py`` and LiveKit's Cartesia plugin).

**Connection.** ``GET {tts.base_url}/tts/websocket?cartesia_version=2025-04-16``
upgraded to a WebSocket, headers ``X-API-Key: <tts.api_key>`` (left out
when the key is empty) and ``Cartesia-Version``; ``http(s)://`` base URLs
become ``ws(s)://``. :meth:`CartesiaSynthesiser.warm` opens it; a stream
whose first clause comes before (or while) it opens waits for it. Cartesia
closes a socket after about 5 minutes idle and has no keepalive (Pipecat's
note): a socket that closes or drops while no reply has text in flight is
not a failure; the next clause opens a new one (a clause written while
the server's close is already on its way fails with ``closed``, and the
caller's reconnect speaks it).

**On the wire.** Each pushed clause is one generation request on the
reply's context, then a manual flush (docs, "Context flushing": an empty
transcript with ``continue`` and ``flush`` true)::

    {"model_id": tts.model, "transcript": <the clause, ending in a space>,
     "voice": {"mode": "id", "id": tts.voice}, "language": "en",
     "context_id": <the reply's>, "output_format": {"container": "raw",
     "encoding": "pcm_s16le", "sample_rate": tts.sample_rate},
     "add_timestamps": true, "use_normalized_timestamps": false, "continue": true}
    {...the same fields..., "transcript": "", "continue": true, "flush": true}

Every field but ``transcript``, ``continue`` and ``flush`` is the same on
one context (Cartesia refuses inputs that change them). Transcripts are
concatenated verbatim by Cartesia, so a clause not ending in whitespace
gets a space. ``language`` is the ISO-639-1 part of ``tts.language`` (left
out when it is empty). :meth:`CartesiaStream.end_input` sends the same
fields with ``"transcript": ""`` and ``"continue": false`` (not sent when
nothing was pushed, or when every clause is spoken and the context is
about to expire: it ends on its own).

**Contexts expire** 1 s after their last audio, and inputs on an expired
context are "not supported" (docs, "Contexts"). A clause pushed when every
earlier clause is spoken and the context's last audio (or its last clause
done) is :attr:`CartesiaSynthesiser.context_reuse_s` old (0.6 s: a margin
for the network) goes on a *new* context, ``<context_id>-k<n>``; its
audio and word times continue the reply's stream seconds.

**Answers** (JSON text, routed by ``context_id``; a message of a context
no stream owns, e.g. an old reply's, is dropped; without ``type`` the kind
is read from its fields): ``chunk`` (``data``: base64 raw s16 LE at the
rate asked; no field says its rate), ``timestamps``
(``word_timestamps.words/start/end``, seconds), ``flush_done``, ``done``,
``error`` (the stream fails with ``provider``; an error without a
``context_id`` fails every reply with text in flight on the socket).
Unknown types are skipped.

**When a clause is done** (one :class:`voice.synthesis.SegmentDone` per
clause, in order). Cartesia's outputs for a context come in the order of
its inputs (docs, "Contexts"), so the first of these that holds ends it:

1. a ``chunk`` whose ``flush_id`` is greater than the clause's flush id
   (the docs: the audio of the n-th transcript, before the n-th flush,
   carries ``flush_id`` n, counting from 1): all audio of the earlier
   clauses has arrived;
2. a ``flush_done`` (reference 2.3: ``{"type":"flush_done","flush_id":1,...}``):
   the clauses up to its ``flush_id`` are done (read as "the generator
   this flush closed"; without a ``flush_id``, the n-th ``flush_done``
   ends the n-th clause). Flush ids beyond the flushes written are not
   believed;
3. ``done``: every clause written on the context is done;
4. only while the socket has shown neither a ``flush_id`` nor a
   ``flush_done`` (an older server that ignores flushes): the clause's
   words have all come in ``timestamps`` (counted by their letters and
   digits, so a word split or joined differently still counts) and the
   audio reaches the end of its last word. Audio after a clause's last
   word (trailing silence) then belongs to the next clause, and a clause
   whose words Cartesia writes differently (normalised numbers) waits for
   ``done``.

**Word times.** The reference gives ``start``/``end`` in seconds but not
their origin (VERIFY): Cartesia's and Pipecat's use (Pipecat adds them to
the context's first audio) say seconds of the *context's* audio; a server
could instead count from each transcript's first audio. Both are taken:
the first word of a context's second (or later) clause tells which (a
start well before where that clause's audio begins, by more than half of
it, is per transcript), the socket remembers it for the next contexts, and
the times are moved to stream seconds (the context's place in the reply,
plus the clause's place in the context when per transcript). Each word is
given as Cartesia wrote it (:class:`voice.synthesis.TimedWord`).

**Audio.** Chunks are raw s16 LE at ``tts.sample_rate`` (Cartesia's raw
``pcm_s16le`` has no header and its chunks name no rate, so it cannot be
resampled from what it says). An odd byte at a chunk's end waits for the
next chunk; one left when the reply's last clause is done is a
``protocol`` error. Audio at another rate than asked cannot be told from
the bytes; it shows in the word times: a clause done whose last word ends
past a quarter more (plus 0.1 s) than the audio received is a
``protocol`` error (a *higher* rate than asked looks like trailing silence
and is not caught).

**Stop.** :meth:`CartesiaStream.cancel` puts ``{"context_id": ...,
"cancel": true}`` at the front of the socket's writer (sent within
milliseconds, ahead of anything queued), and the stop is *told* when it is
written. Cartesia documents no acknowledgement, and a generation already
running goes on to its end (docs, "Contexts": cancel "will only halt
requests that have not begun generating"), so the stop stays *unconfirmed*
and the stragglers are dropped by context and counted as late audio; a
``done`` for the cancelled context is taken as the confirmation that
nothing more comes. Clauses not yet written when the stop comes are never
sent (not billed: taken out of ``characters``); a reply none of whose
clauses in flight were written is confirmed at once.

**Failure** (:class:`voice.synthesis.SynthesisError`; nothing here
retries): connect refused, DNS, TLS, ``tts.connect_timeout_s`` exceeded,
an upgrade answered with another status ``unreachable``; 401/403
``unauthorized``; 400/429 on the upgrade and Cartesia's ``error`` messages
``provider``; no first audio of a clause within ``tts.first_audio_timeout_s``
of its request being written (after the previous clause was done), or no
audio that long in the middle of a clause, ``provider``; the socket
dropping (no close frame) while a clause is in flight ``dropped``; a close
frame then ``closed`` (its code and reason); text that is not JSON, a
binary frame, bad base64, malformed timestamps, an odd number of audio
bytes, word times past the audio ``protocol``. A stream that fails by the
client's own finding (timeout, protocol) has its context cancelled on the
wire, and its socket is *retired*: no new context goes on it, and it is
closed once nothing is in flight on it, so the caller's reconnect gets a
new socket.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import math
import time
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from yarl import URL

from voice.providers import websocket_base
from voice.recognition import language_code
from voice.synthesis import BaseSynthesisStream, SynthesisError, TimedWord, cancel_and_wait
from voice.synthesisers import TtsConfig

log = logging.getLogger(__name__)

PROVIDER = "cartesia"
#: the API version asked for (LiveKit's plugin pins it; reference 2.3)
API_VERSION = "2025-04-16"
#: the largest message read from Cartesia, bytes (a chunk is a few kB of base64)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: how long closing the socket waits for the server's close frame, s
WS_CLOSE_TIMEOUT_S = 1.0
#: a context whose last audio is this old is not used again, s (Cartesia
#: expires contexts 1 s after their last audio: docs, "Contexts")
CONTEXT_REUSE_S = 0.6
#: slack when comparing word times with the audio received, s
TIME_TOLERANCE_S = 0.005
#: wire contexts remembered after their reply for routing stragglers
ROUTES_KEPT = 64
#: how long closing a stream or the synthesiser waits for a queued cancel to be written, s
TELL_WAIT_S = 0.5


def websocket_url(config: TtsConfig) -> URL:
    """The TTS WebSocket URL: ``{tts.base_url}/tts/websocket?cartesia_version=...``
    (``http(s)://`` mapped to ``ws(s)://``; a base URL already ending in
    ``/tts/websocket`` is not doubled). Reference section 2.3."""
    base = websocket_base(config.url)
    if not base.endswith("/tts/websocket"):
        base += "/tts/websocket"
    return URL(base).with_query({"cartesia_version": API_VERSION})


def request_fields(config: TtsConfig, context_id: str) -> dict[str, Any]:
    """The fields every input on context ``context_id`` carries (all but
    ``transcript``, ``continue`` and ``flush``; module doc, "On the wire")."""
    fields: dict[str, Any] = {
        "model_id": config.model_name,
        "voice": {"mode": "id", "id": config.voice_name},
        "context_id": context_id,
        "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": config.sample_rate},
        "add_timestamps": True,
        "use_normalized_timestamps": False,
    }
    language = language_code(config.language)
    if language:
        fields["language"] = language
    return fields


def _letters(text: str) -> int:
    """Letters and digits in ``text``: what clauses and Cartesia's words are matched by."""
    return sum(1 for c in text if c.isalnum())


class CartesiaSynthesiser:
    """:class:`voice.synthesis.Synthesiser` for Cartesia's TTS WebSocket
    (module doc): one socket per session, one context per reply.

    Args:
        config: the ``tts.*`` settings (``base_url``, ``api_key``, ``model``,
            ``voice``, ``language``, ``sample_rate``, ``connect_timeout_s``,
            ``first_audio_timeout_s``, prices).
        clock: monotonic seconds, for the streams' stop records.

    Attributes:
        name: ``"cartesia"``.
        context_reuse_s: a reply's context is not used again once its last
            audio is this old, s (tests lower it with the fake's expiry).
        unrouted: messages dropped because no stream owns their context.
        connections: sockets opened so far (tests, logs).
        request_timebase: where Cartesia's word times count from, as learned
            on this session (None: not known yet; False: the context's first
            audio; True: each transcript's; module doc, "Word times").
    """

    name = PROVIDER

    def __init__(self, config: TtsConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.context_reuse_s = CONTEXT_REUSE_S
        self.unrouted = 0
        self.connections = 0
        self._session: aiohttp.ClientSession | None = None
        self._conn: _Connection | None = None
        self._conns: set[_Connection] = set()
        #: wire context id -> (its stream, its state)
        self._routes: OrderedDict[str, tuple[CartesiaStream, _Context]] = OrderedDict()
        #: the word-time origin learned on this session (None: not known yet; True: per transcript)
        self.request_timebase: bool | None = None
        self._closed = False

    @property
    def connected(self) -> bool:
        """A socket is open (or opening) for the next reply."""
        conn = self._conn
        return conn is not None and conn.state != "gone" and not conn.closing and not conn.retired

    @property
    def url(self) -> URL:
        """The WebSocket URL with its query."""
        return websocket_url(self.config)

    def headers(self) -> dict[str, str]:
        """The upgrade's headers: ``Cartesia-Version`` and ``X-API-Key`` (none without a key)."""
        headers = {"Cartesia-Version": API_VERSION}
        key = self.config.api_key.get_secret_value()
        if key:
            headers["X-API-Key"] = key
        return headers

    def open(self, context_id: str) -> CartesiaStream:
        """A stream for one reply, on context ``context_id`` (unique in the
        session). Nothing is sent until its first clause.

        Raises:
            RuntimeError: the synthesiser is closed.
        """
        if self._closed:
            raise RuntimeError("the Cartesia synthesiser is closed")
        return CartesiaStream(self, context_id)

    async def warm(self) -> None:
        """Open the socket (idempotent: an open or opening one is kept).
        Never raises but ``CancelledError``: a failure is logged and the
        first stream meets it (it connects again)."""
        if self._closed:
            return
        conn = self._connection()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.connect_timeout_s + 1.0):
                await conn.settled.wait()
        if conn.error is not None:
            log.info("Cartesia (tts.base_url %s) could not be reached to warm up: %s", self.config.url, conn.error)

    async def aclose(self) -> None:
        """Close the socket (a queued cancel is written first, within
        :data:`TELL_WAIT_S`) and the HTTP client; replies still speaking
        fail with ``closed``. Idempotent; no task is left running."""
        self._closed = True
        self._conn = None
        for conn in list(self._conns):
            await conn.aclose()
        self._conns.clear()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    # -- connecting -----------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            )
        return self._session

    def _connection(self) -> _Connection:
        """The session's socket: the open (or opening) one, else a new one."""
        conn = self._conn
        if conn is None or conn.state == "gone" or conn.closing or conn.retired:
            conn = _Connection(self)
            self._conn = conn
            self._conns = {c for c in self._conns if not c.task.done()}
            self._conns.add(conn)
            self.connections += 1
        return conn

    async def _connect(self) -> aiohttp.ClientWebSocketResponse:
        """Open the WebSocket.

        Raises:
            SynthesisError: ``unauthorized`` (401/403), ``provider`` (400,
                429), ``unreachable`` (anything else that keeps it from opening).
        """
        session = self._client()
        where = self.config.url
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                return await session.ws_connect(
                    self.url,
                    headers=self.headers(),
                    autoping=True,
                    max_msg_size=MAX_MESSAGE_BYTES,
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=WS_CLOSE_TIMEOUT_S),
                )
        except aiohttp.WSServerHandshakeError as exc:
            status = f"{exc.status} {exc.message}".strip()
            if exc.status in (401, 403):
                raise SynthesisError("unauthorized", f"tts.api_key was refused by Cartesia ({status})", PROVIDER) from None
            if exc.status in (400, 429):
                raise SynthesisError("provider", f"Cartesia at {where} refused the connection ({status})", PROVIDER) from None
            raise SynthesisError("unreachable", f"Cartesia at {where} answered the upgrade with {status}", PROVIDER) from None
        except TimeoutError:
            raise SynthesisError(
                "unreachable",
                f"Cartesia at {where} did not accept a connection within {self.config.connect_timeout_s:g} s",
                PROVIDER,
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise SynthesisError("unreachable", f"cannot connect to Cartesia at {where}: {type(exc).__name__}: {exc}", PROVIDER) from None

    # -- routing --------------------------------------------------------------------

    def _route(self, stream: CartesiaStream, ctx: _Context) -> None:
        self._routes[ctx.wire_id] = (stream, ctx)
        while len(self._routes) > ROUTES_KEPT:
            oldest = next(iter(self._routes))
            self._routes.pop(oldest)

    def _dispatch(self, conn: _Connection, raw: str) -> None:
        """Route one text message to its context's stream.

        Raises:
            SynthesisError: ``protocol``: it is not a JSON object (the whole
                socket is untrustworthy then).
        """
        try:
            msg = json.loads(raw)
        except (ValueError, RecursionError):
            raise SynthesisError("protocol", f"Cartesia sent text that is not JSON: {raw[:120]!r}", PROVIDER) from None
        if not isinstance(msg, dict):
            raise SynthesisError("protocol", f"Cartesia sent JSON that is not an object: {raw[:120]!r}", PROVIDER)
        kind = msg.get("type")
        if not isinstance(kind, str):  # tolerate a message without a type: read it from its fields
            kind = (
                "chunk"
                if "data" in msg
                else "timestamps"
                if "word_timestamps" in msg
                else "error"
                if msg.get("error")
                else "done"
                if msg.get("done") is True
                else ""
            )
        ctx_id = msg.get("context_id")
        route = self._routes.get(ctx_id) if isinstance(ctx_id, str) else None
        if route is None:
            if kind == "error" and not ctx_id:
                conn.fail_active(SynthesisError("provider", f"Cartesia reported an error: {_error_text(msg)}", PROVIDER))
                return
            self.unrouted += 1
            log.debug("Cartesia %s for context %r that no reply owns: dropped", kind or "message", ctx_id)
            return
        stream, ctx = route
        if kind == "done" or (kind == "error" and msg.get("done") is not False):
            self._routes.pop(ctx.wire_id, None)
        stream._on_message(ctx, kind, msg)

    def _ended(self, conn: _Connection, error: SynthesisError) -> None:
        """The socket is gone: replies with text in flight on it fail with
        ``error``; the others will use a new socket for their next clause."""
        if self._conn is conn:
            self._conn = None
        failed = 0
        for stream, ctx in list(self._routes.values()):
            if ctx.conn is not conn:
                continue
            ctx.closed = True
            if stream.stop is None and not stream.finished and stream.pending:
                stream.emit_error(SynthesisError(error.kind, str(error), PROVIDER))
                failed += 1
        if failed:
            log.info("Cartesia socket ended with %d replies in flight: %s: %s", failed, error.kind, error)
        else:
            log.debug("Cartesia socket ended with nothing in flight: %s", error)


@dataclass
class _Segment:
    """One pushed clause on the wire."""

    text: str
    index: int  # 0-based on its context
    written_at: float | None = None  # loop time its request was written
    audio_at: float | None = None  # loop time of its first audio
    done: bool = False
    start_ctx_s: float | None = None  # context seconds where its audio begins (its predecessor done)
    words_end_s: float | None = None  # stream seconds: the end of its last word heard of


@dataclass
class _Context:
    """One Cartesia context of a reply."""

    wire_id: str
    conn: _Connection
    base_s: float  # stream seconds where its audio begins
    last_activity: float  # loop time
    segments: list[_Segment] = field(default_factory=list)
    cum_letters: list[int] = field(default_factory=list)
    n_done: int = 0
    flushes_written: int = 0
    flush_dones: int = 0
    ts_letters: int = 0
    request_timebase: bool | None = None
    audio_bytes: int = 0
    last_chunk_at: float | None = None
    closed: bool = False  # its socket is gone, or Cartesia ended it


@dataclass
class _Out:
    """Frames for the writer."""

    stream: CartesiaStream
    ctx: _Context
    kind: Literal["text", "end", "cancel"]
    frames: list[str]
    segment: _Segment | None = None


class _Connection:
    """The session's socket: one task connecting, then reading and writing."""

    def __init__(self, owner: CartesiaSynthesiser) -> None:
        self.owner = owner
        self.state: Literal["connecting", "open", "gone"] = "connecting"
        self.closing = False
        #: suspect (a reply on it timed out or got bad audio): no new context goes on
        #: it, and it closes once nothing is in flight on it and its queue is written
        self.retired = False
        self.error: SynthesisError | None = None
        #: Cartesia answered a flush on this socket (a flush_id or a flush_done)
        self.flush_seen = False
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.outbox: deque[_Out] = deque()
        self.wake = asyncio.Event()
        self.drained = asyncio.Event()
        self.settled = asyncio.Event()  # open or gone
        self.task = asyncio.get_running_loop().create_task(self._run(), name="cartesia-socket")

    def send(self, item: _Out, *, front: bool = False) -> bool:
        """Queue ``item`` (``front``: ahead of everything); False: the socket is gone."""
        if self.state == "gone":
            return False
        if front:
            self.outbox.appendleft(item)
        else:
            self.outbox.append(item)
        self.drained.clear()
        self.wake.set()
        return True

    def active(self) -> list[CartesiaStream]:
        """The replies with text in flight on this socket."""
        return [
            stream
            for stream, ctx in self.owner._routes.values()
            if ctx.conn is self and stream.stop is None and not stream.finished and stream.pending
        ]

    def fail_active(self, error: SynthesisError) -> None:
        """Fail every reply with text in flight on this socket."""
        for stream in self.active():
            stream.emit_error(SynthesisError(error.kind, str(error), PROVIDER))

    def retire(self) -> None:
        """Use it for nothing new; close it once its queue is written and nothing is in flight."""
        self.retired = True
        self.wake.set()

    async def aclose(self) -> None:
        """Write the queued cancels (within :data:`TELL_WAIT_S`), then close."""
        self.closing = True
        keep = [item for item in self.outbox if item.kind == "cancel"]
        self.outbox.clear()
        self.outbox.extend(keep)
        if keep and self.state == "open":
            self.wake.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TELL_WAIT_S):
                    await self.drained.wait()
        await cancel_and_wait(self.task)

    async def _run(self) -> None:
        error: SynthesisError | None = None
        cancelled = False
        try:
            self.ws = await self.owner._connect()
            self.state = "open"
            self.settled.set()
            log.debug("Cartesia socket open to %s", self.owner.url.with_query(None))
            error = await self._converse(self.ws)
        except SynthesisError as exc:
            error = exc
        except asyncio.CancelledError:
            cancelled = True
            raise
        except Exception as exc:  # an answer nothing here foresaw: the socket's replies fail, clearly
            log.warning("Cartesia socket: unexpected %s: %s", type(exc).__name__, exc)
            error = SynthesisError("protocol", f"Cartesia: {type(exc).__name__}: {exc}", PROVIDER)
        finally:
            self.state = "gone"
            self.settled.set()
            self.drained.set()
            ws, self.ws = self.ws, None
            if ws is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(0.05 if cancelled else WS_CLOSE_TIMEOUT_S):
                        await ws.close()
            if error is None:
                error = SynthesisError("closed", "the Cartesia synthesiser was closed", PROVIDER)
            self.error = error
            self.outbox.clear()
            self.owner._ended(self, error)

    async def _converse(self, ws: aiohttp.ClientWebSocketResponse) -> SynthesisError | None:
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(ws), name="cartesia-read")
        writer = loop.create_task(self._write(ws), name="cartesia-write")
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if writer in done:
                result = writer.result()
                if isinstance(result, SynthesisError):
                    return result
                if result is _RETIRED:
                    log.debug("Cartesia socket retired: closing it")
                    self.closing = True
                    return SynthesisError("closed", "the Cartesia socket was retired", PROVIDER)
            return await reader
        finally:
            for task in (reader, writer):
                task.cancel()
            await asyncio.wait({reader, writer})

    async def _write(self, ws: aiohttp.ClientWebSocketResponse) -> SynthesisError | object | None:
        """Write what is queued, in order (cancels first); returns the error
        if sending fails, :data:`_RETIRED` once a retired socket is idle."""
        loop = asyncio.get_running_loop()
        while True:
            if not self.outbox:
                self.wake.clear()
                self.drained.set()
                if self.retired and not self.active():
                    return _RETIRED
                await self.wake.wait()
                continue
            item = self.outbox.popleft()
            stream = item.stream
            if item.kind != "cancel" and (stream.stop is not None or stream._failed):
                continue  # a stopped or failed reply sends nothing more
            if item.segment is not None:
                item.segment.written_at = loop.time()  # before the await: a cancel meanwhile knows it went
                item.ctx.flushes_written += 1
            try:
                for frame in item.frames:
                    await ws.send_str(frame)
            except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
                return SynthesisError("dropped", f"the Cartesia socket broke while sending: {type(exc).__name__}: {exc}", PROVIDER)
            if item.kind == "cancel":
                stream._told_now()
            else:
                stream._arm()

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> SynthesisError | None:
        """Read Cartesia's messages until the socket ends; the error that ended it."""
        while True:
            msg = await ws.receive()
            if msg.type is aiohttp.WSMsgType.TEXT:
                try:
                    self.owner._dispatch(self, msg.data)
                except SynthesisError as exc:
                    return exc
            elif msg.type is aiohttp.WSMsgType.BINARY:
                return SynthesisError("protocol", f"Cartesia sent a binary frame ({len(msg.data)} bytes); it sends JSON text", PROVIDER)
            elif msg.type is aiohttp.WSMsgType.CLOSE:
                if self.closing:
                    return None
                reason = f" {msg.extra}" if msg.extra else ""
                return SynthesisError("closed", f"Cartesia closed the socket: {msg.data}{reason}", PROVIDER)
            elif msg.type is aiohttp.WSMsgType.ERROR:
                failure = msg.data
                if isinstance(failure, aiohttp.WebSocketError):
                    return SynthesisError("protocol", f"Cartesia sent a bad WebSocket message: {failure}", PROVIDER)
                return SynthesisError("dropped", f"the Cartesia socket failed: {type(failure).__name__}: {failure}", PROVIDER)
            else:  # CLOSED, CLOSING: it ended without a close frame
                if self.closing:
                    return None
                return SynthesisError("dropped", "the Cartesia socket dropped without a close frame", PROVIDER)


#: the writer's answer when a retired socket has nothing more to do
_RETIRED = object()


class _Bad(Exception):
    """A message of one context that is not Cartesia's protocol."""


class CartesiaStream(BaseSynthesisStream):
    """One reply on one Cartesia context (or more: module doc, "Contexts
    expire"): :class:`voice.synthesis.SynthesisStream`.

    Args:
        owner: the synthesiser (settings, socket, routing).
        context_id: the reply's context id on the wire.

    Attributes:
        context_id: as given.
        wire_contexts: the context ids used, in order.
    """

    def __init__(self, owner: CartesiaSynthesiser, context_id: str) -> None:
        super().__init__(PROVIDER, owner.config.sample_rate, owner.config.pricing, owner.clock)
        self._owner = owner
        self.context_id = context_id
        self.wire_contexts: list[str] = []
        self._ctx: _Context | None = None
        self._received_bytes = 0  # whole-sample bytes emitted before any stop
        self._carry = b""  # an odd byte waiting for the next chunk
        self._failed = False
        self._last_done_at: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._cancel_queued = False
        self._told_event = asyncio.Event()

    @property
    def _received_s(self) -> float:
        return self._received_bytes / 2 / self.sample_rate

    # -- the base's hooks -------------------------------------------------------------

    def _send_text(self, text: str) -> None:
        owner = self._owner
        if owner._closed:
            self._fail(SynthesisError("closed", "the Cartesia synthesiser is closed", PROVIDER), tell=False)
            return
        loop = asyncio.get_running_loop()
        ctx = self._ctx
        if (
            ctx is None
            or ctx.closed
            or ctx.conn.state == "gone"
            or ctx.conn.closing
            or ctx.conn.retired
            or (ctx.n_done == len(ctx.segments) and loop.time() - ctx.last_activity >= owner.context_reuse_s)
        ):
            ctx = self._new_context(loop.time())
        transcript = text if text[-1:].isspace() else text + " "
        seg = _Segment(text, len(ctx.segments))
        if seg.index == 0:
            seg.start_ctx_s = 0.0
        ctx.segments.append(seg)
        ctx.cum_letters.append((ctx.cum_letters[-1] if ctx.cum_letters else 0) + _letters(text))
        fields = request_fields(owner.config, ctx.wire_id)
        frames = [
            json.dumps({**fields, "transcript": transcript, "continue": True}),
            json.dumps({**fields, "transcript": "", "continue": True, "flush": True}),
        ]
        if not ctx.conn.send(_Out(self, ctx, "text", frames, seg)):
            self._fail(ctx.conn.error or SynthesisError("dropped", "the Cartesia socket is gone", PROVIDER), tell=False)

    def end_input(self) -> None:
        """See :meth:`voice.synthesis.SynthesisStream.end_input`; an odd
        byte of audio left over is a ``protocol`` error."""
        if not self.ended and self.stop is None and not self.pending and self._carry:
            self._fail(SynthesisError("protocol", "Cartesia sent an odd number of audio bytes (not whole s16 samples)", PROVIDER))
        super().end_input()

    def _send_end(self) -> None:
        ctx = self._ctx
        if ctx is None or ctx.closed or not ctx.segments or self._failed:
            return
        if ctx.n_done == len(ctx.segments) and asyncio.get_running_loop().time() - ctx.last_activity >= self._owner.context_reuse_s:
            return  # all said and the context expiring: an input on it is "not supported"
        fields = request_fields(self._owner.config, ctx.wire_id)
        ctx.conn.send(_Out(self, ctx, "end", [json.dumps({**fields, "transcript": "", "continue": False})]))

    def _send_cancel(self) -> None:
        stop = self.stop
        assert stop is not None
        self._disarm()
        ctx = self._ctx
        unwritten = [s for s in ctx.segments if s.written_at is None] if ctx is not None else []
        never_sent = sum(len(s.text) for s in unwritten)
        self.characters -= never_sent  # never reaches Cartesia: not billed
        stop.characters_unspoken = max(0, stop.characters_unspoken - never_sent)
        in_flight = ctx is not None and any(s.written_at is not None and not s.done for s in ctx.segments)
        if ctx is None or not in_flight:
            stop.confirmed = True  # nothing reached Cartesia: nothing to stop
            self._told_event.set()
            return
        cancel = json.dumps({"context_id": ctx.wire_id, "cancel": True})
        if ctx.closed or not ctx.conn.send(_Out(self, ctx, "cancel", [cancel]), front=True):
            self._told_event.set()  # the socket is gone: nothing can be told, nothing confirms
            return
        self._cancel_queued = True

    async def _close(self) -> None:
        self._disarm()
        if self._cancel_queued and not self._told_event.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TELL_WAIT_S):
                    await self._told_event.wait()

    # -- the writer's reports -----------------------------------------------------------

    def _told_now(self) -> None:
        self.told()
        self._told_event.set()

    def _fail(self, error: SynthesisError, *, tell: bool = True) -> None:
        """The stream fails with ``error``; with ``tell`` (the client's own
        finding: a timeout, bad audio), its context is cancelled on the wire
        (the reply will not use its audio) and the socket is retired."""
        if self.stop is not None or self.finished:
            return
        log.debug("cartesia tts %s failed: %s: %s", self.context_id, error.kind, error)
        self._failed = True
        self._disarm()
        self.emit_error(error)
        ctx = self._ctx
        if tell and ctx is not None and not ctx.closed:
            if any(s.written_at is not None and not s.done for s in ctx.segments):
                ctx.conn.send(_Out(self, ctx, "cancel", [json.dumps({"context_id": ctx.wire_id, "cancel": True})]), front=True)
            ctx.conn.retire()  # the caller's reconnect gets a new socket

    # -- contexts ---------------------------------------------------------------------

    def _new_context(self, now: float) -> _Context:
        n = len(self.wire_contexts)
        wire_id = self.context_id if n == 0 else f"{self.context_id}-k{n}"
        ctx = _Context(wire_id, self._owner._connection(), self._received_s, now)
        ctx.request_timebase = self._owner.request_timebase
        self.wire_contexts.append(wire_id)
        self._ctx = ctx
        self._owner._route(self, ctx)
        return ctx

    # -- Cartesia's messages ------------------------------------------------------------

    def _on_message(self, ctx: _Context, kind: str, msg: dict[str, Any]) -> None:
        try:
            if kind == "chunk":
                self._on_chunk(ctx, msg)
            elif kind == "timestamps":
                self._on_timestamps(ctx, msg)
            elif kind == "flush_done":
                self._on_flush_done(ctx, msg)
            elif kind == "done":
                self._on_done(ctx)
            elif kind == "error":
                ctx.closed = True
                if self.stop is None and not self.finished:
                    self._fail(SynthesisError("provider", f"Cartesia reported an error: {_error_text(msg)}", PROVIDER), tell=False)
            else:
                log.debug("Cartesia message of unknown type %r skipped", kind)
        except _Bad as exc:
            if self.stop is None:
                self._fail(SynthesisError("protocol", f"Cartesia {exc}", PROVIDER))

    def _on_chunk(self, ctx: _Context, msg: dict[str, Any]) -> None:
        data = msg.get("data")
        if not isinstance(data, str):
            raise _Bad(f"sent a chunk without base64 data: {str(msg)[:120]}")
        try:
            pcm = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise _Bad(f"sent a chunk whose data is not base64: {data[:40]!r}") from None
        flush_id = msg.get("flush_id")
        if isinstance(flush_id, int) and not isinstance(flush_id, bool):
            ctx.conn.flush_seen = True
            self._done_through(ctx, flush_id - 1)  # the audio of clause n carries flush_id n
        if self.stop is not None:
            self.emit_audio(pcm)  # late audio of a stopped reply: dropped and counted
            return
        if self.finished:
            return
        now = asyncio.get_running_loop().time()
        ctx.last_chunk_at = ctx.last_activity = now
        head = self._head(ctx)
        if head is not None and head.audio_at is None:
            head.audio_at = now
        pcm = self._carry + pcm
        whole = len(pcm) - len(pcm) % 2
        self._carry = pcm[whole:]
        if whole:
            ctx.audio_bytes += whole
            self._received_bytes += whole
            self.emit_audio(pcm[:whole])
        self._by_words(ctx)
        self._arm()

    def _on_timestamps(self, ctx: _Context, msg: dict[str, Any]) -> None:
        stamps = msg.get("word_timestamps")
        if not isinstance(stamps, dict):
            raise _Bad(f"sent timestamps without word_timestamps: {str(msg)[:120]}")
        words, starts, ends = stamps.get("words"), stamps.get("start"), stamps.get("end", stamps.get("start"))
        if not (isinstance(words, list) and isinstance(starts, list) and isinstance(ends, list) and len(words) == len(starts) == len(ends)):
            raise _Bad(f"sent word_timestamps whose words, start and end are not lists of one length: {str(stamps)[:160]}")
        if self.stop is not None or self.finished or not ctx.segments:
            return
        out: list[TimedWord] = []
        for word, start, end in zip(words, starts, ends, strict=True):
            if not isinstance(word, str) or not _seconds_ok(start) or not _seconds_ok(end):
                raise _Bad(f"sent a malformed word timestamp: {word!r:.40} {start!r:.20} {end!r:.20}")
            start, end = float(start), max(float(start), float(end))
            j = min(bisect_right(ctx.cum_letters, ctx.ts_letters), len(ctx.segments) - 1)
            seg = ctx.segments[j]
            first_of_clause = ctx.ts_letters == (ctx.cum_letters[j - 1] if j else 0)
            if first_of_clause and j > 0 and ctx.request_timebase is None and seg.start_ctx_s is not None and seg.start_ctx_s > 0.1:
                ctx.request_timebase = start < seg.start_ctx_s / 2
                self._owner.request_timebase = ctx.request_timebase
                log.debug("Cartesia word times count from each %s", "transcript" if ctx.request_timebase else "context")
            offset = ctx.base_s
            if ctx.request_timebase:
                offset += seg.start_ctx_s if seg.start_ctx_s is not None else ctx.audio_bytes / 2 / self.sample_rate
            timed = TimedWord(word, offset + start, offset + end)
            out.append(timed)
            seg.words_end_s = max(seg.words_end_s or 0.0, timed.end_s)
            ctx.ts_letters += _letters(word)
        self.emit_words(out)
        self._by_words(ctx)

    def _on_flush_done(self, ctx: _Context, msg: dict[str, Any]) -> None:
        ctx.conn.flush_seen = True
        ctx.flush_dones += 1
        flush_id = msg.get("flush_id")
        through = flush_id if isinstance(flush_id, int) and not isinstance(flush_id, bool) else ctx.flush_dones
        self._done_through(ctx, through)

    def _on_done(self, ctx: _Context) -> None:
        ctx.closed = True
        if self.stop is not None:
            self.confirm_stop()  # Cartesia says the context is over: nothing more comes
            return
        self._done_through(ctx, len(ctx.segments))

    # -- clauses done -----------------------------------------------------------------

    def _head(self, ctx: _Context) -> _Segment | None:
        return ctx.segments[ctx.n_done] if ctx.n_done < len(ctx.segments) else None

    def _done_through(self, ctx: _Context, count: int) -> None:
        """The first ``count`` clauses of ``ctx`` are done (never beyond those written)."""
        while ctx.n_done < min(count, ctx.flushes_written) and self.stop is None and not self.finished:
            self._segment_done(ctx, ctx.segments[ctx.n_done])

    def _by_words(self, ctx: _Context) -> None:
        """Rule 4 of the module doc: clauses done by their words, while the socket shows no flush support."""
        if ctx.conn.flush_seen:
            return
        while (seg := self._head(ctx)) is not None and seg.written_at is not None and self.stop is None and not self.finished:
            before = ctx.cum_letters[seg.index - 1] if seg.index else 0
            if ctx.cum_letters[seg.index] == before:  # no word to wait for
                self._segment_done(ctx, seg)
                continue
            if ctx.ts_letters < ctx.cum_letters[seg.index] or seg.words_end_s is None:
                return
            if self._received_s < seg.words_end_s - TIME_TOLERANCE_S:
                return
            self._segment_done(ctx, seg)

    def _segment_done(self, ctx: _Context, seg: _Segment) -> None:
        heard_ctx = ctx.audio_bytes / 2 / self.sample_rate
        words_whole = ctx.ts_letters >= ctx.cum_letters[seg.index]
        if seg.words_end_s is not None and words_whole:
            spoken_ctx = seg.words_end_s - ctx.base_s
            if spoken_ctx > heard_ctx * 1.25 + 0.1:
                self._fail(
                    SynthesisError(
                        "protocol",
                        f"Cartesia's words run to {spoken_ctx:.2f} s but only {heard_ctx:.2f} s of audio came "
                        f"(is the audio at {self.sample_rate} Hz, as asked?)",
                        PROVIDER,
                    )
                )
                return
        if self.ended and len(self.pending) == 1 and self._carry:
            self._fail(SynthesisError("protocol", "Cartesia sent an odd number of audio bytes (not whole s16 samples)", PROVIDER))
            return
        now = asyncio.get_running_loop().time()
        seg.done = True
        ctx.n_done += 1
        ctx.last_activity = now
        self._last_done_at = now
        if ctx.n_done < len(ctx.segments):
            ctx.segments[ctx.n_done].start_ctx_s = heard_ctx
        self.emit_segment_done()
        self._arm()

    # -- the first-audio watchdog -------------------------------------------------------

    def _deadline(self) -> tuple[float, str] | None:
        """When the clause in flight fails for lack of audio (loop time), and why."""
        ctx = self._ctx
        if self.stop is not None or self.finished or ctx is None:
            return None
        head = self._head(ctx)
        if head is None or head.written_at is None:
            return None
        timeout = self._owner.config.first_audio_timeout_s
        if head.audio_at is None:
            since = max(head.written_at, self._last_done_at or 0.0)
            return since + timeout, f"no audio for a clause within {timeout:g} s of its request"
        assert ctx.last_chunk_at is not None
        return ctx.last_chunk_at + timeout, f"no audio for {timeout:g} s in the middle of a clause"

    def _arm(self) -> None:
        if self._timer is None and (due := self._deadline()) is not None:
            self._timer = asyncio.get_running_loop().call_at(due[0], self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        due = self._deadline()
        if due is None:
            return
        if asyncio.get_running_loop().time() >= due[0] - 1e-3:
            self._fail(SynthesisError("provider", f"Cartesia sent {due[1]}", PROVIDER))
        else:
            self._arm()


def _seconds_ok(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _error_text(msg: dict[str, Any]) -> str:
    status = msg.get("status_code")
    detail = msg.get("error") or msg.get("message") or msg.get("title") or json.dumps(msg)[:200]
    return f"{detail} (status {status})" if status is not None else str(detail)
