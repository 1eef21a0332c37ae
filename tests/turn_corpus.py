"""A labelled corpus of turns: where a caller's request really ends (issue 31, item 4).

Each :class:`TurnRequest` is one thing a caller says to the demo shop's agent,
of one of four kinds (:data:`KINDS`):

* ``complete``: a finished request ("i'd like to order a large coffee
  please"): the turn is over when the speech stops;
* ``mid_pause``: a request spoken in two parts with a pause of 400 to 800 ms
  between them, at a place where the sentence is clearly unfinished ("i'd
  like to order" + pause + "a large coffee"): the turn is over only after the
  second part; an agent that answers in the pause cuts the caller off;
* ``one_word``: a one- or two-word answer ("yes", "two", "cancel it"): over
  when the speech stops, however short;
* ``trailing``: a sentence the caller trails off on and does not finish ("so
  i was thinking maybe"): they stop talking and wait. Genuinely ambiguous:
  the agent should answer, but only after the longer bound; score it apart.

The expected end of every request is the end of its audio
(:attr:`RenderedRequest.speech_end_s`); a ``mid_pause`` request also says
where its pause is (:attr:`RenderedRequest.pauses`).

Speech is espeak-ng's, in three voices (``en-us``, ``en-gb``, ``en-us+f3``)
at two speeds (130 and 175 words per minute): six renderings. As in
``tests/recognition_corpus.py``, the six (voice, speed) pairs are shuffled
once with ``random.Random(SEED)`` and dealt cyclically to the phrases in the
order listed here, each phrase taking :data:`RENDERINGS` of its kind
consecutive pairs. The pauses of the ``mid_pause`` requests are spread evenly
over :data:`PAUSE_MS_RANGE` (multiples of 10 ms) and dealt in an order
shuffled with the same seed. The whole corpus is a fixed list: the same on
every machine.

:func:`render` speaks a request: each part through espeak-ng, resampled with
the project's resampler (:class:`media.frames.PcmResampler`, libswresample),
trimmed of espeak's leading and trailing silence, and joined with exactly
``pause_ms`` of digital silence. Trimming works on 10 ms windows: speech
starts at the first window whose RMS level is above
:data:`SPEECH_THRESHOLD_DBFS` and ends after the last such window, so every
span said here is exact to the sample of the returned PCM.

Lengths are seconds unless named ``_ms``, rates Hz, PCM mono s16 little-endian.
This module needs no pytest (bench/end_of_turn.py and bench/latency.py import it).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from media.frames import BYTES_PER_SAMPLE, load_pcm

SEED = 31
VOICES = ("en-us", "en-gb", "en-us+f3")
SPEEDS = (130, 175)  # words per minute
TurnKind = Literal["complete", "mid_pause", "one_word", "trailing"]
KINDS: tuple[TurnKind, ...] = get_args(TurnKind)
#: renderings (voice, speed pairs) of each phrase, per kind
RENDERINGS: dict[TurnKind, int] = {"complete": 1, "mid_pause": 2, "one_word": 1, "trailing": 1}
#: the shortest and longest mid-sentence pause, ms (both included)
PAUSE_MS_RANGE = (400, 800)
#: a 10 ms window louder than this (RMS, dBFS: 0 = a full-scale square wave) is speech
SPEECH_THRESHOLD_DBFS = -50.0
#: espeak-ng's speed limits, words per minute (it clamps outside them)
WPM_RANGE = (80, 450)
_CACHE_VERSION = "1"

#: (key, text): finished requests to the shop's agent
COMPLETE = [
    ("order-large-coffee", "i'd like to order a large coffee please"),
    ("weather-paris", "what is the weather like in paris today"),
    ("cancel-subscription", "please cancel my subscription"),
    ("medium-latte", "can i get a medium latte"),
    ("where-order", "where is my order"),
    ("muffins", "do you have any blueberry muffins"),
    ("add-croissant", "add a chocolate croissant to my order"),
    ("size-small", "change the size to small"),
    ("pay-card", "i want to pay with my card"),
    ("repeat", "can you repeat that please"),
    ("espressos", "two espressos to take away"),
    ("price", "how much is a large cappuccino"),
    ("order-number", "my order number is four one seven"),
    ("weather-tomorrow", "will it rain in london tomorrow"),
    ("open-hours", "what time do you close tonight"),
    ("receipt", "send the receipt to my email"),
    ("oat-milk", "could i have that with oat milk"),
    ("thanks", "thank you that is all for today"),
    ("delivery", "how long will the delivery take"),
    ("other-one", "no i meant the other one"),
    ("refund", "i would like a refund for yesterday's order"),
    ("tea", "a pot of green tea for two please"),
    ("messages", "send five messages to the kitchen"),
    ("hello", "hello there how are you"),
]
#: (key, first part, second part): the first part leaves the sentence clearly unfinished
MID_PAUSE = [
    ("order", "i'd like to order", "a large coffee"),
    ("weather", "can you tell me", "the weather in paris"),
    ("order-number", "my order number is", "four one seven"),
    ("cancel", "i want to cancel", "my subscription"),
    ("latte", "can i get a", "medium latte please"),
    ("size", "change the size to", "small"),
    ("pay", "i would like to pay with", "my card"),
    ("receipt", "please send the receipt to", "my email"),
    ("muffins", "do you have any", "blueberry muffins"),
    ("add", "and could you also add", "a chocolate croissant"),
    ("forecast", "what will the weather be like in", "london tomorrow"),
    ("address", "the delivery address is", "twelve high street"),
    ("espressos", "i need two", "espressos to take away"),
]
#: (key, text): one- and two-word answers
ONE_WORD = [
    ("yes", "yes"),
    ("no", "no"),
    ("two", "two"),
    ("sure", "sure"),
    ("cancel-it", "cancel it"),
    ("coffee", "coffee"),
    ("okay", "okay"),
    ("three", "three"),
    ("yes-please", "yes please"),
    ("no-thanks", "no thanks"),
    ("large", "large"),
    ("paris", "paris"),
]
#: (key, text): sentences the caller stops on without finishing
TRAILING = [
    ("thinking-maybe", "so i was thinking maybe"),
    ("and-then", "and then i"),
    ("order-um", "i'd like to order a um"),
    ("not-sure", "i'm not really sure if"),
    ("wondering", "i was wondering whether you could"),
    ("the-thing-is", "well the thing is"),
    ("maybe-the", "maybe the"),
    ("can-you", "can you"),
    ("so-yeah", "so yeah i guess"),
    ("my-order-was", "my order was"),
    ("what-about", "what about the"),
    ("because", "because i"),
]


@dataclass(frozen=True)
class TurnRequest:
    """One labelled request.

    Attributes:
        name: unique, stable id, usable as a file stem: ``<kind>-<key>-<voice>-<wpm>``
            ("mid_pause-order-en-gb-130"; a voice's "+" is written "-").
        kind: one of :data:`KINDS`.
        voice: espeak-ng voice ("en-us").
        wpm: espeak-ng speed, words per minute (within :data:`WPM_RANGE`).
        parts: the text spoken: two parts for ``mid_pause``, one otherwise.
        pause_ms: silence between the parts, ms (0 with one part).

    Raises:
        ValueError: an unknown kind, a part count or pause that does not fit
            the kind, an empty part or voice, a speed outside :data:`WPM_RANGE`.
    """

    name: str
    kind: TurnKind
    voice: str
    wpm: int
    parts: tuple[str, ...]
    pause_ms: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown turn kind {self.kind!r}: one of {', '.join(KINDS)}")
        want = 2 if self.kind == "mid_pause" else 1
        if len(self.parts) != want:
            raise ValueError(f"a {self.kind} request has {want} part(s), not {len(self.parts)}: {self.parts!r}")
        if any(not p.strip() for p in self.parts):
            raise ValueError(f"empty part in {self.parts!r}")
        if want == 2 and self.pause_ms <= 0:
            raise ValueError(f"a mid_pause request needs a pause > 0 ms, not {self.pause_ms}")
        if want == 1 and self.pause_ms != 0:
            raise ValueError(f"a one-part request has no pause (pause_ms = 0), not {self.pause_ms}")
        if not self.voice.strip():
            raise ValueError("empty espeak-ng voice")
        if not WPM_RANGE[0] <= self.wpm <= WPM_RANGE[1]:
            raise ValueError(f"speed {self.wpm} wpm is outside espeak-ng's {WPM_RANGE[0]}..{WPM_RANGE[1]}")

    @property
    def text(self) -> str:
        """The parts joined with a space: what a recogniser should hear."""
        return " ".join(self.parts)


@dataclass(frozen=True)
class RenderedRequest:
    """A request spoken (:func:`render`).

    Attributes:
        request: what was spoken.
        pcm: mono s16 at ``rate``: the speech only, trimmed at both ends
            (no silence before the first or after the last speech window).
        rate: sample rate, Hz.
        speech_end_s: end of the last speech sample, s from the start of
            ``pcm`` (the expected end of the turn): the length of ``pcm``.
        pauses: the mid-sentence pauses, (start, end) s; () if none. Each is
            digital silence, speech on both sides.
    """

    request: TurnRequest
    pcm: bytes
    rate: int
    speech_end_s: float
    pauses: tuple[tuple[float, float], ...]

    def until(self, t: float) -> bytes:
        """The first ``t`` s of :attr:`pcm` (whole samples): e.g. a
        ``mid_pause`` request cut at its pause, ``until(pauses[0][0])``."""
        return self.pcm[: int(round(t * self.rate)) * BYTES_PER_SAMPLE]


def _slug_voice(voice: str) -> str:
    return voice.replace("+", "-")


def renderings() -> list[tuple[str, int]]:
    """The six (voice, words per minute) pairs in their seeded order (the deal's cycle)."""
    pairs = [(v, s) for v in VOICES for s in SPEEDS]
    random.Random(SEED).shuffle(pairs)
    return pairs


def pauses_ms(n: int) -> list[int]:
    """``n`` pauses, ms, spread evenly over :data:`PAUSE_MS_RANGE` (both
    ends included, rounded to 10 ms), in an order shuffled with :data:`SEED`."""
    lo, hi = PAUSE_MS_RANGE
    if n <= 1:
        return [(lo + hi) // 2] * n
    values = [int(round((lo + (hi - lo) * i / (n - 1)) / 10) * 10) for i in range(n)]
    random.Random(SEED).shuffle(values)
    return values


def corpus(quick: bool = False) -> list[TurnRequest]:
    """The whole corpus in a fixed order (complete, mid_pause, one_word,
    trailing), 74 requests; ``quick``: a small subset for tests, three of
    each kind, each a different phrase and together using every voice.
    """
    deal = itertools.cycle(renderings())
    phrases: list[tuple[TurnKind, str, tuple[str, ...]]] = [("complete", k, (t,)) for k, t in COMPLETE]
    phrases += [("mid_pause", k, (a, b)) for k, a, b in MID_PAUSE]
    phrases += [("one_word", k, (t,)) for k, t in ONE_WORD]
    phrases += [("trailing", k, (t,)) for k, t in TRAILING]
    pauses = iter(pauses_ms(len(MID_PAUSE) * RENDERINGS["mid_pause"]))
    out: list[TurnRequest] = []
    for kind, key, parts in phrases:
        for _ in range(RENDERINGS[kind]):
            voice, wpm = next(deal)
            pause = next(pauses) if kind == "mid_pause" else 0
            out.append(TurnRequest(f"{kind}-{key}-{_slug_voice(voice)}-{wpm}", kind, voice, wpm, parts, pause))
    if not quick:
        return out
    picked: list[TurnRequest] = []
    for kind in KINDS:
        seen: set[tuple[str, ...]] = set()
        for r in out:
            if r.kind == kind and r.parts not in seen and len(seen) < 3:
                seen.add(r.parts)
                picked.append(r)
    return picked


def default_cache_dir() -> Path:
    """Where rendered parts are kept: ``$TURNKEEPER_CORPUS_CACHE`` or
    ``<tmp>/turnkeeper-corpus`` (shared with ``tests/corpus.py``)."""
    d = Path(os.environ.get("TURNKEEPER_CORPUS_CACHE") or Path(tempfile.gettempdir()) / "turnkeeper-corpus")
    d.mkdir(parents=True, exist_ok=True)
    return d


def speech_windows(pcm: bytes, rate: int) -> np.ndarray:
    """Which 10 ms windows of ``pcm`` (mono s16 at ``rate`` Hz; a last
    partial window counts as one) are speech: RMS above
    :data:`SPEECH_THRESHOLD_DBFS`. Boolean array, one entry per window."""
    x = np.frombuffer(pcm, dtype="<i2").astype(np.float64) / 32768.0
    n = rate // 100
    if not len(x):
        return np.zeros(0, dtype=bool)
    padded = np.concatenate([x, np.zeros(-len(x) % n)])
    frames = padded.reshape(-1, n)
    counts = np.full(len(frames), n, dtype=np.float64)
    counts[-1] = len(x) - n * (len(frames) - 1)
    rms = np.sqrt((frames * frames).sum(axis=1) / counts)
    # 0 dBFS is a full-scale square wave: RMS 1.0 on samples in [-1, 1)
    with np.errstate(divide="ignore"):
        db = 20 * np.log10(rms)
    return db > SPEECH_THRESHOLD_DBFS


def trim(pcm: bytes, rate: int) -> bytes:
    """``pcm`` from its first speech window to the end of its last
    (:func:`speech_windows`); b"" if it has none."""
    speech = np.nonzero(speech_windows(pcm, rate))[0]
    if not len(speech):
        return b""
    n = rate // 100
    start, end = speech[0] * n, min(len(pcm) // BYTES_PER_SAMPLE, (speech[-1] + 1) * n)
    return pcm[start * BYTES_PER_SAMPLE : end * BYTES_PER_SAMPLE]


def _espeak(text: str, voice: str, wpm: int, rate: int) -> bytes:
    """``text`` spoken by espeak-ng, resampled to ``rate``, untrimmed."""
    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng is not installed (Debian package espeak-ng)")
    with tempfile.TemporaryDirectory() as d:
        wav = Path(d) / "part.wav"
        done = subprocess.run(["espeak-ng", "-v", voice, "-s", str(wpm), "-w", str(wav), text], capture_output=True, text=True)
        if done.returncode != 0 or not wav.exists():
            said = (done.stderr or done.stdout).strip()
            if "voice does not exist" in said:
                raise ValueError(f"unknown espeak-ng voice {voice!r} (espeak-ng --voices lists them)")
            raise RuntimeError(f"espeak-ng failed on {text!r} (voice {voice!r}, {wpm} wpm): {said or done.returncode}")
        return load_pcm(wav, rate)


def _part(text: str, voice: str, wpm: int, rate: int, directory: Path | None) -> bytes:
    """One part, trimmed (:func:`trim`), cached in ``directory``."""
    key = hashlib.sha1(repr((_CACHE_VERSION, text, voice, wpm, rate, SPEECH_THRESHOLD_DBFS)).encode()).hexdigest()[:16]
    path = directory / f"turn-part-{key}.pcm" if directory is not None else None
    if path is not None and path.exists():
        return path.read_bytes()
    pcm = trim(_espeak(text, voice, wpm, rate), rate)
    if not pcm:
        raise RuntimeError(f"espeak-ng said nothing audible for {text!r} (voice {voice!r})")
    if path is not None:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pcm)
        tmp.replace(path)
    return pcm


def render(req: TurnRequest, rate: int = 16000, cache_dir: Path | None = None) -> RenderedRequest:
    """Speak ``req``: each part through espeak-ng, resampled to ``rate`` and
    trimmed (:func:`trim`), the parts joined by exactly ``req.pause_ms`` of
    digital silence (``rate * pause_ms / 1000`` samples, rounded).

    Args:
        req: the request.
        rate: output rate, Hz (8000 to 48000).
        cache_dir: where trimmed parts are kept between runs; None: the
            default (:func:`default_cache_dir`, shared with ``tests/corpus.py``).

    Raises:
        ValueError: ``rate`` out of range; ``req.voice`` is not an espeak-ng voice.
        RuntimeError: espeak-ng is missing, fails, or says nothing audible.
    """
    if not 8000 <= rate <= 48000:
        raise ValueError(f"rate {rate} Hz is outside 8000..48000")
    directory = default_cache_dir() if cache_dir is None else cache_dir
    directory.mkdir(parents=True, exist_ok=True)
    parts = [_part(text, req.voice, req.wpm, rate, directory) for text in req.parts]
    gap = bytes(int(round(rate * req.pause_ms / 1000)) * BYTES_PER_SAMPLE)
    pauses: list[tuple[float, float]] = []
    pcm = parts[0]
    for p in parts[1:]:
        start = len(pcm) // BYTES_PER_SAMPLE
        pauses.append((start / rate, (start + len(gap) // BYTES_PER_SAMPLE) / rate))
        pcm += gap + p
    return RenderedRequest(req, pcm, rate, len(pcm) // BYTES_PER_SAMPLE / rate, tuple(pauses))


def materialise(directory: Path, requests: list[TurnRequest] | None = None, rate: int = 16000) -> dict[str, Path]:
    """Write each request as ``directory/<name>.wav`` (mono s16 at ``rate``)
    for listening or other tools; an existing file is kept.

    Returns:
        request name -> WAV path.
    """
    import wave

    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for req in corpus() if requests is None else requests:
        path = directory / f"{req.name}.wav"
        if not path.exists():
            r = render(req, rate)
            tmp = path.with_suffix(".part.wav")
            with wave.open(str(tmp), "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(BYTES_PER_SAMPLE)
                w.setframerate(rate)
                w.writeframes(r.pcm)
            tmp.replace(path)
        out[req.name] = path
    return out

