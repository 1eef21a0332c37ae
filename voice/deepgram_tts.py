"""Speech synthesis by Deepgram Aura's streaming WebSocket (``tts.provider =
"deepgram"``): one ``/v1/speak`` socket per session, one reply on it at a
time (shared/reference/speech-providers.md, section 2.4; Deepgram's pages
https://developers.deepgram.com/docs/tts-ws-flush, /docs/tts-ws-clear,
/reference/tts-ws-close; LiveKit's and Pipecat's ``deepgram/tts.py``).

**Connect.** ``GET {tts.base_url}/v1/speak?model=<tts.model>&encoding=linear16
&sample_rate=<tts.sample_rate>`` upgraded to a WebSocket, header
``Authorization: Token <tts.api_key>`` (left out when the key is empty, for
a local server); ``http(s)://`` base URLs become ``ws(s)://``. No
``container`` is asked: the WebSocket's documented query has none (only the
REST ``/v1/speak`` takes ``container=none``), and a RIFF header at the start
of a clause's audio is tolerated (below). The socket is made by
:meth:`DeepgramSynthesiser.warm` or by the first clause pushed, and kept for
the session; a socket that failed is replaced by the next clause pushed
(lazily: nothing here retries a failed reply).

**One reply at a time.** Deepgram has no contexts: everything on the socket
is one text buffer and one audio stream. A reply's clauses go on the wire
only once no other reply has text on it (a later reply's clauses wait,
unsent, until the earlier one's last ``Flushed`` or ``Cleared``), so all
audio between two acknowledgements belongs to one reply.

**A clause** is ``{"type":"Speak","text":clause}`` then ``{"type":"Flush"}``;
Deepgram answers ``{"type":"Flushed","sequence_id":n}`` when the audio of
the text flushed has all been sent, so every binary frame before it belongs
to that flush's clauses, whose segments are then done (in order). Flushed
answers are matched to Flushes by order; ``sequence_id`` is only logged.

**Flush budget** (Deepgram: at most 20 Flushes per 60 s, then a Warning and
the Flush is not processed): the Flushes sent on the socket in the last
:data:`FLUSH_WINDOW_S` are counted. While more than
:data:`FLUSH_RESERVE` of the :data:`FLUSH_LIMIT` are left, every clause is
flushed. Below that, clauses are sent with ``Speak`` only and kept in one
*group*, flushed when the reply has ended (its last clause is in the group)
as long as any Flush is left; with none left, the group waits until the
oldest Flush leaves the window. A group completes at its ``Flushed``: each
of its clauses then gets its segment done, in order. If Deepgram refuses a
Flush anyway (a ``Warning`` whose ``description`` or ``warn_msg``, or
``warn_code``, mentions flush: PC reads ``description``, LK ``warn_msg``;
the reference says to read both), the newest Flush not yet refused is taken
as the refused one (right whether the Warning comes at once or in order
with the Flushed answers, since every Flush after a refused one is refused
too): its clauses join the group after it (their text is still in
Deepgram's buffer, so the next ``Flushed`` covers it), and no Flush is sent
for a whole window from then. Whether Deepgram
makes audio from unflushed text is not documented; either way works here
(audio is attributed by order, not by flush).

**Audio**: binary frames of raw s16 LE mono at the rate asked. An odd byte
at a frame's end waits for the next frame (a clause whose audio ends on an
odd byte is a ``protocol`` error). A RIFF/WAVE header at the start of a
clause's audio is stripped; its ``fmt `` chunk must say 16-bit PCM mono,
and a rate other than the one asked is resampled to it
(:class:`media.frames.PcmResampler`). No word timings come on this protocol.

**Stop.** :meth:`DeepgramStream.cancel` drops the reply's clauses not yet
sent and, if any of its text is on the wire, puts ``{"type":"Clear"}`` first
in the writer's way (it goes out within milliseconds, ahead of anything
queued): *told* when written. Deepgram drops its text and audio buffers and
answers ``{"type":"Cleared","sequence_id":n}``: the stop is *confirmed*
then, and how long it took is kept (:attr:`DeepgramStream.cleared_ms`,
:attr:`DeepgramSynthesiser.clears`). Audio arriving between the Clear and
the Cleared belongs to the stopped reply (dropped and counted as its late
audio); nothing else is sent on the socket before the Cleared, so no old
audio can be taken for a new reply's. With no Cleared within
:data:`CLEAR_WAIT_S`, the socket is closed (the stop stays unconfirmed) and
the next reply gets a new one. A reply stopped before any of its text was
sent has nothing to tell: it is confirmed at once (nothing can be billed).

**Failure** (:class:`voice.synthesis.SynthesisError`; nothing here
retries: :mod:`voice.tts_failover` reconnects once, then falls back): every
reply with clauses queued or on the wire of the failed socket gets the
error. Connect refused, DNS, TLS, ``tts.connect_timeout_s``, an HTTP 5xx on
the upgrade ``unreachable``; 401/403 ``unauthorized``; another 4xx on the
upgrade (a model it does not have) and an error message
(``{"type":"Error","err_code","err_msg"|"description"}``) ``provider``; a
clause with no audio (or no progress: no audio and no ``Flushed``) within
``tts.first_audio_timeout_s`` of its Flush being sent (or of the clause
before it completing, whichever is later) ``provider``; the socket broken
without a close frame ``dropped``; a close frame we did not ask for while
a reply is on the wire ``closed`` (with its code, e.g. 1008); text that is
not JSON, JSON that is not an object with a ``type``, a bad WAV header or
an odd byte count ``protocol``. A socket that ends while idle fails no one.

Billing is per character: :attr:`voice.synthesis.SynthesisRecord.characters`
counts what was pushed; at a stop, ``characters_unspoken`` bounds what
Deepgram may still bill.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import aiohttp
from yarl import URL

from media.frames import PcmResampler
from voice.providers import websocket_base
from voice.synthesis import BaseSynthesisStream, SynthesisError, SynthesisErrorKind
from voice.synthesisers import TtsConfig

log = logging.getLogger(__name__)

PROVIDER = "deepgram"
#: Deepgram's Flush limit: this many per :data:`FLUSH_WINDOW_S` (docs/tts-ws-flush)
FLUSH_LIMIT = 20
#: the Flush limit's window, s (a little over Deepgram's 60, for clock skew)
FLUSH_WINDOW_S = 60.5
#: Flushes kept for reply ends: below this many left, clauses are grouped
FLUSH_RESERVE = 4
#: how long a new reply waits for ``Cleared`` before the socket is replaced, s
CLEAR_WAIT_S = 1.0
#: the largest message read from Deepgram, bytes
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: how long closing the socket waits for the server's close frame, s
WS_CLOSE_TIMEOUT_S = 1.0
#: how long a failed send waits for the reader's reason, s
READER_GRACE_S = 0.2
#: a RIFF header longer than this is not one, bytes
MAX_WAV_HEADER = 64 * 1024

CLEAR = json.dumps({"type": "Clear"})
FLUSH = json.dumps({"type": "Flush"})


def speak_url(config: TtsConfig) -> URL:
    """The ``/v1/speak`` WebSocket URL with its query (module doc, "Connect").

    ``tts.base_url`` is the host (``wss://api.deepgram.com``); ``http://``
    and ``https://`` become ``ws://`` and ``wss://``; a base URL already
    ending in ``/v1/speak`` (or ``/v1``) is completed, not doubled.
    """
    base = websocket_base(config.url)
    if not base.endswith("/v1/speak"):
        base += "/speak" if base.endswith("/v1") else "/v1/speak"
    query = [("model", config.model_name), ("encoding", "linear16"), ("sample_rate", str(config.sample_rate))]
    return URL(base).with_query(query)


def warning_text(msg: dict[str, Any]) -> str:
    """The words of a Deepgram ``Warning`` (or ``Error``): ``description``
    (Pipecat reads it), ``warn_msg`` (LiveKit reads it), ``err_msg`` or
    ``message``, with ``warn_code``/``err_code`` first; both names are read
    because the sources disagree (reference section 2.4)."""
    code = next((str(msg[k]) for k in ("warn_code", "err_code", "code") if msg.get(k)), "")
    words = [str(msg[k]) for k in ("description", "warn_msg", "err_msg", "message") if msg.get(k)]
    text = "; ".join(dict.fromkeys(words))  # the same words under two names once
    return f"{code}: {text}" if code and text else (code or text)


@dataclass
class ClearRecord:
    """One ``Clear`` sent.

    Attributes:
        context_id: the stopped reply's.
        sent_at: when it was written (the synthesiser's clock, s).
        cleared_ms: how long until ``Cleared`` came, ms (None: it did not).
        late_audio_bytes: audio that arrived between the two, bytes.
    """

    context_id: str
    sent_at: float
    cleared_ms: float | None = None
    late_audio_bytes: int = 0


@dataclass(eq=False)
class _Segment:
    stream: DeepgramStream
    text: str


@dataclass(eq=False)
class _Group:
    """Clauses of one reply flushed together (or waiting for their Flush)."""

    stream: DeepgramStream
    segments: list[_Segment] = field(default_factory=list)
    flushed_at: float | None = None  # loop time
    last_audio_at: float | None = None
    audio_bytes: int = 0
    header: bytearray | None = field(default_factory=bytearray)  # None: checked
    resampler: PcmResampler | None = None
    in_rate: int = 0


@dataclass(eq=False)
class _Conn:
    """One socket and what is on it."""

    task: asyncio.Task[None] | None = None
    ws: aiohttp.ClientWebSocketResponse | None = None
    up: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: text on the wire, oldest first; the last may be unflushed (open)
    groups: deque[_Group] = field(default_factory=deque)
    #: loop times of the Flushes sent in the window
    flush_times: deque[float] = field(default_factory=deque)
    flush_blocked_until: float = 0.0
    #: a cancelled reply whose Clear is to be written
    clear_for: DeepgramStream | None = None
    #: the Clear written, waiting for Cleared
    clearing: tuple[DeepgramStream, ClearRecord, float] | None = None
    #: since when the head group is at the head (loop time)
    head_since: float = 0.0
    carry: bytes = b""
    #: the reply whose audio came last (stray audio goes to it)
    last_stream: DeepgramStream | None = None
    request_id: str = ""
    closing: bool = False
    stray_audio_bytes: int = 0
    #: the clause whose Speak is being written
    sending: _Segment | None = None

    @property
    def open_group(self) -> _Group | None:
        return self.groups[-1] if self.groups and self.groups[-1].flushed_at is None else None


class _Retire(Exception):
    """The socket is given up quietly (no Cleared in time)."""


class DeepgramStream(BaseSynthesisStream):
    """One reply on Deepgram's socket (:class:`voice.synthesis.SynthesisStream`).

    Args:
        owner: the session's synthesiser (its socket and queue).
        context_id: names the reply in logs (Deepgram has no contexts).

    Attributes:
        context_id: as given.
        cleared_ms: after a stop told by ``Clear``: how long ``Cleared``
            took, ms (None: not yet, never, or no Clear was needed).
    """

    def __init__(self, owner: DeepgramSynthesiser, context_id: str) -> None:
        super().__init__(PROVIDER, owner.config.sample_rate, owner.config.pricing, owner.clock)
        self._owner = owner
        self.context_id = context_id
        self.cleared_ms: float | None = None

    def _send_text(self, text: str) -> None:
        self._owner._enqueue(self, text)

    def _send_end(self) -> None:
        self._owner._wake()

    def _send_cancel(self) -> None:
        self._owner._cancel(self)


class DeepgramSynthesiser:
    """:class:`voice.synthesis.Synthesiser` for Deepgram Aura (module doc).

    Args:
        config: the ``tts.*`` settings (``base_url``, ``api_key``, ``model``,
            ``sample_rate``, ``connect_timeout_s``, ``first_audio_timeout_s``,
            prices).
        clock: monotonic seconds, for stop records and :attr:`clears`
            (timeouts run on the event loop's clock).

    Attributes:
        name: ``"deepgram"``.
        clears: every ``Clear`` sent, with how long its ``Cleared`` took.
        connections: sockets opened (attempts that got through the upgrade).
        flush_limit / flush_window_s / flush_reserve: the Flush budget
            (:data:`FLUSH_LIMIT`, :data:`FLUSH_WINDOW_S`, :data:`FLUSH_RESERVE`;
            tests shrink them).
        clear_wait_s: :data:`CLEAR_WAIT_S`.
    """

    name = PROVIDER

    def __init__(self, config: TtsConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.clears: list[ClearRecord] = []
        self.connections = 0
        self.flush_limit = FLUSH_LIMIT
        self.flush_window_s = FLUSH_WINDOW_S
        self.flush_reserve = FLUSH_RESERVE
        self.clear_wait_s = CLEAR_WAIT_S
        self._http: aiohttp.ClientSession | None = None
        self._conn: _Conn | None = None
        #: clauses pushed and not yet sent, in order
        self._queue: deque[_Segment] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def url(self) -> URL:
        """The ``/v1/speak`` URL with its query."""
        return speak_url(self.config)

    def headers(self) -> dict[str, str]:
        """The upgrade's headers: ``Authorization: Token <key>`` (none without a key)."""
        key = self.config.api_key.get_secret_value()
        return {"Authorization": f"Token {key}"} if key else {}

    def open(self, context_id: str) -> DeepgramStream:
        """A stream for one reply (it connects when its first clause is
        pushed, if :meth:`warm` has not). Must be called in a running loop."""
        return DeepgramStream(self, context_id)

    async def warm(self) -> None:
        """Open the socket (idempotent; waits at most
        ``tts.connect_timeout_s`` for it); never raises but
        ``CancelledError``: a failure is met by the first reply."""
        if self._closed:
            return
        conn = self._ensure_conn()
        waiters = {asyncio.ensure_future(conn.up.wait()), asyncio.ensure_future(conn.ended.wait())}
        try:
            await asyncio.wait(waiters, timeout=self.config.connect_timeout_s + 0.5, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
            await asyncio.wait(waiters)

    async def aclose(self) -> None:
        """Close the socket and the HTTP client; replies still waiting for
        audio fail with ``closed``. Idempotent."""
        self._closed = True
        conn, self._conn = self._conn, None
        self._fail_streams(conn, SynthesisError("closed", "the Deepgram synthesiser was closed", PROVIDER))
        if conn is not None:
            conn.closing = True
        tasks = set(self._tasks)  # the socket's, and any older one still closing
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        http, self._http = self._http, None
        if http is not None:
            await http.close()

    # -- the replies' side (synchronous, never blocks) -------------------------------

    def _enqueue(self, stream: DeepgramStream, text: str) -> None:
        if stream.finished:
            return
        if self._closed:
            stream.emit_error(SynthesisError("closed", "the Deepgram synthesiser was closed", PROVIDER))
            return
        self._queue.append(_Segment(stream, text))
        self._ensure_conn()
        self._wake()

    def _wake(self) -> None:
        if self._conn is not None:
            self._conn.wake.set()

    def _cancel(self, stream: DeepgramStream) -> None:
        """The reply was stopped: drop its unsent clauses; Clear what is on the wire."""
        self._queue = deque(s for s in self._queue if s.stream is not stream)
        conn = self._conn
        on_wire = conn is not None and (
            any(g.stream is stream for g in conn.groups) or (conn.sending is not None and conn.sending.stream is stream)
        )
        if conn is None or not on_wire:
            stream.confirm_stop()  # nothing of it reached Deepgram
            return
        conn.clear_for = stream
        if stream.stop is not None:
            stream.stop.confirmable = True  # Cleared will say so: the turn's record waits for it
        conn.wake.set()

    # -- the socket --------------------------------------------------------------------

    def _ensure_conn(self) -> _Conn:
        if self._conn is None:
            conn = _Conn()
            self._conn = conn
            conn.task = asyncio.get_running_loop().create_task(self._run(conn), name="deepgram-tts")
            self._tasks.add(conn.task)
            conn.task.add_done_callback(self._tasks.discard)
        return self._conn

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s))
        return self._http

    async def _connect(self) -> aiohttp.ClientWebSocketResponse:
        """Open the socket.

        Raises:
            SynthesisError: ``unauthorized`` (401/403), ``provider`` (other
                4xx), ``unreachable`` (anything else).
        """
        url = self.url
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                return await self._client().ws_connect(
                    url,
                    headers=self.headers(),
                    autoping=True,
                    max_msg_size=MAX_MESSAGE_BYTES,
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=WS_CLOSE_TIMEOUT_S),
                )
        except aiohttp.WSServerHandshakeError as exc:
            detail = exc.headers.get("dg-error", "") if exc.headers is not None else ""
            try:
                phrase = HTTPStatus(exc.status).phrase
            except ValueError:
                phrase = ""
            status = f"{exc.status} {phrase}".strip() + (f": {detail}" if detail else "")
            if exc.status in (401, 403):
                raise SynthesisError("unauthorized", f"tts.api_key was refused by Deepgram ({status})", PROVIDER) from None
            if 400 <= exc.status < 500:
                raise SynthesisError(
                    "provider", f"Deepgram refused /v1/speak with HTTP {status}: check tts.model and tts.sample_rate", PROVIDER
                ) from None
            raise SynthesisError(
                "unreachable", f"Deepgram at {self.config.url} answered the upgrade with HTTP {status}", PROVIDER
            ) from None
        except TimeoutError:
            raise SynthesisError(
                "unreachable",
                f"Deepgram at {self.config.url} did not accept a connection within {self.config.connect_timeout_s:g} s",
                PROVIDER,
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise SynthesisError(
                "unreachable", f"cannot connect to Deepgram at {self.config.url}: {type(exc).__name__}: {exc}", PROVIDER
            ) from None

    async def _run(self, conn: _Conn) -> None:
        tasks: list[asyncio.Task[None]] = []
        cancelled = False
        try:
            conn.ws = await self._connect()
            self.connections += 1
            conn.up.set()
            conn.head_since = asyncio.get_running_loop().time()
            conn.wake.set()
            loop = asyncio.get_running_loop()
            reader, writer = loop.create_task(self._read(conn)), loop.create_task(self._write(conn))
            tasks = [reader, writer, loop.create_task(self._watch(conn))]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if writer in done and reader not in done and isinstance(writer.exception(), SynthesisError):
                # a send that failed: the reader may know why (a close frame and its code)
                await asyncio.wait({reader}, timeout=READER_GRACE_S)
                if reader.done():
                    done = {reader}
            for t in (reader, *tasks[1:]):
                if t in done:
                    t.result()  # raises what ended it
            raise SynthesisError("dropped", "the Deepgram connection ended", PROVIDER)
        except asyncio.CancelledError:
            cancelled = True
            raise
        except _Retire as exc:
            log.info("Deepgram socket given up: %s", exc)
            self._retire(conn)
        except SynthesisError as exc:
            self._fail(conn, exc)
        except Exception as exc:  # an answer nothing here foresaw: fail clearly
            log.warning("Deepgram synthesis: unexpected %s: %s", type(exc).__name__, exc)
            self._fail(conn, SynthesisError("protocol", f"Deepgram: {type(exc).__name__}: {exc}", PROVIDER))
        finally:
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks)
            if conn.ws is not None:
                with contextlib.suppress(TimeoutError, aiohttp.ClientError, ConnectionError, RuntimeError):
                    async with asyncio.timeout(0.05 if cancelled else WS_CLOSE_TIMEOUT_S):
                        await conn.ws.close()
            conn.ended.set()

    def _retire(self, conn: _Conn) -> None:
        """Give the socket up without failing anyone (its queue goes to a new one)."""
        if self._conn is conn:
            self._conn = None
        conn.groups.clear()
        if self._queue and not self._closed:
            self._ensure_conn()

    def _fail(self, conn: _Conn, error: SynthesisError) -> None:
        """The socket failed: every reply with clauses queued or on it gets the error."""
        if self._conn is conn:
            self._conn = None
        if conn.closing:
            return
        if conn.groups or self._queue:
            log.info("Deepgram synthesis failed (%s): %s", error.kind, error)
        else:
            log.debug("idle Deepgram socket ended (%s): %s", error.kind, error)
        self._fail_streams(conn, error)

    def _fail_streams(self, conn: _Conn | None, error: SynthesisError) -> None:
        streams: list[DeepgramStream] = []
        for g in conn.groups if conn is not None else ():
            if g.stream not in streams:
                streams.append(g.stream)
        for s in self._queue:
            if s.stream not in streams:
                streams.append(s.stream)
        if conn is not None:
            conn.groups.clear()
        self._queue.clear()
        for stream in streams:
            stream.emit_error(SynthesisError(error.kind, str(error), PROVIDER))

    # -- writing -----------------------------------------------------------------------

    def _flush_left(self, conn: _Conn, now: float) -> tuple[int, float | None]:
        """Flushes left in the window and, if that is not all of them, when
        the next one frees (loop time)."""
        while conn.flush_times and conn.flush_times[0] <= now - self.flush_window_s:
            conn.flush_times.popleft()
        if now < conn.flush_blocked_until:
            return 0, conn.flush_blocked_until
        left = self.flush_limit - len(conn.flush_times)
        frees = conn.flush_times[0] + self.flush_window_s if conn.flush_times else None
        return left, frees

    def _flush_due(self, conn: _Conn, group: _Group, now: float) -> tuple[bool, float | None]:
        """Whether to flush the open group now (module doc, "Flush budget");
        if not, when to look again (None: at the next wake)."""
        left, frees = self._flush_left(conn, now)
        stream = group.stream
        last = stream.ended and not any(s.stream is stream for s in self._queue)
        if left > self.flush_reserve or (last and left > 0):
            return True, None
        if not last and self._queue and self._queue[0].stream is stream:
            return False, None  # its next clause joins the group first
        return False, frees

    def _next_segment(self, conn: _Conn) -> _Segment | None:
        while self._queue and (self._queue[0].stream.finished or self._queue[0].stream.stop is not None):
            self._queue.popleft()
        if not self._queue:
            return None
        seg = self._queue[0]
        if conn.groups and conn.groups[0].stream is not seg.stream:
            return None  # one reply at a time on the socket
        return self._queue.popleft()

    async def _write(self, conn: _Conn) -> None:
        """Send what is due, Clear first (module doc); returns never, raises
        what ends the socket."""
        ws = conn.ws
        assert ws is not None
        loop = asyncio.get_running_loop()
        try:
            while True:
                conn.wake.clear()
                if conn.clear_for is not None and conn.clearing is None:
                    stream, conn.clear_for = conn.clear_for, None
                    await ws.send_str(CLEAR)
                    stream.told()
                    record = ClearRecord(stream.context_id, self.clock())
                    self.clears.append(record)
                    conn.clearing = (stream, record, loop.time())
                    conn.groups.clear()  # Deepgram drops its text and audio buffers
                    conn.carry = b""
                    continue
                if conn.clearing is not None:
                    left_s: float | None = conn.clearing[2] + self.clear_wait_s - loop.time()
                    if left_s is not None and left_s <= 0:
                        if self._queue:
                            raise _Retire(f"no Cleared within {self.clear_wait_s:g} s of Clear")
                        left_s = None  # nothing waits: the next clause decides
                    await _wait(conn.wake, left_s)
                    continue
                now = loop.time()
                timeout: float | None = None
                group = conn.open_group
                if group is not None:
                    due, timeout = self._flush_due(conn, group, now)
                    if due:
                        await ws.send_str(FLUSH)
                        group.flushed_at = loop.time()
                        conn.flush_times.append(group.flushed_at)
                        continue
                    if timeout is not None:
                        timeout = max(0.0, timeout - now)
                seg = self._next_segment(conn)
                if seg is not None:
                    conn.sending = seg
                    try:
                        await ws.send_str(json.dumps({"type": "Speak", "text": seg.text}))
                    finally:
                        conn.sending = None
                    group = conn.open_group
                    if group is None:
                        if not conn.groups:
                            conn.head_since = loop.time()
                        group = _Group(seg.stream)
                        conn.groups.append(group)
                    group.segments.append(seg)
                    continue
                await _wait(conn.wake, timeout)
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
            raise SynthesisError("dropped", f"Deepgram connection broke while sending: {type(exc).__name__}: {exc}", PROVIDER) from None

    async def _watch(self, conn: _Conn) -> None:
        """Fail the socket when the head clause makes no progress (module doc, "Failure")."""
        loop = asyncio.get_running_loop()
        limit = self.config.first_audio_timeout_s
        step = min(0.25, limit / 5)
        while True:
            await asyncio.sleep(step)
            if conn.clearing is not None or not conn.groups:
                continue
            head = conn.groups[0]
            if head.flushed_at is None:
                continue
            since = max(head.flushed_at, conn.head_since, head.last_audio_at or 0.0)
            if loop.time() - since > limit:
                what = "no audio" if head.audio_bytes == 0 else "no more audio and no Flushed"
                raise SynthesisError("provider", f"Deepgram sent {what} within {limit:g} s (tts.first_audio_timeout_s)", PROVIDER)

    # -- reading -----------------------------------------------------------------------

    async def _read(self, conn: _Conn) -> None:
        """Read Deepgram's frames until the socket ends; raises what ended it."""
        ws = conn.ws
        assert ws is not None
        while True:
            msg = await ws.receive()
            if msg.type is aiohttp.WSMsgType.BINARY:
                self._on_audio(conn, msg.data)
            elif msg.type is aiohttp.WSMsgType.TEXT:
                self._on_text(conn, msg.data)
            elif msg.type is aiohttp.WSMsgType.CLOSE:
                raise SynthesisError("closed", f"Deepgram closed the socket: {msg.data} {msg.extra or ''}".rstrip(), PROVIDER)
            elif msg.type is aiohttp.WSMsgType.ERROR:
                failure = msg.data
                if isinstance(failure, aiohttp.WebSocketError):
                    raise _bad(f"sent a bad WebSocket message: {failure}")
                raise SynthesisError("dropped", f"Deepgram connection failed: {type(failure).__name__}: {failure}", PROVIDER)
            else:
                raise SynthesisError("dropped", "the Deepgram connection dropped without a close frame", PROVIDER)

    def _on_text(self, conn: _Conn, text: str) -> None:
        try:
            msg = json.loads(text)
        except (ValueError, RecursionError):
            raise _bad(f"sent text that is not JSON: {text[:120]!r}") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise _bad(f"sent a message that is not an object with a type: {text[:120]!r}")
        kind = msg["type"]
        if kind == "Flushed":
            self._on_flushed(conn, msg)
        elif kind == "Cleared":
            self._on_cleared(conn, msg)
        elif kind == "Metadata":
            conn.request_id = str(msg.get("request_id") or "")
            log.debug("Deepgram speak socket: request_id %s, model %s", conn.request_id or "-", msg.get("model_name", "-"))
        elif kind == "Warning":
            self._on_warning(conn, msg)
        elif kind.lower() == "error":
            raise SynthesisError("provider", f"Deepgram reported an error: {warning_text(msg) or text[:200]}", PROVIDER)
        else:
            log.debug("Deepgram message of unknown type %r skipped", kind)

    def _on_flushed(self, conn: _Conn, msg: dict[str, Any]) -> None:
        if conn.clearing is not None or conn.clear_for is not None:
            return  # for text the Clear drops
        if not conn.groups or conn.groups[0].flushed_at is None:
            log.debug("Deepgram Flushed %s with no Flush outstanding: ignored", msg.get("sequence_id"))
            return
        group = conn.groups[0]
        self._end_audio(conn, group)  # may raise: the group is still on the wire, its reply fails
        conn.groups.popleft()
        conn.head_since = asyncio.get_running_loop().time()
        for _ in group.segments:
            group.stream.emit_segment_done()
        conn.wake.set()

    def _on_cleared(self, conn: _Conn, msg: dict[str, Any]) -> None:
        if conn.clearing is None:
            log.debug("Deepgram Cleared %s with no Clear outstanding: ignored", msg.get("sequence_id"))
            return
        stream, record, _ = conn.clearing
        conn.clearing = None
        record.cleared_ms = (self.clock() - record.sent_at) * 1000
        stream.cleared_ms = record.cleared_ms
        stream.confirm_stop()
        conn.carry = b""
        conn.head_since = asyncio.get_running_loop().time()
        conn.wake.set()

    def _on_warning(self, conn: _Conn, msg: dict[str, Any]) -> None:
        words = warning_text(msg)
        if "flush" not in words.lower():
            log.info("Deepgram warning: %s", words or msg)
            return
        log.info("Deepgram refused a Flush (%s): clauses are grouped for %g s", words, self.flush_window_s)
        now = asyncio.get_running_loop().time()
        conn.flush_blocked_until = now + self.flush_window_s
        if conn.clearing is not None:
            return
        flushed = [i for i, g in enumerate(conn.groups) if g.flushed_at is not None]
        if not flushed:
            return
        # the newest Flush not yet refused: right whether Deepgram warns at once
        # or in order (the Flushes after a refused one are refused too)
        i = flushed[-1]
        refused = conn.groups[i]
        if i + 1 < len(conn.groups):  # the open group: its Flush will cover the refused text
            nxt = conn.groups[i + 1]
            del conn.groups[i]
            nxt.segments[:0] = refused.segments
            nxt.audio_bytes += refused.audio_bytes
            nxt.header, nxt.resampler, nxt.in_rate = refused.header, refused.resampler, refused.in_rate
            nxt.last_audio_at = refused.last_audio_at
        else:
            refused.flushed_at = None  # its text waits in Deepgram's buffer for the next Flush
        conn.wake.set()

    def _on_audio(self, conn: _Conn, data: bytes) -> None:
        if conn.clearing is not None:
            stream, record, _ = conn.clearing
            record.late_audio_bytes += len(data)
            stream.emit_audio(data[: len(data) // 2 * 2])  # the stopped reply's: dropped and counted
            return
        if not conn.groups:
            conn.stray_audio_bytes += len(data)
            log.debug("Deepgram sent %d bytes of audio with no text outstanding: dropped", len(data))
            if conn.last_stream is not None and conn.last_stream.stop is not None:
                conn.last_stream.emit_audio(data[: len(data) // 2 * 2])
            return
        group = conn.groups[0]
        conn.last_stream = group.stream
        group.last_audio_at = asyncio.get_running_loop().time()
        if group.header is not None:
            group.header += data
            status = self._read_header(group)
            if status == "more":
                return
            data = bytes(group.header)
            group.header = None
        self._emit(conn, group, data)

    def _read_header(self, group: _Group) -> str:
        """Strip a RIFF header at the start of the group's audio: ``"more"``
        (not all of it yet) or ``"done"`` (``group.header`` now holds the
        audio after it). Raises ``protocol`` on a header that is not 16-bit
        PCM mono."""
        buf = group.header
        assert buf is not None
        if len(buf) < 4:
            return "more" if b"RIFF".startswith(bytes(buf)) else "done"
        if not buf.startswith(b"RIFF"):
            return "done"
        if len(buf) < 12:
            return "more"
        if buf[8:12] != b"WAVE":
            raise _bad("sent a RIFF header that is not WAVE")
        pos, fmt = 12, None
        while True:
            if len(buf) < pos + 8:
                break
            cid, size = bytes(buf[pos : pos + 4]), struct.unpack_from("<I", buf, pos + 4)[0]
            if cid == b"data":
                if fmt is None:
                    raise _bad("sent a WAV header without a fmt chunk")
                del buf[: pos + 8]
                tag, channels, rate, bits = fmt
                if tag not in (1, 0xFFFE) or bits != 16 or channels != 1:
                    raise _bad(f"sent WAV audio that is not 16-bit PCM mono (format {tag}, {channels} channels, {bits} bits)")
                if rate != group.stream.sample_rate:
                    log.info("Deepgram sent %d Hz audio, %d Hz asked: resampled", rate, group.stream.sample_rate)
                    group.in_rate = rate
                    group.resampler = PcmResampler(group.stream.sample_rate)
                return "done"
            if cid == b"fmt ":
                if len(buf) < pos + 8 + 16:
                    break
                tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", buf, pos + 8)
                if rate <= 0:
                    raise _bad(f"sent a WAV header with rate {rate}")
                fmt = (tag, channels, rate, bits)
            pos += 8 + size + (size & 1)
        if len(buf) > MAX_WAV_HEADER:
            raise _bad("sent a RIFF header with no data chunk")
        return "more"

    def _emit(self, conn: _Conn, group: _Group, data: bytes) -> None:
        if conn.carry:
            data = conn.carry + data
        if len(data) % 2:
            data, conn.carry = data[:-1], data[-1:]
        else:
            conn.carry = b""
        if not data:
            return
        group.audio_bytes += len(data)
        if group.resampler is not None:
            data = group.resampler.pcm(data, group.in_rate)
        group.stream.emit_audio(data)

    def _end_audio(self, conn: _Conn, group: _Group) -> None:
        """The group's audio is complete: emit what is held, check it was whole samples."""
        if group.header is not None:  # shorter than a header: plain audio
            data, group.header = bytes(group.header), None
            self._emit(conn, group, data)
        if conn.carry:
            conn.carry = b""
            raise _bad("sent an odd number of audio bytes for a clause (s16 samples are 2 bytes)")
        if group.resampler is not None:
            group.stream.emit_audio(group.resampler.flush())


async def _wait(event: asyncio.Event, timeout: float | None) -> None:
    if timeout is None:
        await event.wait()
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()


def _bad(what: str) -> SynthesisError:
    kind: SynthesisErrorKind = "protocol"
    return SynthesisError(kind, f"Deepgram {what}", PROVIDER)
