"""Barge-in quality end to end: the real server on loopback, the aiortc
client over WebRTC (Opus both ways), corpus clips played over the agent.
Speech barges in; a cough, a tone, a knock, an "uh-huh" and the agent's own
voice from a speakerphone cancel nothing."""

from __future__ import annotations

import corpus as C
import pytest
from conftest import plain, requires_espeak
from test_call_e2e import TOKEN, Server, server  # noqa: F401  (fixture)

from client.call import CallClient
from client.results import Utterance
from media.frames import PLAYOUT_RATE, VAD_RATE

pytestmark = [pytest.mark.e2e, requires_espeak]


def clip(name: str, kind: str, at_s: float) -> Utterance:
    found = {c.name: c for c in [*C.nonspeech_clips(), *C.backchannel_clips()]}[name]
    return Utterance(C.resample(found.pcm, VAD_RATE, PLAYOUT_RATE), at_s=at_s, label=name, kind=kind)


def spoken(text: str, at_s: float | None = None) -> Utterance:
    pcm, _ = C.embed(C.espeak(text, "en-us", 140), 0, 300)
    return Utterance(C.resample(pcm, VAD_RATE, PLAYOUT_RATE), at_s=at_s, label=text)


async def test_noise_and_backchannels_cancel_nothing_and_speech_barges_in(server: Server) -> None:  # noqa: F811
    script = [
        clip("cough-loud", "noise", 0.5),
        clip("tone-1k--12", "noise", 0.5),
        clip("bc-en-us-uh-huh", "backchannel", 0.5),
        clip("knock-5", "noise", 0.5),
        spoken("what is the weather like today", 0.5),
    ]
    result = await CallClient(server.url, token=TOKEN).run(spoken("tell me a story"), script, timeout_s=90, settle_s=0.3)
    assert result.ok, result.as_dict()
    by_label = {m.label: m for m in result.barge_ins}
    for m in result.barge_ins[:-1]:
        assert not m.barged_in, m.as_dict()
    weather = by_label["what is the weather like today"]
    assert weather.barged_in and weather.speaking_at_onset
    # the agent went silent at the client soon after the speech began (a
    # sanity bound for a loaded machine; bench/bargein.py measures it)
    assert weather.stop_ms is not None and weather.stop_ms < 600
    story, last = result.turns[0], result.turns[-1]
    assert story.stop_reason == "barge_in" and len(result.turns) == 2  # nothing else opened a turn
    assert plain(last.transcript) == "what is the weather like today" and last.status == "COMPLETED"
    types = [e["type"] for e in result.events]
    assert "backchannel" in types


@pytest.mark.serial  # the echo path is aligned in real time: a loaded CPU skews it
async def test_a_speakerphone_does_not_interrupt_the_agent(server: Server) -> None:  # noqa: F811
    client = CallClient(server.url, echo_gain_db=-6, echo_delay_ms=60, token=TOKEN)
    result = await client.run(
        spoken("tell me a story"), [spoken("what is the weather like today", 6.0)], timeout_s=60, settle_s=0.3
    )
    assert result.ok, result.as_dict()
    barge_ins = [e for e in result.events if e["type"] == "barge_in"]
    assert len(barge_ins) == 1  # only the user's question, not the agent's own voice
    [m] = result.barge_ins
    assert m.barged_in
    # a pause of the agent for its own voice would be audible: a sanity bound
    # here (bench/bargein.py counts them over several calls)
    assert sum(e["type"] == "false_interruption" for e in result.events) <= 1
    # the question is heard (once, in a CI run, two words of the agent's own echo from before its onset
    # were heard with it, "we more what is ...": the candidate's pre-roll holds the echo; noted)
    assert result.turns[-1].status == "COMPLETED" and plain(result.turns[-1].transcript).endswith("what is the weather like today")
