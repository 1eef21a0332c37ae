"""A scripted device call with the simulator, measured at the device:
``turnkeeper call --device ws://... --ptt``, the device tests and the
device benches.

:class:`DeviceCallClient` connects a :class:`client.device.DeviceSimulator`,
says the opening utterance (``manual`` mode: the button held for the
utterance's length, then released; ``realtime`` mode: the microphone open
from the start), then interrupts the agent with each barge-in a set time
after the device's speaker starts playing its reply: an ``abort``
(:attr:`client.results.Utterance.abort`; with a ``revive`` utterance it is
said right after the abort's ``tts stop``, so the next interruption has a
reply to interrupt), a push-to-talk press while the
agent speaks (manual mode: ``abort`` + ``listen start``, the utterance, the
release), or speech into the open microphone (realtime mode). It returns the
same :class:`client.results.CallResult` as the WebRTC and phone clients.

The turns come from the session's event log when a tenant ``token`` is
given (the session id is the server hello's ``session_id``); without one,
from what the device was told (each ``stt`` a turn, the ``tts
sentence_start`` texts after it its reply; state unknown).

Stop time at the device, for each interruption at T (the press of abort or
the button, or the first sample of barge-in speech sent): old-generation
audio is what arrived after the interrupted reply's ``tts start`` and
before the ``tts stop`` that followed T; the stop time is T to the end of
the last sound of it the speaker played (0 if none played after T).
Besides: T to the ``tts stop`` arriving, T to the last old packet
arriving, sound sent after the ``tts stop`` before the next ``tts start``
(should be 0), and how much of the reply the speaker played before T
against what the server counted (``agent.interrupted`` played_ms). Without
a ``tts stop`` (a voice barge-in the server did not commit), the end of the
sound before ``SILENT_RUN_MS`` of silence. A speech sample counts as sent
when the 60 ms packet carrying it leaves.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from client.device import DeviceSimulator
from client.device_mic import UPLINK_RATE
from client.results import BargeInMeasure, CallError, CallResult, TurnView, Utterance, caller_turns
from client.session_events import (
    NO_SPEECH_S,
    SessionEvents,
    quiet,
    run_until_hangup,
    silent_run_end,
    sound_again_after,
)
from media.frames import PLAYOUT_RATE, PcmResampler, first_sound_sample, last_sound_sample
from web.devices import framing

LEAD_SILENCE_S = 0.3
VERDICT_WAIT_S = 1.5
REVIVE_AFTER_S = 5.0
TTS_STOP_WAIT_S = 2.0  # after an abort, how long the script waits for tts stop
CALL_MODES = ("manual", "realtime")


def to_16k(pcm48: bytes) -> bytes:
    """48 kHz mono s16 to 16 kHz (PyAV)."""
    r = PcmResampler(UPLINK_RATE)
    return r.pcm(pcm48, PLAYOUT_RATE) + r.flush()


def http_base(url: str) -> str:
    """The server's HTTP base URL from its device WebSocket URL
    (``ws://h:p/v1/devices/ws`` -> ``http://h:p``)."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return f"{scheme}://{parts.netloc}"


class DeviceCallClient(SessionEvents):
    """One device call against ``url`` (``ws://127.0.0.1:8080/v1/devices/ws``).

    Args:
        mode: ``manual`` (push-to-talk) or ``realtime`` (open microphone).
        device_token: the device's token (``Authorization: Bearer``).
        token: a bearer token of the device's tenant, to read its events.
        version: binary protocol version (1, 2 or 3).
        device_id / hello_timeout_s / wifi_jitter_ms / seed: as
            :class:`client.device.DeviceSimulator`.

    Raises:
        ValueError: an unknown mode, a URL that is not ws(s):// or
            http(s)://, or a bad protocol version.
    """

    def __init__(
        self,
        url: str,
        *,
        mode: str = "manual",
        device_token: str | None = None,
        token: str | None = None,
        version: int = 1,
        device_id: str = "02:00:00:00:00:01",
        hello_timeout_s: float = 10.0,
        wifi_jitter_ms: float = 0.0,
        seed: int | None = None,
    ) -> None:
        if mode not in CALL_MODES:
            raise ValueError(f"device call mode {mode!r} (one of {CALL_MODES})")
        if not url.startswith(("ws://", "wss://", "http://", "https://")):
            raise ValueError(f"the device URL must be ws://, wss://, http:// or https://, not {url!r}")
        self.url, self.mode, self.device_token, self.token = url, mode, device_token, token
        self.version, self.device_id, self.hello_timeout_s = version, device_id, hello_timeout_s
        self.wifi_jitter_ms, self.seed = wifi_jitter_ms, seed
        self.base_url = http_base(url)
        self.session_id = ""
        self.sim: DeviceSimulator | None = None
        self._init_events()
        self._onsets: dict[int, float] = {}  # utterance -> speech onset, s into it
        self._ends: dict[int, float] = {}  # utterance -> where its speech ends, s into it
        self._revive: Utterance | None = None
        if version not in framing.VERSIONS:
            raise ValueError(f"protocol version {version} (one of {framing.VERSIONS})")

    # -- the call -------------------------------------------------------------------

    async def run(
        self,
        opening: Utterance,
        barge_ins: list[Utterance] = (),  # type: ignore[assignment]
        *,
        out_wav: Path | None = None,
        timeout_s: float = 60.0,
        settle_s: float = 0.5,
        revive: Utterance | None = None,
        hangup_after_s: float | None = None,
    ) -> CallResult:
        """Make the call and return what happened (the arguments are those
        of :meth:`client.call.CallClient.run`; utterances are 48 kHz).

        Raises:
            CallError: the server refused the device, sent no hello in time,
                or heard no speech in the opening.
            OSError: ``out_wav`` cannot be written.
        """
        measures = [BargeInMeasure(label=u.label, at_s=u.at_s or 0.0, kind=u.kind) for u in barge_ins]
        self._revive = revive
        sim = self.sim = DeviceSimulator(self.url, self.device_token, version=self.version, device_id=self.device_id,
                                         hello_timeout_s=self.hello_timeout_s, wifi_jitter_ms=self.wifi_jitter_ms,
                                         seed=self.seed)
        async with aiohttp.ClientSession() as http:
            await sim.connect()
            self.session_id = sim.session_id or sim.response_headers.get("X-Turnkeeper-Session", "")
            follower = asyncio.ensure_future(self._follow(http)) if self.following else None
            try:
                timed_out, server_hung_up = await run_until_hangup(
                    self._script(sim, opening, barge_ins, measures, hangup_after_s), sim.server_closed, timeout_s
                )
                await asyncio.sleep(settle_s)
            finally:
                await sim.close()
                if follower is not None:
                    await asyncio.sleep(0.3)  # the last events (the turn settled after the close)
                    follower.cancel()
                    await asyncio.gather(follower, return_exceptions=True)
        self._measure(sim, measures)
        if out_wav is not None:
            sim.write_heard(out_wav)
        heard = sim.heard_frames()
        turns, withdrawn = caller_turns(list(self._turns.values())) if self.following else (self._device_turns(sim), [])
        return CallResult(
            session_id=self.session_id,
            turns=turns,
            withdrawn=withdrawn,
            barge_ins=measures,
            events=list(self._events),
            received_audio_ms=sum(1 for f in heard if f.real) * 20,
            timed_out=timed_out,
            server_hung_up=server_hung_up,
            received=[(f.at, f.dbfs, f.sound_end_ms) for f in heard],
            event_times=list(self._event_times),
            transport="device",
            protocol_errors=list(sim.log.errors),
            transport_info={
                "protocol_version": self.version, "mode": self.mode,
                "downlink_rate": sim.downlink_rate, "downlink_frame_ms": sim.downlink_frame_ms,
                "speaker_overflows": sim.speaker.overflows,
            },
        )

    def reception(self) -> list[tuple[float, float, float]]:
        """What the simulated device's speaker has played so far, one entry
        per 20 ms from the connection to the end of the last audio it
        played: (its start, client monotonic s; level, dBFS RMS; where its
        sound ends, ms into the frame, 0 if silent); empty before the
        connection (``CallResult.received`` at the call's end)."""
        if self.sim is None:
            return []
        return [(f.at, f.dbfs, f.sound_end_ms) for f in self.sim.heard_frames()]

    @staticmethod
    def _device_turns(sim: DeviceSimulator) -> list[TurnView]:
        """Turns as the device was told them (no event log): each ``stt``
        opens one, the ``sentence_start`` texts after it are its reply."""
        turns: list[TurnView] = []
        for _, m in sim.log.messages_in:
            if m.get("type") == "stt" and isinstance(m.get("text"), str):
                turns.append(TurnView(id=f"stt-{len(turns) + 1}", generation=len(turns) + 1, status="n/a",
                                      label="told to the device", transcript=m["text"]))
            elif m.get("type") == "tts" and m.get("state") == "sentence_start" and turns and isinstance(m.get("text"), str):
                turns[-1].reply += ("" if not turns[-1].reply else " ") + m["text"]
        return turns

    # -- the script ----------------------------------------------------------------------

    async def _say(self, sim: DeviceSimulator, index: int, pcm48: bytes, *, ptt: bool,
                   speech_end_s: float | None = None) -> float | None:
        """Say an utterance; with ``ptt``, hold the button for its length.
        Returns when the button was pressed (None without ``ptt``)."""
        onset = first_sound_sample(pcm48)
        if onset is not None:
            self._onsets[index] = onset / PLAYOUT_RATE
        end = last_sound_sample(pcm48) if speech_end_s is None else round(speech_end_s * PLAYOUT_RATE)
        if end is not None:
            self._ends[index] = end / PLAYOUT_RATE
        pcm = to_16k(pcm48)
        pressed = await sim.press() if ptt else None
        sim.say(pcm, index)
        await sim.said()
        if ptt:
            await sim.release()
        return pressed

    async def _script(self, sim: DeviceSimulator, opening: Utterance, barge_ins: list[Utterance],
                      measures: list[BargeInMeasure], hangup_after_s: float | None) -> None:
        ptt = self.mode == "manual"
        if not ptt:
            await sim.listen("realtime")
        await asyncio.sleep(LEAD_SILENCE_S)
        began = time.monotonic()
        await self._say(sim, 1, opening.pcm, ptt=ptt)
        await self._expect_reply(sim, began)
        for k, (utt, m) in enumerate(zip(barge_ins, measures, strict=True), start=2):
            sent_at = time.monotonic()
            while True:
                try:
                    m.agent_started_at = await sim.wait_audible(sent_at, REVIVE_AFTER_S if self._revive is not None else None)
                    break
                except TimeoutError:
                    assert self._revive is not None
                    await self._say(sim, -2, self._revive.pcm, ptt=ptt)
                    sent_at = time.monotonic()
            await asyncio.sleep(max(0.0, m.agent_started_at + (utt.at_s or 0.0) - time.monotonic()))
            if utt.abort:
                m.initiator = "abort"
                m.sent_from = m.onset_sent_at = await sim.abort()
                try:
                    await sim.wait_message(lambda msg: msg.get("type") == "tts" and msg.get("state") == "stop", TTS_STOP_WAIT_S)
                except TimeoutError:
                    pass
                if self._revive is not None and k - 1 < len(barge_ins):  # a reply for the next one to interrupt
                    await asyncio.sleep(0.3)
                    await self._say(sim, -2, self._revive.pcm, ptt=ptt)
            elif ptt:
                m.initiator = "ptt"
                m.sent_from = m.onset_sent_at = await self._say(sim, k, utt.pcm, ptt=True)
            else:
                m.initiator = "voice"
                m.sent_from = time.monotonic()
                await self._say(sim, k, utt.pcm, ptt=False, speech_end_s=utt.speech_end_s)
            m.sent_until = time.monotonic()
            last = k - 1 == len(barge_ins)
            if utt.kind != "speech" and not (last and hangup_after_s is not None):
                await asyncio.sleep(1.0)
        if hangup_after_s is not None:
            await asyncio.sleep(hangup_after_s)
            return
        if self.following:
            await self._wait_all_terminal()
        else:  # no events: wait for the speaker to fall silent
            while not quiet(sim.heard_frames(time.monotonic())):
                await asyncio.sleep(0.1)

    async def _expect_reply(self, sim: DeviceSimulator, since: float) -> None:
        if self.following:
            await self._expect_a_turn()
            return
        try:
            await sim.wait_message(lambda m: m.get("type") in ("stt", "tts"), NO_SPEECH_S, since=since)
        except TimeoutError:
            raise CallError(f"the server answered nothing to the opening audio ({NO_SPEECH_S:.0f} s after it ended)") from None

    # -- measuring ------------------------------------------------------------------------------

    def _measure(self, sim: DeviceSimulator, measures: list[BargeInMeasure]) -> None:
        heard = sim.heard_frames()
        received = sim.log.received
        for k, m in enumerate(measures, start=2):
            if m.sent_from is None:
                continue
            until = self._verdict_until(measures, k - 2, VERDICT_WAIT_S)
            self._judge_by_events(m, until)
            if m.old_turn_id is None:  # an abort is no barge-in: the turn it stopped went CANCEL_REQUESTED
                m.old_turn_id = next((ev.get("turn_id") for at, ev in self._event_times if m.sent_from <= at <= until
                                      and ev.get("type") == "turn" and ev.get("status") == "CANCEL_REQUESTED"), None)
            if m.initiator == "voice":
                m.onset_sent_at = self._onset_sent(sim, k)
                end = self._sent_at(sim, k, self._ends)
                if m.resumed is not None and not m.barged_in and end is not None:
                    again = sound_again_after(heard, end)
                    m.resumed_after_end_ms = None if again is None else round((again - end) * 1000, 1)
            t = m.onset_sent_at
            if t is None:
                continue
            m.speaking_at_onset = any(p.segment is not None and p.segment.loud and p.segment.start <= t
                                      and p.segment.sound_until >= t - 0.1 for p in received)
            stop = next(iter(sim.log.tts("stop", after=t)), None)
            if stop is not None and stop > until + 1.0:
                stop = None
            reply_start = max((a for a in sim.log.tts("start") if a <= t), default=float("-inf"))
            next_start = next(iter(sim.log.tts("start", after=t)), float("inf"))
            if stop is None:
                if not self.following:
                    m.barged_in = False
                m.silent_at = silent_run_end(heard, t)
                continue
            if not self.following:  # the device's own verdict: the server stopped the reply
                m.barged_in = True
            horizon = min(stop, next_start)
            old = [p for p in received if reply_start <= p.at < horizon]
            played = [p.segment for p in old if p.segment is not None and p.segment.loud and p.segment.sound_until > t]
            m.silent_at = max((s.sound_until for s in played), default=t)
            m.tts_stop_ms = round((stop - t) * 1000, 1)
            late = [p.at for p in old if p.at >= t]
            m.received_stop_ms = round((max(late) - t) * 1000, 1) if late else 0.0
            after = [p for p in received if stop <= p.at < next_start and p.sound_end > 0]
            m.old_audio_after_tts_stop_ms = round(sum(p.samples for p in after) * 1000 / sim.downlink_rate, 1)
            segs = [p.segment for p in old if p.segment is not None]
            m.played_ms_at_ear = round(sum(max(0.0, min(s.end, t) - s.start) for s in segs) * 1000, 1)
            self._interrupted(m)

    def _onset_sent(self, sim: DeviceSimulator, k: int) -> float | None:
        """When the first sample of utterance ``k``'s speech left (clock s):
        when the packet carrying it was sent (once its 60 ms were captured)."""
        return self._sent_at(sim, k, self._onsets)

    @staticmethod
    def _sent_at(sim: DeviceSimulator, k: int, points: dict[int, float]) -> float | None:
        """When the packet carrying the sample at ``points[k]`` (s into
        utterance ``k``) was sent (clock s)."""
        at_s = points.get(k)
        if at_s is None:
            return None
        sample = int(at_s * UPLINK_RATE)
        for p in sim.log.sent:
            if p.utterance == k and p.sample + UPLINK_RATE * 60 // 1000 > sample:
                return p.at
        return None

