"""A scripted phone call with the simulator, measured at the caller's ear:
``turnkeeper call --phone twilio|telnyx``, the phone tests and the phone
barge-in bench.

:class:`PhoneCallClient` answers the call as the provider would (Twilio:
it POSTs the voice webhook and follows the TwiML's ``<Connect><Stream>``
with its ``<Parameter>``s; Telnyx: it opens ``/v1/telephony/telnyx``),
plays the opening utterance, interrupts the agent with each barge-in
utterance a set time after the agent is heard, and returns the same
:class:`client.results.CallResult` as the WebRTC client. The turns come
from the session's event log (``GET /v1/sessions/{id}/events`` with a
bearer token; the session id is the ``X-Turnkeeper-Session`` header of the
stream's upgrade response); without a token the result has audio only.

Audible stop time on a phone call = from the first sample of barge-in
speech sent (in the ``media`` message that carried it; for telephone keys,
the first ``dtmf`` message) to the last sample
of old-generation audio played at the caller's ear: old audio is what the
server sent before the barge-in's ``clear`` (the first from
``FENCE_CLEAR_SLACK_S`` before the fence's event on; a stage-1 pause may have sent one before, recalling what the
provider held); without a ``clear``, the end of the sound before
``SILENT_RUN_MS`` of silence.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import time
import uuid
import xml.etree.ElementTree as ET  # Python's expat refuses entity-expansion bombs
from pathlib import Path

import aiohttp

from client.phone import SILENCE_DBFS, PhoneSimulator
from client.phone_dialects import Dialect, TelnyxDialect, TwilioDialect
from client.results import BargeInMeasure, CallError, CallResult, Utterance, caller_turns
from client.session_events import SessionEvents, quiet, run_until_hangup, silent_run_end, sound_again_after
from media.frames import PLAYOUT_RATE, PcmResampler, first_sound_sample, last_sound_sample
from media.g711 import MULAW_RATE

log = logging.getLogger(__name__)

LEAD_SILENCE_S = 0.3  # line silence before the opening utterance
VERDICT_WAIT_S = 1.5
REVIVE_AFTER_S = 5.0
KEY_GAP_S = 0.1  # between two telephone keys
#: a barge-in's clear may reach the ear this long before its fence's event (s)
FENCE_CLEAR_SLACK_S = 0.05
SESSION_HEADER = "X-Turnkeeper-Session"


def twilio_signature(auth_token: str, url: str, params: dict[str, str]) -> str:
    """``X-Twilio-Signature`` as Twilio computes it (docs: "Webhooks
    security"): HMAC-SHA1 keyed with the Auth Token over the full URL
    followed by each POST parameter's name and value, sorted by name;
    base64."""
    data = url + "".join(k + params[k] for k in sorted(params))
    return base64.b64encode(hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()).decode()


def to_8k(pcm48: bytes) -> bytes:
    """48 kHz mono s16 to 8 kHz (PyAV)."""
    r = PcmResampler(MULAW_RATE)
    return r.pcm(pcm48, PLAYOUT_RATE) + r.flush()


class PhoneCallClient(SessionEvents):
    """One phone call against ``base_url`` (``http://127.0.0.1:8080``).

    Args:
        provider: ``twilio`` or ``telnyx``.
        token: a bearer token of the call's tenant, to read its events.
        twilio_auth_token: sign the webhook and the upgrade with it.
        reorder / seed: deliver that share of microphone frames late
            (:class:`client.phone.PhoneSimulator`).
        to_number: the number called (the webhook's ``To``).
    """

    def __init__(
        self,
        base_url: str,
        provider: str = "twilio",
        *,
        token: str | None = None,
        twilio_auth_token: str | None = None,
        reorder: float = 0.0,
        seed: int = 0,
        to_number: str = "+15550100002",
    ) -> None:
        if provider not in ("twilio", "telnyx"):
            raise ValueError(f"unknown phone provider {provider!r} (twilio or telnyx)")
        self.base_url = base_url.rstrip("/")
        self.provider = provider
        self.token = token
        self.twilio_auth_token = twilio_auth_token
        self.reorder, self.seed, self.to_number = reorder, seed, to_number
        self.session_id = ""
        self.sim: PhoneSimulator | None = None
        self._init_events()
        self._onsets: dict[int, float] = {}  # utterance -> onset, s into it
        self._ends: dict[int, float] = {}  # utterance -> where its speech ends, s into it
        self._keys_at: dict[int, float] = {}  # utterance of keys -> when the first was sent
        self._revive: Utterance | None = None

    # -- answering ------------------------------------------------------------------

    async def _answer(self, http: aiohttp.ClientSession) -> tuple[Dialect, str, dict[str, str]]:
        """(dialect, stream URL, custom parameters) as the provider gets them."""
        if self.provider == "telnyx":
            d: Dialect = TelnyxDialect()
            return d, self.base_url + d.path, {}
        call_sid, account_sid = "CA" + uuid.uuid4().hex, "AC" + uuid.uuid4().hex
        url = f"{self.base_url}/v1/telephony/twilio/voice"
        form = {"CallSid": call_sid, "AccountSid": account_sid, "From": "+15550100001", "To": self.to_number,
                "CallStatus": "ringing", "Direction": "inbound", "ApiVersion": "2010-04-01"}
        headers = {}
        if self.twilio_auth_token:
            headers["X-Twilio-Signature"] = twilio_signature(self.twilio_auth_token, url, form)
        try:
            async with http.post(url, data=form, headers=headers) as resp:
                body, status = await resp.text(), resp.status
        except (aiohttp.ClientError, OSError) as exc:
            raise CallError(f"cannot reach {url}: {exc or type(exc).__name__}") from exc
        if status != 200:
            raise CallError(f"the voice webhook answered HTTP {status}: {body[:200]!r}")
        try:
            stream = ET.fromstring(body).find("./Connect/Stream")
        except ET.ParseError as exc:
            raise CallError(f"the voice webhook did not answer TwiML: {body[:200]!r}") from exc
        if stream is None or not stream.get("url"):
            raise CallError(f"the TwiML has no <Connect><Stream url=...>: {body[:200]!r}")
        params = {p.get("name", ""): p.get("value", "") for p in stream.findall("Parameter")}
        return TwilioDialect(call_sid=call_sid, account_sid=account_sid), str(stream.get("url")), params

    # -- the call -----------------------------------------------------------------------

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
        of :meth:`client.call.CallClient.run`).

        Raises:
            CallError: the webhook or the stream was refused or unreachable,
                or the server heard no speech in the opening.
            OSError: ``out_wav`` cannot be written.
        """
        measures = [BargeInMeasure(label=u.label, at_s=u.at_s or 0.0, kind=u.kind) for u in barge_ins]
        self._revive = revive
        async with aiohttp.ClientSession() as http:
            dialect, stream_url, params = await self._answer(http)
            headers = {}
            if self.twilio_auth_token and self.provider == "twilio":
                headers["X-Twilio-Signature"] = twilio_signature(self.twilio_auth_token, stream_url, {})
            sim = self.sim = PhoneSimulator(stream_url, dialect, custom_parameters=params, headers=headers,
                                            reorder=self.reorder, seed=self.seed)
            await sim.connect()
            self.session_id = sim.response_headers.get(SESSION_HEADER, "")
            follower = asyncio.ensure_future(self._follow(http)) if self.token and self.session_id else None
            try:
                timed_out, server_hung_up = await run_until_hangup(
                    self._script(sim, opening, barge_ins, measures, hangup_after_s), sim.server_closed, timeout_s
                )
                await asyncio.sleep(settle_s)
            finally:
                await sim.hangup()
                if follower is not None:
                    await asyncio.sleep(0.3)  # the last events (the turn settled after stop)
                    follower.cancel()
                    await asyncio.gather(follower, return_exceptions=True)
        self._measure(sim, measures)
        if out_wav is not None:
            sim.write_heard(out_wav)
        heard = sim.log.heard
        turns, withdrawn = caller_turns(list(self._turns.values()))
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
            transport=self.provider,
            protocol_errors=list(sim.log.errors),
        )

    def reception(self) -> list[tuple[float, float, float]]:
        """What the simulated caller has heard so far, one entry per 20 ms
        the phone played (silence where nothing did): (when it began
        playing, client monotonic s; level, dBFS RMS; where its sound ends,
        ms into the frame, 0 if silent); empty before the stream is up
        (``CallResult.received`` at the call's end)."""
        if self.sim is None:
            return []
        return [(f.at, f.dbfs, f.sound_end_ms) for f in list(self.sim.log.heard)]

    # -- the script ------------------------------------------------------------------------

    def _say(self, sim: PhoneSimulator, index: int, pcm48: bytes, speech_end_s: float | None = None) -> None:
        onset = first_sound_sample(pcm48)
        if onset is not None:
            self._onsets[index] = onset / PLAYOUT_RATE
        end = last_sound_sample(pcm48) if speech_end_s is None else round(speech_end_s * PLAYOUT_RATE)
        if end is not None:
            self._ends[index] = end / PLAYOUT_RATE
        sim.say(to_8k(pcm48), index)

    async def _script(self, sim: PhoneSimulator, opening: Utterance, barge_ins: list[Utterance],
                      measures: list[BargeInMeasure], hangup_after_s: float | None) -> None:
        await asyncio.sleep(LEAD_SILENCE_S)
        self._say(sim, 1, opening.pcm)
        await sim.said()
        await self._expect_a_turn()
        for k, (utt, m) in enumerate(zip(barge_ins, measures, strict=True), start=2):
            sent_at = time.monotonic()
            while True:
                try:
                    frame = await sim.wait_heard(lambda f, t=sent_at: f.at > t and f.real and f.dbfs > SILENCE_DBFS,
                                                 REVIVE_AFTER_S if self._revive is not None else None)
                    m.agent_started_at = frame.at
                    break
                except TimeoutError:
                    assert self._revive is not None
                    self._say(sim, -2, self._revive.pcm)
                    await sim.said()
                    sent_at = time.monotonic()
            await asyncio.sleep(max(0.0, m.agent_started_at + (utt.at_s or 0.0) - time.monotonic()))
            m.sent_from = time.monotonic()
            if utt.keys:
                self._keys_at[k] = time.monotonic()
                for key in utt.keys:
                    await sim.press(key)
                    await asyncio.sleep(KEY_GAP_S)
            else:
                self._say(sim, k, utt.pcm, utt.speech_end_s)
                await sim.said()
            m.sent_until = time.monotonic()
            last = k - 1 == len(barge_ins)
            if utt.kind != "speech" and not (last and hangup_after_s is not None):
                await asyncio.sleep(1.0)
        if hangup_after_s is not None:
            await asyncio.sleep(hangup_after_s)
            return
        if self.following:
            await self._wait_all_terminal()
        else:  # no events: wait for the agent to fall silent
            await sim.wait_heard(lambda f: quiet(sim.log.heard))

    # -- measuring ----------------------------------------------------------------------------

    def _measure(self, sim: PhoneSimulator, measures: list[BargeInMeasure]) -> None:
        heard = sim.log.heard
        for k, m in enumerate(measures, start=2):
            if m.sent_from is None:
                continue
            until = self._verdict_until(measures, k - 2, VERDICT_WAIT_S)
            fence_at = self._judge_by_events(m, until)
            end = self._sent_at(sim, k, self._ends)
            if m.resumed is not None and not m.barged_in and end is not None:
                again = sound_again_after(heard, end)
                m.resumed_after_end_ms = None if again is None else round((again - end) * 1000, 1)
            t = self._onset_sent(sim, k)
            m.onset_sent_at = t
            if t is None:
                continue
            m.speaking_at_onset = any(t - 0.1 <= f.at <= t and f.real and f.dbfs > SILENCE_DBFS for f in heard)
            # the barge-in's clear: the first about the fence (it may come a
            # few ms before the fence's event; one sent earlier recalled the
            # provider's audio on a stage-1 pause, hundreds of ms before the
            # commit); a pause taken back made no barge-in: its clear measures nothing
            after = max(t, fence_at - FENCE_CLEAR_SLACK_S) if fence_at is not None else t
            clear = next(((at, c) for at, c in sim.log.clears if at >= after and at <= until + 1.0), None)
            if clear is not None and (fence_at is not None or not self.following):
                at_clear, cleared = clear
                old = [f for f in heard if f.start < cleared.at_offset and f.real and f.at >= t - 0.02]
                loud = [f for f in old if f.dbfs > SILENCE_DBFS]
                m.silent_at = loud[-1].at + loud[-1].sound_end_ms / 1000 if loud else t
                if fence_at is not None:
                    m.clear_after_fence_ms = round((at_clear - fence_at) * 1000, 1)
                self._after_clear(sim, m, at_clear, cleared.at_offset + cleared.dropped)
            else:
                m.silent_at = silent_run_end(heard, t)

    def _onset_sent(self, sim: PhoneSimulator, k: int) -> float | None:
        """When the first sample of utterance ``k``'s speech left (clock s)."""
        if k in self._keys_at:  # keys: the first one's dtmf message
            return self._keys_at[k]
        return self._sent_at(sim, k, self._onsets)

    @staticmethod
    def _sent_at(sim: PhoneSimulator, k: int, points: dict[int, float]) -> float | None:
        """When the sample at ``points[k]`` (s into utterance ``k``) left (clock s)."""
        at_s = points.get(k)
        if at_s is None:
            return None
        sample = int(at_s * MULAW_RATE)
        for f in sim.log.sent:
            if f.utterance == k and f.sample + 160 > sample:
                return f.at + max(0, sample - f.sample) / MULAW_RATE
        return None

    def _after_clear(self, sim: PhoneSimulator, m: BargeInMeasure, at_clear: float, received_at_clear: int) -> None:
        """Old audio played after the clear, and how much of the old reply
        the ear played. The old reply's audio is what arrived from its turn
        going RUNNING to the clear; anything arriving after the clear and
        before the new turn's ``transcript`` (its reply cannot come sooner)
        is old audio the server sent after its clear."""
        new_turn_at = next((at for at, ev in self._event_times if at > at_clear and ev.get("type") == "transcript"
                            and ev.get("turn_id") != m.old_turn_id), None)
        end_offset = next((off for at, off, _ in sim.log.media_in if new_turn_at is not None and at >= new_turn_at),
                          sim.playout.received)
        stale = [f for f in sim.log.heard if received_at_clear <= f.start < end_offset and f.real and f.dbfs > SILENCE_DBFS]
        m.old_audio_after_clear_ms = len(stale) * 20.0
        running = next((at for at, ev in self._event_times if ev.get("type") == "turn" and ev.get("turn_id") == m.old_turn_id
                        and ev.get("status") == "RUNNING"), None)
        first = next((off for at, off, _ in sim.log.media_in if running is not None and at >= running), None)
        cleared = next(c for at, c in sim.log.clears if at == at_clear)
        if first is not None:
            m.played_ms_at_ear = max(0, cleared.at_offset - first) * 1000 / MULAW_RATE
        self._interrupted(m)
