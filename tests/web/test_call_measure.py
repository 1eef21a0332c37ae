"""How the call client measures the audible stop, on synthetic timelines."""

from __future__ import annotations

import numpy as np
import pytest
from aiortc import RTCPeerConnection

from client.call import CallClient, sound_end_ms
from client.results import BargeInMeasure, RequestMeasure, TurnView, Utterance, caller_turns, track_turn
from media.playout import PlayoutFrame


def test_sound_end_ms() -> None:
    f = np.zeros(960, dtype="<i2")
    assert sound_end_ms(f.tobytes()) == 0.0
    f[:300] = 8000  # 6.25 ms of sound, ends inside the third 2.5 ms window
    assert sound_end_ms(f.tobytes()) == 7.5
    f[:] = 8000
    assert sound_end_ms(f.tobytes()) == 20.0


def timeline(sounds: list[tuple[float, float]]) -> list[tuple[float, float, float]]:
    """(dBFS, tail ms) per frame, arriving every 20 ms from t=10.0 s."""
    return [(10.0 + 0.02 * i, lv, tail) for i, (lv, tail) in enumerate(sounds)]


def measure(rx: list[tuple[float, float, float]], onset: float) -> BargeInMeasure:
    c = CallClient("http://127.0.0.1:1")
    c._received = rx
    c._onset_sent[2] = onset
    m = BargeInMeasure(label="b", at_s=1.0, sent_from=onset - 0.1, sent_until=onset + 0.5)
    c._event_times.append((onset + 0.05, {"type": "barge_in", "onset_to_fence_ms": 40.0}))
    c._event_times.append((onset + 5.0, {"type": "barge_in", "onset_to_fence_ms": 99.0}))  # another clip's
    c._measure([m])
    return m


def test_stop_counts_to_where_the_sound_ends() -> None:
    loud, quiet = (-20.0, 20.0), (-90.0, 0.0)
    rx = timeline([loud] * 10 + [(-35.0, 6.5)] + [quiet] * 40)
    m = measure(rx, onset=10.0 + 0.02 * 3)
    assert m.speaking_at_onset
    # last sound frame arrives at index 10 (10.2 s) and its sound ends 6.5 ms in
    assert m.stop_ms is not None and abs(m.stop_ms - (200 - 60 + 6.5)) < 1e-6
    assert m.server_onset_to_fence_ms == 40.0 and m.barged_in and m.resumed is None


def test_a_clip_that_only_paused_the_agent_is_scored_as_resumed() -> None:
    c = CallClient("http://127.0.0.1:1")
    m = BargeInMeasure(label="cough", at_s=1.0, kind="noise", sent_from=10.0, sent_until=10.4)
    c._event_times.append((10.9, {"type": "false_interruption", "paused_ms": 600.0}))
    c._measure([m])
    assert not m.barged_in and m.resumed == "false_interruption"


def test_pause_shorter_than_the_silent_run_is_not_a_stop() -> None:
    loud, quiet = (-20.0, 20.0), (-90.0, 0.0)
    rx = timeline([loud] * 5 + [quiet] * 10 + [loud] * 5 + [quiet] * 30)
    m = measure(rx, onset=10.0)
    assert m.stop_ms is not None and abs(m.stop_ms - 400) < 1e-6  # the 200 ms pause did not count


def test_agent_already_silent_at_onset() -> None:
    quiet = (-90.0, 0.0)
    m = measure(timeline([quiet] * 40), onset=10.1)
    assert not m.speaking_at_onset
    assert m.stop_ms == 0.0


def test_no_long_silence_means_unmeasured() -> None:
    m = measure(timeline([(-20.0, 20.0)] * 40), onset=10.1)
    assert m.stop_ms is None


def test_the_last_speech_sample_counts_as_sent_with_its_frame() -> None:
    """Voice-to-voice starts when the frame carrying the last speech sample
    leaves, not where in that frame the sample lies (which would make it up
    to 20 ms shorter); every frame's departure is kept for the requests."""
    c = CallClient("http://127.0.0.1:1")
    c._ends[1] = 1000  # inside the second frame (samples 960..1919)
    c._on_mic_sent(PlayoutFrame(bytes(1920), generation=1, sample=0), 5.0)
    assert 1 not in c._end_sent
    c._on_mic_sent(PlayoutFrame(bytes(1920), generation=1, sample=960), 5.02)
    c._on_mic_sent(PlayoutFrame(bytes(1920), generation=1, sample=1920), 5.04)
    c._on_mic_sent(None, 5.06)  # microphone silence belongs to no utterance
    c._on_mic_sent(PlayoutFrame(bytes(1920), generation=0, sample=0), 5.08)  # lead silence neither
    assert c._end_sent[1] == 5.02
    assert c._frames_sent == {1: [5.0, 5.02, 5.04]}


def requests_call(rx: list[tuple[float, float, float]]) -> tuple[CallClient, list[RequestMeasure]]:
    """Two requests: the first sent from 10.0 s (speech ends in its 50th
    frame), the second from 20.0 s (speech ends in its 25th)."""
    c = CallClient("http://127.0.0.1:1")
    c._frames_sent = {1: [10.0 + 0.02 * i for i in range(60)], 2: [20.0 + 0.02 * i for i in range(30)]}
    c._ends = {1: 50 * 960, 2: 24 * 960 + 500}
    c._received = rx
    measures = [RequestMeasure("a", waited_until=15.0), RequestMeasure("b", waited_until=24.0)]
    c._measure_requests(measures)
    return c, measures


def test_each_request_is_measured_from_its_speech_end_to_the_next_sound() -> None:
    loud, quiet = -20.0, -90.0
    rx = [(11.0, quiet, 0.0), (12.3, loud, 20.0), (12.32, loud, 20.0), (13.0, quiet, 0.0),  # the first reply
          (20.3, quiet, 0.0), (21.5, loud, 20.0)]  # the second
    _, (a, b) = requests_call(rx)
    assert a.speech_end_sent == 10.0 + 0.02 * 49 and a.first_reply_at == 12.3 and not a.sound_before_end
    assert a.voice_to_voice_ms is not None and abs(a.voice_to_voice_ms - (12.3 - 10.98) * 1000) < 0.1
    assert b.speech_end_sent == 20.0 + 0.02 * 24 and b.first_reply_at == 21.5
    assert a.sent_at(0) == 10.0 and a.sent_at(959) == 10.0 and a.sent_at(960) == 10.02 and a.sent_at(60 * 960) is None


def test_sound_before_a_request_ends_is_told_apart_from_its_reply() -> None:
    loud = -20.0
    rx = [(10.5, loud, 20.0), (20.1, loud, 20.0), (20.2, loud, 20.0)]  # the agent talks while each is said, then nothing
    _, (a, b) = requests_call(rx)
    assert a.sound_before_end and a.first_reply_at is None and a.voice_to_voice_ms is None
    assert b.sound_before_end and b.first_reply_at is None


def test_a_request_never_sent_is_not_measured() -> None:
    c = CallClient("http://127.0.0.1:1")
    c._received = [(10.0, -20.0, 20.0)]
    m = RequestMeasure("never")
    c._measure_requests([m])
    assert m.sent_from is None and m.speech_end_sent is None and m.voice_to_voice_ms is None and not m.sound_before_end


async def test_a_conversation_needs_requests_and_sane_waits() -> None:
    c = CallClient("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="at least one request"):
        await c.converse([])
    with pytest.raises(ValueError, match="reply_timeout_s"):
        await c.converse([Utterance(bytes(1920))], reply_timeout_s=0)
    with pytest.raises(ValueError, match="gap_s"):
        await c.converse([Utterance(bytes(1920))], gap_s=-1)
    with pytest.raises(ValueError, match=r"request 2 \(b\) has no audio"):
        await c.converse([Utterance(bytes(1920), label="a"), Utterance(b"", label="b")])
    with pytest.raises(ValueError, match=r"request 1 \(a\): speech_end_s 0.5 s is outside its audio \(0 to 0.02 s\)"):
        await c.converse([Utterance(bytes(1920), label="a", speech_end_s=0.5)])
    with pytest.raises(ValueError, match="speech_end_s 0 s"):
        await c.converse([Utterance(bytes(1920), label="a", speech_end_s=0)])


class _Mapper:
    def __init__(self, origin: int | None) -> None:
        self._origin = origin


class _Receiver:
    def __init__(self, origin: int | None) -> None:
        self._RTCRtpReceiver__timestamp_mapper = _Mapper(origin)

    async def _handle_rtp_packet(self, packet: object, arrival_time_ms: int) -> None:
        return None


class _Packet:
    def __init__(self, timestamp: int) -> None:
        self.timestamp = timestamp


async def test_a_frame_is_timed_at_its_rtp_packets_arrival() -> None:
    """aiortc numbers decoded frames from the stream's first RTP timestamp;
    the packet's arrival is found from that origin (also across the 2^32
    wrap), and a frame whose packet was not seen is timed when decoded and
    counted."""
    c = CallClient("http://127.0.0.1:1")
    origin = (1 << 32) - 960  # the stream starts one frame before the wrap
    receiver = _Receiver(origin)
    c._note_rtp_arrival(receiver)
    c.clock.monotonic = lambda: 7.0  # type: ignore[method-assign]
    await receiver._handle_rtp_packet(_Packet(origin), 0)
    c.clock.monotonic = lambda: 7.02  # type: ignore[method-assign]
    await receiver._handle_rtp_packet(_Packet(0), 0)  # wrapped
    assert c._arrival(0, decoded_at=7.5) == 7.0
    assert c._arrival(960, decoded_at=7.52) == 7.02
    assert c._arrival_unknown == 0
    assert c._arrival(1920, decoded_at=7.54) == 7.54 and c._arrival(None, decoded_at=7.56) == 7.56
    assert c._arrival_unknown == 2


def test_an_aiortc_without_the_timestamp_mapper_is_refused() -> None:
    with pytest.raises(RuntimeError, match="RTP timestamp mapper"):
        CallClient("http://127.0.0.1:1")._note_rtp_arrival(object())


async def test_this_aiortcs_receiver_has_the_timestamp_mapper() -> None:
    pc = RTCPeerConnection()
    try:
        receiver = pc.addTransceiver("audio").receiver
        CallClient("http://127.0.0.1:1")._note_rtp_arrival(receiver)  # raises if an upgrade moved it
    finally:
        await pc.close()


def test_speculative_turns_taken_back_are_kept_apart_from_the_callers_turns() -> None:
    """A reply started at a pause the user went on from (stop reason
    speculation_withdrawn) was never heard or shown: the client lists it
    apart (CallResult.withdrawn), so one request answered is one turn."""
    seen: dict[str, TurnView] = {}
    for ev in (
        {"type": "turn", "turn_id": "a", "generation": 1, "status": "RUNNING", "label": "running"},
        {"type": "turn", "turn_id": "b", "generation": 2, "status": "RUNNING", "label": "running"},
        {"type": "turn", "turn_id": "a", "generation": 1, "status": "CANCELLED", "label": "cancelled",
         "stop_reason": {"kind": "speculation_withdrawn"}, "transcript": "what is the weather"},
        {"type": "turn", "turn_id": "b", "generation": 2, "status": "COMPLETED", "label": "completed",
         "transcript": "what is the weather like in paris"},
        {"type": "turn", "turn_id": "c", "generation": 3, "status": "CANCELLED", "label": "cancelled",
         "stop_reason": {"kind": "barge_in"}},
    ):
        track_turn(seen, ev)
    turns, withdrawn = caller_turns(list(seen.values()))
    assert [t.id for t in turns] == ["b", "c"] and [t.id for t in withdrawn] == ["a"]
    assert caller_turns([]) == ([], [])
