#!/usr/bin/env python3
"""The backchannel judge's words: Whisper's short decode against its full one.

While the agent speaks, a short utterance is judged a backchannel when every
word the recogniser heard in it is a backchannel word
(:meth:`voice.backchannel.BackchannelConfig.matches`). The embedded Whisper
decodes it on a short encoder window for that
(:func:`voice.whisper_worker.transcribe_short`) instead of the 30 s one of a
turn's final (:func:`voice.whisper_worker.transcribe`). This bench says what
that costs and saves, on espeak-ng clips of the issue 32 phrases: 7
backchannels ("uh-huh", "mm-hmm", "okay", "yeah", "right", "I see", "sure")
and 9 things that are not ("wait", "no stop", "hold on", "actually I want
tea", "what about tomorrow", "no", "two", "yes please", "yeah but"), in 3
voices at 2 speeds, each with 200 ms of silence before and 100 ms after (as
the session's pre-roll and quiet run give them).

Per decode: verdicts right (a backchannel matched, anything else not),
transcripts word for word, decode time p50/p95/max in ms (one worker
process's model, in this process, 2 threads), and the wrong verdicts.
Both decodes run on the same clips in the same process, one after the other.

Usage: python bench/backchannel_decode.py [--json] [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from voice import whisper_worker  # noqa: E402
from voice.backchannel import BackchannelConfig, normalise  # noqa: E402
from voice.whisper_stt import packaged_model_dir  # noqa: E402

BACKCHANNELS = ("uh-huh", "mm-hmm", "okay", "yeah", "right", "I see", "sure")
OTHERS = ("wait", "no stop", "hold on", "actually I want tea", "what about tomorrow", "no", "two", "yes please", "yeah but")
VOICES = ("en-us", "en-gb", "en-us+f3")
SPEEDS = (130, 175)


def clips(tmp: Path, quick: bool = False) -> list[tuple[str, bool, bytes]]:
    """(text, is a backchannel, 16 kHz s16 audio) for each phrase, voice and
    speed (``quick``: the first voice at the first speed only)."""
    out = []
    for text in (*BACKCHANNELS, *OTHERS):
        for voice in VOICES[:1] if quick else VOICES:
            for wpm in SPEEDS[:1] if quick else SPEEDS:
                raw, wav16 = tmp / "raw.wav", tmp / "x16.wav"
                subprocess.run(["espeak-ng", "-v", voice, "-s", str(wpm), "-w", str(raw), text], check=True)
                subprocess.run(["sox", str(raw), "-r", "16000", "-c", "1", "-b", "16", str(wav16), "pad", "0.2", "0.1"],
                               check=True)
                with wave.open(str(wav16)) as f:
                    out.append((text, text in BACKCHANNELS, f.readframes(f.getnframes())))
    return out


def stats(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"p50": round(float(np.percentile(a, 50)), 1), "p95": round(float(np.percentile(a, 95)), 1),
            "max": round(float(a.max()), 1)}


def run(threads: int, quick: bool = False) -> dict[str, object]:
    """The figures (see the module doc) as one dict."""
    whisper_worker.init(str(packaged_model_dir()), threads, "en", 5)
    config = BackchannelConfig()
    with tempfile.TemporaryDirectory() as d:
        items = clips(Path(d), quick)
    out: dict[str, object] = {"clips": len(items), "backchannels": sum(b for _, b, _ in items), "threads": threads}
    for name, decode in (("full", whisper_worker.transcribe), ("short", whisper_worker.transcribe_short)):
        decode(items[0][2])  # warm
        times, right, exact, wrong = [], 0, 0, []
        for text, backchannel, pcm in items:
            t0 = time.perf_counter()
            heard, _ = decode(pcm)
            times.append((time.perf_counter() - t0) * 1000)
            if config.matches(heard) == backchannel:
                right += 1
            else:
                wrong.append({"said": text, "heard": heard})
            exact += normalise(heard) == normalise(text)
        out[name] = {"verdicts_right": right, "exact": exact, "decode_ms": stats(times), "wrong": wrong}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="CPU threads of the decode (stt.threads; default 2)")
    p.add_argument("--quick", action="store_true", help="one voice at one speed (16 clips)")
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = p.parse_args()
    out = run(args.threads, args.quick)
    if args.json:
        print(json.dumps(out))
        return 0
    n = out["clips"]
    print(f"{n} clips ({out['backchannels']} backchannels), {args.threads} threads")
    print(f"{'decode':<8}{'verdicts right':>16}{'word for word':>15}{'p50 ms':>9}{'p95 ms':>9}{'max ms':>9}")
    for name in ("full", "short"):
        r = out[name]
        assert isinstance(r, dict)
        t = r["decode_ms"]
        print(f"{name:<8}{r['verdicts_right']:>12}/{n:<3}{r['exact']:>11}/{n:<3}{t['p50']:>9}{t['p95']:>9}{t['max']:>9}")
        for w in r["wrong"]:
            print(f"    wrong: {w['said']!r} heard as {w['heard']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
