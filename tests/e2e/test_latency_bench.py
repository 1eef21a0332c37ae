"""bench/latency.py runs as a newcomer runs it: ``--quick --modes silence
--json`` (one session of two requests, a complete one and one with a
pause mid-sentence, to keep it short) against a server on the embedded
defaults, over WebRTC. It prints one JSON object of the documented shape,
every request got a reply, and voice-to-voice was measured. The bound on
voice-to-voice is only a sanity bound (a reply within 10 s); the figures
themselves are the bench's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def test_the_quick_bench_measures_every_request_in_silence_mode(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "latency.py"), "--quick", "--modes", "silence", "--sessions", "1",
         "--per-session", "2", "--json", "--logs", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)  # one object, nothing else on stdout
    assert set(out) >= {"modes", "corpus", "sessions"} and list(out["modes"]) == ["silence"]
    assert out["sessions"] == 1 and out["requests_said"] == 2 and out["corpus"]["quick"]
    s = out["modes"]["silence"]
    assert s["available"] and s["call_errors"] == [] and s["arrival_unknown_frames"] == 0, s
    assert s["requests"] == 2 and s["replied"] == 2 and s["no_reply"] == 0 and s["reply_timed_out"] == 0, s
    v2v = s["voice_to_voice_ms"]
    assert v2v["n"] == 2 and 0 < v2v["min"] <= v2v["p50"] <= v2v["max"] < 10_000, v2v
    assert s["voice_to_voice_ms_by_kind"]["complete"]["n"] == 1 and s["voice_to_voice_ms_by_kind"]["mid_pause"]["n"] == 1
    assert s["false_cut_offs"]["n"] == 1 and s["false_cut_offs"]["k"] in (0, 1)
    # today's endpointing speculates nothing
    assert s["speculative"]["started"] == 0 and s["withdrawn_tokens"]["total"] == 0
    assert s["env"]["TURNKEEPER_SESSION__ENDPOINT__MODE"] == "silence"
    assert 0 < s["server_cpu_ms_per_request"] < 60_000, s  # the server's own CPU, workers included: it did work
    rows = [json.loads(line) for line in (tmp_path / "requests-silence.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["complete", "mid_pause"] and all(r["transcripts"] for r in rows)
