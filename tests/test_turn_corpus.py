"""The turn corpus (tests/turn_corpus.py): its coverage, its names, and
rendered audio that keeps the spans it promises."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import turn_corpus as T
from conftest import requires_espeak


def test_the_corpus_has_every_kind_in_the_promised_numbers() -> None:
    kinds = Counter(r.kind for r in T.corpus())
    assert set(kinds) == set(T.KINDS)
    assert kinds["complete"] >= 20 and kinds["mid_pause"] >= 20
    assert kinds["one_word"] >= 10 and kinds["trailing"] >= 10
    assert 60 <= sum(kinds.values()) <= 90


def test_names_are_unique_stable_file_stems() -> None:
    names = [r.name for r in T.corpus()]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[a-z0-9_-]+", n) for n in names)
    assert "mid_pause-order-en-gb-130" in names  # the deal is fixed: this name is quoted in bench notes


def test_the_corpus_is_the_same_list_every_time() -> None:
    assert T.corpus() == T.corpus()
    assert T.corpus(quick=True) == T.corpus(quick=True)


def test_every_voice_and_speed_is_used() -> None:
    pairs = Counter((r.voice, r.wpm) for r in T.corpus())
    assert set(pairs) == {(v, s) for v in T.VOICES for s in T.SPEEDS}
    assert max(pairs.values()) - min(pairs.values()) <= 2  # dealt about equally


def test_pauses_are_spread_over_400_to_800_ms() -> None:
    pauses = sorted(r.pause_ms for r in T.corpus() if r.kind == "mid_pause")
    assert pauses[0] == 400 and pauses[-1] == 800
    assert len(set(pauses)) >= len(pauses) - 2  # spread, not a few values
    assert all(r.pause_ms == 0 and len(r.parts) == 1 for r in T.corpus() if r.kind != "mid_pause")


def test_quick_has_at_least_two_of_each_kind_each_a_different_phrase() -> None:
    quick = T.corpus(quick=True)
    kinds = Counter(r.kind for r in quick)
    assert set(kinds) == set(T.KINDS) and min(kinds.values()) >= 2
    assert len({r.parts for r in quick}) == len(quick)
    assert {r.voice for r in quick} == set(T.VOICES)
    assert set(quick) <= set(T.corpus())


def test_text_joins_the_parts() -> None:
    req = next(r for r in T.corpus() if r.name == "mid_pause-order-en-gb-130")
    assert req.parts == ("i'd like to order", "a large coffee")
    assert req.text == "i'd like to order a large coffee"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "finished"}, "unknown turn kind"),
        ({"kind": "mid_pause", "parts": ("i'd like",), "pause_ms": 500}, "2 part"),
        ({"parts": ("yes", "no")}, "1 part"),
        ({"kind": "mid_pause", "parts": ("i'd like", "a coffee"), "pause_ms": 0}, "pause > 0"),
        ({"pause_ms": 300}, "no pause"),
        ({"parts": ("  ",)}, "empty part"),
        ({"voice": ""}, "empty espeak-ng voice"),
        ({"wpm": 20}, "outside"),
        ({"wpm": 900}, "outside"),
    ],
)
def test_a_malformed_request_is_refused(kwargs: dict, message: str) -> None:
    fields = {"name": "x", "kind": "complete", "voice": "en-us", "wpm": 150, "parts": ("yes",), "pause_ms": 0} | kwargs
    with pytest.raises(ValueError, match=message):
        T.TurnRequest(**fields)


def _window_db(x: np.ndarray, rate: int) -> np.ndarray:
    n = rate // 100
    f = x[: len(x) // n * n].reshape(-1, n).astype(np.float64) / 32768.0
    with np.errstate(divide="ignore"):
        return 10 * np.log10((f * f).mean(axis=1))


@requires_espeak
@pytest.mark.parametrize("rate", [16000, 8000])
def test_render_keeps_the_promised_spans(rate: int, tmp_path: Path) -> None:
    for req in T.corpus(quick=True):
        r = T.render(req, rate, cache_dir=tmp_path)
        x = np.frombuffer(r.pcm, dtype="<i2")
        assert r.rate == rate and len(r.pcm) % 2 == 0
        assert r.speech_end_s == pytest.approx(len(x) / rate, abs=1e-9)
        ten_ms = rate // 100
        # speech right at both ends: espeak's silence is trimmed away
        assert _window_db(x[:ten_ms], rate)[0] > T.SPEECH_THRESHOLD_DBFS
        assert _window_db(x[-ten_ms:], rate)[0] > T.SPEECH_THRESHOLD_DBFS
        if req.kind != "mid_pause":
            assert r.pauses == ()
            continue
        ((a, b),) = r.pauses
        assert b - a == pytest.approx(req.pause_ms / 1000, abs=1 / rate)
        i, j = round(a * rate), round(b * rate)
        assert not x[i:j].any()  # the pause is digital silence, all of it
        assert _window_db(x[i - ten_ms : i], rate)[0] > T.SPEECH_THRESHOLD_DBFS
        assert _window_db(x[j : j + ten_ms], rate)[0] > T.SPEECH_THRESHOLD_DBFS
        assert 0.3 < a and r.speech_end_s - b > 0.2  # real words on both sides
        assert r.until(a) == r.pcm[: i * 2]


@requires_espeak
def test_a_slower_speed_makes_longer_speech(tmp_path: Path) -> None:
    req = T.corpus()[0]
    slow = T.render(T.TurnRequest("slow", req.kind, req.voice, 100, req.parts, 0), cache_dir=tmp_path)
    fast = T.render(T.TurnRequest("fast", req.kind, req.voice, 250, req.parts, 0), cache_dir=tmp_path)
    assert slow.speech_end_s > 1.5 * fast.speech_end_s


@requires_espeak
def test_render_is_cached_and_repeatable(tmp_path: Path) -> None:
    req = T.corpus(quick=True)[3]
    first = T.render(req, cache_dir=tmp_path)
    assert list(tmp_path.glob("turn-part-*.pcm"))
    assert T.render(req, cache_dir=tmp_path) == first
    assert T.render(req, cache_dir=tmp_path / "fresh") == first  # espeak-ng is deterministic


@requires_espeak
def test_an_unknown_voice_is_a_clear_error(tmp_path: Path) -> None:
    req = T.TurnRequest("x", "complete", "xx-nobody", 150, ("hello",), 0)
    with pytest.raises(ValueError, match="unknown espeak-ng voice 'xx-nobody'"):
        T.render(req, cache_dir=tmp_path)


def test_a_rate_out_of_range_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rate 100 Hz"):
        T.render(T.corpus()[0], 100, cache_dir=tmp_path)


def test_trim_drops_silence_at_both_ends_only() -> None:
    rate = 16000
    tone = (np.sin(np.arange(1600) * 0.2) * 8000).astype("<i2").tobytes()
    pcm = bytes(3200) + tone + bytes(1600) + tone + bytes(4000)  # 10 ms windows of 320 bytes: aligned
    out = T.trim(pcm, rate)
    assert out == tone + bytes(1600) + tone
    assert T.trim(bytes(3200), rate) == b""
