"""ElevenLabs streaming synthesis over the multi-context stream-input
WebSocket (``tts.provider = "elevenlabs"``): one socket per session (a
second one only past its context limit), one *context* per reply, behind
:class:`voice.synthesis.Synthesiser`.

Wire protocol (shared/reference/speech-providers.md, section 2.2; its
sources: ElevenLabs' ``elevenlabs-python`` types, LiveKit Agents'
``livekit-plugins-elevenlabs/.../tts.py`` and Pipecat's
``services/elevenlabs/tts.py``; https://elevenlabs.io/docs/api-reference/text-to-speech/v-1-text-to-speech-voice-id-multi-stream-input):

- **Connect**: ``GET {tts.base_url}/v1/text-to-speech/{voice_id}/multi-stream-input``
  upgraded to a WebSocket, header ``xi-api-key`` (left out when the key is
  empty, for a local server); ``http(s)://`` base URLs become ``ws(s)://``.
  Query: ``model_id``, ``output_format=pcm_<tts.sample_rate>`` (only the
  PCM rates ElevenLabs has, :data:`OUTPUT_RATES`; any other is refused when
  the synthesiser is made), ``sync_alignment=true`` (each audio chunk
  carries the alignment of its own characters), ``inactivity_timeout``
  (:data:`INACTIVITY_TIMEOUT_S`, ElevenLabs' maximum; LK uses the same) and
  ``language_code`` (ISO 639-1, only for the ``*_v2_5`` models: the others
  refuse it).
- **A context per reply** (named by :meth:`ElevenLabsSynthesiser.open`'s
  ``context_id``), opened on the wire with the reply's first clause:
  ``{"text":" ","voice_settings":{...},"context_id":id}`` (the first text
  must be one space); each clause ``{"text":"<clause> ","context_id":id,
  "flush":true}`` (ending with a space; flushed so its audio comes at once).
  A reply whose audio has all arrived is closed with
  ``{"context_id":id,"close_context":true}`` to free its slot: never before,
  since ``close_context`` *interrupts* (it is the stop).
- **Keep-alive**: ``{"text":"","context_id":id}`` for each open context
  (a bare ``{"text":""}`` when none is) after :data:`KEEPALIVE_S` without
  sending anything (ElevenLabs closes an idle socket after
  ``inactivity_timeout``, 20 s by default; in multi-context an empty text
  is not the end of input).
- **Replies**: ``{"audio":<base64 PCM>,"isFinal":null|true,"alignment":
  {"chars","charStartTimesMs","charDurationsMs"},"normalizedAlignment":{...},
  "contextId"|"context_id":id}`` (both id spellings and both
  ``charStartTimesMs``/``charsStartTimesMs`` spellings are read);
  ``{"type":"flush_done"}`` (with or without a context id) acknowledges a
  flush; ``{"error":...,"message":...}`` (maybe with a context id) is an
  error. Messages of a context no stream is open for are skipped.

**Audio** is s16 LE mono at the rate asked. What is not raw PCM is sniffed:
a chunk starting with a WAV header (``RIFF....WAVE``, as some compatible
servers answer) has it parsed and stripped, and is resampled to the rate
asked if its rate differs; an MP3 (``ID3``), Ogg or FLAC stream is a
``protocol`` error. An odd trailing byte is kept until the next chunk; one
still left when a reply's audio is complete is a ``protocol`` error. A rate
that differs without any header cannot be seen on this protocol.

**Word timings** come from ``alignment`` (the original text;
``normalizedAlignment``, whose text is rewritten, e.g. "2" -> "two", is used
for words only when ``alignment`` is missing, and never for counting),
through :func:`voice.synthesis.words_from_characters`; a word cut between
two chunks is held until its end arrives. The **timebase** is marked VERIFY
in the reference: the SDK docs say the times are relative to the chunk
(Pipecat adds a running offset), LiveKit uses them as they are (cumulative).
Both are read: per chunk, the reading under which the chunk's first
character starts nearer to where the chunk's audio starts in the context is
taken (relative: plus the context's audio before the chunk; cumulative: as
is); it is settled for the context once a chunk goes back in time (only
relative times do) or the two readings differ by
:data:`TIMEBASE_MARGIN_MS`.

**Segments** (one per :meth:`push_text`): a clause's audio is complete
when the ``alignment`` characters received reach the clause's end, counted
in non-space characters (alignment may drop or merge whitespace), *and* the
audio received reaches that last character's end (its chunk may come before
the rest of its sound, :data:`END_TOLERANCE_MS`); also when a ``flush_done``
acknowledges its flush; on ``isFinal`` every clause sent is complete. A
clause's end also ends a word (alignment without the space between two
clauses does not merge their words). Without any of these (no alignment, no ``flush_done``), once the
input has ended and no audio came for ``settle_s`` after some arrived for
the last clause, the context is closed to have ``isFinal``.

**Stop** (:meth:`ElevenLabsStream.cancel`): ``close_context`` goes to the
front of the socket's writer at once (its text still queued is dropped; if
nothing of the context had reached the wire, nothing is sent and the stop is
confirmed). ElevenLabs does not confirm a stop: trailing audio and an
``isFinal`` of the context may follow, which the stream drops and counts
(``late_audio_ms``); ``after_stop`` is ``"unconfirmed"``.

**Contexts per socket**: ElevenLabs allows :data:`MAX_CONTEXTS` at once and
closes the socket with 1008 past it (livekit/agents-js issue #1985). A
context holds its slot from its first clause until its ``isFinal`` after
its ``close_context`` (or :data:`CONTEXT_RELEASE_S` after it, if none
comes); a reply needing a sixth opens another socket, which is closed
(``{"close_socket":true}``) once its contexts are all freed.

**Errors** (:class:`voice.synthesis.SynthesisError`, nothing retried here:
:mod:`voice.tts_failover` reconnects once, then falls back):
``unreachable`` (refused, DNS, TLS, connect timeout, an HTTP status other
than 4xx on the upgrade), ``unauthorized`` (401/403 on the upgrade, or an
error or close whose text names the key or authorisation), ``dropped`` (the
socket broke without a close frame), ``closed`` (a close frame we did not
ask for: 1008 for too many contexts, an inactivity close, the synthesiser
closed), ``protocol`` (not JSON, a binary frame, bad fields or base64, audio
that is not s16 PCM), ``provider`` (an error message: a context's fails its
stream, a socket's fails every stream on it, as ``closed`` if the close
follows within :data:`SOCKET_ERROR_GRACE_S`; another 4xx on the upgrade; a
clause whose audio has not begun, or audio that stopped before a clause's
end, within ``tts.first_audio_timeout_s``).

Billing: per character of text sent (no usage field on the socket);
:meth:`voice.synthesis.BaseSynthesisStream.usage` counts them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import math
import re
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import aiohttp
from yarl import URL

from media.frames import PcmResampler
from voice.providers import websocket_base
from voice.recognition import language_code
from voice.synthesis import BaseSynthesisStream, SynthesisError, SynthesisErrorKind, TimedWord, words_from_characters
from voice.synthesisers import TtsConfig

log = logging.getLogger(__name__)

PROVIDER = "elevenlabs"
#: the ``pcm_<rate>`` output formats ElevenLabs has (reference 2.2; LK ``elevenlabs/models.py``)
OUTPUT_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
#: contexts ElevenLabs allows on one socket at once (reference 2.2)
MAX_CONTEXTS = 5
#: the ``inactivity_timeout`` asked for, s (ElevenLabs' maximum; its default is 20)
INACTIVITY_TIMEOUT_S = 180
#: send keep-alives after this long without sending anything, s (below the default 20 s timeout)
KEEPALIVE_S = 10.0
#: input ended, no segment mark, no audio for this long after some came: ask for ``isFinal``, s
SETTLE_S = 1.0
#: a closed context's slot is freed this long after its ``close_context`` if no ``isFinal`` came, s
CONTEXT_RELEASE_S = 2.0
#: after an error naming no context, how long a close frame is awaited (then ``closed``, else ``provider``), s
SOCKET_ERROR_GRACE_S = 0.5
#: the alignment readings must differ this much before a context's timebase is settled, ms
TIMEBASE_MARGIN_MS = 200.0
#: a clause's audio is complete once the audio received reaches its last character's end, within this, ms
END_TOLERANCE_MS = 5.0
#: the largest message read, bytes (a second of 48 kHz audio is 128 kB in base64)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: how long closing a socket waits for the server's close frame, s
WS_CLOSE_TIMEOUT_S = 1.0
#: how often a socket's timers (first audio, settle, context release) are checked, s
WATCH_INTERVAL_S = 0.05
#: stopped or finished streams remembered per socket, to drop their late audio
RETIRED_STREAMS = 32
#: what the init message carries (ElevenLabs' defaults for a conversational voice)
DEFAULT_VOICE_SETTINGS: dict[str, Any] = {"stability": 0.5, "similarity_boost": 0.75}

_AUTH = re.compile(r"api[ _-]?key|auth|unauthori[sz]ed|forbidden|credential|permission|\b40[13]\b", re.IGNORECASE)
_ALIGNMENT_KEYS = ("audio", "isFinal", "alignment", "normalizedAlignment", "normalized_alignment")


def stream_url(config: TtsConfig, inactivity_timeout_s: int = INACTIVITY_TIMEOUT_S) -> URL:
    """The ``multi-stream-input`` WebSocket URL with its query (module doc, "Connect").

    ``tts.base_url`` is the host (``wss://api.elevenlabs.io``); ``http(s)://``
    becomes ``ws(s)://``; a base ending in ``/v1`` is completed, not doubled.

    Raises:
        ValueError: ``tts.sample_rate`` is not one of :data:`OUTPUT_RATES`.
    """
    check_rate(config.sample_rate)
    base = websocket_base(config.url)
    url = URL(base)
    path = url.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    url = url.with_path(path) / "v1" / "text-to-speech" / config.voice_name / "multi-stream-input"
    query: list[tuple[str, str]] = [
        ("model_id", config.model_name),
        ("output_format", f"pcm_{config.sample_rate}"),
        ("sync_alignment", "true"),
        ("inactivity_timeout", str(inactivity_timeout_s)),
    ]
    # only the v2.5 models take a language code; the others answer an error for it (ElevenLabs API docs)
    lang = language_code(config.language)
    if lang and "_v2_5" in config.model_name:
        query.append(("language_code", lang))
    return url.with_query(query)


def check_rate(rate: int) -> None:
    """Raises ValueError naming ``tts.sample_rate`` unless ElevenLabs has ``pcm_<rate>``."""
    if rate not in OUTPUT_RATES:
        raise ValueError(
            f"tts.sample_rate {rate} is not an ElevenLabs PCM rate; use one of {', '.join(map(str, OUTPUT_RATES))}"
        )


def _bad(what: str) -> SynthesisError:
    return SynthesisError("protocol", f"ElevenLabs {what}", PROVIDER)


class ElevenLabsSynthesiser:
    """:class:`voice.synthesis.Synthesiser` for ElevenLabs' multi-context
    WebSocket (module doc).

    Args:
        config: the ``tts.*`` settings (``url``, ``api_key``, ``model_name``,
            ``voice_name``, ``language``, ``sample_rate``,
            ``connect_timeout_s``, ``first_audio_timeout_s``, ``pricing``).
        clock: monotonic seconds, for the streams' stop records.
        max_contexts: contexts one socket holds at once (ElevenLabs: 5).
        inactivity_timeout_s: the ``inactivity_timeout`` asked for, s.
        keepalive_s: keep-alives after this long without sending, s.
        settle_s: see :data:`SETTLE_S`.
        context_release_s: see :data:`CONTEXT_RELEASE_S`.
        voice_settings: the init message's ``voice_settings``.

    Raises:
        ValueError: ``config.sample_rate`` is not one of :data:`OUTPUT_RATES`.

    Attributes:
        name: ``"elevenlabs"``.
    """

    name = PROVIDER

    def __init__(
        self, config: TtsConfig, clock: Callable[[], float] = time.monotonic, *,
        max_contexts: int = MAX_CONTEXTS, inactivity_timeout_s: int = INACTIVITY_TIMEOUT_S,
        keepalive_s: float = KEEPALIVE_S, settle_s: float = SETTLE_S, context_release_s: float = CONTEXT_RELEASE_S,
        voice_settings: dict[str, Any] | None = None,
    ) -> None:
        check_rate(config.sample_rate)
        if max_contexts < 1:
            raise ValueError("max_contexts must be at least 1")
        self.config = config
        self.clock = clock
        self.max_contexts = max_contexts
        self.inactivity_timeout_s = inactivity_timeout_s
        self.keepalive_s = keepalive_s
        self.settle_s = settle_s
        self.context_release_s = context_release_s
        self.voice_settings = dict(DEFAULT_VOICE_SETTINGS if voice_settings is None else voice_settings)
        self.url = stream_url(config, inactivity_timeout_s)
        #: sockets new contexts may go to, oldest first
        self._pool: list[_Connection] = []
        #: every socket made and not yet over
        self._all: list[_Connection] = []
        self._ids: set[str] = set()
        #: a warmed socket's connect failure, for the next stream to meet
        self._warm_error: SynthesisError | None = None
        self._http: aiohttp.ClientSession | None = None
        self._closed = False

    @property
    def connections(self) -> int:
        """Sockets open or being opened."""
        return sum(1 for c in self._all if not c.dead)

    @property
    def open_contexts(self) -> int:
        """Context slots held on all sockets (module doc, "Contexts per socket")."""
        return sum(len(c.open_contexts) for c in self._all if not c.dead)

    def headers(self) -> dict[str, str]:
        """The upgrade's headers: ``xi-api-key`` (none without a key)."""
        key = self.config.api_key.get_secret_value()
        return {"xi-api-key": key} if key else {}

    def open(self, context_id: str) -> ElevenLabsStream:
        """A stream for one reply, on the wire as context ``context_id``
        (its socket is chosen, and connected if need be, at its first clause).

        Raises:
            ValueError: ``context_id`` is empty or was used in this session.
            RuntimeError: the synthesiser is closed.
        """
        if self._closed:
            raise RuntimeError("the ElevenLabs synthesiser is closed")
        if not context_id or context_id in self._ids:
            raise ValueError(f"context id {context_id!r} is empty or already used in this session")
        self._ids.add(context_id)
        return ElevenLabsStream(self, context_id)

    async def warm(self) -> None:
        """Open the socket the next reply will use (idempotent; never
        raises: a failure to connect is met by the next stream, which
        fails with it, once; the stream after connects anew)."""
        if self._closed:
            return
        conn = next((c for c in self._pool if c.usable), None)
        if conn is None:
            self._warm_error = None  # this attempt's outcome is the one the next stream meets
            conn = self._new_connection()
        await conn.ready.wait()

    async def aclose(self) -> None:
        """Close every socket (their unfinished streams fail with
        ``closed``) and the HTTP client; idempotent."""
        self._closed = True
        self._pool.clear()
        for conn in list(self._all):
            await conn.aclose()
        self._all.clear()
        http, self._http = self._http, None
        if http is not None:
            await http.close()

    # -- sockets ----------------------------------------------------------------------

    def _assign(self, stream: ElevenLabsStream) -> _Connection:
        """The socket for a stream's context: the first with a free slot, or a new one.

        Raises:
            SynthesisError: the synthesiser is closed (``closed``), or the
                socket :meth:`warm` opened could not connect (its error).
        """
        if self._closed:
            raise SynthesisError("closed", "the ElevenLabs synthesiser is closed", PROVIDER)
        if self._warm_error is not None:
            error, self._warm_error = self._warm_error, None
            raise SynthesisError(error.kind, str(error), PROVIDER)
        conn = next((c for c in self._pool if c.usable and len(c.open_contexts) < self.max_contexts), None)
        if conn is None:
            conn = self._new_connection()
            if len(self._pool) > 1:
                log.info("ElevenLabs: %d contexts open on every socket; opening socket %d", self.max_contexts, len(self._pool))
        conn.adopt(stream)
        return conn

    def _new_connection(self) -> _Connection:
        self._all = [c for c in self._all if not c.task.done()]
        conn = _Connection(self)
        self._pool.append(conn)
        self._all.append(conn)
        return conn

    def _forget(self, conn: _Connection) -> None:
        if conn in self._pool:
            self._pool.remove(conn)

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            )
        return self._http

    async def _connect(self) -> aiohttp.ClientWebSocketResponse:
        """Open one socket.

        Raises:
            SynthesisError: ``unauthorized`` (401/403), ``provider`` (another
                4xx), ``unreachable`` (anything else that keeps it from opening).
        """
        where = self.config.url
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                return await self._client().ws_connect(
                    self.url,
                    headers=self.headers(),
                    autoping=True,
                    max_msg_size=MAX_MESSAGE_BYTES,
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=WS_CLOSE_TIMEOUT_S),
                )
        except aiohttp.WSServerHandshakeError as exc:
            try:
                status = f"{exc.status} {HTTPStatus(exc.status).phrase}"
            except ValueError:
                status = str(exc.status)
            if exc.status in (401, 403):
                raise SynthesisError("unauthorized", f"tts.api_key was refused by ElevenLabs (HTTP {status})", PROVIDER) from None
            if 400 <= exc.status < 500:
                raise SynthesisError(
                    "provider", f"ElevenLabs refused the socket with HTTP {status}: check tts.voice, tts.model and tts.language",
                    PROVIDER,
                ) from None
            raise SynthesisError("unreachable", f"ElevenLabs at {where} answered the upgrade with HTTP {status}", PROVIDER) from None
        except TimeoutError:
            raise SynthesisError(
                "unreachable", f"ElevenLabs at {where} did not accept a socket within {self.config.connect_timeout_s:g} s", PROVIDER,
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise SynthesisError("unreachable", f"cannot connect to ElevenLabs at {where}: {type(exc).__name__}: {exc}", PROVIDER) from None


@dataclass
class _Out:
    """A message waiting for the writer."""

    text: str
    stream: ElevenLabsStream | None = None
    #: called when the writer takes it (before it is written)
    taken: Callable[[], None] | None = None
    #: called once it is written
    sent: Callable[[], None] | None = None
    last: bool = False


class _Connection:
    """One socket: its writer queue, reader, timers and context slots."""

    def __init__(self, owner: ElevenLabsSynthesiser) -> None:
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self.out: deque[_Out] = deque()
        self.wake = asyncio.Event()
        #: set once the socket is open or has failed
        self.ready = asyncio.Event()
        #: streams with a context on this socket, by context id
        self.streams: dict[str, ElevenLabsStream] = {}
        #: stopped or finished streams whose slot was freed (late audio still goes to them)
        self.retired: OrderedDict[str, ElevenLabsStream] = OrderedDict()
        #: context ids holding a slot
        self.open_contexts: set[str] = set()
        #: context id -> when its ``close_context`` was written (loop time)
        self.closing: dict[str, float] = {}
        #: flushes written and not acknowledged, in order: (stream, segment index)
        self.flushes: deque[tuple[ElevenLabsStream, int]] = deque()
        self.dead = False
        self.connected = False
        #: ``close_socket`` was queued: the close that follows is ours
        self.retiring = False
        self._socket_error: tuple[str, float] | None = None
        self.task = self.loop.create_task(self._run(), name="elevenlabs-socket")

    @property
    def usable(self) -> bool:
        return not self.dead and not self.retiring

    def adopt(self, stream: ElevenLabsStream) -> None:
        self.streams[stream.context_id] = stream
        self.open_contexts.add(stream.context_id)

    def send(self, item: _Out, *, front: bool = False) -> None:
        if self.dead:
            return
        if front:
            self.out.appendleft(item)
        else:
            self.out.append(item)
        self.wake.set()

    def drop_queued(self, stream: ElevenLabsStream) -> None:
        """Drop the messages of ``stream`` not yet taken by the writer."""
        if any(o.stream is stream for o in self.out):
            self.out = deque(o for o in self.out if o.stream is not stream)

    def free(self, context_id: str) -> None:
        """The context's slot is free again."""
        self.open_contexts.discard(context_id)
        self.closing.pop(context_id, None)
        stream = self.streams.pop(context_id, None)
        if stream is not None:
            if any(s is stream for s, _ in self.flushes):
                self.flushes = deque(f for f in self.flushes if f[0] is not stream)
            self.retired[context_id] = stream
            while len(self.retired) > RETIRED_STREAMS:
                self.retired.popitem(last=False)
        if not self.open_contexts and not self.dead and not self.retiring and self.owner._pool[:1] != [self]:
            # an extra socket with nothing left on it: close it
            self.retiring = True
            self.owner._forget(self)
            self.send(_Out(json.dumps({"close_socket": True}), last=True))

    def stream_for(self, context_id: str | None) -> ElevenLabsStream | None:
        if context_id is None:
            live = [s for s in self.streams.values() if s.stop is None and not s.finished]
            return live[0] if len(live) == 1 else None
        return self.streams.get(context_id) or self.retired.get(context_id)

    async def aclose(self) -> None:
        self.task.cancel()
        await asyncio.wait({self.task})

    # -- the socket's life ------------------------------------------------------------

    async def _run(self) -> None:
        ws: aiohttp.ClientWebSocketResponse | None = None
        error: SynthesisError | None = None
        cancelled = False
        try:
            ws = await self.owner._connect()
            self.connected = True
            self.owner._warm_error = None  # a socket is up: an older failure is past
            self.ready.set()
            error = await self._converse(ws)
        except SynthesisError as exc:
            error = exc
        except asyncio.CancelledError:
            cancelled = True
            error = SynthesisError("closed", "the ElevenLabs synthesiser was closed", PROVIDER)
            raise
        except Exception as exc:  # an answer nothing here foresaw: its streams fail, clearly
            log.warning("ElevenLabs socket: unexpected %s: %s", type(exc).__name__, exc)
            error = _bad(f"socket failed: {type(exc).__name__}: {exc}")
        finally:
            self._die(error)
            self.ready.set()
            if ws is not None and not ws.closed:
                with contextlib.suppress(TimeoutError, aiohttp.ClientError, ConnectionError, RuntimeError):
                    async with asyncio.timeout(0.05 if cancelled else WS_CLOSE_TIMEOUT_S):
                        await ws.close()

    def _die(self, error: SynthesisError | None) -> None:
        if self.dead:
            return
        self.dead = True
        self.owner._forget(self)
        self.out.clear()
        if not self.connected and not self.streams and error is not None and error.kind != "closed":
            self.owner._warm_error = error  # warmed, and it could not connect: the next stream meets it
        if error is not None and any(s.stop is None and not s.finished for s in self.streams.values()):
            log.info("ElevenLabs socket ended: %s (%s)", error, error.kind)
        for stream in list(self.streams.values()):
            stream._connection_lost(error)

    async def _converse(self, ws: aiohttp.ClientWebSocketResponse) -> SynthesisError | None:
        reader = self.loop.create_task(self._read(ws), name="elevenlabs-reader")
        writer = self.loop.create_task(self._write(ws), name="elevenlabs-writer")
        watch = self.loop.create_task(self._watch(), name="elevenlabs-watch")
        tasks = {reader, writer, watch}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if reader in done:
                return reader.result()
            if writer in done and writer.result() is not None:
                return writer.result()
            if watch in done:
                return watch.result()
            # close_socket written: the server closes it; wait a little for that
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WS_CLOSE_TIMEOUT_S):
                    await asyncio.wait({reader})
            return None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)

    async def _write(self, ws: aiohttp.ClientWebSocketResponse) -> SynthesisError | None:
        """Send what is queued as it comes; keep-alives when idle. None once
        ``close_socket`` is sent; the error if sending fails."""
        keepalive_s = self.owner.keepalive_s
        sent_at = self.loop.time()
        try:
            while True:
                if not self.out:
                    self.wake.clear()
                    wait_s = keepalive_s - (self.loop.time() - sent_at)
                    if wait_s <= 0:
                        for text in self._keepalives():
                            await ws.send_str(text)
                        sent_at = self.loop.time()
                        continue
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait_s):
                            await self.wake.wait()
                    continue
                item = self.out.popleft()
                if item.taken is not None:
                    item.taken()
                await ws.send_str(item.text)
                sent_at = self.loop.time()
                if item.sent is not None:
                    item.sent()
                if item.last:
                    return None
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
            return SynthesisError("dropped", f"the ElevenLabs socket broke while sending: {type(exc).__name__}: {exc}", PROVIDER)

    def _keepalives(self) -> list[str]:
        ids = [cid for cid, s in self.streams.items() if s.on_wire and not s.released and cid in self.open_contexts]
        if not ids:
            return [json.dumps({"text": ""})]
        return [json.dumps({"text": "", "context_id": cid}) for cid in ids]

    async def _watch(self) -> SynthesisError | None:
        """The timers: each stream's first-audio and settle checks, and the
        slots of closed contexts whose ``isFinal`` did not come."""
        release_s = self.owner.context_release_s
        while True:
            busy = self.closing or any(s.stop is None and not s.finished for s in self.streams.values())
            await asyncio.sleep(WATCH_INTERVAL_S if busy else 10 * WATCH_INTERVAL_S)
            now = self.loop.time()
            for stream in list(self.streams.values()):
                stream._check(now)
            for cid, at in list(self.closing.items()):
                if now - at >= release_s:
                    log.debug("ElevenLabs context %s: no isFinal %g s after close_context; slot freed", cid, release_s)
                    waiting = self.streams.get(cid)
                    if waiting is not None:  # closed to have its isFinal, which did not come
                        waiting._fail(SynthesisError(
                            "provider", f"ElevenLabs sent no isFinal on context {cid} within {release_s:g} s of close_context", PROVIDER,
                        ))
                    self.free(cid)

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> SynthesisError | None:
        """Read messages into the streams until the socket ends; the error
        that ended it (None: a close we asked for)."""
        while True:
            timeout: float | None = None
            if self._socket_error is not None:
                timeout = max(0.0, self._socket_error[1] + SOCKET_ERROR_GRACE_S - self.loop.time())
            try:
                msg = await ws.receive(timeout=timeout)
            except TimeoutError:
                assert self._socket_error is not None
                return SynthesisError("provider", f"ElevenLabs reported an error: {self._socket_error[0]}", PROVIDER)
            if msg.type is aiohttp.WSMsgType.TEXT:
                try:
                    self._dispatch(msg.data)
                except SynthesisError as exc:
                    return exc
            elif msg.type is aiohttp.WSMsgType.BINARY:
                return _bad(f"sent a binary frame ({len(msg.data)} bytes); the socket sends JSON text only")
            elif msg.type is aiohttp.WSMsgType.CLOSE:
                if self.retiring:
                    return None
                return self._close_error(msg.data, msg.extra or "")
            elif msg.type is aiohttp.WSMsgType.ERROR:
                failure = msg.data
                if isinstance(failure, aiohttp.WebSocketError):
                    return _bad(f"sent a bad WebSocket message: {failure}")
                return SynthesisError("dropped", f"the ElevenLabs socket failed: {type(failure).__name__}: {failure}", PROVIDER)
            else:  # CLOSED, CLOSING: it ended without a close frame
                if self.retiring:
                    return None
                return SynthesisError("dropped", "the ElevenLabs socket dropped without a close frame", PROVIDER)

    def _close_error(self, code: Any, reason: str) -> SynthesisError:
        said = f"{code} {reason}".strip()
        if self._socket_error is not None:
            said += f" after its error: {self._socket_error[0]}"
        kind: SynthesisErrorKind = "unauthorized" if _AUTH.search(said) else "closed"
        return SynthesisError(kind, f"ElevenLabs closed the socket: {said}", PROVIDER)

    # -- ElevenLabs' messages ---------------------------------------------------------

    def _dispatch(self, text: str) -> None:
        """One message (module doc, "Replies").

        Raises:
            SynthesisError: it ends the socket (``protocol``, ``unauthorized``).
        """
        try:
            msg = json.loads(text)
        except (ValueError, RecursionError):
            raise _bad(f"sent text that is not JSON: {text[:120]!r}") from None
        if not isinstance(msg, dict):
            raise _bad(f"sent JSON that is not an object: {text[:120]!r}")
        cid = msg.get("contextId")
        if cid is None:
            cid = msg.get("context_id")
        if cid is not None and not isinstance(cid, str):
            raise _bad(f"sent a context id that is not a string: {cid!r:.60}")
        if msg.get("error") or (isinstance(msg.get("message"), str) and not any(k in msg for k in _ALIGNMENT_KEYS)):
            self._error(msg, cid)
            return
        kind = msg.get("type")
        if kind == "flush_done":
            self._flush_done(cid)
            return
        if kind is not None and not any(k in msg for k in _ALIGNMENT_KEYS):
            log.debug("ElevenLabs message of unknown type %r skipped", kind)
            return
        stream = self.stream_for(cid)
        if stream is None:
            log.debug("ElevenLabs message for context %r, which no stream has, skipped", cid)
            return
        stream._message(msg)

    def _error(self, msg: dict[str, Any], cid: str | None) -> None:
        detail = " / ".join(str(msg[k]) for k in ("error", "message") if msg.get(k)) or json.dumps(msg)[:200]
        kind: SynthesisErrorKind = "unauthorized" if _AUTH.search(detail) else "provider"
        stream = self.streams.get(cid) if cid is not None else None
        if stream is not None:
            stream._fail(SynthesisError(kind, f"ElevenLabs reported an error on context {cid}: {detail}", PROVIDER))
            return
        if cid is not None:
            log.debug("ElevenLabs error for context %r, which no live stream has: %s", cid, detail)
            return
        if kind == "unauthorized":
            raise SynthesisError(kind, f"ElevenLabs reported an error: {detail}", PROVIDER)
        # about the socket: a close usually follows (1008 past the context limit)
        if self._socket_error is None:
            self._socket_error = (detail, self.loop.time())

    def _flush_done(self, cid: str | None) -> None:
        for i, (stream, index) in enumerate(self.flushes):
            if cid is None or stream.context_id == cid:
                del self.flushes[i]
                stream._segments_done_through(index)
                return
        log.debug("ElevenLabs flush_done for context %r with no flush outstanding", cid)

    def context_final(self, context_id: str) -> None:
        """An ``isFinal`` arrived: the slot is free if the context was closed."""
        if context_id in self.closing:
            self.free(context_id)


@dataclass
class _Segment:
    """One :meth:`ElevenLabsStream.push_text` call on the wire."""

    text: str
    #: non-space characters of the context through this segment's end
    bound: int
    #: when the writer took it (loop time)
    written_at: float | None = None
    #: where its last character ends, stream ms (once aligned)
    end_ms: float | None = None


@dataclass
class _Alignment:
    chars: list[str]
    starts_ms: list[float]
    durations_ms: list[float]


class ElevenLabsStream(BaseSynthesisStream):
    """One reply: one ElevenLabs context (:class:`voice.synthesis.SynthesisStream`;
    module doc). Made by :meth:`ElevenLabsSynthesiser.open`; it has no task of
    its own (its socket's reader feeds it).

    Attributes:
        context_id: its context's id on the wire.
    """

    def __init__(self, owner: ElevenLabsSynthesiser, context_id: str) -> None:
        super().__init__(PROVIDER, owner.config.sample_rate, owner.config.pricing, owner.clock)
        self.owner = owner
        self.context_id = context_id
        self.loop = asyncio.get_running_loop()
        self._conn: _Connection | None = None
        #: the init message was taken by the writer (the context exists at ElevenLabs)
        self.on_wire = False
        #: close_context queued (or nothing to close)
        self.released = False
        self._close_written = False
        self._segments: list[_Segment] = []
        self._done = 0  # segments done
        self._counted = 0  # segments whose characters have all been aligned
        self._nonspace = 0  # non-space characters pushed
        self._aligned = 0  # non-space alignment characters received
        self._tail: list[tuple[str, float, float]] = []  # a word not ended yet: (char, start ms, duration ms), stream ms
        self._timebase: str | None = None  # "chunk" or "cumulative" once settled
        self._last_raw_start: float | None = None
        self._in_s = 0.0  # seconds of audio received (provider's rate)
        self._in_rate = self.sample_rate
        self._resampler: PcmResampler | None = None
        self._carry = b""
        self._first_chunk = True
        self._last_audio_at: float | None = None

    # -- the reply's side -------------------------------------------------------------

    def cancel(self) -> None:
        """See :meth:`voice.synthesis.SynthesisStream.cancel`; also frees the
        context when nothing was in flight."""
        super().cancel()
        if self.stop is not None:
            self._release(front=True)

    def _send_text(self, text: str) -> None:
        conn = self._conn
        if conn is None:
            try:
                conn = self._conn = self.owner._assign(self)
            except SynthesisError as exc:
                self.released = True
                self.emit_error(exc)
                return
            init = {"text": " ", "voice_settings": self.owner.voice_settings, "context_id": self.context_id}
            conn.send(_Out(json.dumps(init), self, taken=self._init_taken))
        if not text[-1:].isspace():
            text += " "  # ElevenLabs: end each chunk of text with a space
        self._nonspace += sum(1 for c in text if not c.isspace())
        seg = _Segment(text, self._nonspace)
        self._segments.append(seg)
        index = len(self._segments) - 1
        msg = {"text": text, "context_id": self.context_id, "flush": True}

        def taken() -> None:
            seg.written_at = self.loop.time()
            conn.flushes.append((self, index))

        conn.send(_Out(json.dumps(msg), self, taken=taken))

    def _send_end(self) -> None:
        if self.finished:
            self._release()

    def _send_cancel(self) -> None:
        self._release(front=True)

    async def _close(self) -> None:
        self._release(front=True)

    def _init_taken(self) -> None:
        self.on_wire = True

    def _release(self, *, front: bool = False) -> None:
        """Close the context (``close_context``) once: at the front of the
        writer for a stop, else after what is queued. Nothing on the wire:
        nothing to close (a stop is then confirmed)."""
        conn = self._conn
        if self.released:
            if self.stop is not None and self._close_written:
                self.told()  # closed already (to have isFinal): told when it was written
            return
        self.released = True
        if conn is None:
            return
        if conn.dead:
            return
        conn.drop_queued(self)
        if not self.on_wire:
            if self.stop is not None:
                self.confirm_stop()  # nothing reached ElevenLabs: nothing is generated
            conn.free(self.context_id)
            return
        msg = json.dumps({"context_id": self.context_id, "close_context": True})
        conn.send(_Out(msg, self, sent=self._close_sent), front=front)

    def _close_sent(self) -> None:
        self._close_written = True
        if self._conn is not None:
            self._conn.closing[self.context_id] = self.loop.time()
        self.told()

    def _fail(self, error: SynthesisError) -> None:
        self.emit_error(error)
        self._release(front=True)

    def _connection_lost(self, error: SynthesisError | None) -> None:
        self.released = True
        if self.stop is None and not self.finished:
            if error is None:
                error = SynthesisError("closed", "the ElevenLabs socket was closed", PROVIDER)
            self.emit_error(SynthesisError(error.kind, str(error), PROVIDER))

    # -- timers -----------------------------------------------------------------------

    def _check(self, now: float) -> None:
        """First audio and settle (module doc, "Segments" and "Errors")."""
        if self.stop is not None or self.finished or self._done >= len(self._segments):
            return
        oldest = self._segments[self._done]
        if oldest.written_at is None:
            return  # still queued: the connect timeout covers it
        progress = max(oldest.written_at, self._last_audio_at or 0.0)
        limit = self.owner.config.first_audio_timeout_s
        if now - progress > limit:
            self._fail(SynthesisError(
                "provider", f"ElevenLabs sent no audio on context {self.context_id} for {limit:g} s while its text was pending",
                PROVIDER,
            ))
            return
        last = self._segments[-1]
        if (
            self.ended and not self.released and last.written_at is not None and self._last_audio_at is not None
            and self._last_audio_at > last.written_at and now - self._last_audio_at >= self.owner.settle_s
        ):
            log.debug("ElevenLabs context %s: no mark for the last clauses %g s after its audio; closing it for isFinal",
                      self.context_id, self.owner.settle_s)
            self._release()

    # -- ElevenLabs' messages ---------------------------------------------------------

    def _message(self, msg: dict[str, Any]) -> None:
        """One reply message of this context.

        Raises:
            SynthesisError: ``protocol`` (bad fields, base64 or audio format).
        """
        start_s = self._in_s
        audio = msg.get("audio")
        if audio is not None and audio != "":
            if not isinstance(audio, str):
                raise _bad(f"sent audio that is not a base64 string: {type(audio).__name__}")
            try:
                raw = base64.b64decode(audio, validate=True)
            except (binascii.Error, ValueError):
                raise _bad(f"sent audio that is not base64: {audio[:40]!r}") from None
            pcm = self._ingest(raw)
            if raw:
                self._last_audio_at = self.loop.time()
            self.emit_audio(pcm)
        live = self.stop is None and not self.finished
        alignment = _alignment(msg, "alignment")
        if live and alignment is not None and alignment.chars:
            self.emit_words(self._words(alignment, start_s, count=True))
        elif live and alignment is None:
            normalised = _alignment(msg, "normalizedAlignment") or _alignment(msg, "normalized_alignment")
            if normalised is not None and normalised.chars:
                self.emit_words(self._words(normalised, start_s, count=False))
        if live:
            self._count()
        final = msg.get("isFinal")
        if final is not None and not isinstance(final, bool):
            raise _bad(f"sent isFinal={final!r:.40} (true/false/null expected)")
        if final:
            if self.stop is None and not self.finished:
                self._emit_tail()
                written = [i for i, s in enumerate(self._segments) if s.written_at is not None]
                if written:
                    self._segments_done_through(written[-1])
            if self._conn is not None:
                self._conn.context_final(self.context_id)

    def _ingest(self, raw: bytes) -> bytes:
        """Audio received -> PCM at :attr:`sample_rate` (module doc, "Audio")."""
        if raw[:4] == b"RIFF" and raw[8:12] == b"WAVE":
            rate, raw = _wav_pcm(raw)
            if self._carry:
                raise _bad("sent a WAV header after an odd number of audio bytes")
            if rate != self._in_rate:
                if self._resampler is not None:
                    self.emit_audio(self._resampler.flush())
                self._in_rate = rate
                self._resampler = PcmResampler(self.sample_rate) if rate != self.sample_rate else None
                if self._resampler is not None:
                    log.info("ElevenLabs context %s: audio at %d Hz (asked for %d); resampled", self.context_id, rate, self.sample_rate)
        elif self._first_chunk:
            container = _container(raw)
            if container is not None:
                raise _bad(f"sent {container} audio; pcm_{self.sample_rate} was asked for")
        self._first_chunk = False
        data = self._carry + raw
        cut = len(data) - len(data) % 2
        data, self._carry = data[:cut], data[cut:]
        self._in_s += len(data) / 2 / self._in_rate
        if self._resampler is not None and data:
            return self._resampler.pcm(data, self._in_rate)
        return data

    def _words(self, al: _Alignment, chunk_start_s: float, *, count: bool) -> list[TimedWord]:
        """The words ended by this chunk's characters, stream seconds
        (module doc, "Word timings"); with ``count``, its non-space
        characters are counted against the clauses' ends."""
        before_ms = chunk_start_s * 1000
        first = al.starts_ms[0]
        mode = self._timebase
        if mode is None:
            err_chunk, err_cumulative = abs(first), abs(first - before_ms)
            if self._last_raw_start is not None and first + 0.5 < self._last_raw_start:
                mode = self._timebase = "chunk"  # time went back: only relative times do
            elif abs(err_chunk - err_cumulative) >= TIMEBASE_MARGIN_MS:
                mode = self._timebase = "chunk" if err_chunk < err_cumulative else "cumulative"
            else:
                mode = "chunk" if err_chunk < err_cumulative else "cumulative"
            if self._timebase is not None:
                log.debug("ElevenLabs context %s: alignment times are %s", self.context_id,
                          "relative to each chunk" if mode == "chunk" else "cumulative")
        self._last_raw_start = al.starts_ms[-1]
        offset = before_ms if mode == "chunk" else 0.0
        chars = list(self._tail)
        for c, s, d in zip(al.chars, al.starts_ms, al.durations_ms, strict=True):
            chars.append((c, s + offset, d))
            if not count or not c.strip():
                continue
            self._aligned += 1
            while self._counted < len(self._segments) and self._aligned >= self._segments[self._counted].bound:
                self._segments[self._counted].end_ms = s + offset + d
                self._counted += 1
                chars.append((" ", s + offset + d, 0.0))  # a clause's end ends a word
        end = max((i for i, (c, _, _) in enumerate(chars) if c.isspace()), default=-1)
        ready, self._tail = chars[: end + 1], chars[end + 1:]
        return _timed(ready)

    def _emit_tail(self) -> None:
        if self._tail:
            tail, self._tail = self._tail, []
            self.emit_words(_timed(tail))

    def _count(self) -> None:
        """Segments whose characters have all been aligned, and whose audio
        has arrived up to their last character's end, are done."""
        heard_ms = self._in_s * 1000 + END_TOLERANCE_MS
        through = self._done - 1
        while through + 1 < self._counted:
            end_ms = self._segments[through + 1].end_ms
            if end_ms is None or heard_ms < end_ms:
                break
            through += 1
        if through >= self._done:
            self._segments_done_through(through)

    def _segments_done_through(self, index: int) -> None:
        """Every segment up to ``index`` has all its audio: SegmentDone for each, in order."""
        while self._done <= index and self._done < len(self._segments) and self.stop is None and not self.finished:
            if self.ended and self._done == len(self._segments) - 1:
                if self._resampler is not None:
                    self.emit_audio(self._resampler.flush())
                if self._carry:
                    self._fail(_bad(f"sent an odd number of audio bytes on context {self.context_id}: not s16 PCM"))
                    return
                self._emit_tail()
            self._done += 1
            self.emit_segment_done()
        if self.finished and self.stop is None:
            self._release()


def _timed(chars: list[tuple[str, float, float]]) -> list[TimedWord]:
    if not chars:
        return []
    c, s, d = zip(*chars, strict=True)
    return words_from_characters(list(c), list(s), list(d))


def _alignment(msg: dict[str, Any], key: str) -> _Alignment | None:
    """``msg[key]`` as an alignment (None: absent or null).

    Raises:
        SynthesisError: ``protocol``, it is not one.
    """
    raw = msg.get(key)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _bad(f"sent {key} that is not an object: {raw!r:.80}")
    chars = raw.get("chars")
    starts = raw.get("charStartTimesMs", raw.get("charsStartTimesMs"))
    durations = raw.get("charDurationsMs", raw.get("charsDurationsMs"))
    if not isinstance(chars, list) or not isinstance(starts, list) or not isinstance(durations, list):
        raise _bad(f"sent {key} without chars, charStartTimesMs and charDurationsMs lists: {raw!r:.120}")
    if not (len(chars) == len(starts) == len(durations)):
        raise _bad(f"sent {key} whose lists differ in length ({len(chars)}, {len(starts)}, {len(durations)})")
    if not all(isinstance(c, str) for c in chars):
        raise _bad(f"sent {key} chars that are not strings")
    for values in (starts, durations):
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise _bad(f"sent {key} times that are not milliseconds >= 0: {v!r:.40}")
    return _Alignment(chars, [float(v) for v in starts], [float(v) for v in durations])


def _container(head: bytes) -> str | None:
    """The encoded format ``head`` starts with, if one is recognised (MP3 with an ID3 tag, Ogg, FLAC)."""
    if head[:3] == b"ID3" and len(head) >= 5 and head[3] in (2, 3, 4) and head[4] == 0:
        return "MP3"
    if head[:4] == b"OggS":
        return "Ogg"
    if head[:4] == b"fLaC":
        return "FLAC"
    return None


def _wav_pcm(data: bytes) -> tuple[int, bytes]:
    """A WAV header's rate and the PCM after it.

    Raises:
        SynthesisError: ``protocol``: not mono s16 PCM, or a header cut short.
    """
    pos = 12
    rate: int | None = None
    while pos + 8 <= len(data):
        chunk_id, size = struct.unpack("<4sI", data[pos:pos + 8])
        body = pos + 8
        if chunk_id == b"data":
            if rate is None:
                raise _bad("sent a WAV data chunk before its fmt chunk")
            return rate, data[body:]
        if chunk_id == b"fmt ":
            if size < 16 or body + 16 > len(data):
                raise _bad("sent a WAV fmt chunk cut short")
            fmt, channels, rate, _, _, bits = struct.unpack("<HHIIHH", data[body:body + 16])
            if fmt != 1 or channels != 1 or bits != 16:
                raise _bad(f"sent WAV audio that is not mono s16 PCM (format {fmt}, {channels} channels, {bits} bits)")
            if not 1000 <= rate <= 384000:
                raise _bad(f"sent WAV audio at {rate} Hz")
        pos = body + size + (size & 1)
    raise _bad("sent a WAV header with no data chunk in its first message")
