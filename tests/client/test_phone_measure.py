"""The phone call's measures at the caller's ear, on a made-up reception:
the audible stop runs from the first barge-in speech sample sent to the
last old-generation sample played (old = received before the clear)."""

from __future__ import annotations

from client.phone import HeardFrame, PhoneSimulator, SentFrame
from client.phone_call import PhoneCallClient, twilio_signature
from client.phone_dialects import TwilioDialect
from client.phone_playout import Cleared
from client.results import BargeInMeasure


def reception(sim: PhoneSimulator, *, loud_until: float, clear_at: float | None) -> None:
    """20 ms frames from 9.00 s to 11.00 s: old audio (loud) until
    ``loud_until``, nothing after a clear at ``clear_at``."""
    offset = 0
    for i in range(100):
        at = round(9.0 + i * 0.02, 2)
        playing = clear_at is None or at < clear_at
        loud = at < loud_until
        real = 160 if playing and loud else 0
        sim.log.heard.append(HeardFrame(at, offset, real, -20.0 if real else -120.0, 20.0 if real else 0.0))
        if real:
            sim.log.media_in.append((at - 0.06, offset, real))  # it arrived 60 ms ahead (send-ahead)
        offset += real
        sim.playout.received = offset + 8000  # the clear dropped a second
    for i in range(50):
        sim.log.sent.append(SentFrame(round(10.0 + i * 0.02, 2), 500 + i, 2, i * 160))


def measured(sim: PhoneSimulator, events: list[tuple[float, dict[str, object]]]) -> BargeInMeasure:
    client = PhoneCallClient("http://127.0.0.1:1")
    client._onsets[2] = 0.05  # speech begins 50 ms into the utterance: sample 400, in the frame sent at 10.04
    client._event_times = events  # type: ignore[assignment]
    client._events = [ev for _, ev in events]  # type: ignore[misc]
    m = BargeInMeasure(label="b", at_s=1.0, sent_from=10.0, sent_until=11.0)
    client._measure(sim, [m])
    return m


def test_the_stop_is_the_end_of_the_old_audio_the_ear_played_before_the_clear() -> None:
    sim = PhoneSimulator("ws://127.0.0.1:1/x", TwilioDialect())
    reception(sim, loud_until=12.0, clear_at=10.13)
    last_old = max(f.start for f in sim.log.heard if f.real)
    sim.log.clears.append((10.13, Cleared(at_offset=last_old + 160, dropped=8000, echoes=["s3"])))
    m = measured(sim, [
        (8.9, {"type": "turn", "turn_id": "t1", "status": "RUNNING", "generation": 1, "label": "running"}),
        (10.11, {"type": "barge_in", "old_turn_id": "t1", "onset_to_fence_ms": 55.0}),
        (10.2, {"type": "agent.interrupted", "turn_id": "t1", "heard": "once upon", "played_ms": 1160}),
    ])
    assert m.onset_sent_at is not None and abs(m.onset_sent_at - 10.05) < 1e-9
    assert m.barged_in and m.speaking_at_onset and m.server_onset_to_fence_ms == 55.0
    # the last old frame began at 10.12 and sounded to its end: 10.14 - 10.05
    assert m.stop_ms is not None and abs(m.stop_ms - 90.0) < 1e-6
    assert m.clear_after_fence_ms == 20.0
    assert m.old_audio_after_clear_ms == 0.0
    assert m.server_heard == "once upon" and m.server_played_ms == 1160
    assert m.played_ms_at_ear == (last_old + 160) / 8  # the reply's audio from its first byte to the clear


def test_a_pause_before_the_clear_stops_the_audio_earlier() -> None:
    sim = PhoneSimulator("ws://127.0.0.1:1/x", TwilioDialect())
    reception(sim, loud_until=10.08, clear_at=10.3)  # stage 1 stopped sending; the send-ahead ran dry
    last_old = max(f.start for f in sim.log.heard if f.real)
    sim.log.clears.append((10.3, Cleared(at_offset=last_old + 160, dropped=0, echoes=[])))
    m = measured(sim, [(10.28, {"type": "barge_in", "old_turn_id": "t1", "onset_to_fence_ms": 200.0})])
    assert m.stop_ms is not None and abs(m.stop_ms - 30.0) < 1e-6  # 10.06 + 20 ms - 10.05
    assert m.clear_after_fence_ms == 20.0


def test_without_a_clear_the_old_audio_ends_where_the_ear_hears_silence() -> None:
    sim = PhoneSimulator("ws://127.0.0.1:1/x", TwilioDialect())
    reception(sim, loud_until=10.5, clear_at=None)  # a bridge that forgot clear: it all played out
    m = measured(sim, [(10.11, {"type": "barge_in", "old_turn_id": "t1", "onset_to_fence_ms": 55.0})])
    assert m.clear_after_fence_ms is None
    assert m.stop_ms is not None and abs(m.stop_ms - 450.0) < 1e-6  # 10.48 + 20 ms - 10.05


def test_the_webhook_signature_is_twilios_documented_example() -> None:
    # Twilio's "Webhooks security" page: auth token 12345, this URL and these
    # POST parameters give 0/KCTR6DLpKmkAf8muzZqo1nDgQ=
    params = {"CallSid": "CA1234567890ABCDE", "Caller": "+12349013030", "Digits": "1234",
              "From": "+12349013030", "To": "+18005551212"}
    assert twilio_signature("12345", "https://mycompany.com/myapp.php?foo=1&bar=2", params) == "0/KCTR6DLpKmkAf8muzZqo1nDgQ="
