#!/usr/bin/env python3
"""Barge-in benchmark over a labelled corpus: fast, and right.

Starts a turnkeeper server in its own process on loopback and makes calls
with the headless aiortc client (client/call.py). Each call asks for a story;
while the agent talks, the client plays corpus clips into its microphone at
random offsets (0.3 to 2 s after the agent's audio starts again):

- speech (should barge in): "tell me a story" from espeak-ng in four voices
  at three speeds, and the alsa-utils human recordings;
- backchannels (should cancel nothing): espeak-ng "uh-huh", "mm-hmm",
  "yeah", "okay", "right" in two voices;
- not speech (should cancel nothing): alsa Noise.wav, white and brown noise,
  tones, DTMF, a sweep, clicks, knocks, coughs;
- echo (should cancel nothing): calls whose client is a speakerphone, playing
  the agent's audio back into its microphone (-6 dB, +60 ms) for 8 s before
  the user speaks over it.

The WebRTC clients declare their microphone's echo canceller in the offer as
the browser page does: the echo calls, a speakerphone with it off (the page's
raw mode), the others on (``--undeclared-aec``: nothing declared, as before
the declaration existed).

Figures (min, p50, p95, max where they apply):

- audible stop: from the first sample of speech handed to the client's RTP
  sender to the arrival (at the client's RTP receiver, before its jitter
  buffer) of the packet where the agent's sound ends, for barge-ins that
  landed while the agent was audible;
- audible stop by moment: the same, for speech whose first sample came in
  the reply's first 300 ms, 0.3-1 s into it, or later (from the reply's
  first sound at the client; ``--min-at``/``--max-at`` choose the moments);
- commit time: server side, from the first gated frame of the speech to the
  committed barge-in (generation advanced, buffers cleared, work cancelled);
- false cancels: barge-ins committed for a backchannel, a noise or echo;
- missed: speech over the audible agent that committed no barge-in;
- false interruptions: pauses that resumed (not errors: the audio was held
  while the detector made sure);
- inserted gap per kind: the longest silence each clip inserted into the
  agent's reply as the client received it, told from the reply's own pauses
  by a reference reception of the story without any clip (tests/listening.py;
  one extra call of about 45 s); ">=100 ms" counts the audible ones;
- after its end: for a clip that paused the agent and let it go on (a
  backchannel, a noise), from the last sample of its speech sent to the
  agent's sound again where the caller hears it (WebRTC: its arrival; the
  phone's ear; the device's speaker): the silence the caller hears once
  they stopped (issue 32: <= 300 ms p95 after a backchannel).

Over the phone path (``--transport twilio`` or ``telnyx``) the same corpus
is played by the phone simulator (client/phone_call.py: a simulated Twilio
or Telnyx media stream, 8 kHz mu-law both ways) and the same figures are
taken at the simulated caller's ear: audible stop from the first sample of
speech sent in a ``media`` message to the last sample of old-generation
audio the provider's playout buffer played. Besides: ``clear`` after the
fence in every committed barge-in, old audio played after it, and the
words the ear played of the interrupted reply against the heard text the
server kept from the marks (bench/phone_figures.py). No speakerphone calls
on the phone path (the simulator has no echo path).

Over the device path (``--transport device``) the same corpus is played by
the simulated xiaozhi-esp32 device (client/device_call.py) in realtime mode
(the microphone open while the agent speaks, barge-in by voice; 16 kHz Opus
in 60 ms packets up, Opus at the announced rate down) and the figures are
taken at the device's speaker: audible stop from the packet carrying the
first sample of speech leaving to the end of the last old-generation sound
the speaker played. Besides: ``tts stop`` after the speech, old audio sent
after it, and the words the speaker played of the interrupted reply against
the heard text the server kept (sent minus the send-ahead in flight). No
speakerphone calls on the device path either.

Usage: python bench/bargein.py [--json] [--seed S] [--per-call K] [--quick] [--transport webrtc|twilio|telnyx|device]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import corpus as C  # noqa: E402  (the tests' labelled corpus)
import listening as L  # noqa: E402  (the inserted-gap measure)
import phone_figures as P  # noqa: E402  (the phone path's own figures)
from local_server import server  # noqa: E402  (its own process, the embedded defaults)

from client.call import CallClient  # noqa: E402
from client.command import issue_device_token  # noqa: E402
from client.device_call import DeviceCallClient  # noqa: E402
from client.phone_call import PhoneCallClient  # noqa: E402
from client.results import BargeInMeasure, CallResult, Utterance  # noqa: E402
from media.frames import PLAYOUT_RATE, VAD_RATE  # noqa: E402

STORY = "tell me a story"
REFERENCE_S = 44.0  # the reference reception hears this much of the story (s after it starts)
WEATHER = "what is the weather like today"
BENCH_TOKEN = "bench-events"  # the bench server's API token for the default tenant (phone calls' events)


#: moments of a reply, s after its first sound: (name, from, to)
MOMENTS = (("first 300 ms", 0.0, 0.3), ("0.3-1 s", 0.3, 1.0), ("after 1 s", 1.0, float("inf")))


def make_client(url: str, transport: str, device_token: str | None = None, declare_aec: bool = True,
                device_id: str = "02:00:00:00:00:01", **kw: object) -> CallClient | PhoneCallClient | DeviceCallClient:
    """The headless client of ``transport``: WebRTC, the phone simulator, or
    the device simulator in realtime mode.

    A WebRTC client declares its microphone's echo canceller as the
    browser page does (``declare_aec``): on, unless it plays the agent back
    into its microphone (``echo_gain_db``: a speakerphone with the
    canceller off, the page's raw mode). ``declare_aec=False``: nothing
    declared (the figures before the declaration existed). ``device_id``:
    the device's MAC (its ``Device-Id``), one per device calling at once."""
    if transport == "webrtc":
        if declare_aec:
            kw.setdefault("echo_cancellation", kw.get("echo_gain_db") is None)
        return CallClient(url, **kw)  # type: ignore[arg-type]
    if transport == "device":
        return DeviceCallClient(device_url(url), mode="realtime", device_token=device_token, token=BENCH_TOKEN,
                                device_id=device_id)
    return PhoneCallClient(url, transport, token=BENCH_TOKEN)


def device_url(url: str) -> str:
    """The device WebSocket of the server at ``url`` (http://h:p)."""
    return "ws" + url[len("http"):] + "/v1/devices/ws"


def up(pcm16: bytes) -> bytes:
    return C.resample(pcm16, VAD_RATE, PLAYOUT_RATE)


def stats(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "min": None, "p50": None, "p95": None, "max": None}
    a = np.asarray(values, dtype=float)
    return {
        "n": len(values),
        "min": round(float(a.min()), 1),
        "p50": round(float(np.percentile(a, 50)), 1),
        "p95": round(float(np.percentile(a, 95)), 1),
        "max": round(float(a.max()), 1),
    }


def corpus_items(quick: bool) -> list[Utterance]:
    """The clips played over the agent, labelled."""
    items: list[Utterance] = []
    voices, speeds = (C.VOICES[:2], C.SPEEDS[1:2]) if quick else (C.VOICES, C.SPEEDS)
    for voice in voices:
        for wpm in speeds:
            pcm, _ = C.embed(C.espeak(STORY, voice, wpm), 0, 300)
            items.append(Utterance(up(pcm), label=f"story-{voice}-{wpm}", kind="speech"))
    for clip in C.backchannel_clips()[: 4 if quick else None]:
        end = clip.speech_at[1] if clip.speech_at is not None else None
        items.append(Utterance(up(clip.pcm), label=clip.name, kind="backchannel", speech_end_s=end))
    for clip in C.nonspeech_clips()[:: 3 if quick else 1]:
        items.append(Utterance(up(clip.pcm), label=clip.name, kind="noise"))
    return items


def human_items() -> list[Utterance]:
    """alsa-utils recordings of a human voice (short words: each ends a call)."""
    out = []
    for clip in C.speech_clips():
        if clip.name.startswith("alsa-"):
            out.append(Utterance(up(clip.pcm), label=clip.name, kind="speech"))
    return out


async def run(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    items = corpus_items(args.quick)
    rng.shuffle(items)
    humans = human_items()[: 2 if args.quick else None]
    weather, _ = C.embed(C.espeak(WEATHER, "en-us", 140), 0, 300)
    story, _ = C.embed(C.espeak(STORY, "en-us", 140), 0, 300)
    measures: list[BargeInMeasure] = []
    echo_calls: list[CallResult] = []
    echo_gap_ms: list[float] = []
    phone = args.transport != "webrtc"  # a simulated far end (phone or device), read through the events
    heard_checks: list[dict[str, object]] = []
    env = {"TURNKEEPER_API_TOKENS": f"default:{BENCH_TOKEN}"} if phone else None
    async with server("tk-bench-", env) as (url, _proc):
        device_token = await issue_device_token(url, BENCH_TOKEN) if args.transport == "device" else None
        # The story heard with no clip: what the inserted gaps are measured against.
        ref_call = await make_client(url, args.transport, device_token).run(
            Utterance(up(story), label="story"), [Utterance(bytes(9600), at_s=REFERENCE_S, label="reference", kind="none")],
            timeout_s=REFERENCE_S + 20, settle_s=0.2, hangup_after_s=0.3,
        )
        reference = ref_call.received
        # Calls of K corpus items; each ends with a human recording (or the
        # weather question) so it does not wait out a whole story.
        chunks = [items[i : i + args.per_call] for i in range(0, len(items), args.per_call)]
        for n, chunk in enumerate(chunks):
            last = humans[n] if n < len(humans) else Utterance(up(weather), label="weather", kind="speech")
            script = [*chunk, last]
            for u in script:
                u.at_s = round(rng.uniform(args.min_at, args.max_at), 2)
            result = await make_client(url, args.transport, device_token, args.declare_aec).run(
                Utterance(up(story), label="story"), script, timeout_s=60 + 15 * len(script), settle_s=0.3,
                revive=Utterance(up(story), label="story again"),  # the recogniser misheard: ask again
            )
            L.judge_call(result, reference)
            measures.extend(result.barge_ins)
            if phone:
                texts = P.replies(result)
                for m in result.barge_ins:
                    if m.barged_in and m.kind == "speech":
                        judged = await P.judge_heard(m, texts.get(m.old_turn_id or "", ""))
                        if judged is not None:
                            heard_checks.append(judged)
                if result.protocol_errors:
                    print(f"  protocol errors: {result.protocol_errors[:5]}", file=sys.stderr)
            if not args.json:
                print(f"  call {n + 1}/{len(chunks)} {result.session_id[:8]}: {len(script)} clips", file=sys.stderr)
        for n in range(0 if phone else args.echo_calls):
            client = CallClient(url, echo_gain_db=-6, echo_delay_ms=60,
                                echo_cancellation=False if args.declare_aec else None)
            result = await client.run(
                Utterance(up(story), label="story"),
                [Utterance(up(weather), at_s=8.0, label="weather over echo", kind="speech")],
                timeout_s=60,
                settle_s=0.3,
            )
            echo_calls.append(result)
            # the echo is there from the start: judged from the reply's first sound to the user's question
            until = result.barge_ins[0].sent_from
            cut = L.newer_turn_at(result.event_times)  # a false barge-in on the echo
            if cut is not None and (until is None or cut < until):
                until = cut
            echo_gaps = L.listen(L.without_replays(result.received, L.replays_of(result.event_times)), reference, until=until)
            echo_gap_ms.append(round(echo_gaps.max_gap_ms, 1))
            measures.extend(result.barge_ins)
            if not args.json:
                print(f"  speakerphone call {n + 1}/{args.echo_calls} {result.session_id[:8]}", file=sys.stderr)
    unsent = [m for m in measures if m.sent_from is None]  # a call that ended early (timeout)
    measures = [m for m in measures if m.sent_from is not None]
    speech = [m for m in measures if m.kind == "speech"]
    others = [m for m in measures if m.kind != "speech"]
    audible = [m.stop_ms for m in speech if m.barged_in and m.speaking_at_onset and m.stop_ms is not None]
    commit = [m.server_onset_to_fence_ms for m in speech if m.barged_in and m.server_onset_to_fence_ms is not None]
    echo_false = sum(max(0, sum(e.get("type") == "barge_in" for e in r.events) - 1) for r in echo_calls)
    echo_pauses = sum(sum(e.get("type") == "false_interruption" for e in r.events) for r in echo_calls)
    by_kind: dict[str, dict[str, int]] = {}
    for m in measures:
        k = by_kind.setdefault(
            m.label.split("-")[0] if m.kind == "noise" else m.kind, {"n": 0, "barged_in": 0, "resumed": 0, "gaps": []}
        )
        k["n"] += 1
        k["barged_in"] += m.barged_in
        k["resumed"] += m.resumed is not None
        if m.gap_ms is not None:
            k["gaps"].append(m.gap_ms)
    if echo_calls:
        by_kind["echo"] = {"n": len(echo_calls), "barged_in": echo_false, "resumed": echo_pauses, "gaps": echo_gap_ms}
    for m in measures:
        if m.resumed_after_end_ms is not None:
            by_kind[m.label.split("-")[0] if m.kind == "noise" else m.kind].setdefault("after_end", []).append(
                m.resumed_after_end_ms
            )
    for k in by_kind.values():
        # the silence after the clip's own end, ms (the caller stopped; issue 32: <= 300 ms p95 after a backchannel)
        k["resumed_after_end_ms"] = stats(k.pop("after_end", []))
        gaps = k.pop("gaps")
        k["inserted_gap_ms"] = stats(gaps)  # the longest silence each clip inserted, ms
        k["gaps_100ms_or_more"] = sum(g >= 100 for g in gaps)
    return {
        "clips": len(measures),
        "unsent": len(unsent),
        "speech": len(speech),
        "agent_silent_at_onset": sum(1 for m in speech if not m.speaking_at_onset),
        "audible_stop_ms": stats([v for v in audible if v is not None]),
        # the same, leaving out speech first taken for a backchannel or noise
        # (the agent resumed before the barge-in committed)
        "audible_stop_first_pause_ms": stats(
            [m.stop_ms for m in speech if m.barged_in and m.speaking_at_onset and m.stop_ms is not None and m.resumed is None]
        ),
        # the same by the moment of the reply the speech began in (its onset after the reply's first sound)
        "audible_stop_by_moment_ms": {
            name: stats([m.stop_ms for m in speech if m.barged_in and m.speaking_at_onset and m.stop_ms is not None
                         and m.into_reply_s is not None and lo <= m.into_reply_s < hi])
            for name, lo, hi in MOMENTS
        },
        "speech_resumed_before_commit": sum(m.barged_in and m.resumed is not None for m in speech),
        "commit_ms": stats([v for v in commit if v is not None]),
        "false_cancels": sum(m.barged_in for m in others) + echo_false,
        "false_cancels_echo": echo_false,
        # speech while the agent was already silent opens a turn, no barge-in
        "missed": sum(not m.barged_in for m in speech if m.speaking_at_onset),
        "false_interruptions": sum(m.resumed == "false_interruption" for m in others) + echo_pauses,
        "backchannels_resumed": sum(m.resumed == "backchannel" for m in others),
        "echo_calls": len(echo_calls),
        "by_kind": by_kind,
        # each speech clip: how soon it silenced the agent, and whether the
        # agent resumed first (taken for a backchannel or a noise)
        "speech_detail": [
            {"label": m.label, "stop_ms": None if m.stop_ms is None else round(m.stop_ms, 1),
             "resumed": m.resumed, "commit_ms": m.server_onset_to_fence_ms,
             # its onset, ms after the reply's first sound at the client
             "into_reply_ms": None if m.into_reply_s is None else round(m.into_reply_s * 1000, 1)}
            for m in speech
        ],
        "transport": args.transport,
        **({"device": {
            "tts_stop_ms": stats([m.tts_stop_ms for m in speech if m.barged_in and m.tts_stop_ms is not None]),
            "received_stop_ms": stats([m.received_stop_ms for m in speech if m.barged_in and m.received_stop_ms is not None]),
            "old_audio_after_tts_stop_ms": sum(m.old_audio_after_tts_stop_ms or 0.0 for m in speech),
            "heard_within_one_word": sum(1 for h in heard_checks if h["word_diff"] <= 1),  # type: ignore[operator]
            "heard_checked": len(heard_checks),
            "heard_detail": heard_checks,
        }} if args.transport == "device" else {}),
        **({"phone": {
            **P.clear_figures([m for m in speech if m.barged_in]),
            "heard_within_one_word": sum(1 for h in heard_checks if h["word_diff"] <= 1),  # type: ignore[operator]
            "heard_checked": len(heard_checks),
            # the re-synthesis gave the server's own heard text back from its played_ms (else it is off by its own error)
            "resynthesis_matches": sum(1 for h in heard_checks if h["resynthesis_matches"]),
            "heard_detail": heard_checks,
        }} if phone and args.transport != "device" else {}),
        "failures": [
            m.as_dict() for m in measures if m.barged_in != (m.kind == "speech") and (m.kind != "speech" or m.speaking_at_onset)
        ],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-call", type=int, default=8, help="corpus clips per call (default 8)")
    p.add_argument("--echo-calls", type=int, default=3, help="speakerphone calls (default 3)")
    p.add_argument("--min-at", type=float, default=0.3, help="earliest offset after the agent's audio starts, s")
    p.add_argument("--max-at", type=float, default=2.0, help="latest offset, s")
    p.add_argument("--quick", action="store_true", help="a small subset of the corpus")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    p.add_argument("--undeclared-aec", dest="declare_aec", action="store_false",
                   help="WebRTC clients declare nothing of their echo canceller (default: as the browser page does)")
    p.add_argument("--transport", choices=["webrtc", "twilio", "telnyx", "device"], default="webrtc",
                   help="WebRTC (default), a phone call through the simulated Twilio or Telnyx media stream, "
                        "or the simulated xiaozhi-esp32 device in realtime mode")
    args = p.parse_args()
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"transport: {out['transport']}  clips: {out['clips']}  speech: {out['speech']} "
          f"(agent already silent at onset: {out['agent_silent_at_onset']})")
    print(f"{'figure':<34}{'n':>4}{'min':>9}{'p50':>9}{'p95':>9}{'max':>9}")
    for name, key in (
        ({"webrtc": "audible stop at client (ms)", "device": "audible stop at the device (ms)"}.get(
            str(out["transport"]), "audible stop at the ear (ms)"), "audible_stop_ms"),
        ("  stopped at the first pause (ms)", "audible_stop_first_pause_ms"),
        ("commit time on server (ms)", "commit_ms"),
        *((f"  audible stop, {name} of the reply", ("audible_stop_by_moment_ms", name)) for name, _, _ in MOMENTS),
    ):
        s = out[key[0]][key[1]] if isinstance(key, tuple) else out[key]  # type: ignore[index]
        assert isinstance(s, dict)
        cells = "".join(f"{'-' if s[c] is None else s[c]:>9}" for c in ("min", "p50", "p95", "max"))
        print(f"{name:<34}{s['n']:>4}{cells}")
    print(f"false cancels: {out['false_cancels']} (echo: {out['false_cancels_echo']})   missed: {out['missed']}   "
          f"false interruptions (paused, resumed): {out['false_interruptions']}   "
          f"backchannels resumed: {out['backchannels_resumed']}")
    print("by kind: " + ", ".join(f"{k} {v['barged_in']}/{v['n']} barged in" for k, v in sorted(out["by_kind"].items())))  # type: ignore[union-attr]
    print(f"inserted gap per kind (ms){'n':>10}{'p50':>9}{'max':>9}{'>=100':>7}"
          f"   after its end: {'n':>3}{'p50':>7}{'p95':>7}{'max':>7}")
    for k, v in sorted(out["by_kind"].items()):  # type: ignore[union-attr]
        g, a = v["inserted_gap_ms"], v["resumed_after_end_ms"]
        after = "".join(f"{'-' if a[c] is None else a[c]:>7}" for c in ("p50", "p95", "max")) if a["n"] else ""
        print(f"  {k:<24}{g['n']:>10}{'-' if g['p50'] is None else g['p50']:>9}{'-' if g['max'] is None else g['max']:>9}"
              f"{v['gaps_100ms_or_more']:>7}   {'':>14}{a['n']:>3}{after}")
    if "phone" in out:
        ph = out["phone"]
        assert isinstance(ph, dict)
        print(f"clear after the fence: {ph['clear_after_fence']}/{ph['barge_ins']} barge-ins "
              f"({ph['clear_after_fence_pct']} %; ms after the fence: {ph['clear_after_fence_ms']}); "
              f"old audio played after a clear: {ph['old_audio_after_clear_ms']:.0f} ms")
        print(f"heard text within one word of what the ear played: {ph['heard_within_one_word']}/{ph['heard_checked']} "
              f"(re-synthesis reproduced the server's text in {ph['resynthesis_matches']})")
        for h in ph["heard_detail"]:
            if h["word_diff"] > 1:
                print(f"  heard differs: {h}")
    if "device" in out:
        dv = out["device"]
        assert isinstance(dv, dict)
        print(f"tts stop after the speech (ms): {dv['tts_stop_ms']}; last old packet (ms): {dv['received_stop_ms']}; "
              f"old audio sent after tts stop: {dv['old_audio_after_tts_stop_ms']:.0f} ms")
        print(f"heard text within one word of what the device played: {dv['heard_within_one_word']}/{dv['heard_checked']}")
        for h in dv["heard_detail"]:
            if h["word_diff"] > 1:
                print(f"  heard differs: {h}")
    for f in out["failures"]:  # type: ignore[union-attr]
        print(f"  wrong: {f}")
    for d in out["speech_detail"]:  # type: ignore[union-attr]
        if d["resumed"] is not None:
            print(f"  speech first taken for {d['resumed']}: {d['label']} (audible stop {d['stop_ms']} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
