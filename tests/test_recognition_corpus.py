"""The recognition corpus (tests/recognition_corpus.py): its word error rate
and normaliser, its coverage, and its WAV files."""

from __future__ import annotations

import wave
from collections import Counter
from pathlib import Path

import pytest
import recognition_corpus as R
from conftest import requires_espeak
from hypothesis import given
from hypothesis import strategies as st

# words as a recogniser writes them: letters, digits, punctuation, hyphens, apostrophes
TEXT = st.text(alphabet=st.sampled_from("abcdeiklmnorstuyABCOK0123456789 ,.?!'-"), max_size=40)
WORDS = st.lists(st.sampled_from("order a coffee large small two twenty five okay mm hmm uh huh yes no".split()), max_size=8)


# ---------------------------------------------------------------- normaliser


@pytest.mark.parametrize(
    ("heard", "said"),
    [
        ("Order a coffee, please.", "order a coffee please"),
        ("2.", "two"),
        ("25", "twenty five"),
        ("Order number 417.", "order number four one seven"),
        ("Order number 417.", "order number four hundred seventeen"),
        ("100", "one hundred"),
        ("007", "zero zero seven"),
        ("1,000", "one thousand"),
        ("2.50", "two point five zero"),
        ("OK.", "okay"),
        ("Okay!", "okay"),
        ("Mhm.", "mm hmm"),
        ("Mm-hmm.", "mm hmm"),
        ("mmhmm", "mm hmm"),
        ("Uh-huh.", "uh huh"),
        ("Front-center", "front center"),
        ("I see.", "i see"),
        ("What\u2019s up", "whats up"),
    ],
)
def test_the_normaliser_makes_these_equal(heard: str, said: str) -> None:
    assert R.wer(said, heard) == 0.0


@pytest.mark.parametrize(
    ("heard", "said"),
    [
        ("too", "two"),  # homophones are errors
        ("to", "two"),
        ("I'd like a coffee", "i would like a coffee"),  # contractions are not expanded
        ("Front centre", "front center"),  # nor spellings equated
        ("Hmm.", "mm hmm"),
        ("Order number 41.", "order number four one seven"),
    ],
)
def test_the_normaliser_leaves_these_apart(heard: str, said: str) -> None:
    assert R.wer(said, heard) > 0


def test_word_error_rate_counts_substitutions_deletions_insertions() -> None:
    assert R.wer("order a large coffee", "order a small coffee") == 0.25
    assert R.wer("order a large coffee", "order coffee") == 0.5
    assert R.wer("order a coffee", "order a coffee now please") == pytest.approx(2 / 3)
    assert R.wer("order a coffee", None) == 1.0
    assert R.wer("", "") == 0.0
    assert R.wer("", "hello there") == 2.0  # an empty reference scores the words heard
    assert R.word_errors("order number four one seven", "Order number 41, Sambin.") == (2, 5)


def test_cardinals() -> None:
    assert R.cardinal(0) == ["zero"]
    assert R.cardinal(40) == ["forty"]
    assert R.cardinal(417) == "four hundred seventeen".split()
    assert R.cardinal(2_000_005) == "two million five".split()


@given(TEXT)
def test_a_text_matches_itself(text: str) -> None:
    assert R.wer(text, text) == 0.0


@given(TEXT)
def test_normalising_twice_changes_nothing(text: str) -> None:
    once = R.normalise(text)
    assert R.normalise(once) == once
    assert once == once.lower() and all(c.isalnum() or c == " " for c in once)


@given(WORDS, WORDS)
def test_case_and_punctuation_do_not_count(said: list[str], heard: list[str]) -> None:
    ref, hyp = " ".join(said), " ".join(heard)
    assert R.wer(ref, hyp.upper().replace(" ", ", ") + ".") == R.wer(ref, hyp)


@given(WORDS, WORDS)
def test_error_rate_is_bounded_by_lengths(said: list[str], heard: list[str]) -> None:
    errors, words = R.word_errors(" ".join(said), " ".join(heard))
    n_said, n_heard = len(R.normalise(" ".join(said)).split()), len(R.normalise(" ".join(heard)).split())
    assert words == n_said
    assert abs(n_said - n_heard) <= errors <= max(n_said, n_heard)
    assert R.wer(" ".join(said), "") == (1.0 if said else 0.0)


@given(st.integers(0, 10**7))
def test_numbers_in_digits_equal_their_words(n: int) -> None:
    assert R.wer(" ".join(R.cardinal(n)), f"{n}.") == 0.0
    assert R.wer(" ".join(R.cardinal(n)), f"{n:,}") == 0.0


# -------------------------------------------------------------------- corpus


def test_the_corpus_is_big_enough_and_labelled() -> None:
    corpus = R.entries()
    assert len(corpus) >= 60
    assert len({e.name for e in corpus}) == len(corpus)
    counts = Counter(e.category for e in corpus)
    assert set(counts) == set(R.CATEGORIES)
    assert counts["request"] >= 20 and counts["backchannel"] >= 10 and counts["short"] >= 10
    assert counts["human"] == 8 and counts["non_speech"] == 1
    for e in corpus:
        if e.category == "non_speech":
            assert e.label == ""
            continue
        assert e.label and R.normalise(e.label) == e.label, e  # lower case words, no punctuation, no digits
        assert not any(c.isdigit() for c in e.label)


def test_the_corpus_covers_its_phrases_voices_and_speeds() -> None:
    corpus = R.entries()
    labels = {e.label for e in corpus}
    for word in ("uh huh", "mm hmm", "okay", "yeah", "right", "i see", "sure", "no", "yes", "two", "three",
                 "twenty five", "order number four one seven", "cancel my subscription", "order a coffee please",
                 "front center", "side right"):
        assert word in labels
    spoken = [e for e in corpus if e.source is None]
    assert {(e.voice, e.wpm) for e in spoken} == {(v, s) for v in R.VOICES for s in R.SPEEDS}
    per_pair = Counter((e.voice, e.wpm) for e in spoken)
    assert max(per_pair.values()) - min(per_pair.values()) <= 1  # dealt evenly
    by_phrase: dict[str, list[tuple[str | None, int | None]]] = {}
    for e in spoken:
        by_phrase.setdefault(e.label, []).append((e.voice, e.wpm))
    assert all(len(set(pairs)) == len(pairs) for pairs in by_phrase.values())  # no rendering twice
    assert R.entries() == corpus  # the selection is fixed


def test_the_quick_subset() -> None:
    q = R.quick()
    assert 10 <= len(q) <= 14
    assert {e.category for e in q} == {"request", "backchannel", "short", "human"}
    assert len({e.label for e in q}) == len(q)


@requires_espeak
def test_materialise_writes_wavs(tmp_path: Path) -> None:
    corpus = R.entries()
    sample = [next(e for e in corpus if e.category == "request"), next(e for e in corpus if e.category == "short")]
    paths = R.materialise(tmp_path, sample)
    assert set(paths) == {e.name for e in sample}
    for e in sample:
        with wave.open(str(paths[e.name])) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (22050, 1, 2)
            assert 0.2 < w.getnframes() / w.getframerate() < 5
    stamp = paths[sample[0].name].stat().st_mtime_ns
    assert R.materialise(tmp_path, sample[:1]) == {sample[0].name: paths[sample[0].name]}
    assert paths[sample[0].name].stat().st_mtime_ns == stamp  # an existing file is kept


def test_materialise_copies_the_recordings(tmp_path: Path) -> None:
    human = [e for e in R.entries() if e.category == "human"][:1]
    assert human[0].source is not None
    if not human[0].source.exists():
        pytest.skip("alsa-utils' recordings are missing")
    paths = R.materialise(tmp_path, human)
    assert paths[human[0].name].read_bytes() == human[0].source.read_bytes()
