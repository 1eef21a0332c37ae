"""bench/end_of_turn.py: its text rule, its scores on made-up verdicts, and
one quick run over the corpus with the real model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import requires_espeak

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import end_of_turn as B  # noqa: E402


@pytest.mark.parametrize(
    ("words", "complete"),
    [
        ("i'd like to order a large coffee", True),
        ("can i get a", False),
        ("change the size to", False),
        ("my order number is", False),
        ("I'd like to order a, um", False),  # fillers and punctuation
        ("and then I", False),
        ("cancel it", True),
        ("yes", True),
        ("", True),  # nothing heard: no evidence either way
    ],
)
def test_the_text_rule_reads_the_last_word(words: str, complete: bool) -> None:
    assert B.text_complete(words) is complete


def test_auc_is_one_when_separated_half_at_chance_and_none_without_cases() -> None:
    assert B.roc_auc([0.9, 0.8], [0.1, 0.2]) == 1.0
    assert B.roc_auc([0.1], [0.9]) == 0.0
    assert B.roc_auc([0.5, 0.5], [0.5]) == 0.5
    assert B.roc_auc([], [0.3]) is None


def test_scores_count_cutoffs_and_missed_ends() -> None:
    rows = [{"set": "complete", "ok": True}, {"set": "complete", "ok": False}, {"set": "one_word", "ok": True},
            {"set": "mid_pause whole", "ok": True}, {"set": "pause", "ok": True}, {"set": "pause", "ok": False},
            {"set": "pause", "ok": False}, {"set": "trailing", "ok": True}]
    s = B.score(rows, lambda r: r["ok"])
    assert s["false_cutoffs"] == {"n": 1, "of": 3, "rate": pytest.approx(1 / 3)}
    assert s["missed_ends"]["n"] == 1 and s["missed_ends"]["of"] == 4 and s["missed_ends"]["complete_requests"] == 1
    assert s["accuracy_ends"] == 0.75 and s["accuracy_pauses"] == pytest.approx(2 / 3)
    assert s["trailing_judged_complete"] == 1.0
    always = B.score(rows, lambda r: True)
    assert always["false_cutoffs"]["rate"] == 1.0 and always["missed_ends"]["n"] == 0


@requires_espeak
def test_a_quick_run_measures_every_judge(capsys: pytest.CaptureFixture[str]) -> None:
    result = B.run(quick=True)
    assert set(result["judges"]) == set(B.JUDGES)
    assert result["corpus"]["sets"] == {"complete": 3, "one_word": 3, "mid_pause whole": 3, "pause": 3, "trailing": 3}
    silence = result["judges"]["silence"]
    assert silence["false_cutoffs"]["rate"] == 1.0 and silence["missed_ends"]["n"] == 0
    st = result["judges"]["smart_turn@200ms"]
    assert st["inference_ms"]["n"] == 15 and 0 < st["inference_ms"]["p50"] < 2000
    assert result["model"]["load_ms"] > 0 and len(result["model"]["sha256"]) == 64
    both = result["judges"]["smart_turn@200ms+text"]["false_cutoffs"]["n"]
    assert both <= min(st["false_cutoffs"]["n"], result["judges"]["text"]["false_cutoffs"]["n"])
    assert len(result["cases"]) == 15 and all(0 <= c["p@200ms"] <= 1 for c in result["cases"])
    text = B.table(result)
    assert "smart_turn@200ms+text" in text and "by threshold" in text
