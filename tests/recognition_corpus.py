"""A labelled corpus for free-form speech recognition (issue 29), and the
word error rate it is scored with.

Each :class:`Entry` is one utterance a caller says to the demo shop's agent,
with the words it says (its ``label``: lower case, no punctuation, numbers
written as words) and its ``category``:

* ``request``: what a caller asks a shop agent (order a coffee, sizes,
  cancel an order or a subscription, pay, the weather, ...);
* ``backchannel``: "uh huh", "mm hmm", "okay", "yeah", "right", "i see",
  "sure" (said while the agent is silent here, so each is a user turn);
* ``short``: short answers ("no", "yes please", "two") and numbers
  ("twenty five", "order number four one seven");
* ``human``: the eight speech recordings of alsa-utils
  (``/usr/share/sounds/alsa/Front_Center.wav`` says "front center", ...),
  used as they are (48 kHz mono);
* ``non_speech``: alsa-utils' ``Noise.wav``, label ``""``: nothing should be
  heard in it (not counted in a word error rate; the words heard in it are
  insertions).

The espeak-ng utterances are spoken by three voices (``en-us``, ``en-gb``,
``en-us+f3``) at two speeds (130 and 175 words per minute): six renderings.
Not every phrase gets every rendering; the selection is fixed: the six
(voice, speed) pairs are shuffled once with ``random.Random(SEED)`` and dealt
in that order, cyclically, to the phrases in the order listed here, each
phrase taking :data:`RENDERINGS` of its category consecutive pairs (so a
phrase's renderings differ, and each pair is used about equally).

:func:`materialise` writes the corpus as WAV files (espeak-ng's own: 22.05
kHz mono s16; the alsa files copied). :func:`wer` scores a transcript
against a label through :func:`readings`, the normaliser, whose every
equivalence is listed there.

Lengths are seconds, rates Hz; this module needs no pytest (bench/recognition.py
imports it).
"""

from __future__ import annotations

import itertools
import random
import re
import shutil
import subprocess
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from corpus import ALSA, BACKCHANNELS, have_espeak  # the barge-in corpus: the alsa folder, its backchannels

from voice.backchannel import normalise as product_normalise

SEED = 29
VOICES = ("en-us", "en-gb", "en-us+f3")
SPEEDS = (130, 175)  # words per minute
CATEGORIES = ("request", "backchannel", "short", "human", "non_speech")
#: renderings (voice, speed pairs) of each espeak-ng phrase, per category
RENDERINGS = {"request": 1, "backchannel": 2, "short": 2}

#: what a caller asks the shop's agent (demo_shop/: the weather, orders, payment, messages)
REQUESTS = [
    "i would like to order a coffee",
    "order a coffee please",
    "make it a large one",
    "a small latte please",
    "can i get a medium cappuccino",
    "two espressos to take away",
    "cancel my subscription",
    "cancel my order",
    "what is the weather like today",
    "what is the weather in paris",
    "send five messages",
    "i want to pay now",
    "charge my card",
    "where is my order",
    "do you have any muffins",
    "add a chocolate croissant",
    "change the size to small",
    "can you repeat that",
    "wait stop please",
    "no i meant the other one",
    "hello there",
    "how much is a large coffee",
]
#: (what espeak-ng is told, the label): the barge-in corpus's backchannels and two more
BACKCHANNEL_PHRASES = [(t, " ".join(t.replace("-", " ").split())) for t in BACKCHANNELS] + [("i see", "i see"), ("sure", "sure")]
SHORT_ANSWERS = ["no", "yes", "two", "three", "yes please", "no thanks"]
NUMBERS = ["twenty five", "forty two", "seventeen", "one hundred", "order number four one seven", "my table is number twelve"]
#: alsa-utils recordings that are speech: file stem -> what is said
HUMAN = {
    "Front_Center": "front center",
    "Front_Left": "front left",
    "Front_Right": "front right",
    "Rear_Center": "rear center",
    "Rear_Left": "rear left",
    "Rear_Right": "rear right",
    "Side_Left": "side left",
    "Side_Right": "side right",
}
NON_SPEECH = ["Noise"]


@dataclass(frozen=True)
class Entry:
    """One labelled utterance.

    Attributes:
        name: unique, stable id, usable as a file stem ("request-order-a-coffee-please-en-gb-130").
        label: the words said: lower case, no punctuation, numbers as words; "" for non-speech.
        category: one of :data:`CATEGORIES`.
        text: what espeak-ng is told to say (None: a recording).
        voice / wpm: espeak-ng's voice and speed, words per minute (None: a recording).
        source: the recording (None: espeak-ng).
    """

    name: str
    label: str
    category: str
    text: str | None = None
    voice: str | None = None
    wpm: int | None = None
    source: Path | None = None

    @property
    def file_name(self) -> str:
        return f"{self.name}.wav"


def _slug(text: str) -> str:
    return "-".join(re.sub(r"[^a-z0-9 ]+", " ", text.lower()).split())


def renderings() -> list[tuple[str, int]]:
    """The six (voice, words per minute) pairs in their seeded order (the deal's cycle)."""
    pairs = [(v, s) for v in VOICES for s in SPEEDS]
    random.Random(SEED).shuffle(pairs)
    return pairs


def entries() -> list[Entry]:
    """The whole corpus, in a fixed order: requests, backchannels, short
    answers and numbers, the alsa recordings, non-speech. The recordings
    are listed whether or not alsa-utils is installed (:func:`materialise`
    says which are missing)."""
    deal = itertools.cycle(renderings())
    phrases: list[tuple[str, str, str]] = [("request", t, t) for t in REQUESTS]
    phrases += [("backchannel", t, label) for t, label in BACKCHANNEL_PHRASES]
    phrases += [("short", t, t) for t in SHORT_ANSWERS + NUMBERS]
    out = []
    for category, text, label in phrases:
        for _ in range(RENDERINGS[category]):
            voice, wpm = next(deal)
            out.append(Entry(f"{category}-{_slug(label)}-{voice.replace('+', '-')}-{wpm}", label, category, text, voice, wpm))
    out += [Entry(f"human-{_slug(label)}", label, "human", source=ALSA / f"{stem}.wav") for stem, label in HUMAN.items()]
    out += [Entry(f"non-speech-{stem.lower()}", "", "non_speech", source=ALSA / f"{stem}.wav") for stem in NON_SPEECH]
    return out


def quick(corpus: list[Entry] | None = None) -> list[Entry]:
    """A dozen entries for a smoke test, each a different phrase: the first
    four requests, three backchannels, three short answers and two
    recordings of ``corpus`` (default :func:`entries`); no non-speech."""
    corpus = entries() if corpus is None else corpus
    take = {"request": 4, "backchannel": 3, "short": 3, "human": 2}
    out: list[Entry] = []
    for e in corpus:
        if take.get(e.category, 0) > 0 and all(o.label != e.label for o in out):
            out.append(e)
            take[e.category] -= 1
    return out


def materialise(directory: Path, corpus: list[Entry] | None = None) -> dict[str, Path]:
    """Write each entry as ``directory/<name>.wav`` (an existing file is
    kept): espeak-ng's output as it comes (22.05 kHz mono s16, its own
    silence around the words), the recordings copied as they are.

    Returns:
        entry name -> WAV path, for every entry that could be made
        (a recording missing from this machine is left out).

    Raises:
        RuntimeError: espeak-ng is missing and an entry needs it.
        subprocess.CalledProcessError: espeak-ng failed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for e in entries() if corpus is None else corpus:
        path = directory / e.file_name
        if not path.exists():
            if e.source is not None:
                if not e.source.exists():
                    continue
                shutil.copyfile(e.source, path)
            else:
                if not have_espeak():
                    raise RuntimeError("espeak-ng is not installed (Debian package espeak-ng)")
                assert e.text is not None and e.voice is not None and e.wpm is not None
                tmp = path.with_suffix(".part.wav")
                subprocess.run(["espeak-ng", "-v", e.voice, "-s", str(e.wpm), "-w", str(tmp), e.text], check=True, capture_output=True)
                tmp.replace(path)
        out[e.name] = path
    return out


# ------------------------------------------------------------ word error rate

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ((10**9, "billion"), (10**6, "million"), (1000, "thousand"), (100, "hundred"))

#: single words taken as another's spelling: each maps to its canonical words
EQUIVALENT = {
    "ok": ["okay"],  # Whisper writes "OK" as often as "Okay"
    "mhm": ["mm", "hmm"],  # "mhm", "mmhmm", "mm-hmm" and "mm hmm" are one backchannel
    "mmhmm": ["mm", "hmm"],
    "mmhm": ["mm", "hmm"],
    "uhhuh": ["uh", "huh"],  # "uhhuh", "uh-huh" and "uh huh" are one backchannel
}
#: a text with more numbers of three or more digits than this reads the rest as cardinals only
MAX_AMBIGUOUS_NUMBERS = 4


def cardinal(n: int) -> list[str]:
    """``n`` (>= 0) in words, without "and": 25 -> twenty five, 417 -> four hundred seventeen."""
    if n < 20:
        return [_ONES[n]]
    if n < 100:
        return [_TENS[n // 10]] + ([] if n % 10 == 0 else [_ONES[n % 10]])
    for scale, word in _SCALES:
        if n >= scale:
            return cardinal(n // scale) + [word] + ([] if n % scale == 0 else cardinal(n % scale))
    raise AssertionError(n)  # unreachable: n >= 100 meets the hundred


def _number_readings(digits: str) -> list[list[str]]:
    """How a caller may have said a number written in digits: 0 to 99 as a
    number; three or more digits as a number or digit by digit ("417":
    four hundred seventeen, four one seven); a leading zero digit by digit
    only ("007")."""
    by_digit = [_ONES[int(d)] for d in digits]
    if len(digits) > 1 and digits[0] == "0":
        return [by_digit]
    n = int(digits)
    if n < 100:
        return [cardinal(n)]
    return [cardinal(n), by_digit]


def _tokens(text: str) -> list[str]:
    """Lower case words: Unicode compatibility forms folded (NFKC), commas in
    numbers dropped ("1,000"), a point between digits read "point" and the
    decimals digit by digit ("2.50" -> 2 point 5 0), then the product's
    normaliser (:func:`voice.backchannel.normalise`: hyphens as spaces,
    letters, digits and apostrophes only), apostrophes dropped ("what's" ->
    whats), digits split from letters ("4pm" -> 4 pm)."""
    t = unicodedata.normalize("NFKC", text).replace("\u2019", "'")
    t = re.sub(r"(?<=\d),(?=\d{3}\b)", "", t)
    t = re.sub(r"(?<=\d)\.(\d+)", lambda m: " point " + " ".join(m.group(1)), t)
    t = product_normalise(t).replace("'", "")
    return re.sub(r"(?<=\d)(?=[^\d\s])|(?<=[^\d\s])(?=\d)", " ", t).split()


def readings(text: str) -> list[list[str]]:
    """The normalised word sequences ``text`` may stand for (one, unless it
    has numbers of three or more digits).

    The normaliser: lower case; punctuation dropped; hyphens as spaces;
    apostrophes dropped; digits written as words (:func:`_number_readings`;
    "25" -> twenty five, "2.50" -> two point five zero, "1,000" -> one thousand);
    and the few equivalences of :data:`EQUIVALENT` ("ok" = okay; "mhm",
    "mmhmm", "mmhm" = mm hmm; "uhhuh" = uh huh). Nothing else is equated:
    homophones ("to", "too" for two), contractions ("i'd" for i would),
    British spellings ("centre") and ordinals ("1st") count as errors.
    """
    options: list[list[list[str]]] = []
    ambiguous = 0
    for w in _tokens(text):
        if w.isdecimal():
            alts = _number_readings(w)
            if len(alts) > 1:
                ambiguous += 1
                if ambiguous > MAX_AMBIGUOUS_NUMBERS:
                    alts = alts[:1]
            options.append(alts)
        else:
            options.append([EQUIVALENT.get(w, [w])])
    return [[w for part in choice for w in part] for choice in itertools.product(*options)]


def normalise(text: str) -> str:
    """``text`` as compared (its first reading): "OK, 25 lattes!" -> "okay twenty five lattes"."""
    return " ".join(readings(text)[0])


def edits(ref: list[str], hyp: list[str]) -> int:
    """Word-level Levenshtein distance: substitutions + deletions + insertions."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i]
        for j, h in enumerate(hyp, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h)))
        prev = cur
    return prev[-1]


def word_errors(reference: str, hypothesis: str | None) -> tuple[int, int]:
    """(word errors, reference words) of ``hypothesis`` (None: nothing
    heard) against ``reference``, both normalised, over the pair of
    readings with the fewest errors relative to the reference's length
    (see :func:`wer`). Summed over a corpus, errors / words is its WER."""
    best: tuple[float, int, int] | None = None
    for ref in readings(reference):
        for hyp in readings(hypothesis or ""):
            e = edits(ref, hyp)
            score = e / max(1, len(ref))
            if best is None or score < best[0]:
                best = (score, e, len(ref))
    assert best is not None  # readings() is never empty
    return best[1], best[2]


def wer(reference: str, hypothesis: str | None) -> float:
    """Word error rate of ``hypothesis`` against ``reference``:
    (substitutions + deletions + insertions) / words in the reference, after
    :func:`readings` (the reading of each with the lowest rate). An empty
    reference scores the number of words heard (0.0 for nothing), so
    ``wer(x, x)`` is 0.0 for every ``x``. None means nothing was heard.
    Examples: wer("two", "2.") == 0.0; wer("order a coffee", "Order coffee") == 1/3.
    """
    e, n = word_errors(reference, hypothesis)
    return e / max(1, n)
