"""Speech recognition by an OpenAI Realtime transcription session
(``stt.provider = "openai_realtime"``, issue 28 item 3): one WebSocket per
session's stream, segmented by our own endpointing.

Wire protocol (shared/reference/speech-providers.md, section 1.2, from
openai-python ``src/openai/types/realtime/*`` and ``types/beta/realtime/*``,
LiveKit's ``livekit-plugins-openai/.../stt.py``; speaches: section 1.4 and
speaches-ai/speaches @870e1e1 ``src/speaches/realtime/*``):

- **Connect**: ``GET {stt.base_url}/realtime?intent=transcription`` upgraded
  to a WebSocket (``https`` -> ``wss``, ``http`` -> ``ws``), header
  ``Authorization: Bearer <stt.api_key>`` (none when the key is empty). On
  ``api.openai.com`` no ``model=`` goes in the URL (it would make a
  conversation session, and the transcription ``session.update`` is then
  refused with ``invalid_model``); on any other host ``&model=<stt.model>``
  is added (gateways need it; speaches' ``/v1/realtime`` requires it and
  takes it as the transcription model). The beta shapes also send
  ``OpenAI-Beta: realtime=v1``.
- **Configure**: the server's first event (``session.created``, or
  ``transcription_session.created`` for the beta) is read if it comes
  within :data:`CREATED_WAIT_S`; then one update, and its answer is awaited
  (bounded by :data:`UPDATE_WAIT_S`) before any audio goes:

  - ``"ga"``: ``session.update`` with ``session.type = "transcription"``
    and ``audio.input`` = ``format {audio/pcm, 24000}``, ``transcription
    {model, language, prompt}``, ``turn_detection: null``;
  - ``"beta"``: ``transcription_session.update`` with ``input_audio_format:
    pcm16``, ``input_audio_transcription``, ``turn_detection: null``;
  - ``"legacy"``: ``session.update`` with the beta conversation session's
    flat fields (``input_audio_transcription``, ``turn_detection: null``).
    speaches @870e1e1 speaks only this one: it has no
    ``transcription_session.update`` (it answers "Invalid client event"),
    it silently ignores the GA fields (``PartialSession`` drops unknown
    keys, so its default ``server_vad`` would stay on), and it reports an
    error for ``input_audio_format`` (so the legacy update omits it).

  ``stt.realtime_shape = "ga"`` sends only the GA update; ``"beta"`` the
  beta one, then the legacy one if that is refused; ``"auto"`` picks by
  the first event (a ``transcription_session.created`` means beta, a
  ``session.created`` whose session has the flat ``input_audio_transcription``
  and no ``audio`` means legacy, anything else GA) and goes on down
  ``ga -> beta -> legacy`` while the server answers the update with an
  ``error`` (or, for GA, with a ``session.updated`` whose session shows it
  ignored the GA fields). The shape that worked is remembered for the
  recogniser's later streams. ``turn_detection`` is null in every shape:
  our own endpointing commits.
- **Audio**: 16 kHz stream audio resampled to 24 kHz (one
  :class:`media.frames.PcmResampler` per stream, so its filter state carries
  across chunks; it delays the audio by 1 ms), base64 s16 LE in
  ``input_audio_buffer.append`` events of at most 100 ms, sent as soon as
  they are queued (what is queued together is batched; nothing waits).
- ``finalize()`` -> ``input_audio_buffer.commit``; ``discard()`` ->
  ``input_audio_buffer.clear`` (the server answers ``input_audio_buffer.cleared``).
  A commit of under 100 ms is refused by both servers (OpenAI:
  ``input_audio_buffer_commit_empty``; speaches: "buffer too small"), so a
  segment that short is cleared instead and given an empty final at once.
- **Answers**, keyed by ``item_id`` (completion is asynchronous: the
  completed events of two items may come in either order, and a delta or
  completed may come before the ``committed`` that names its item):
  ``input_audio_buffer.committed {item_id, previous_item_id}`` acknowledges
  our commits in order and gives each its item; ``...transcription.delta``
  accumulates into an :class:`~voice.recognition.Interim`;
  ``...transcription.completed {transcript, usage}`` gives the
  :class:`~voice.recognition.Final` (``finalized``), an
  :class:`~voice.recognition.EndOfUtterance` and a
  :class:`~voice.recognition.RecognitionUsage` (``{"type": "tokens"}`` or
  ``{"type": "duration"}``); ``...transcription.failed`` fails the stream
  (``provider``: the session replays that audio elsewhere).
  ``input_audio_buffer.speech_started/stopped`` (only if a server runs its
  own VAD) give ``SpeechStarted``/``EndOfUtterance`` at ``audio_*_ms / 1000``.

  Answers come out of :meth:`OpenAiRealtimeStream.events` in the order the
  server sent them (two items' finals possibly out of order), each in the
  stream seconds of its own commit; an item's answers are held only until
  its ``committed`` names it. Every finalize with audio gets exactly one
  ``finalized`` final ending at the stream position of that finalize
  (:meth:`voice.recognition.RecognitionStream.finalize`); an item the
  server committed on its own (its VAD) gives a final that is not
  ``finalized``.
- ``error`` events: during configuration they move to the next shape (see
  above); a refused commit of ours (``input_audio_buffer_commit_empty`` or
  speaches' "buffer too small") gives that segment an empty final; another
  error naming one of our commits fails the stream (``provider``);
  ``session_expired`` (the session's maximum duration) fails it ``closed``;
  an auth error (``invalid_api_key``...) ``unauthorized``; any other is
  logged (once per code) and ignored, as the server-events reference says
  most errors are recoverable.
- **Close**: there is no close message. :meth:`OpenAiRealtimeStream.aclose`
  sends what is queued, waits (bounded) for the answers to the commits
  already made (their usage), then closes the socket. A server close we
  did not ask for is ``closed`` (OpenAI closes a session at its maximum
  duration, 1001 "going away"; speaches after 30 min); a connection lost
  without a close frame is ``dropped``.

Nothing here retries: :mod:`voice.transcription` reconnects once and falls
back (:mod:`voice.stt_failover`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from yarl import URL

from media.frames import PcmResampler
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
    language_code,
    stream_seconds,
)

log = logging.getLogger(__name__)

#: the rate OpenAI's ``audio/pcm`` (and beta ``pcm16``) input must have, Hz
PROVIDER_RATE = 24_000
#: bytes per second of provider audio (24 kHz mono s16)
PROVIDER_BYTES_PER_S = PROVIDER_RATE * 2
#: audio per ``input_audio_buffer.append`` at most, bytes (100 ms at 24 kHz)
APPEND_MAX_BYTES = PROVIDER_BYTES_PER_S // 10
#: audio kept while the connection is not up (or not keeping up), s; the oldest goes beyond
MAX_BUFFER_S = 30.0
#: a segment shorter than this is cleared, not committed, s (both servers
#: refuse a commit of under 100 ms; a little margin for the resampler's 1 ms)
MIN_COMMIT_S = 0.11
#: how long the server's first event is waited for before configuring anyway, s
CREATED_WAIT_S = 1.0
#: how long the answer to a session update is waited for (then it is taken as accepted), s
UPDATE_WAIT_S = 2.0
#: how long closing may wait for the answers still owed, s (then the close
#: handshake's 1 s: within voice.transcription's own 2 s bound)
CLOSE_TIMEOUT_S = 1.0
#: a WebSocket ping this often; no pong within half of it ends the stream ``dropped``, s
HEARTBEAT_S = 20.0
#: a server message larger than this is a protocol error, bytes
MAX_MESSAGE_BYTES = 1 << 20
#: a transcript (or accumulated deltas) longer than this is a protocol error, characters
MAX_TEXT_CHARS = 20_000
#: answers held for items not yet committed, at most (more is a protocol error)
MAX_HELD_ITEMS = 64
#: the host where ``model=`` must not be in the URL
OPENAI_HOST = "api.openai.com"

Shape = Literal["ga", "beta", "legacy"]
#: the shapes each ``stt.realtime_shape`` may use, in the order tried
SHAPE_CHAINS: dict[str, tuple[Shape, ...]] = {
    "ga": ("ga",),
    "beta": ("beta", "legacy"),
    "auto": ("ga", "beta", "legacy"),
}
#: error codes and types that mean the key is refused
AUTH_CODES = frozenset({
    "invalid_api_key", "invalid_authentication", "missing_api_key", "unauthorized", "insufficient_permissions",
    "authentication_error", "permission_error",
})
#: error codes of a commit refused for holding (almost) no audio
COMMIT_EMPTY_CODES = frozenset({"input_audio_buffer_commit_empty"})

_TRANSCRIPTION = "conversation.item.input_audio_transcription"


def realtime_url(base_url: str, model: str) -> str:
    """The WebSocket URL of a transcription session.

    Args:
        base_url: ``stt.base_url``, up to ``/v1`` (``https://api.openai.com/v1``,
            ``http://127.0.0.1:8000/v1``); ``https``/``http`` become
            ``wss``/``ws``.
        model: the transcription model; put in the URL (``&model=``) on
            every host but ``api.openai.com`` (reference 1.2: there it makes
            a conversation session; gateways and speaches need it).

    Raises:
        ValueError: not an http(s) or ws(s) URL.
    """
    url = URL(base_url.rstrip("/"))
    scheme = {"https": "wss", "http": "ws"}.get(url.scheme, url.scheme)
    if scheme not in ("ws", "wss") or not url.host:
        raise ValueError(f"not an http(s) or ws(s) URL: {base_url!r}")
    query = {"intent": "transcription"}
    if url.host != OPENAI_HOST:
        query["model"] = model
    return str(url.with_scheme(scheme).with_path(url.path.rstrip("/") + "/realtime").with_query(query))


def session_update(shape: Shape, config: SttConfig) -> dict[str, Any]:
    """The session update of ``shape`` for ``config`` (without ``event_id``).

    The transcription part is ``{model, language, prompt}``: ``language``
    omitted when ``stt.language`` is empty, ``prompt`` the keyterms joined by
    ``", "`` and omitted when there are none. ``turn_detection`` is null:
    our own endpointing commits (reference 1.2).
    """
    transcription: dict[str, Any] = {"model": config.model_name}
    if language := language_code(config.language):
        transcription["language"] = language
    if config.keyterms:
        transcription["prompt"] = ", ".join(config.keyterms)
    if shape == "ga":
        return {"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": PROVIDER_RATE},
            "transcription": transcription,
            "turn_detection": None,
        }}}}
    if shape == "beta":
        return {"type": "transcription_session.update", "session": {
            "input_audio_format": "pcm16", "input_audio_transcription": transcription, "turn_detection": None,
        }}
    return {"type": "session.update", "session": {"input_audio_transcription": transcription, "turn_detection": None}}


def guess_shape(first: dict[str, Any] | None) -> Shape | None:
    """The shape a server's first event suggests (None: no hint):
    ``transcription_session.created`` is the beta; a ``session.created``
    whose session has the flat ``input_audio_transcription`` and no
    ``audio`` is speaches' legacy one; one with ``type: transcription`` or
    ``audio`` is GA."""
    if first is None:
        return None
    if first.get("type") == "transcription_session.created":
        return "beta"
    session = first.get("session")
    if first.get("type") != "session.created" or not isinstance(session, dict):
        return None
    if session.get("type") == "transcription" or "audio" in session:
        return "ga"
    if "input_audio_transcription" in session:
        return "legacy"
    return None


def _ignored_ga(answer: dict[str, Any]) -> bool:
    """A ``session.updated`` answering our GA update shows a session without
    the GA fields but with the legacy ones: the server dropped what it did
    not know (speaches)."""
    session = answer.get("session")
    return isinstance(session, dict) and "audio" not in session and "input_audio_transcription" in session


@dataclass(eq=False)
class _Item:
    """One committed segment and what the provider answered for it.

    Attributes:
        start_s / end_s: the stream seconds it spans.
        event_id: our commit's ``event_id`` (None: not awaiting an answer to a commit of ours).
        ours: it answers a finalize of ours (False: the server committed on its own).
        item_id: the provider's item, once ``committed`` named it.
        text: the deltas so far; shown: the text of the last interim given.
        transcript: the completed transcript (None: not yet).
        usage: (audio s, input tokens, output tokens) of its completed event.
    """

    start_s: float
    end_s: float
    event_id: str | None = None
    ours: bool = True
    item_id: str | None = None
    text: str = ""
    shown: str = ""
    transcript: str | None = None
    usage: tuple[float, int, int] | None = None

    @property
    def awaiting_ack(self) -> bool:
        return self.item_id is None and self.transcript is None


@dataclass(eq=False)
class _Held:
    """Answers for an item whose ``committed`` has not come yet."""

    text: str = ""
    transcript: str | None = None
    usage: tuple[float, int, int] | None = None


class _Control:
    """A queued control event (``commit`` or ``clear``) and its ``event_id``."""

    __slots__ = ("kind", "event_id")

    def __init__(self, kind: Literal["commit", "clear"], event_id: str) -> None:
        self.kind = kind
        self.event_id = event_id


class OpenAiRealtimeRecogniser:
    """:class:`voice.recognition.Recogniser` over OpenAI Realtime
    transcription sessions (see the module doc for the wire protocol).

    Args:
        config: the ``stt.*`` settings: ``base_url`` (up to ``/v1``),
            ``api_key``, ``model``, ``language``, ``keyterms`` (the
            transcription prompt), ``realtime_shape``, ``connect_timeout_s``,
            ``fallback`` (named in the refused-key warning) and the prices.

    Attributes:
        name: ``"openai_realtime"``.
        pricing: ``config.pricing`` (tokens for the ``gpt-4o-*-transcribe``
            models, minutes for ``whisper-1``).
        refused: why the provider refused the key (401/403 or an auth
            error event), or None; while set, streams fail at once with
            ``unauthorized``; a later :meth:`start` that is let in clears it.
    """

    name = "openai_realtime"

    #: the session's bound applies (stt.final_timeout_ms)
    final_timeout_s: float | None = None

    def __init__(self, config: SttConfig) -> None:
        self.config = config
        self.pricing: SpeechPricing = config.pricing
        self.refused: str | None = None
        #: the session shape that worked last (None: not known yet)
        self.shape: Shape | None = None
        self._session: aiohttp.ClientSession | None = None
        self._unreachable_logged = False
        self._ids = itertools.count(1)

    @property
    def url(self) -> str:
        """The session's WebSocket URL (:func:`realtime_url`)."""
        return realtime_url(self.config.url, self.config.model_name)

    @property
    def provider_label(self) -> str:
        """The provider as log lines name it (``OpenAI`` or the host)."""
        host = URL(self.config.url).host or self.config.url
        return "OpenAI" if host == OPENAI_HOST else f"the server at {host}"

    def shapes(self) -> tuple[Shape, ...]:
        """The shapes a new stream may try, the one that worked last first."""
        chain = SHAPE_CHAINS[self.config.realtime_shape]
        if self.shape in chain:
            i = chain.index(self.shape)
            return chain[i:] + chain[:i]
        return chain

    def next_event_id(self) -> str:
        """A fresh client ``event_id`` (the server echoes it in its errors)."""
        return f"tk_{next(self._ids)}"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # no total timeout: the socket lives as long as the session; the upgrade is bounded in connect()
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def connect(self, shapes: tuple[Shape, ...], *, probe: bool = False) -> aiohttp.ClientWebSocketResponse:
        """Open the session's WebSocket (bounded by ``stt.connect_timeout_s``),
        with the beta header if ``shapes`` starts with a beta shape.

        Args:
            shapes: the shapes the stream will try (:meth:`shapes`).
            probe: connect even if the key was refused before (:meth:`start`).

        Raises:
            RecognitionError: ``unauthorized`` (401/403, or refused before:
                remembered, and the setting named in one warning),
                ``unreachable`` (refused, DNS, TLS, timeout, any other HTTP
                status on the upgrade).
        """
        if self.refused is not None and not probe:
            raise RecognitionError("unauthorized", self.refused)
        headers = {}
        key = self.config.api_key.get_secret_value()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        if shapes[0] != "ga":
            headers["OpenAI-Beta"] = "realtime=v1"
        try:
            url = self.url
        except ValueError as exc:
            raise RecognitionError("unreachable", f"stt.base_url: {exc}") from None
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                return await self._client().ws_connect(
                    url, headers=headers, max_msg_size=MAX_MESSAGE_BYTES, autoping=True, heartbeat=HEARTBEAT_S,
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=1.0),
                )
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in (401, 403):
                raise self.note_refused(f"{exc.status} {_reason(exc.status)}") from None
            raise RecognitionError(
                "unreachable", f"{url} (stt.base_url) answered the WebSocket upgrade with {exc.status} {exc.message}"
            ) from None
        except TimeoutError:
            raise RecognitionError(
                "unreachable", f"{url} (stt.base_url) did not connect within {self.config.connect_timeout_s:g} s"
            ) from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise RecognitionError("unreachable", f"{url} (stt.base_url): {type(exc).__name__}: {exc}") from None

    def note_refused(self, why: str) -> RecognitionError:
        """The provider refused the key (``why``: ``401 Unauthorized``, an
        error event's code): remember it, log it once, and return the
        ``unauthorized`` error to raise."""
        after = ("sessions will use the fallback recogniser" if self.config.fallback == "embedded"
                 else "turns will fail until it is fixed (stt.fallback is none)")
        message = f"stt.api_key was refused by {self.provider_label} ({why}): {after}"
        if self.refused is None:
            log.warning("%s", message)
        self.refused = message
        return RecognitionError("unauthorized", message)

    async def start(self) -> None:
        """Check the key: connect, read the first event (an auth error
        comes there on servers that accept the upgrade first), close.
        Never raises: a refused key is one warning naming ``stt.api_key``
        (and later streams fail at once until a later start is let in); an
        unreachable provider is one warning (sessions still try it, then
        fall back). Idempotent."""
        try:
            ws = await self.connect(self.shapes(), probe=True)
            try:
                first = await _receive_json(ws, CREATED_WAIT_S)
                if first is not None and first.get("type") == "error" and _is_auth(first):
                    code, _etype, message, _eid = _error_fields(first)
                    raise self.note_refused(f"{code}: {message}")
            finally:
                await ws.close()
        except RecognitionError as exc:
            if exc.kind == "unauthorized":
                return
            if not self._unreachable_logged:
                self._unreachable_logged = True
                then = "then use the fallback recogniser" if self.config.fallback == "embedded" else "and fail without it"
                log.warning("OpenAI Realtime transcription is not reachable now (%s): sessions will try it, %s", exc, then)
            return
        except Exception as exc:  # a probe never fails the server's start
            log.warning("checking OpenAI Realtime transcription at %s failed: %s: %s", self.config.url, type(exc).__name__, exc)
            return
        self._unreachable_logged = False
        if self.refused is not None:
            log.info("stt.api_key is accepted by %s again", self.provider_label)
        self.refused = None  # a start that is let in clears an earlier refusal
        log.info("OpenAI Realtime transcription at %s accepted the connection", self.config.url)

    def open(self, options: StreamOptions) -> OpenAiRealtimeStream:
        """One session's stream; it connects in the background (audio sent
        meanwhile waits, up to :data:`MAX_BUFFER_S`). Needs a running loop."""
        return OpenAiRealtimeStream(self, options)

    async def aclose(self) -> None:
        """Close the HTTP client. Idempotent."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()


class OpenAiRealtimeStream:
    """One session's :class:`voice.recognition.RecognitionStream` on an
    OpenAI Realtime transcription session (see the module doc).

    ``send``, ``finalize`` and ``discard`` never block and never raise;
    their events go out in order once the connection is configured.
    """

    def __init__(self, owner: OpenAiRealtimeRecogniser, options: StreamOptions) -> None:
        self._owner = owner
        self._options = options
        self._events: asyncio.Queue[RecognitionEvent | RecognitionError | None] = asyncio.Queue()
        self._resampler = PcmResampler(PROVIDER_RATE)
        #: what waits to be sent: 24 kHz audio, commits and clears, in order
        self._ops: deque[bytes | _Control] = deque()
        self._queued_audio = 0
        self._dropped_audio = 0
        self._wake = asyncio.Event()
        self._sent = 0  # stream bytes passed to send()
        self._mark = 0  # stream bytes at the last finalize/discard
        #: committed segments not completed yet, in commit order (acknowledged in that order)
        self._items: deque[_Item] = deque()
        self._held: dict[str, _Held] = {}
        self._done_items: deque[str] = deque(maxlen=256)
        self._server_buffer_from = 0.0  # stream s where the server's buffer begins (its own commits)
        self._server_stopped_s: float | None = None  # its VAD's latest speech_stopped, stream s
        self._shape: Shape = owner.shapes()[0]
        self._error_codes_logged: set[str] = set()
        self._configured = False
        self._writing = False
        self._closing = False
        self._abort = False
        self._ended = False
        self._failed: RecognitionError | None = None
        self._drained = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="openai-realtime-stt")

    # -- the session's side --------------------------------------------------

    @property
    def position_s(self) -> float:
        """Stream seconds sent so far."""
        return stream_seconds(self._sent)

    @property
    def buffered_s(self) -> float:
        """Audio queued and not yet sent, s (at most :data:`MAX_BUFFER_S`)."""
        return self._queued_audio / PROVIDER_BYTES_PER_S

    @property
    def shape(self) -> Shape | None:
        """The session shape the server accepted (None: not configured yet)."""
        return self._shape if self._configured else None

    def send(self, pcm: bytes) -> None:
        """Queue 16 kHz mono s16 LE audio (resampled to 24 kHz now, sent as
        soon as the connection is up). Ignored once failed or closing."""
        if not pcm or self._failed is not None or self._closing:
            return
        pcm = pcm[: len(pcm) // 2 * 2]
        self._sent += len(pcm)
        try:
            out = self._resampler.pcm(pcm, STREAM_RATE)
        except ValueError as exc:  # cannot happen with whole samples at one rate
            log.warning("openai_realtime: audio not resampled: %s", exc)
            return
        if out:
            self._ops.append(out)
            self._queued_audio += len(out)
            self._bound_queue()
            self._wake.set()

    def finalize(self) -> None:
        """Commit the audio since the last finalize/discard (one item; its
        final comes out of :meth:`events`); a stretch under
        :data:`MIN_COMMIT_S` is cleared and given an empty final at once.
        Nothing since the last one: nothing."""
        if self._failed is not None or self._closing or self._sent == self._mark:
            return
        start_s, end_s = stream_seconds(self._mark), self.position_s
        short = self._sent - self._mark < MIN_COMMIT_S * STREAM_BYTES_PER_S
        self._mark = self._sent
        self._server_buffer_from = end_s
        self._wake.set()
        if short:
            self._ops.append(_Control("clear", self._owner.next_event_id()))
            item = _Item(start_s, end_s, transcript="")
            self._items.append(item)
            self._release(item)
        else:
            control = _Control("commit", self._owner.next_event_id())
            self._ops.append(control)
            self._items.append(_Item(start_s, end_s, event_id=control.event_id))

    def discard(self) -> None:
        """Clear the audio since the last finalize/discard at the server
        (no final is owed for it). Nothing since the last one: nothing."""
        if self._failed is not None or self._closing or self._sent == self._mark:
            return
        self._mark = self._sent
        self._server_buffer_from = self.position_s
        self._ops.append(_Control("clear", self._owner.next_event_id()))
        self._wake.set()

    async def events(self) -> AsyncIterator[RecognitionEvent]:
        """The stream's events until :meth:`aclose`, in the server's order:
        per item, its interims, then its final, end of utterance and usage.

        Raises:
            RecognitionError: ``unauthorized``, ``unreachable``, ``dropped``,
                ``closed``, ``protocol`` or ``provider`` (module doc);
                nothing comes after it.
        """
        while (item := await self._events.get()) is not None:
            if isinstance(item, RecognitionError):
                raise item
            yield item

    async def aclose(self) -> None:
        """Send what is queued, wait (at most :data:`CLOSE_TIMEOUT_S`) for
        the answers to the commits made (their usage), close the socket
        (there is no close message); then :meth:`events` ends. Not yet
        connected: stop connecting at once. Idempotent; cancelling it closes
        at once."""
        if self._closing:
            if not self._task.done():
                await asyncio.wait({self._task})
            return
        self._closing = True
        try:
            if self._configured and not self._task.done():
                self._wake.set()
                self._check_drained()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(CLOSE_TIMEOUT_S):
                        await self._drained.wait()
        except asyncio.CancelledError:
            self._abort = True  # no close handshake: the socket is torn down
            raise
        finally:
            self._task.cancel()
            try:
                await asyncio.wait({self._task})
            except asyncio.CancelledError:
                self._abort = True
                self._task.cancel()  # cancelled again: aiohttp aborts the socket
                raise
            finally:
                self._end()

    # -- the connection ------------------------------------------------------

    async def _run(self) -> None:
        owner = self._owner
        try:
            ws = await owner.connect(owner.shapes())
            try:
                await self._configure(ws)
                self._configured = True
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._reader(ws))
                    tg.create_task(self._writer(ws))
            finally:
                if self._abort:  # a cancelled close: aiohttp tears the socket down when its close is cancelled
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0):
                            await ws.close()
                else:
                    await ws.close()  # the close handshake, bounded by ws_close
        except* RecognitionError as group:
            error = _first(group)
            assert isinstance(error, RecognitionError)
            self._fail(error)
        except* Exception as group:  # a bug here must still end events(), never hang it
            log.error("openai_realtime: the stream failed unexpectedly", exc_info=group)
            self._fail(RecognitionError("protocol", f"{owner.provider_label}: unexpected {_first(group)!r}"))

    async def _configure(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Read the first event, send the session update and await its
        answer, trying the next shape while the server refuses one (module
        doc).

        Raises:
            RecognitionError: ``unauthorized`` (an auth error event),
                ``provider`` (every shape refused), ``protocol``/``dropped``/``closed``.
        """
        owner = self._owner
        first = await self._receive(ws, CREATED_WAIT_S)
        if first is not None:
            log.debug("openai_realtime: first event %s", first.get("type"))
            if first.get("type") == "error":
                self._config_error(first, "before the session update")
        chain = owner.shapes()
        guess = guess_shape(first)
        if guess is not None and guess in chain:
            i = chain.index(guess)
            chain = chain[i:] + chain[:i]
        first_refusal: str | None = None
        for shape in chain:
            self._shape = shape
            update = session_update(shape, owner.config)
            update["event_id"] = event_id = owner.next_event_id()
            await self._send_json(ws, update)
            answer = await self._await_update_answer(ws, event_id)
            if answer is None:
                log.debug("openai_realtime: no answer to the %s session update; going on", shape)
                break
            if answer.get("type") == "error":
                _code, _etype, message, _eid = _error_fields(answer)
                self._config_error(answer, f"the {shape} session update")
                first_refusal = first_refusal or f"{shape}: {message}"
                log.info("openai_realtime: %s refused the %s session update (%s)", owner.provider_label, shape, message)
                continue
            if shape == "ga" and _ignored_ga(answer):
                if len(chain) > 1:
                    first_refusal = first_refusal or "ga: the GA session fields were ignored"
                    log.info("openai_realtime: %s ignored the GA session fields; trying the older shape", owner.provider_label)
                    continue
                log.warning("openai_realtime: %s ignored the GA session fields (its own turn detection stays on); "
                            "set stt.realtime_shape to \"auto\" or \"beta\"", owner.provider_label)
            break
        else:
            raise RecognitionError("provider", f"{owner.provider_label} refused every session shape tried "
                                               f"(stt.realtime_shape = {owner.config.realtime_shape!r}): {first_refusal}")
        if owner.config.realtime_shape != "ga":
            owner.shape = self._shape

    def _config_error(self, event: dict[str, Any], during: str) -> None:
        if _is_auth(event):
            code, _etype, message, _eid = _error_fields(event)
            raise self._owner.note_refused(f"{code}: {message}")
        if _error_fields(event)[0] == "session_expired":
            raise RecognitionError("closed", f"{self._owner.provider_label} ended the session: {_error_fields(event)[2]}")
        log.debug("openai_realtime: error %s", during)

    async def _await_update_answer(self, ws: aiohttp.ClientWebSocketResponse, event_id: str) -> dict[str, Any] | None:
        """The ``session.updated``/``transcription_session.updated`` or the
        ``error`` answering our update (None: none within :data:`UPDATE_WAIT_S`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + UPDATE_WAIT_S
        while (left := deadline - loop.time()) > 0:
            event = await self._receive(ws, left)
            if event is None:
                return None
            kind = event.get("type")
            if kind in ("session.updated", "transcription_session.updated"):
                return event
            if kind == "error":
                eid = _error_fields(event)[3]
                if eid is None or eid == event_id:
                    return event
            log.debug("openai_realtime: %s while configuring", kind)
        return None

    async def _receive(self, ws: aiohttp.ClientWebSocketResponse, wait_s: float) -> dict[str, Any] | None:
        """The next event, or None if none comes within ``wait_s``.

        Raises:
            RecognitionError: see :func:`_decode`.
        """
        try:
            async with asyncio.timeout(wait_s):
                msg = await ws.receive()
        except TimeoutError:
            return None
        return _decode(msg, ws, self._owner.provider_label)

    async def _send_json(self, ws: aiohttp.ClientWebSocketResponse, event: dict[str, Any]) -> None:
        try:
            await ws.send_str(json.dumps(event, separators=(",", ":")))
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            raise RecognitionError("dropped", f"{self._owner.provider_label}: sending failed: {exc}") from None

    async def _writer(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Send what is queued, in order: audio batched up to 100 ms per
        append, commits and clears as they come. Never waits for more."""
        while True:
            if not self._ops:
                self._writing = False
                self._check_drained()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._writing = True
            op = self._ops.popleft()
            if isinstance(op, _Control):
                event: dict[str, Any] = {"type": f"input_audio_buffer.{op.kind}", "event_id": op.event_id}
            else:
                chunk = bytearray(op)
                while self._ops and len(chunk) < APPEND_MAX_BYTES and isinstance(nxt := self._ops[0], bytes):
                    self._ops.popleft()
                    chunk += nxt
                if len(chunk) > APPEND_MAX_BYTES:
                    self._ops.appendleft(bytes(chunk[APPEND_MAX_BYTES:]))
                    del chunk[APPEND_MAX_BYTES:]
                self._queued_audio -= len(chunk)
                event = {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode("ascii")}
            try:
                await ws.send_str(json.dumps(event, separators=(",", ":")))
            except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
                # the reader sees why (a close frame, a drop) a moment later; it tells it better
                await asyncio.sleep(0.5)
                raise RecognitionError("dropped", f"{self._owner.provider_label}: sending failed: {exc}") from None

    async def _reader(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        label = self._owner.provider_label
        while True:
            msg = await ws.receive()
            if self._closing and msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING,
                                              aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                self._drained.set()  # nothing more will be answered
                return
            self._on_event(_decode(msg, ws, label))
            self._check_drained()

    # -- what the server says ------------------------------------------------

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "input_audio_buffer.committed":
            self._on_committed(_str_field(event, "item_id", kind))
        elif kind == f"{_TRANSCRIPTION}.delta":
            item_id = _str_field(event, "item_id", kind)
            delta = _str_field(event, "delta", kind)
            self._on_answer(item_id, delta=delta)
        elif kind == f"{_TRANSCRIPTION}.completed":
            item_id = _str_field(event, "item_id", kind)
            transcript = _str_field(event, "transcript", kind)
            if len(transcript) > MAX_TEXT_CHARS:
                raise RecognitionError("protocol", f"{self._owner.provider_label} sent a transcript of {len(transcript)} characters")
            self._on_answer(item_id, transcript=transcript, usage=_usage(event.get("usage"), self._owner.provider_label))
        elif kind == f"{_TRANSCRIPTION}.failed":
            item_id = _str_field(event, "item_id", kind)
            error = event.get("error")
            message = error.get("message") if isinstance(error, dict) else None
            raise RecognitionError("provider", f"{self._owner.provider_label} could not transcribe item {item_id}: {message or error}")
        elif kind == "input_audio_buffer.speech_started":
            self._emit(SpeechStarted(_ms_field(event, "audio_start_ms", kind)))
        elif kind == "input_audio_buffer.speech_stopped":
            self._server_stopped_s = _ms_field(event, "audio_end_ms", kind)
            self._emit(EndOfUtterance(self._server_stopped_s))
        elif kind == "error":
            self._on_error(event)
        else:
            log.debug("openai_realtime: %s ignored", kind)

    def _on_committed(self, item_id: str) -> None:
        item = next((i for i in self._items if i.awaiting_ack), None)
        if item is None:
            # the server committed on its own (its VAD: turn_detection was not turned off)
            stopped = self._server_stopped_s if self._server_stopped_s is not None else self.position_s
            end_s = max(self._server_buffer_from, min(stopped, self.position_s))
            item = _Item(self._server_buffer_from, end_s, ours=False)
            self._server_buffer_from = end_s
            self._items.append(item)
            log.debug("openai_realtime: the server committed item %s itself", item_id)
        item.item_id = item_id
        held = self._held.pop(item_id, None)
        if held is not None:
            item.text = held.text
            item.transcript, item.usage = held.transcript, held.usage
        self._release(item)

    def _on_answer(self, item_id: str, *, delta: str | None = None, transcript: str | None = None,
                   usage: tuple[float, int, int] | None = None) -> None:
        item: _Item | _Held | None = next((i for i in self._items if i.item_id == item_id), None)
        if item is None:
            if item_id in self._done_items:
                log.debug("openai_realtime: late answer for item %s ignored", item_id)
                return
            item = self._held.get(item_id)
            if item is None:
                if len(self._held) >= MAX_HELD_ITEMS:
                    raise RecognitionError("protocol", f"{self._owner.provider_label} answered for {len(self._held) + 1} "
                                                       "items it never said were committed")
                item = self._held[item_id] = _Held()
        if item.transcript is not None:
            return  # a delta after the completed event adds nothing
        if delta is not None:
            item.text += delta
            if len(item.text) > MAX_TEXT_CHARS:
                raise RecognitionError("protocol", f"{self._owner.provider_label} sent deltas of over {MAX_TEXT_CHARS} characters")
        if transcript is not None:
            item.transcript, item.usage = transcript, usage
        if isinstance(item, _Item):
            self._release(item)

    def _on_error(self, event: dict[str, Any]) -> None:
        code, etype, message, eid = _error_fields(event)
        label = self._owner.provider_label
        if _is_auth(event):
            raise self._owner.note_refused(f"{code}: {message}")
        if code == "session_expired":
            raise RecognitionError("closed", f"{label} ended the session: {message}")
        ours = next((i for i in self._items if i.event_id is not None and i.event_id == eid), None) if eid else None
        if code in COMMIT_EMPTY_CODES or "buffer too small" in message or "buffer is empty" in message:
            item = ours if ours is not None else next((i for i in self._items if i.awaiting_ack and i.event_id), None)
            if item is not None and item.awaiting_ack:
                log.debug("openai_realtime: a commit of %.3f s was refused as empty", item.end_s - item.start_s)
                item.transcript = ""
                item.event_id = None
                self._release(item)
            return
        if ours is not None and ours.awaiting_ack:
            raise RecognitionError("provider", f"{label} refused a commit: {code or etype}: {message}")
        key = code or etype or message[:40]
        if key not in self._error_codes_logged:
            self._error_codes_logged.add(key)
            log.warning("openai_realtime: %s reported an error (%s: %s); going on", label, code or etype, message)

    def _release(self, item: _Item) -> None:
        """Give what ``item`` has (once its span is known): its latest
        interim, or once it is completed its final, end and usage."""
        if item.awaiting_ack:
            return
        if item.transcript is None:
            if item.text and item.text != item.shown:
                item.shown = item.text
                self._emit(Interim(item.text, item.start_s, item.end_s))
            return
        with contextlib.suppress(ValueError):
            self._items.remove(item)
        if item.item_id is not None:
            self._done_items.append(item.item_id)
        self._emit(Final(item.transcript, item.start_s, item.end_s, finalized=item.ours))
        self._emit(EndOfUtterance(item.end_s))
        if item.usage is not None:
            audio_s, inp, out = item.usage
            self._emit(RecognitionUsage(audio_s=audio_s, input_tokens=inp, output_tokens=out,
                                        start_s=item.start_s, end_s=item.end_s))
        self._check_drained()

    # -- plumbing ------------------------------------------------------------

    def _emit(self, event: RecognitionEvent) -> None:
        if self._failed is None and not self._ended:
            self._events.put_nowait(event)

    def _fail(self, error: RecognitionError) -> None:
        self._drained.set()  # nothing more will be answered
        if self._failed is not None or self._ended:
            return
        if self._closing and error.kind in ("dropped", "closed"):
            return  # we were closing it anyway
        self._failed = error
        self._ops.clear()
        self._events.put_nowait(error)

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._events.put_nowait(None)

    def _check_drained(self) -> None:
        if self._closing and not self._ops and not self._writing and not self._items:
            self._drained.set()

    def _bound_queue(self) -> None:
        limit = int(MAX_BUFFER_S * PROVIDER_BYTES_PER_S)
        while self._queued_audio > limit:
            i, dropped = next((i, op) for i, op in enumerate(self._ops) if isinstance(op, bytes))
            del self._ops[i]
            self._queued_audio -= len(dropped)
            if not self._dropped_audio:
                log.warning("openai_realtime: more than %g s of audio waiting for %s; dropping the oldest",
                            MAX_BUFFER_S, self._owner.provider_label)
            self._dropped_audio += len(dropped)


# -- wire helpers ---------------------------------------------------------------


def _reason(status: int) -> str:
    return {401: "Unauthorized", 403: "Forbidden"}.get(status, "")


def _first(group: BaseExceptionGroup[Any]) -> BaseException:
    """The first leaf exception of ``group``."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


async def _receive_json(ws: aiohttp.ClientWebSocketResponse, wait_s: float) -> dict[str, Any] | None:
    try:
        async with asyncio.timeout(wait_s):
            msg = await ws.receive()
    except TimeoutError:
        return None
    try:
        return _decode(msg, ws, "the server")
    except RecognitionError:
        return None


def _decode(msg: aiohttp.WSMessage, ws: aiohttp.ClientWebSocketResponse, label: str) -> dict[str, Any]:
    """One server message as an event (a JSON object with a string ``type``).

    Raises:
        RecognitionError: ``protocol`` (binary, not JSON, not an object, no
            type, larger than :data:`MAX_MESSAGE_BYTES`), ``closed`` (a close
            frame: the server ended the session), ``dropped`` (the
            connection was lost without a close frame).
    """
    if msg.type == aiohttp.WSMsgType.TEXT:
        try:
            event = json.loads(msg.data)
        except (ValueError, RecursionError):
            raise RecognitionError("protocol", f"{label} sent a message that is not JSON: {str(msg.data)[:80]!r}") from None
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise RecognitionError("protocol", f"{label} sent a message that is not an event: {str(msg.data)[:80]!r}")
        return event
    if msg.type == aiohttp.WSMsgType.BINARY:
        raise RecognitionError("protocol", f"{label} sent a binary frame ({len(msg.data)} bytes); the protocol has none")
    if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING):
        code = msg.data if msg.type == aiohttp.WSMsgType.CLOSE else ws.close_code
        reason = msg.extra if isinstance(msg.extra, str) else ""
        raise RecognitionError("closed", f"{label} closed the session ({code}{' ' + reason if reason else ''})")
    if msg.type == aiohttp.WSMsgType.ERROR:
        exc = msg.data
        if isinstance(exc, aiohttp.WebSocketError) and exc.code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
            raise RecognitionError("protocol", f"{label} sent a message larger than {MAX_MESSAGE_BYTES} bytes")
        raise RecognitionError("dropped", f"{label}: the connection failed: {exc}")
    raise RecognitionError("dropped", f"{label}: the connection was lost (close code {ws.close_code})")


def _str_field(event: dict[str, Any], name: str, kind: str) -> str:
    value = event.get(name)
    if not isinstance(value, str):
        raise RecognitionError("protocol", f"{kind} without a string {name}: {json.dumps(event)[:200]}")
    return value


def _ms_field(event: dict[str, Any], name: str, kind: str) -> float:
    value = event.get(name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise RecognitionError("protocol", f"{kind} without a number {name}: {json.dumps(event)[:200]}")
    return float(value) / 1000


def _usage(usage: Any, label: str) -> tuple[float, int, int] | None:
    """A completed event's ``usage`` as (audio s, input tokens, output
    tokens): ``{"type": "tokens", "input_tokens", "output_tokens", ...}`` or
    ``{"type": "duration", "seconds"}`` (openai-python
    ``conversation_item_input_audio_transcription_completed_event.py``);
    None if absent or of another type.

    Raises:
        RecognitionError: ``protocol``: a usage of a known type whose figures are not numbers.
    """
    if usage is None:
        return None
    if not isinstance(usage, dict):
        raise RecognitionError("protocol", f"{label} sent a usage that is not an object: {str(usage)[:80]}")
    kind = usage.get("type")
    if kind == "tokens":
        inp, out = usage.get("input_tokens", 0), usage.get("output_tokens", 0)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (inp, out)):
            raise RecognitionError("protocol", f"{label} sent token usage that is not counts: {json.dumps(usage)[:200]}")
        return 0.0, inp, out
    if kind == "duration":
        seconds = usage.get("seconds")
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds < 1e7:
            raise RecognitionError("protocol", f"{label} sent a duration usage that is not seconds: {json.dumps(usage)[:200]}")
        return float(seconds), 0, 0
    log.debug("openai_realtime: usage of type %r ignored", kind)
    return None


def _error_fields(event: dict[str, Any]) -> tuple[str, str, str, str | None]:
    """An ``error`` event's (code, type, message, event_id), each "" / None if absent."""
    error = event.get("error")
    if not isinstance(error, dict):
        return "", "", str(error)[:200] if error is not None else "", None
    code, etype, message, eid = (error.get(k) for k in ("code", "type", "message", "event_id"))
    return (
        code if isinstance(code, str) else "",
        etype if isinstance(etype, str) else "",
        message if isinstance(message, str) else "",
        eid if isinstance(eid, str) else None,
    )


def _is_auth(event: dict[str, Any]) -> bool:
    code, etype, _message, _eid = _error_fields(event)
    return code in AUTH_CODES or etype in AUTH_CODES

