"""Barge-in at the very start of a reply (issue 11.4).

A user who speaks 0.0-0.3 s after the agent starts a reply used to be heard
180-220 ms late: each reply started from "the echo may come back at full
level", and the user's onset, rising from silence, matched the reply's own
onset at some delay, so the echo guard took it for echo. The loss learnt in
the session's earlier replies is now kept between replies.

A session's first reply has no earlier replies: there the guard assumes the
echo comes back no louder than it was played (``echo_assumed_loss_db``),
and bounds it by what was played around the delay its envelope matched, not
by the reply's loudest word.

Frames are fed on virtual time; latencies are exact.
"""

from __future__ import annotations

import corpus as C
import numpy as np
import pytest
from test_bargein import run_clip

from media.bargein import DetectorEventKind as K
from media.frames import PLAYOUT_RATE, VAD_RATE

pytestmark = pytest.mark.skipif(not C.have_espeak(), reason="espeak-ng is not installed")

#: the second reply starts here (s): 2.5 s of a first reply, 1 s of the
#: user's turn and the agent thinking
SECOND_REPLY_S = 3.5


def two_replies(user16: bytes, lead_s: float, echo_db: float | None) -> C.Clip:
    """The agent's first reply (0-2.5 s), silence, its second reply from
    ``SECOND_REPLY_S``; the user speaks ``lead_s`` after the second starts.
    ``echo_db``: None for a headset (no echo), else a speakerphone bringing
    the agent back that many dB down after 120 ms."""
    reply = C.espeak(C.AGENT_PHRASES[0] + " " + C.AGENT_PHRASES[1], "en-us", 175, PLAYOUT_RATE)
    first = reply[: int(2.5 * PLAYOUT_RATE) * 2]
    gap = bytes(int((SECOND_REPLY_S - 2.5) * PLAYOUT_RATE) * 2)
    ref48 = first + gap + reply
    ref48 = ref48[: len(ref48) // 1920 * 1920]
    mic = np.zeros(len(ref48) // 6)  # 16 kHz samples over the reference (48 kHz s16)
    if echo_db is not None:
        mic += C.to_array(C.echo_path(ref48, 120, echo_db))[: len(mic)]
    if user16:
        u = C.to_array(user16)
        k = int((SECOND_REPLY_S + lead_s) * VAD_RATE)
        mic[k : k + len(u)] += u[: len(mic) - k]
    onset_s = SECOND_REPLY_S + lead_s
    return C.Clip("two-replies", "speech", C.to_pcm(mic), (onset_s, onset_s + len(user16) / 2 / VAD_RATE), ref48)


@pytest.mark.parametrize("voice", C.VOICES)
@pytest.mark.parametrize("lead_s", [0.0, 0.1, 0.2, 0.3])
def test_a_barge_in_at_the_start_of_a_later_reply_is_not_taken_for_echo(voice: str, lead_s: float) -> None:
    """Headset: the user is heard as fast as with no echo guard at all."""
    user = C.resample(C.opus_round_trip(C.espeak("hey wait stop I have a question", voice, 175, PLAYOUT_RATE)), PLAYOUT_RATE, VAD_RATE)
    clip = two_replies(user, lead_s, echo_db=None)
    guarded, bare = run_clip(clip), run_clip(clip, echo=False)
    started, bare_started = guarded.first(K.SPEECH_STARTED), bare.first(K.SPEECH_STARTED)
    assert started is not None and bare_started is not None
    assert started.at == bare_started.at, (started, bare_started)
    assert K.SPEECH_CONFIRMED in guarded.kinds()


def test_a_speakerphone_does_not_interrupt_the_start_of_a_later_reply() -> None:
    """The same two replies on a speakerphone (6 dB down): the loss kept
    between replies is the speakerphone's, so the second reply's onset
    coming back is still echo."""
    clip = two_replies(b"", 0.0, echo_db=6.0)
    run = run_clip(clip)
    assert K.SPEECH_CONFIRMED not in run.kinds(), run.events
    assert run.detector.echo_return_loss_db <= 6.0 + 3


def first_reply(user16: bytes, lead_s: float, echo: tuple[int, float] | None) -> C.Clip:
    """A session's first reply (from 0.5 s, after silence); the user speaks
    ``lead_s`` after it starts, at the agent's level. ``echo``: None for a
    headset, else (delay ms, loss dB) of a speakerphone."""
    reply = C.espeak(C.AGENT_PHRASES[0] + " " + C.AGENT_PHRASES[1], "en-us", 175, PLAYOUT_RATE)
    ref48 = bytes(PLAYOUT_RATE) + reply[: int(2.5 * PLAYOUT_RATE) * 2]  # 0.5 s of silence first
    ref48 = ref48[: len(ref48) // 1920 * 1920]
    mic = np.zeros(len(ref48) // 6)  # 16 kHz samples over the reference (48 kHz s16)
    if echo is not None:
        mic += C.to_array(C.echo_path(ref48, *echo))[: len(mic)]
    onset_s = 0.5 + lead_s
    if user16:
        u = C.to_array(user16)
        k = int(onset_s * VAD_RATE)
        mic[k : k + len(u)] += u[: len(mic) - k]
    return C.Clip("first-reply", "speech", C.to_pcm(mic), (onset_s, onset_s + len(user16) / 2 / VAD_RATE), ref48)


@pytest.mark.parametrize("voice", C.VOICES)
@pytest.mark.parametrize("wpm", [120, 175])
@pytest.mark.parametrize("lead_s", [0.1, 0.2])
def test_a_barge_in_at_the_start_of_the_first_reply_loses_at_most_its_onset(voice: str, wpm: int, lead_s: float) -> None:
    """Headset, a user as loud as the agent: the onset's first 60 ms still
    match the reply's own onset (nothing can tell them apart before the
    echo path's loss is known), but no more. It was 140-200 ms: the user's
    frames that matched the reply's envelope were measured against the
    reply's loudest word and a loss of 0 dB, so none was louder than echo."""
    user = C.resample(C.opus_round_trip(C.espeak("tell me a story", voice, wpm, PLAYOUT_RATE)), PLAYOUT_RATE, VAD_RATE)
    clip = first_reply(user, lead_s, echo=None)
    guarded, bare = run_clip(clip), run_clip(clip, echo=False)
    started, bare_started = guarded.first(K.SPEECH_STARTED), bare.first(K.SPEECH_STARTED)
    assert started is not None and bare_started is not None
    assert started.at - bare_started.at <= 0.06 + 1e-9, (started, bare_started)
    assert K.SPEECH_CONFIRMED in guarded.kinds()


@pytest.mark.parametrize("echo", [(40, 6.0), (120, 6.0), (250, 10.0), (60, 0.0)])
def test_a_speakerphone_does_not_interrupt_the_first_reply(echo: tuple[int, float]) -> None:
    """The same first reply heard back by a speakerphone, 6-10 dB down (and
    a path with no loss at all, louder than the guard assumes): no pause."""
    run = run_clip(first_reply(b"", 0.0, echo=echo))
    assert run.events == [], run.events
