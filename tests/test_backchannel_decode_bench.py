"""bench/backchannel_decode.py: a quick run, as a newcomer would start it,
gives one JSON object whose short decode judges the issue 32 phrases as
well as the full one, in less time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import requires_espeak

ROOT = Path(__file__).resolve().parents[1]


@requires_espeak
def test_the_quick_bench_compares_the_two_decodes() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "backchannel_decode.py"), "--quick", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    out = json.loads(done.stdout)
    assert out["clips"] == 16 and out["backchannels"] == 7
    full, short = out["full"], out["short"]
    # the short decode's verdicts are as good (on this machine: 16/16 and 15 or 16 of 16)
    assert short["verdicts_right"] >= full["verdicts_right"] - 1 >= 13, out
    assert all(set(w) == {"said", "heard"} for w in short["wrong"] + full["wrong"])
    # ... and it is the faster (a generous bound; bench figures: p50 71 against 320 ms)
    assert short["decode_ms"]["p50"] < full["decode_ms"]["p50"], out
