"""The call timeline's text (client.command.format_timeline) for phone
calls: a pause that was taken back is said so (not "no clear"), and a
draining server's notice is shown."""

from __future__ import annotations

from client.command import format_timeline
from client.results import BargeInMeasure, CallResult


def result(b: BargeInMeasure, events: list[dict[str, object]] | None = None) -> CallResult:
    return CallResult(session_id="s1", turns=[], barge_ins=[b], events=events or [], received_audio_ms=0,
                      timed_out=False, transport="twilio")


def test_a_pause_taken_back_is_said_so() -> None:
    text = format_timeline(result(BargeInMeasure(label="uh-huh.wav", at_s=1.0, resumed="backchannel", onset_sent_at=1.0, silent_at=1.08)))
    assert "no barge-in: the pause was taken back (backchannel)" in text and "no clear" not in text


def test_a_committed_barge_in_shows_its_clear() -> None:
    b = BargeInMeasure(label="w.wav", at_s=1.0, barged_in=True, onset_sent_at=1.0, silent_at=1.095)
    b.clear_after_fence_ms, b.played_ms_at_ear, b.server_played_ms = 3.0, 1160.0, 1160
    assert "clear +3 ms after the fence; the ear played 1160 ms of the reply" in format_timeline(result(b))


def test_a_draining_server_is_shown() -> None:
    b = BargeInMeasure(label="w.wav", at_s=1.0, barged_in=True)
    text = format_timeline(result(b, [{"type": "session.draining", "left_s": 19.5, "reason": "SIGTERM"}]))
    assert "the server drains (SIGTERM): the session may go on 19.5 s" in text
