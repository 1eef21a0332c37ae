"""Deepgram live streaming speech recognition (``stt.provider = "deepgram"``):
one WebSocket to ``/v1/listen`` per session, behind
:class:`voice.recognition.Recogniser` (issue 28, item 2).

Wire protocol (shared/reference/speech-providers.md, section 1.1; its
sources: LiveKit Agents' Deepgram plugin ``livekit-plugins-deepgram/.../stt.py``,
Pipecat's ``services/deepgram/stt.py``, and Deepgram's docs pages named below):

- **Connect**: ``GET {stt.base_url}/v1/listen?<query>`` upgraded to a
  WebSocket, header ``Authorization: Token <stt.api_key>`` (not ``Bearer``;
  left out when the key is empty, for a local server). ``http(s)://`` base
  URLs are mapped to ``ws(s)://``. The upgrade's ``dg-request-id`` header
  is logged at debug (LK logs the ``dg-*`` headers). The query: ``model``,
  ``language``, ``encoding=linear16``, ``sample_rate=16000``, ``channels=1``
  (``encoding`` and ``sample_rate`` are required for raw PCM),
  ``interim_results``, ``endpointing=<ms>``, ``utterance_end_ms=<ms>`` (only
  with ``interim_results``: https://developers.deepgram.com/docs/utterance-end),
  ``vad_events=true``, ``punctuate=true``; ``stt.keyterms`` as repeated
  ``keyterm`` for nova-3 models, else as repeated ``keywords``. Booleans are
  ``true``/``false``.
- **Audio**: binary frames of raw 16 kHz mono s16 LE, sent as soon as they
  are given (whatever is queued goes in one frame, at most
  :data:`MAX_FRAME_BYTES`; nothing waits to fill a frame).
- **Control** (text frames): ``{"type":"KeepAlive"}`` every ``stt.keepalive_s``
  while no audio is sent (Deepgram closes a socket that got neither audio nor
  KeepAlive for 10 s with ``1011 NET-0001``:
  https://developers.deepgram.com/docs/audio-keep-alive);
  ``{"type":"Finalize"}`` when our endpointing ends an utterance, so its final
  comes at once, marked ``from_finalize`` (https://developers.deepgram.com/docs/finalize;
  Pipecat sends it the same way on ``VADUserStoppedSpeakingFrame``), and also
  on :meth:`DeepgramStream.discard` (Deepgram cannot drop audio: its results
  come at once and the session drops them). A Finalize with nothing left
  to finalize (the finals received already reach the end of the audio:
  Deepgram's endpointing got there first) is not sent, since whether
  Deepgram answers it is not documented (reference 1.1, VERIFY); the empty
  finalized final owed is made here. ``{"type":"CloseStream"}`` at
  the end, after which Deepgram sends the last ``Results``, a ``Metadata``
  summary, then closes (https://developers.deepgram.com/docs/close-stream).
- **Server messages** (JSON text): ``Results`` (``is_final`` false: an
  :class:`Interim`, only when its transcript is not empty; true: a
  :class:`Final`, even empty, with ``finalized`` = ``from_finalize``; times
  ``start`` and ``start + duration``; ``speech_final`` adds an
  :class:`EndOfUtterance` after the final); ``SpeechStarted``
  (``{"channel":[0,1],"timestamp"}``: ``channel`` is a *list*, which several
  public clients crashed on); ``UtteranceEnd`` (``last_word_end``: an
  :class:`EndOfUtterance`); ``Metadata`` (``duration``: the audio Deepgram
  counted, a :class:`RecognitionUsage`); an error message
  (``{"type":"Error","description"|"message"|...}``: ``RecognitionError("provider")``).
  Unknown types are logged at debug and skipped; optional fields may be
  missing; ``channel`` may be a list or an object.

Times: Deepgram counts seconds of audio received on the connection, which
are stream seconds (:mod:`voice.recognition`) except where audio was dropped
before it could be sent (at most :data:`MAX_BUFFER_S` seconds wait for the
connection; older audio is dropped, and the provider's times after the gap
are moved later by what was dropped, so they stay stream seconds).

Errors (:class:`voice.recognition.RecognitionError`): ``unreachable``
(connect refused, DNS, TLS, timeout, an HTTP status other than 401/403 on
the upgrade), ``unauthorized`` (401/403: logged once, naming
``stt.api_key``, and remembered: later streams fail at once until a
:meth:`DeepgramRecogniser.start` succeeds), ``dropped`` (the socket broke
without a close frame), ``closed`` (a close frame we did not ask for: its
code and reason, e.g. NET-0001), ``protocol`` (not JSON, wrong shapes, a
binary frame, a message over :data:`MAX_MESSAGE_BYTES`), ``provider`` (an
error message). Nothing is retried here: :mod:`voice.transcription`
reconnects once and falls back.

Billing: Deepgram's only usage field is ``Metadata.duration``; whether the
invoice follows it or the socket's lifetime is marked VERIFY in the reference
(``stt.billed_by`` chooses; :mod:`voice.transcription` records both).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import math
from collections import deque
from collections.abc import AsyncIterator
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any, Literal

import aiohttp
from yarl import URL

from voice.providers import websocket_base
from voice.recognisers import SttConfig
from voice.recognition import (
    STREAM_BYTES_PER_S,
    STREAM_RATE,
    EndOfUtterance,
    Final,
    Interim,
    RecognitionError,
    RecognitionEvent,
    RecognitionUsage,
    SpeechPricing,
    SpeechStarted,
    StreamOptions,
    Word,
)

log = logging.getLogger(__name__)

#: most audio kept while the connection is not up (or not keeping up), s;
#: older audio is dropped (issue 28: bounded buffers)
MAX_BUFFER_S = 30.0
#: the largest binary frame sent, bytes (2 s of 16 kHz s16; a replay of a
#: long utterance goes in several)
MAX_FRAME_BYTES = 64 * 1024
#: the largest message read from Deepgram, bytes (its Results are a few kB);
#: a larger one is a protocol error
MAX_MESSAGE_BYTES = 1024 * 1024
#: a final ending this close to the end of the audio sent covers it, s
#: (Deepgram rounds its times to the millisecond)
FINAL_TOLERANCE_S = 0.002
#: how long a graceful close waits for Deepgram's last Results, Metadata and close, s
CLOSE_TIMEOUT_S = 2.0
#: how long closing the socket waits for the server's close frame, s
WS_CLOSE_TIMEOUT_S = 1.0

KEEPALIVE = json.dumps({"type": "KeepAlive"})
FINALIZE = json.dumps({"type": "Finalize"})
CLOSE_STREAM = json.dumps({"type": "CloseStream"})

ErrorKind = Literal["unreachable", "unauthorized", "dropped", "closed", "protocol", "provider"]

#: the ``dg-request-id`` of the upgrade being made in this task (set by the trace hook)
_REQUEST_ID: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("deepgram_request_id", default=None)


async def _on_request_end(_session: aiohttp.ClientSession, _ctx: SimpleNamespace, params: aiohttp.TraceRequestEndParams) -> None:
    holder = _REQUEST_ID.get()
    if holder is not None:
        holder.append(params.response.headers.get("dg-request-id", ""))


def listen_url(config: SttConfig) -> URL:
    """The ``/v1/listen`` WebSocket URL with its query (module doc, "Connect").

    ``stt.base_url`` is the host (``wss://api.deepgram.com``); ``http://``
    and ``https://`` become ``ws://`` and ``wss://``; a base URL already
    ending in ``/v1/listen`` (or ``/v1``) is completed, not doubled.
    """
    base = websocket_base(config.url)
    if base.endswith("/v1/listen"):
        pass
    elif base.endswith("/v1"):
        base += "/listen"
    else:
        base += "/v1/listen"

    def flag(value: bool) -> str:
        return "true" if value else "false"

    query: list[tuple[str, str]] = [("model", config.model_name)]
    if config.language:
        query.append(("language", config.language))
    query += [
        ("encoding", "linear16"),
        ("sample_rate", str(STREAM_RATE)),
        ("channels", "1"),
        ("interim_results", flag(config.interim_results)),
        ("endpointing", str(config.endpointing_ms)),
    ]
    if config.interim_results:  # Deepgram requires interim_results for utterance_end_ms
        query.append(("utterance_end_ms", str(config.utterance_end_ms)))
    query += [("vad_events", "true"), ("punctuate", "true")]
    # keyterm prompting is nova-3's; older models take keywords (LK live_config)
    term = "keyterm" if config.model_name.startswith("nova-3") else "keywords"
    query += [(term, t) for t in config.keyterms]
    return URL(base).with_query(query)


class DeepgramRecogniser:
    """:class:`voice.recognition.Recogniser` for Deepgram's live API.

    Args:
        config: the ``stt.*`` settings (``base_url``, ``api_key``, ``model``,
            ``language``, ``keyterms``, ``endpointing_ms``, ``utterance_end_ms``,
            ``interim_results``, ``connect_timeout_s``, ``keepalive_s``, prices).

    Attributes:
        name: ``"deepgram"``.
        pricing: ``config.pricing``.
    """

    name = "deepgram"

    #: the session's bound applies (stt.final_timeout_ms)
    final_timeout_s: float | None = None

    def __init__(self, config: SttConfig) -> None:
        self.config = config
        self.pricing: SpeechPricing = config.pricing
        self._session: aiohttp.ClientSession | None = None
        #: why the key was refused (401/403), until a start() is accepted
        self._refused: str | None = None
        self._closed = False

    @property
    def url(self) -> URL:
        """The ``/v1/listen`` URL with its query."""
        return listen_url(self.config)

    @property
    def refused(self) -> str | None:
        """Why Deepgram refused ``stt.api_key`` (None: it has not)."""
        return self._refused

    def headers(self) -> dict[str, str]:
        """The upgrade's headers: ``Authorization: Token <key>`` (none without a key)."""
        key = self.config.api_key.get_secret_value()
        return {"Authorization": f"Token {key}"} if key else {}

    async def start(self) -> None:
        """Check the key with a probe connection (connect, ``CloseStream``,
        read until Deepgram closes; no audio is sent, so none is billed).
        Idempotent; never raises: a refused key is logged once as a warning
        naming ``stt.api_key`` and remembered (streams then fail at once
        with ``unauthorized``); an unreachable Deepgram is one info line
        (sessions will still try it, and fall back). An accepted key clears
        a remembered refusal."""
        try:
            ws, request_id = await self._connect(probe=True)
        except RecognitionError as exc:
            if exc.kind == "provider":
                log.warning("%s; sessions will try it, then use %s", exc, self._fallback_words())
            elif exc.kind != "unauthorized":
                log.info("Deepgram (stt.base_url %s) is not reachable now (%s); sessions will try it when they start", self.config.url, exc)
            return
        try:
            with contextlib.suppress(aiohttp.ClientError, ConnectionError, RuntimeError, TimeoutError):
                async with asyncio.timeout(self.config.connect_timeout_s):
                    await ws.send_str(CLOSE_STREAM)
                    async for _ in ws:  # Metadata, then the close
                        pass
        finally:
            await _close_ws(ws, WS_CLOSE_TIMEOUT_S)
        if self._refused is not None:
            log.info("stt.api_key is accepted by Deepgram now")
        self._refused = None
        log.debug("Deepgram accepted stt.api_key (dg-request-id %s)", request_id or "-")

    def open(self, options: StreamOptions) -> DeepgramStream:
        """One session's stream; it connects in the background (never blocks).
        Must be called inside a running event loop."""
        return DeepgramStream(self, options)

    async def aclose(self) -> None:
        """Close the HTTP client. Idempotent."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _fallback_words(self) -> str:
        return "the fallback recogniser" if self.config.fallback == "embedded" else "no recogniser (turns fail)"

    # -- connecting ----------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RecognitionError("unreachable", "the Deepgram recogniser is closed")
        if self._session is None or self._session.closed:
            trace = aiohttp.TraceConfig()
            trace.on_request_end.append(_on_request_end)
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
                trace_configs=[trace],
            )
        return self._session

    async def _connect(self, *, probe: bool = False) -> tuple[aiohttp.ClientWebSocketResponse, str]:
        """Open the WebSocket; returns it and its ``dg-request-id``.

        Raises:
            RecognitionError: ``unauthorized`` (401/403, or a refusal
                remembered, unless ``probe``), ``unreachable`` (anything
                else that keeps it from opening).
        """
        if self._refused is not None and not probe:
            raise RecognitionError("unauthorized", self._refused)
        session = self._client()
        url = self.url
        holder: list[str] = []
        token = _REQUEST_ID.set(holder)
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                ws = await session.ws_connect(
                    url,
                    headers=self.headers(),
                    autoping=True,
                    max_msg_size=MAX_MESSAGE_BYTES,
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=WS_CLOSE_TIMEOUT_S),
                )
        except aiohttp.WSServerHandshakeError as exc:
            raise self._refusal(exc) from None
        except TimeoutError:
            raise RecognitionError(
                "unreachable", f"Deepgram at {self.config.url} did not accept a connection within {self.config.connect_timeout_s:g} s"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise RecognitionError("unreachable", f"cannot connect to Deepgram at {self.config.url}: {type(exc).__name__}: {exc}") from None
        finally:
            _REQUEST_ID.reset(token)
        request_id = next((h for h in holder if h), "")
        log.debug("Deepgram stream connected to %s (dg-request-id %s)", url.with_query(None), request_id or "-")
        return ws, request_id

    def _refusal(self, exc: aiohttp.WSServerHandshakeError) -> RecognitionError:
        detail = exc.headers.get("dg-error", "") if exc.headers is not None else ""
        try:
            reason = HTTPStatus(exc.status).phrase
        except ValueError:
            reason = ""
        status = f"{exc.status} {reason}".strip() + (f": {detail}" if detail else "")
        if exc.status in (401, 403):
            message = f"stt.api_key was refused by Deepgram ({status})"
            if self._refused is None:
                log.warning("%s: %s", message, "sessions will use the fallback recogniser" if self.config.fallback == "embedded"
                            else "voice turns will fail (stt.fallback is none)")
            self._refused = message
            return RecognitionError("unauthorized", message)
        if 400 <= exc.status < 500:  # it is there, and refuses what was asked (a model or language it does not have)
            return RecognitionError(
                "provider", f"Deepgram refused the connection with HTTP {status}: check stt.model, stt.language and stt.keyterms"
            )
        return RecognitionError(
            "unreachable", f"Deepgram at {self.config.url} (stt.base_url) answered the upgrade with HTTP {status}"
        )


async def _close_ws(ws: aiohttp.ClientWebSocketResponse, bound_s: float) -> None:
    """Close ``ws``, waiting at most ``bound_s`` for the server's close
    frame; past that (or when cancelled) the connection is aborted (aiohttp
    closes the transport when its close is interrupted)."""
    if ws.closed:
        return
    with contextlib.suppress(TimeoutError, aiohttp.ClientError, ConnectionError, RuntimeError):
        async with asyncio.timeout(bound_s):
            await ws.close()


class DeepgramStream:
    """One session's Deepgram stream (:class:`voice.recognition.RecognitionStream`).

    The connection is made by a background task started here (so this must
    be made in a running event loop); what is sent before it is up waits,
    at most :data:`MAX_BUFFER_S` of audio (older audio is dropped).

    Args:
        owner: the recogniser (settings, HTTP client, remembered refusal).
        options: the session's options (``session_id`` goes into logs only).
    """

    def __init__(self, owner: DeepgramRecogniser, options: StreamOptions) -> None:
        self._owner = owner
        self._config = owner.config
        self._session_id = options.session_id
        #: what waits to be sent, in order: audio (bytes) and control messages (str)
        self._out: deque[bytes | str] = deque()
        self._out_audio = 0  # bytes of audio in _out
        self._wake = asyncio.Event()
        self._events: asyncio.Queue[RecognitionEvent | RecognitionError | None] = asyncio.Queue()
        self._since_mark = 0  # bytes sent since the last finalize/discard
        self._sent = 0  # bytes given to send()
        #: where the latest final received ends, stream s
        self._final_end_s = 0.0
        self._provider_bytes = 0  # bytes of audio handed to the socket
        #: audio dropped before it was sent: (provider seconds where, stream seconds dropped so far)
        self._gaps: list[tuple[float, float]] = []
        self._dropped = 0  # bytes
        self._closing = False
        self._failed = False
        #: the upgrade's ``dg-request-id`` once connected
        self.request_id = ""
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"deepgram-stream-{self._session_id}")

    # -- the session's side (never blocks, never raises) ----------------------------

    def send(self, pcm: bytes) -> None:
        """Queue 16 kHz mono s16 LE audio (any whole number of samples).
        Ignored once the stream is closing or failed."""
        if self._closing or self._failed or not pcm:
            return
        self._since_mark += len(pcm)
        self._sent += len(pcm)
        self._out.append(bytes(pcm))
        self._out_audio += len(pcm)
        if self._out_audio > MAX_BUFFER_S * STREAM_BYTES_PER_S:
            self._drop_oldest(self._out_audio - int(MAX_BUFFER_S * STREAM_BYTES_PER_S))
        self._wake.set()

    def finalize(self) -> None:
        """Send ``Finalize`` (after the audio queued): the audio since the last
        finalize/discard is one utterance, over; Deepgram answers with its
        final (``from_finalize``). Nothing is sent if no audio came since.

        If the finals already received reach the end of the audio sent
        (Deepgram's endpointing got there first), Deepgram has nothing left
        to finalize, and whether it answers such a Finalize is not
        documented (reference 1.1, VERIFY): no Finalize is sent, and the
        final owed is an empty one at the end of the audio, marked
        ``finalized``, made here at once."""
        if self._mark():
            end_s = self._sent / STREAM_BYTES_PER_S
            self._events.put_nowait(Final("", end_s, end_s, finalized=True))

    def discard(self) -> None:
        """The audio since the last finalize/discard is not speech. Deepgram
        cannot drop audio, so ``Finalize`` is sent too: its results come at
        once and the session drops them (no final is owed). Nothing is sent
        when its finals already reach the end of the audio."""
        self._mark()

    def _mark(self) -> bool:
        """Send ``Finalize`` if there is audio since the last mark that no
        final received covers; True: there is audio since the last mark,
        all covered already (nothing was sent)."""
        if self._closing or self._failed or self._since_mark == 0:
            return False
        self._since_mark = 0
        if self._final_end_s >= self._sent / STREAM_BYTES_PER_S - FINAL_TOLERANCE_S:
            return True
        self._out.append(FINALIZE)
        self._wake.set()
        return False

    def _drop_oldest(self, excess: int) -> None:
        excess += excess % 2
        at_s = self._provider_bytes / STREAM_BYTES_PER_S
        dropped = 0
        i = 0
        while dropped < excess and i < len(self._out):
            item = self._out[i]
            if isinstance(item, str):
                i += 1
                continue
            take = min(len(item), excess - dropped)
            if take == len(item):
                del self._out[i]
            else:
                self._out[i] = item[take:]
            dropped += take
        if not dropped:
            return
        if self._dropped == 0:
            log.warning("Deepgram stream %s: the connection is not keeping up; audio older than %g s is dropped",
                        self._session_id or "-", MAX_BUFFER_S)
        self._out_audio -= dropped
        self._dropped += dropped
        total_s = self._dropped / STREAM_BYTES_PER_S
        if self._gaps and self._gaps[-1][0] == at_s:
            self._gaps[-1] = (at_s, total_s)
        else:
            self._gaps.append((at_s, total_s))

    def _stream_s(self, provider_s: float) -> float:
        """Stream seconds of a provider time (shifted by the audio dropped before it)."""
        shift = 0.0
        for at_s, total_s in self._gaps:
            if at_s <= provider_s:
                shift = total_s
        return provider_s + shift

    async def events(self) -> AsyncIterator[RecognitionEvent]:
        """The stream's events in Deepgram's order, until :meth:`aclose`.

        Raises:
            RecognitionError: the stream failed (module doc, "Errors");
                nothing more comes.
        """
        while (item := await self._events.get()) is not None:
            if isinstance(item, RecognitionError):
                raise item
            yield item

    async def aclose(self) -> None:
        """Graceful end: ``CloseStream`` after the audio queued (once
        connected, if the connection is still being made), then read
        Deepgram's last Results and Metadata until it closes, all within
        :data:`CLOSE_TIMEOUT_S` (past it the connection is aborted); then
        :meth:`events` ends, without an error (a failure while closing is
        logged at debug). Idempotent; cancelling it aborts the connection
        at once."""
        if not self._closing:
            self._closing = True
            if not self._failed:
                self._out.append(CLOSE_STREAM)  # after the audio queued, once connected
                self._wake.set()
        try:
            done, _ = await asyncio.wait({self._task}, timeout=CLOSE_TIMEOUT_S)
            if not done:
                log.info("Deepgram stream %s: no close within %g s of CloseStream; closing it", self._session_id or "-", CLOSE_TIMEOUT_S)
                self._task.cancel()
                await asyncio.wait({self._task})
        except asyncio.CancelledError:
            self._task.cancel()
            raise

    # -- the connection ----------------------------------------------------------------

    async def _run(self) -> None:
        ws: aiohttp.ClientWebSocketResponse | None = None
        cancelled = False
        try:
            ws, self.request_id = await self._owner._connect()
            error = await self._converse(ws)
            if error is not None:
                raise error
        except asyncio.CancelledError:
            cancelled = True
            raise
        except Exception as exc:
            if not isinstance(exc, RecognitionError):  # an answer nothing here foresaw: the stream fails, clearly
                log.warning("Deepgram stream %s: unexpected %s: %s", self._session_id or "-", type(exc).__name__, exc)
                exc = RecognitionError("protocol", f"Deepgram: {type(exc).__name__}: {exc}")
            if self._closing:
                log.debug("Deepgram stream %s ended while closing: %s", self._session_id or "-", exc)
            else:
                self._failed = True
                self._out.clear()
                self._events.put_nowait(exc)
        finally:
            if ws is not None:
                await _close_ws(ws, 0.05 if cancelled else WS_CLOSE_TIMEOUT_S)
            self._events.put_nowait(None)

    async def _converse(self, ws: aiohttp.ClientWebSocketResponse) -> RecognitionError | None:
        """Write and read until the socket ends; the error that ended it (None: a close we asked for)."""
        reader = asyncio.ensure_future(self._read(ws))
        writer = asyncio.ensure_future(self._write(ws))
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if writer in done and writer.result() is not None:
                return writer.result()
            return await reader
        finally:
            for task in (reader, writer):
                task.cancel()
            await asyncio.wait({reader, writer})

    async def _write(self, ws: aiohttp.ClientWebSocketResponse) -> RecognitionError | None:
        """Send what is queued as it comes; KeepAlive after ``keepalive_s`` without
        audio. Returns None once CloseStream is sent, the error if sending fails."""
        loop = asyncio.get_running_loop()
        keepalive_s = self._config.keepalive_s
        alive_at = loop.time()
        try:
            while True:
                if not self._out:
                    self._wake.clear()
                    wait_s = keepalive_s - (loop.time() - alive_at)
                    if wait_s <= 0:
                        await ws.send_str(KEEPALIVE)
                        alive_at = loop.time()
                        continue
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait_s):
                            await self._wake.wait()
                    continue
                item = self._out.popleft()
                if isinstance(item, str):
                    await ws.send_str(item)
                    if item == CLOSE_STREAM:
                        return None
                    continue
                parts = [item]
                size = len(item)
                while self._out and isinstance(self._out[0], bytes) and size + len(self._out[0]) <= MAX_FRAME_BYTES:
                    nxt = self._out.popleft()
                    assert isinstance(nxt, bytes)
                    parts.append(nxt)
                    size += len(nxt)
                frame = b"".join(parts)
                if len(frame) > MAX_FRAME_BYTES:
                    self._out.appendleft(frame[MAX_FRAME_BYTES:])
                    frame = frame[:MAX_FRAME_BYTES]
                self._out_audio -= len(frame)
                self._provider_bytes += len(frame)
                await ws.send_bytes(frame)
                alive_at = loop.time()
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
            return RecognitionError("dropped", f"Deepgram connection broke while sending: {type(exc).__name__}: {exc}")

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> RecognitionError | None:
        """Read Deepgram's messages into :meth:`events` until the socket ends;
        the error that ended it (None: the close we asked for)."""
        while True:
            msg = await ws.receive()
            if msg.type is aiohttp.WSMsgType.TEXT:
                try:
                    for event in self._parse(msg.data):
                        self._events.put_nowait(event)
                except RecognitionError as exc:
                    return exc
            elif msg.type is aiohttp.WSMsgType.BINARY:
                return _bad(f"sent a binary frame ({len(msg.data)} bytes); /v1/listen sends only JSON text")
            elif msg.type is aiohttp.WSMsgType.CLOSE:
                if self._closing:
                    return None
                reason = msg.extra or ""
                return RecognitionError("closed", f"Deepgram closed the stream: {msg.data} {reason}".rstrip())
            elif msg.type is aiohttp.WSMsgType.ERROR:
                failure = msg.data
                if isinstance(failure, aiohttp.WebSocketError):
                    return _bad(f"sent a bad WebSocket message (at most {MAX_MESSAGE_BYTES} bytes are read): {failure}")
                return RecognitionError("dropped", f"Deepgram connection failed: {type(failure).__name__}: {failure}")
            else:  # CLOSED, CLOSING: the connection ended without a close frame
                if self._closing:
                    return None
                return RecognitionError("dropped", "the Deepgram connection dropped without a close frame")

    # -- Deepgram's messages --------------------------------------------------------

    def _parse(self, text: str) -> list[RecognitionEvent]:
        """The events of one message (module doc, "Server messages").

        Raises:
            RecognitionError: ``protocol`` (not the protocol) or ``provider``
                (Deepgram's error message).
        """
        try:
            msg = json.loads(text)
        except (ValueError, RecursionError):
            raise _bad(f"sent text that is not JSON: {text[:120]!r}") from None
        if not isinstance(msg, dict):
            raise _bad(f"sent JSON that is not an object: {text[:120]!r}")
        kind = msg.get("type")
        if not isinstance(kind, str):
            raise _bad(f"sent a message without a type: {text[:120]!r}")
        if kind == "Results":
            return self._results(msg)
        if kind == "SpeechStarted":
            return [SpeechStarted(self._stream_s(_seconds(msg, "timestamp")))]
        if kind == "UtteranceEnd":
            return [EndOfUtterance(self._stream_s(_seconds(msg, "last_word_end")))]
        if kind == "Metadata":
            duration = _optional_seconds(msg, "duration")
            if duration is None:
                log.debug("Deepgram Metadata without a duration: %.200s", text)
                return []
            return [RecognitionUsage(audio_s=duration, source="provider")]
        if kind.lower() == "error":
            detail = next((str(msg[k]) for k in ("description", "message", "err_msg", "error", "variant") if msg.get(k)), text[:200])
            raise RecognitionError("provider", f"Deepgram reported an error: {detail}")
        if kind.lower() == "warning":
            log.info("Deepgram warning on stream %s: %.300s", self._session_id or "-", text)
            return []
        log.debug("Deepgram message of unknown type %r skipped", kind)
        return []

    def _results(self, msg: dict[str, Any]) -> list[RecognitionEvent]:
        start = _seconds(msg, "start")
        duration = _seconds(msg, "duration")
        channel = msg.get("channel")
        if isinstance(channel, list):  # an object is documented; tolerate it wrapped in a list
            channel = channel[0] if channel else {}
        if not isinstance(channel, dict):
            raise _bad(f"Results.channel is not an object: {channel!r:.80}")
        alternatives = channel.get("alternatives", [])
        if not isinstance(alternatives, list):
            raise _bad(f"Results.channel.alternatives is not a list: {alternatives!r:.80}")
        best = alternatives[0] if alternatives else {}
        if not isinstance(best, dict):
            raise _bad(f"Results alternative is not an object: {best!r:.80}")
        transcript = best.get("transcript", "")
        if not isinstance(transcript, str):
            raise _bad(f"Results transcript is not a string: {transcript!r:.80}")
        transcript = transcript.strip()
        is_final = _flag(msg, "is_final")
        t0, t1 = self._stream_s(start), self._stream_s(start + duration)
        if not is_final:
            return [Interim(transcript, t0, t1)] if transcript else []
        words_in = best.get("words", [])
        if not isinstance(words_in, list):
            raise _bad(f"Results words is not a list: {words_in!r:.80}")
        words = []
        for w in words_in:
            if not isinstance(w, dict):
                raise _bad(f"Results word is not an object: {w!r:.80}")
            word = w.get("punctuated_word") or w.get("word")
            if not isinstance(word, str):
                raise _bad(f"Results word has no text: {w!r:.80}")
            words.append(Word(
                word, self._stream_s(_seconds(w, "start")), self._stream_s(_seconds(w, "end")), _confidence(w),
            ))
        self._final_end_s = max(self._final_end_s, t1)
        events: list[RecognitionEvent] = [Final(
            transcript, t0, t1, words=tuple(words), confidence=_confidence(best), finalized=_flag(msg, "from_finalize"),
        )]
        if _flag(msg, "speech_final"):
            events.append(EndOfUtterance(t1))
        return events


def _bad(what: str) -> RecognitionError:
    return RecognitionError("protocol", f"Deepgram {what}")


def _optional_seconds(obj: dict[str, Any], key: str) -> float | None:
    """``obj[key]`` as seconds, None if it is missing."""
    return None if obj.get(key) is None else _seconds(obj, key)


def _seconds(obj: dict[str, Any], key: str) -> float:
    """``obj[key]`` as seconds (a finite number >= 0).

    Raises:
        RecognitionError: ``protocol``, it is not.
    """
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _bad(f"sent {key}={value!r:.40} (seconds expected) in {obj.get('type', 'a word')}")
    return float(value)


def _flag(obj: dict[str, Any], key: str) -> bool:
    value = obj.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"sent {key}={value!r:.40} (true/false expected)")
    return value


def _confidence(obj: dict[str, Any]) -> float | None:
    value = obj.get("confidence")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return min(1.0, max(0.0, float(value)))
