"""A labelled audio corpus for barge-in tests and benchmarks, made on demand.

Every clip is 16 kHz mono s16 PCM (``bytes``) with a label; echo clips also
carry the 48 kHz reference (what the server played). Sources:

* speech: espeak-ng in several voices and speeds, and the human recordings
  that ship with alsa-utils (``/usr/share/sounds/alsa/Front_Center.wav`` ...);
* backchannels: espeak-ng "uh-huh", "mm-hmm", "yeah", "okay", "right";
* not speech: ``Noise.wav`` (alsa-utils), tones (440 Hz, 1 kHz, a DTMF pair,
  a sweep) at a few levels, clicks and knocks, cough-like bursts;
* echo: agent speech sent through Opus (libopus via PyAV, 48 kHz) and back
  (two encode/decode round trips: server -> browser, browser mic -> server),
  delayed and attenuated, with the clean reference.

Everything is deterministic (fixed RNG seeds) and cached under
``$TURNKEEPER_CORPUS_CACHE`` or ``<tmp>/turnkeeper-corpus``. Functions that
need espeak-ng call ``pytest.skip`` when it is missing.

Levels are dBFS RMS (0 dBFS = full-scale square wave, as
:func:`media.frames.rms_dbfs`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import av
import numpy as np

from media.frames import PLAYOUT_RATE, VAD_RATE, PcmResampler, load_pcm, pcm_to_frame
from media.g711 import MULAW_FRAME_BYTES, MulawDecoder, pcm_to_mulaw

ALSA = Path("/usr/share/sounds/alsa")
ALSA_SPEECH = ["Front_Center", "Front_Left", "Front_Right", "Rear_Center", "Rear_Left", "Side_Right"]
VOICES = ["en-us", "en-gb", "en-us+f3", "en+m3"]
SPEEDS = [120, 175, 240]
PHRASES = [
    "wait, stop please",
    "what is the weather like today",
    "no, I meant the other one",
    "hello there",
    "can you tell me a story",
]
AGENT_PHRASES = [
    "Sure. Here is the forecast for today: sunny in the morning, with clouds later and a light breeze from the west.",
    "I have ordered one coffee for you. It will be ready in about five minutes at the counter near the door.",
]
BACKCHANNELS = ["uh-huh", "mm-hmm", "yeah", "okay", "right"]
_CACHE_VERSION = "1"


@dataclass(frozen=True)
class Clip:
    """One labelled clip.

    Attributes:
        name: unique, stable id (used as a pytest param id).
        label: "speech", "backchannel", "noise", "tone", "click", "cough",
            "echo" or "double_talk".
        pcm: 16 kHz mono s16.
        speech_at: (start, end) seconds of the user's speech inside ``pcm``
            (None for clips without user speech).
        ref48: for echo clips, the clean 48 kHz mono s16 outbound signal,
            aligned so that its 20 ms frame i was played at i * 0.02 s while
            ``pcm``'s frame i was received at i * 0.02 s.
        delay_ms / atten_db: the echo path (echo clips only).
    """

    name: str
    label: str
    pcm: bytes
    speech_at: tuple[float, float] | None = None
    ref48: bytes | None = None
    delay_ms: int = 0
    atten_db: float = 0.0
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def seconds(self) -> float:
        return len(self.pcm) / 2 / VAD_RATE


# ---------------------------------------------------------------- helpers


def cache_dir() -> Path:
    d = Path(os.environ.get("TURNKEEPER_CORPUS_CACHE") or Path(tempfile.gettempdir()) / "turnkeeper-corpus")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _key(*parts: object) -> str:
    return hashlib.sha1(repr((_CACHE_VERSION, *parts)).encode()).hexdigest()[:16]


def _cached(name: str, make) -> bytes:  # type: ignore[no-untyped-def]
    path = cache_dir() / f"{name}.pcm"
    if path.exists():
        return path.read_bytes()
    data = make()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return data


def to_array(pcm: bytes) -> np.ndarray:
    """s16 bytes -> float64 samples in [-1, 1)."""
    return np.frombuffer(pcm, dtype="<i2").astype(np.float64) / 32768.0


def to_pcm(x: np.ndarray) -> bytes:
    """float samples in [-1, 1) -> s16 bytes (clipped)."""
    return np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()


def level(x: np.ndarray) -> float:
    """RMS dBFS of float samples (-inf for silence)."""
    r = float(np.sqrt(np.mean(x * x))) if len(x) else 0.0
    return 20 * np.log10(r) if r > 0 else -np.inf


def active_level(x: np.ndarray, rate: int = VAD_RATE) -> float:
    """RMS dBFS over the 20 ms frames within 30 dB of the loudest one (a
    crude ITU-T P.56 active speech level)."""
    n = rate // 50
    frames = x[: len(x) // n * n].reshape(-1, n)
    e = np.mean(frames * frames, axis=1)
    if not len(e) or e.max() <= 0:
        return -np.inf
    act = e[e >= e.max() * 1e-3]
    return 10 * np.log10(float(np.mean(act)))


def scale_to(x: np.ndarray, dbfs: float, rate: int = VAD_RATE) -> np.ndarray:
    """Scale so the active level is ``dbfs``."""
    return x * 10 ** ((dbfs - active_level(x, rate)) / 20)


def resample(pcm: bytes, src: int, dst: int) -> bytes:
    """Resample mono s16 with libswresample, keeping the length exact."""
    if src == dst:
        return pcm
    r = PcmResampler(dst)
    out = r.pcm(pcm, src) + r.flush()
    want = len(pcm) // 2 * dst // src * 2
    return (out + bytes(max(0, want - len(out))))[:want]


def sound_extent(pcm: bytes, threshold_db: float = 35.0, rate: int = VAD_RATE) -> tuple[float, float] | None:
    """(start, end) seconds of the part within ``threshold_db`` of the loudest
    10 ms window."""
    x = to_array(pcm)
    n = rate // 100
    e = np.mean(x[: len(x) // n * n].reshape(-1, n) ** 2, axis=1)
    if not len(e) or e.max() <= 0:
        return None
    idx = np.nonzero(e >= e.max() * 10 ** (-threshold_db / 10))[0]
    return idx[0] * n / rate, (idx[-1] + 1) * n / rate


# ------------------------------------------------------------------ speech


def have_espeak() -> bool:
    return shutil.which("espeak-ng") is not None


def espeak(text: str, voice: str = "en-us", wpm: int = 175, rate: int = VAD_RATE) -> bytes:
    """Speech synthesised by espeak-ng at ``rate`` Hz, trimmed of its silent
    head and tail (cached). Skips the test when espeak-ng is missing."""
    if not have_espeak():
        import pytest

        pytest.skip("espeak-ng is not installed")

    def make() -> bytes:
        with tempfile.TemporaryDirectory() as d:
            wav = Path(d) / "out.wav"
            subprocess.run(["espeak-ng", "-v", voice, "-s", str(wpm), "-w", str(wav), text], check=True, capture_output=True)
            pcm = load_pcm(wav, rate)
        ext = sound_extent(pcm, 50.0, rate)
        if ext is None:
            return pcm
        a, b = int(ext[0] * rate), int(ext[1] * rate)
        return pcm[a * 2 : b * 2]

    return _cached(f"espeak-{_key(text, voice, wpm, rate)}", make)


def embed(
    pcm: bytes,
    lead_ms: int = 500,
    trail_ms: int = 1000,
    noise_dbfs: float | None = None,
    snr_db: float | None = None,
    seed: int = 1,
    noise: bytes | None = None,
) -> tuple[bytes, float]:
    """Put a clip between ``lead_ms`` and ``trail_ms`` of silence or noise.

    Args:
        pcm: the clip, 16 kHz mono s16.
        noise_dbfs: white-noise background level (None: digital silence
            unless ``noise`` is given).
        snr_db: if given, scale the clip so its active level is this far above
            the background (``noise_dbfs`` or the ``noise`` signal's level).
        noise: a background signal (16 kHz s16) looped under the whole result.

    Returns:
        (pcm, offset seconds of the clip's first sample).
    """
    x = to_array(pcm)
    lead = VAD_RATE * lead_ms // 1000
    n = lead + len(x) + VAD_RATE * trail_ms // 1000
    bg = np.zeros(n)
    bg_level: float | None = None
    if noise is not None:
        nz = to_array(noise)
        bg = np.resize(nz, n)
        if noise_dbfs is not None:
            bg = bg * 10 ** ((noise_dbfs - level(bg)) / 20)
        bg_level = level(bg)
    elif noise_dbfs is not None:
        rng = np.random.default_rng(seed)
        bg = rng.standard_normal(n) * 10 ** (noise_dbfs / 20)
        bg_level = noise_dbfs
    if snr_db is not None and bg_level is not None:
        x = scale_to(x, bg_level + snr_db)
    out = bg.copy()
    out[lead : lead + len(x)] += x
    return to_pcm(out), lead / VAD_RATE


def speech_clips(lead_ms: int = 500, trail_ms: int = 1000) -> list[Clip]:
    """espeak-ng speech (voices x speeds x phrases, a deterministic subset of
    the cross product) plus the alsa-utils recordings, each in silence."""
    clips = []
    combos = [(v, s, PHRASES[(i + j) % len(PHRASES)]) for i, v in enumerate(VOICES) for j, s in enumerate(SPEEDS)]
    for voice, wpm, text in combos:
        raw = espeak(text, voice, wpm)
        pcm, off = embed(raw, lead_ms, trail_ms)
        name = f"espeak-{voice}-{wpm}-{text.split(',')[0].split()[0].lower()}"
        clips.append(Clip(name, "speech", pcm, (off, off + len(raw) / 2 / VAD_RATE), meta={"voice": voice, "wpm": wpm, "text": text}))
    for n in ALSA_SPEECH:
        path = ALSA / f"{n}.wav"
        if not path.exists():
            continue
        raw = load_pcm(path, VAD_RATE)
        ext = sound_extent(raw, 40.0)
        pcm, off = embed(raw, lead_ms, trail_ms)
        assert ext is not None
        clips.append(Clip(f"alsa-{n}", "speech", pcm, (off + ext[0], off + ext[1])))
    return clips


def backchannel_clips() -> list[Clip]:
    """Short acknowledgements ("uh-huh", "yeah", ...) in two voices."""
    clips = []
    for voice in ("en-us", "en-gb+f3"):
        for text in BACKCHANNELS:
            raw = espeak(text, voice, 160)
            pcm, off = embed(raw, 500, 1000)
            clips.append(Clip(f"bc-{voice}-{text}", "backchannel", pcm, (off, off + len(raw) / 2 / VAD_RATE)))
    return clips


# -------------------------------------------------------------- not speech


def alsa_noise(seconds: float | None = None) -> bytes:
    """``Noise.wav`` from alsa-utils at 16 kHz, looped to ``seconds``."""
    raw = load_pcm(ALSA / "Noise.wav", VAD_RATE)
    if seconds is None:
        return raw
    return to_pcm(np.resize(to_array(raw), int(seconds * VAD_RATE)))


def tone(freqs: tuple[float, ...], seconds: float, dbfs: float, sweep_to: float | None = None) -> bytes:
    """A sum of sines (or a log sweep from freqs[0] to ``sweep_to`` Hz) at
    ``dbfs`` RMS, with 5 ms fades."""
    t = np.arange(int(seconds * VAD_RATE)) / VAD_RATE
    if sweep_to is not None:
        f0 = freqs[0]
        k = np.log(sweep_to / f0) / seconds
        x = np.sin(2 * np.pi * f0 * (np.exp(k * t) - 1) / k)
    else:
        x = sum(np.sin(2 * np.pi * f * t) for f in freqs)
    x = x * 10 ** ((dbfs - level(x)) / 20)
    fade = int(0.005 * VAD_RATE)
    ramp = np.linspace(0, 1, fade)
    x[:fade] *= ramp
    x[-fade:] *= ramp[::-1]
    return to_pcm(x)


def clicks(count: int, every_ms: int, width_ms: float, peak: float, seed: int) -> bytes:
    """``count`` impulses (decaying noise bursts ``width_ms`` long, peak
    amplitude ``peak`` of full scale) every ``every_ms``."""
    rng = np.random.default_rng(seed)
    n = VAD_RATE * (count * every_ms + 200) // 1000
    x = np.zeros(n)
    w = int(width_ms * VAD_RATE / 1000)
    env = np.exp(-np.arange(w) / (w / 4))
    for i in range(count):
        s = VAD_RATE * i * every_ms // 1000 + int(rng.integers(0, 80))
        x[s : s + w] += rng.standard_normal(w) * env * peak / 3
    return to_pcm(x)


def knock(count: int, seed: int) -> bytes:
    """Door knocks: a low (100-400 Hz) resonant thump with a click, ~40 ms,
    every ~180 ms."""
    rng = np.random.default_rng(seed)
    n = VAD_RATE * (count * 180 + 300) // 1000
    x = np.zeros(n)
    w = int(0.04 * VAD_RATE)
    t = np.arange(w) / VAD_RATE
    for i in range(count):
        f = 150 + 60 * rng.random()
        burst = np.sin(2 * np.pi * f * t) * np.exp(-t / 0.012) + 0.3 * rng.standard_normal(w) * np.exp(-t / 0.002)
        s = VAD_RATE * (i * 180 + int(rng.integers(0, 20))) // 1000
        x[s : s + w] += 0.5 * burst
    return to_pcm(x)


def _bandpass(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    spec = np.fft.rfft(x)
    f = np.fft.rfftfreq(len(x), 1 / VAD_RATE)
    spec[(f < lo) | (f > hi)] = 0
    return np.fft.irfft(spec, len(x))


def cough(duration_ms: int, seed: int, dbfs: float = -20.0, double: bool = False) -> bytes:
    """A cough-like burst: band-passed noise (300-3000 Hz, tilted), sharp
    5 ms attack, exponentially decaying envelope; ``double`` adds a second,
    quieter cough 250 ms later."""
    rng = np.random.default_rng(seed)

    def one(ms: int) -> np.ndarray:
        n = VAD_RATE * ms // 1000
        y = _bandpass(rng.standard_normal(n), 300, 3000)
        t = np.arange(n) / VAD_RATE
        env = np.minimum(t / 0.005, 1) * np.exp(-t / (ms / 1000 / 3))
        return y * env

    x = one(duration_ms)
    if double:
        gap = np.zeros(VAD_RATE * 250 // 1000 - len(x)) if len(x) < VAD_RATE // 4 else np.zeros(0)
        x = np.concatenate([x, gap, 0.7 * one(int(duration_ms * 0.8))])
    x = x * 10 ** ((dbfs - active_level(x)) / 20)
    return to_pcm(x)


def nonspeech_clips() -> list[Clip]:
    """Noise, tones, clicks, knocks and coughs, each embedded in silence."""
    raw: list[tuple[str, str, bytes]] = []
    if (ALSA / "Noise.wav").exists():
        raw.append(("alsa-noise", "noise", alsa_noise()))
    rng = np.random.default_rng(7)
    raw.append(("white-noise--30", "noise", to_pcm(rng.standard_normal(VAD_RATE * 2) * 10 ** (-30 / 20))))
    pink = np.cumsum(rng.standard_normal(VAD_RATE * 2))
    pink = _bandpass(pink - pink.mean(), 50, 7000)
    raw.append(("brown-noise--25", "noise", to_pcm(pink * 10 ** ((-25 - level(pink)) / 20))))
    for db in (-40, -25, -12):
        raw.append((f"tone-440-{db}", "tone", tone((440.0,), 1.5, db)))
        raw.append((f"tone-1k-{db}", "tone", tone((1000.0,), 1.5, db)))
    raw.append(("dtmf-5", "tone", tone((770.0, 1336.0), 1.0, -20)))
    raw.append(("dtmf-burst", "tone", b"".join(tone((697.0, 1209.0), 0.1, -20) + bytes(3200) for _ in range(4))))
    raw.append(("sweep", "tone", tone((200.0,), 2.0, -20, sweep_to=6000.0)))
    raw.append(("clicks-5ms", "click", clicks(6, 150, 5, 0.8, seed=3)))
    raw.append(("clicks-10ms", "click", clicks(4, 300, 10, 0.5, seed=4)))
    raw.append(("knock-3", "click", knock(3, seed=5)))
    raw.append(("knock-5", "click", knock(5, seed=6)))
    for ms, seed in ((150, 11), (250, 12), (350, 13)):
        raw.append((f"cough-{ms}", "cough", cough(ms, seed)))
    raw.append(("cough-double", "cough", cough(220, 14, double=True)))
    raw.append(("cough-loud", "cough", cough(300, 15, dbfs=-10)))
    clips = []
    for name, label, pcm in raw:
        out, _ = embed(pcm, 500, 1000)
        clips.append(Clip(name, label, out))
    return clips


# -------------------------------------------------------------------- echo


def mulaw_round_trip(pcm8k: bytes) -> bytes:
    """8 kHz mono s16 as a phone call delivers it to the server: G.711
    mu-law in 20 ms frames (``MULAW_FRAME_BYTES``), decoded and resampled to
    16 kHz mono s16 as ``media.g711.MulawDecoder`` does for a media stream."""
    mulaw = pcm_to_mulaw(pcm8k)
    decoder = MulawDecoder(VAD_RATE)
    return b"".join(decoder.decode(mulaw[i : i + MULAW_FRAME_BYTES]) for i in range(0, len(mulaw), MULAW_FRAME_BYTES))


def opus_round_trip(pcm48: bytes, bitrate: int = 32000) -> bytes:
    """Encode 48 kHz mono s16 with libopus (20 ms frames) and decode it again.
    The codec's pre-skip is removed so the output lines up with the input and
    has the same length."""
    enc = av.CodecContext.create("libopus", "w")
    enc.sample_rate = PLAYOUT_RATE
    enc.layout = "mono"
    enc.format = "s16"
    enc.bit_rate = bitrate
    enc.open()
    dec = av.CodecContext.create("opus", "r")
    dec.sample_rate = PLAYOUT_RATE
    dec.layout = "mono"
    dec.open()
    res = PcmResampler(PLAYOUT_RATE)
    n = 960 * 2
    padded = pcm48 + bytes((-len(pcm48)) % n) + bytes(n * 4)
    out = []
    pts = 0
    frames = [pcm_to_frame(padded[i : i + n], PLAYOUT_RATE, pts=i // 2) for i in range(0, len(padded), n)]
    for fr in [*frames, None]:
        for pkt in enc.encode(fr):
            for d in dec.decode(pkt):
                out.append(res.frame(d))
        pts += 960
    out.append(res.flush())
    y = b"".join(out)
    pre = int(getattr(enc, "delay", 0) or 0)
    pre = pre if 0 < pre < 2000 else 312
    # Find the codec delay by cross-correlation instead of trusting metadata.
    x = to_array(pcm48)[: PLAYOUT_RATE]
    yy = to_array(y)[: PLAYOUT_RATE + 2000]
    if np.any(x):
        corr = [float(np.dot(x[: len(yy) - k][: len(x)], yy[k : k + len(x)])) for k in range(0, 1200, 1)]
        pre = int(np.argmax(corr))
    y = y[pre * 2 :]
    return (y + bytes(max(0, len(pcm48) - len(y))))[: len(pcm48)]


def echo_path(ref48: bytes, delay_ms: int, atten_db: float, bitrate: int = 32000) -> bytes:
    """What the server hears back: ref -> Opus -> (speaker/mic: delay,
    attenuation) -> Opus -> 16 kHz. Same length (at 16 kHz) as ``ref48``."""
    y = to_array(opus_round_trip(ref48, bitrate))
    d = PLAYOUT_RATE * delay_ms // 1000
    y = np.concatenate([np.zeros(d), y])[: len(y)] * 10 ** (-atten_db / 20)
    y2 = opus_round_trip(to_pcm(y), bitrate)
    return resample(y2, PLAYOUT_RATE, VAD_RATE)


def echo_clip(delay_ms: int, atten_db: float, phrase: int = 0, voice: str = "en-us", bitrate: int = 32000) -> Clip:
    """Agent speech played by the server (``ref48``, starting 300 ms into the
    clip) and heard back as echo (``pcm``) with ``delay_ms`` round trip and
    ``atten_db`` attenuation, through two Opus round trips."""

    def make_ref() -> bytes:
        speech = espeak(AGENT_PHRASES[phrase % len(AGENT_PHRASES)], voice, 175, PLAYOUT_RATE)
        x = scale_to(to_array(speech), -20.0, PLAYOUT_RATE)
        lead = np.zeros(PLAYOUT_RATE * 300 // 1000)
        tail = np.zeros(PLAYOUT_RATE * 700 // 1000)
        y = np.concatenate([lead, x, tail])
        y = y[: len(y) // 960 * 960]
        return to_pcm(y)

    ref = _cached(f"ref-{_key(phrase, voice)}", make_ref)
    echo = _cached(f"echo-{_key(phrase, voice, delay_ms, atten_db, bitrate)}", lambda: echo_path(ref, delay_ms, atten_db, bitrate))
    return Clip(f"echo-{voice}-p{phrase}-{delay_ms}ms-{atten_db:g}dB", "echo", echo, None, ref, delay_ms, atten_db)


def double_talk(
    echo: Clip, user_text: str = "wait, stop please", voice: str = "en-gb+f3", at_s: float = 1.0, user_vs_echo_db: float = 0.0
) -> Clip:
    """``echo`` with user speech (a different voice, through one Opus trip)
    added at ``at_s`` seconds, its active level ``user_vs_echo_db`` relative
    to the echo's active level."""
    user48 = espeak(user_text, voice, 175, PLAYOUT_RATE)
    user = to_array(resample(opus_round_trip(user48), PLAYOUT_RATE, VAD_RATE))
    e = to_array(echo.pcm)
    user = scale_to(user, active_level(e) + user_vs_echo_db)
    start = int(at_s * VAD_RATE)
    out = e.copy()
    end = min(len(out), start + len(user))
    out[start:end] += user[: end - start]
    ext = sound_extent(to_pcm(user), 40.0)
    assert ext is not None
    return replace(
        echo,
        name=f"dt-{echo.name}-{user_vs_echo_db:+g}dB",
        label="double_talk",
        pcm=to_pcm(out),
        speech_at=(at_s + ext[0], min(at_s + ext[1], len(out) / VAD_RATE)),
    )


ECHO_CASES = [(40, 6.0), (120, 10.0), (250, 15.0), (400, 20.0), (80, 12.0, 1), (300, 8.0, 1)]


def echo_clips() -> list[Clip]:
    """Echo alone over a range of delays (40..400 ms) and attenuations
    (6..20 dB)."""
    out = []
    for case in ECHO_CASES:
        delay, att, *rest = case
        out.append(echo_clip(delay, att, phrase=rest[0] if rest else 0))
    return out


def double_talk_clips() -> list[Clip]:
    """Each echo clip with user speech on top at 0 and +6 dB."""
    out = []
    texts = ["wait, stop please", "no, I meant the other one"]
    for i, e in enumerate(echo_clips()):
        for rel in (0.0, 6.0):
            out.append(double_talk(e, texts[i % 2], at_s=1.2, user_vs_echo_db=rel))
    return out


def noisy_speech(snr_db: float, noise_seconds: float = 4.0, text: str = "what is the weather like today") -> Clip:
    """``Noise.wav`` looped for ``noise_seconds`` then continuing under speech
    at ``snr_db`` (active speech level over noise RMS)."""
    raw = espeak(text, "en-us", 175)
    noise = alsa_noise()
    pcm, off = embed(raw, int(noise_seconds * 1000), 1000, noise=noise, snr_db=snr_db)
    return Clip(f"noisy-speech-{snr_db:g}dB", "speech", pcm, (off, off + len(raw) / 2 / VAD_RATE))


def frames16(pcm: bytes) -> list[bytes]:
    """Cut 16 kHz s16 PCM into 20 ms (640-byte) frames, dropping a partial tail."""
    return [pcm[i : i + 640] for i in range(0, len(pcm) - 639, 640)]


def frames48(pcm: bytes) -> list[bytes]:
    """Cut 48 kHz s16 PCM into 20 ms (1920-byte) frames."""
    return [pcm[i : i + 1920] for i in range(0, len(pcm) - 1919, 1920)]
