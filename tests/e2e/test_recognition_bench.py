"""bench/recognition.py runs: a server on the embedded default (Whisper),
the quick corpus said over WebRTC calls, one call each, and the figures it
reports are whole (every utterance measured, nothing failed, noise heard as
nothing). The word error rate itself is the bench's figure; the bound here
is only a sanity bound (a recogniser that hears nothing fails it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import recognition as bench  # noqa: E402

pytestmark = pytest.mark.e2e


async def test_the_bench_hears_the_quick_corpus_through_calls(tmp_path: Path) -> None:
    result = await bench.run(argparse.Namespace(stt=["whisper"], quick=True, json=True, logs=str(tmp_path), concurrent=1))
    [r] = result["recognisers"]
    assert "error" not in r, r
    assert r["utterances"] == result["corpus"]["utterances"] - r["non_speech"]["clips"]
    assert r["call_errors"] == 0 and r["failovers"] == 0 and r["nothing_heard"] == 0, r
    assert r["word_error_rate"] is not None and r["word_error_rate"] < 0.5, r["misheard"]
    assert r["recognition_ms"]["p50"] is not None and r["server_cpu_ms_per_utterance"] > 0
    assert (tmp_path / "calls-whisper.jsonl").exists()
    assert "whisper" in bench.table(result)
