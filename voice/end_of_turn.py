"""The end-of-turn judge: has the user finished, or only paused? (issue 31)

It reads the audio of the user's utterance, not only the silence after it:
:class:`SmartTurn` runs Smart Turn v3.2 (Pipecat's audio end-of-turn model,
BSD-2-Clause, Daily), a Whisper-tiny encoder with a classifier head, on the
CPU with onnxruntime. The session calls :meth:`SmartTurn.judge` at a short
silence (``session.endpoint.tentative_ms``): "complete" ends the turn at once,
"incomplete" keeps waiting, up to a longer bound (:mod:`voice.endpointing`).

The model's input, as the model was trained and as Pipecat feeds it
(``pipecat/audio/turn/smart_turn/local_smart_turn_v3.py``):

- the last 8 s of the utterance at 16 kHz, mono, as floats in [-1, 1); a
  shorter one zero-padded at the *start* to 8 s (128,000 samples);
- normalised to zero mean and unit variance over those 8 s (transformers'
  ``do_normalize``: ``(x - mean) / sqrt(var + 1e-7)``);
- Whisper's log-mel spectrogram of that (transformers'
  ``WhisperFeatureExtractor(chunk_length=8)``): 80 Slaney mel bands, a
  400-sample periodic Hann window, hop 160, centred with reflect padding,
  the last frame dropped (800 frames), ``log10`` of the power clamped at
  1e-10, floored at 8 below its maximum, then ``(x + 4) / 4``. faster-whisper's
  numpy extractor (already a dependency, for the recogniser; :func:`_extractor`)
  computes exactly this; it matches transformers within 1e-5 (``tests/voice/test_end_of_turn.py``
  checks it against stored transformers output);
- input ``input_features``, float32, shape (batch, 80, 800); output one
  float per clip, already a probability (a sigmoid) that the turn is
  complete. Pipecat's rule: complete when it is above 0.5.

Where the file comes from: the model ships inside Pipecat's wheel, under
``pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx``. Pipecat's own
dependencies are heavy (numba among them) and we run none of its code, so the
Makefile and the Dockerfile install that wheel alone, ``--no-deps``, pinned
in ``constraints.txt`` (:data:`MODEL_PACKAGE`). We find the file through the
installed distribution's metadata (no import of ``pipecat``, whose
``__init__`` needs packages we do not install) and check its SHA-256
(:data:`MODEL_SHA256`) when the model loads: a missing or altered file is an
:class:`EndOfTurnModelError` naming the package, never a download.

The run is sized for a real-time server on two cores: one intra-op and one
inter-op thread, sequential execution; an inference takes about 40-60 ms
(features about 5 ms of it). onnxruntime's ``InferenceSession.run`` is
thread-safe, so one session per model file serves the whole process
(:func:`_session`, cached); :meth:`SmartTurn.judge` blocks: call it in a
thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, Field

from voice.model_file import sha256_of

if TYPE_CHECKING:
    from faster_whisper.feature_extractor import FeatureExtractor

#: the distribution the model file comes from, pinned (constraints.txt; installed --no-deps)
MODEL_DISTRIBUTION = "pipecat-ai"
MODEL_VERSION = "1.14.0"
MODEL_PACKAGE = f"{MODEL_DISTRIBUTION}=={MODEL_VERSION}"
#: the file inside it
MODEL_FILE = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
#: its SHA-256 (Smart Turn v3.2, CPU build, int8, 8,679,182 bytes)
MODEL_SHA256 = "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"
#: the model's sample rate, Hz
MODEL_RATE = 16_000
#: the audio the model reads: the utterance's last WINDOW_S seconds
WINDOW_S = 8
WINDOW_SAMPLES = WINDOW_S * MODEL_RATE
#: Whisper's log-mel features: mel bands, FFT size and hop (samples)
N_MELS = 80
N_FFT = 400
HOP = 160
#: feature frames of a window: 128,000 / 160
N_FRAMES = WINDOW_SAMPLES // HOP
#: transformers' zero-mean unit-variance normalisation adds this to the variance
_NORM_EPS = 1e-7
_INPUT_NAME = "input_features"


#: closed-class words a finished English request rarely ends on (no content
#: word): articles and other determiners, prepositions, conjunctions,
#: auxiliaries, subject pronouns, possessives and fillers
FUNCTION_WORDS = frozenset(
    "a an the this that these those some any every each no "  # determiners
    "to in on at with for of from about into onto by than like "  # prepositions
    "and but or so because if whether when while then "  # conjunctions
    "is are was were be been am will would could can should shall may might must do does did have has had "  # auxiliaries
    "i we they he she "  # subject pronouns
    "my your our their his its "  # possessives
    "um uh er erm".split()  # fillers
)


def words_complete(text: str) -> bool:
    """The words' half of the judge: False if ``text`` (what the recogniser
    heard of the whole turn) ends on a function word (:data:`FUNCTION_WORDS`:
    "can I get a", "please send the receipt to"), which a finished request
    rarely does; True otherwise, and for one word alone ("no") or none.
    English only: the packaged recogniser hears English (voice.whisper_stt).

    The audio model misses these pauses most often (the ones after a
    function word; bench/end_of_turn.py, issue 31's figures), so the session
    asks both: the turn is complete when the audio and the words say so."""
    tokens = re.findall(r"[a-z0-9']+", text.lower())  # a number ("count to 20") is a content word
    return len(tokens) <= 1 or tokens[-1] not in FUNCTION_WORDS


class EndOfTurnModelError(RuntimeError):
    """The end-of-turn model cannot be used: its file is missing, is not the
    pinned one (SHA-256), or onnxruntime cannot load it. The message names
    the package to (re)install."""


class EndOfTurnConfig(BaseModel):
    """The end-of-turn judge's settings.

    Attributes:
        threshold: a turn is complete when the model's probability is above
            this (0..1; 0.5 is Pipecat's default and the model's trained
            operating point; higher waits more often, cutting off fewer
            pauses and missing more ends).
        model_path: a Smart Turn v3.x ONNX file; None: the pinned package's
            (checked by SHA-256; another file is used as given, unchecked).
    """

    threshold: float = Field(0.5, ge=0.0, le=1.0)
    model_path: Path | None = None


@dataclass(frozen=True)
class EndOfTurnVerdict:
    """What the judge found.

    Attributes:
        complete: the user has finished (``probability > threshold``).
        probability: the model's probability that the turn is complete, 0..1.
        inference_ms: wall time of the features and the model, ms.
        audio_ms: the audio read, ms: the utterance's length, at most
            :data:`WINDOW_S` s (the rest of the window is zero padding).
    """

    complete: bool
    probability: float
    inference_ms: float
    audio_ms: float


def packaged_model_path() -> Path:
    """The model file of the pinned package, found from its installed
    metadata (``pipecat`` is not imported).

    Raises:
        EndOfTurnModelError: the package is not installed, or another version is.
    """
    try:
        dist = importlib.metadata.distribution(MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise EndOfTurnModelError(f"the end-of-turn model's package is not installed: "
                                  f"pip install --no-deps {MODEL_PACKAGE} (make deps does)") from exc
    if dist.version != MODEL_VERSION:
        raise EndOfTurnModelError(f"{MODEL_DISTRIBUTION} {dist.version} is installed, the end-of-turn model is pinned to "
                                  f"{MODEL_PACKAGE}: pip install --no-deps {MODEL_PACKAGE}")
    return Path(str(dist.locate_file(MODEL_FILE)))


def check_model(path: Path) -> None:
    """``path`` is the pinned model file (blocking: about 20 ms).

    Raises:
        EndOfTurnModelError: it is missing, or its SHA-256 is not :data:`MODEL_SHA256`
            (the message names the package to reinstall).
    """
    if not path.is_file():
        raise EndOfTurnModelError(f"the end-of-turn model file {path} is missing: "
                                  f"reinstall it (pip install --no-deps --force-reinstall {MODEL_PACKAGE})")
    digest = sha256_of(path)
    if digest != MODEL_SHA256:
        raise EndOfTurnModelError(f"the end-of-turn model file {path} is not the one {MODEL_PACKAGE} ships "
                                  f"(SHA-256 {digest[:16]}..., want {MODEL_SHA256[:16]}...): "
                                  f"reinstall it (pip install --no-deps --force-reinstall {MODEL_PACKAGE})")


def audio_samples(pcm: bytes | np.ndarray, rate: int = MODEL_RATE) -> np.ndarray:
    """The utterance as float32 samples in [-1, 1).

    Args:
        pcm: mono s16 little-endian bytes, or a 1-D array: int16 samples,
            or floats in [-1, 1].
        rate: its sample rate, Hz: only :data:`MODEL_RATE` (16 kHz, the
            session's inbound rate) is accepted.

    Raises:
        ValueError: another rate, an odd byte count, empty audio, an array
            that is not 1-D, of another dtype, or not finite.
    """
    if rate != MODEL_RATE:
        raise ValueError(f"the end-of-turn model reads {MODEL_RATE} Hz audio, not {rate} Hz: resample first")
    if isinstance(pcm, bytes | bytearray | memoryview):
        if len(pcm) % 2:
            raise ValueError(f"s16 PCM has an even number of bytes, not {len(pcm)}")
        x = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    elif isinstance(pcm, np.ndarray):
        if pcm.ndim != 1:
            raise ValueError(f"audio must be 1-D (mono), not of shape {pcm.shape}")
        if pcm.dtype == np.int16:
            x = pcm.astype(np.float32) / 32768.0
        elif np.issubdtype(pcm.dtype, np.floating):
            x = pcm.astype(np.float32)
            if not np.isfinite(x).all():
                raise ValueError("audio has NaN or infinite samples")
        else:
            raise ValueError(f"audio samples must be int16 or float, not {pcm.dtype}")
    else:
        raise ValueError(f"audio must be bytes or a numpy array, not {type(pcm).__name__}")
    if not len(x):
        raise ValueError("no audio to judge")
    return x


def model_window(samples: np.ndarray) -> np.ndarray:
    """The model's 8 s window of ``samples`` (float32, 16 kHz): the last
    :data:`WINDOW_SAMPLES`, or all of them after zeros (padding at the
    start, so the end of speech stays at the window's end). Shape (128000,)."""
    if len(samples) >= WINDOW_SAMPLES:
        return samples[-WINDOW_SAMPLES:].astype(np.float32)
    return np.concatenate([np.zeros(WINDOW_SAMPLES - len(samples), dtype=np.float32), samples.astype(np.float32)])


@cache
def _extractor() -> FeatureExtractor:
    """faster-whisper's numpy log-mel extractor for 8 s windows.

    Its one file (``faster_whisper/feature_extractor.py``, numpy only) is
    loaded by path, without the package's ``__init__``, which imports
    CTranslate2, tokenizers and PyAV's transcription stack: about 35 MB of
    resident memory the server's process does not otherwise carry (its
    recogniser runs in worker processes). If that file has moved, the
    ordinary import is used.
    """
    spec = importlib.util.find_spec("faster_whisper")  # a top-level name: found, not imported
    if spec is None:
        raise EndOfTurnModelError("faster-whisper (the Whisper features of the end-of-turn model) is not installed")
    locations = list(spec.submodule_search_locations or [])
    path = Path(locations[0]) / "feature_extractor.py" if locations else None
    file_spec = importlib.util.spec_from_file_location("voice._whisper_features", path) if path and path.is_file() else None
    if file_spec is None or file_spec.loader is None:
        from faster_whisper.feature_extractor import FeatureExtractor

        extractor_class = FeatureExtractor
    else:
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
        extractor_class = module.FeatureExtractor
    return extractor_class(feature_size=N_MELS, sampling_rate=MODEL_RATE, hop_length=HOP, chunk_length=WINDOW_S, n_fft=N_FFT)


def log_mel_features(window: np.ndarray) -> np.ndarray:
    """Whisper's log-mel features of one window, as transformers'
    ``WhisperFeatureExtractor(chunk_length=8)`` computes them with
    ``do_normalize`` (see the module doc).

    Args:
        window: float samples at 16 kHz, shape (128000,) (:func:`model_window`).

    Returns:
        float32, shape (80, 800).

    Raises:
        ValueError: another shape.
    """
    if window.shape != (WINDOW_SAMPLES,):
        raise ValueError(f"a window is {WINDOW_SAMPLES} samples, not of shape {window.shape}")
    x = window.astype(np.float32)
    x = (x - x.mean()) / np.sqrt(x.var() + _NORM_EPS)
    # padding=0: the window is already whole; the centred STFT gives 801
    # frames and the extractor drops the last, as transformers does
    features = _extractor()(x, padding=0)
    assert features.shape == (N_MELS, N_FRAMES), features.shape
    return np.asarray(features, dtype=np.float32)


_load_lock = threading.Lock()


@cache
def _session(path: Path) -> Any:
    """One onnxruntime session per model file per process (``run`` is
    thread-safe), on one thread, sequential. Checked by the caller."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only: its graph-optimisation notes are not ours to act on
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own types (InvalidProtobuf, Fail, ...)
        raise EndOfTurnModelError(f"onnxruntime cannot load the end-of-turn model {path}: {exc}") from exc
    inputs = {i.name: i.shape for i in session.get_inputs()}
    if _INPUT_NAME not in inputs or list(inputs[_INPUT_NAME])[1:] != [N_MELS, N_FRAMES]:
        raise EndOfTurnModelError(f"{path} is not a Smart Turn v3 model: its inputs are {inputs}, "
                                  f"not {_INPUT_NAME} (batch, {N_MELS}, {N_FRAMES})")
    return session


class SmartTurn:
    """The end-of-turn judge on Smart Turn v3.2 (see the module doc).

    Args:
        model_path: a Smart Turn v3.x ONNX file; None: the pinned package's,
            checked by SHA-256 at :meth:`load`.
        threshold: complete when the probability is above this, 0..1.

    Raises:
        ValueError: a threshold outside 0..1.
    """

    def __init__(self, model_path: Path | None = None, threshold: float = 0.5) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold {threshold} is outside 0..1")
        self.model_path = model_path
        self.threshold = threshold
        self._session: Any = None

    @classmethod
    def from_config(cls, config: EndOfTurnConfig) -> SmartTurn:
        """A judge with ``config``'s file and threshold (not loaded yet)."""
        return cls(config.model_path, config.threshold)

    @property
    def loaded(self) -> bool:
        """:meth:`load` has succeeded: the model is open and checked."""
        return self._session is not None

    def load(self) -> None:
        """Find and check the model file and open it (blocking: about 0.1 s
        the first time in a process, nothing after; idempotent, thread-safe).
        The pinned file is checked by SHA-256; a given ``model_path`` only
        for existence.

        Raises:
            EndOfTurnModelError: the package or file is missing, the hash is
                wrong, or onnxruntime cannot load it.
        """
        if self._session is not None:
            return
        with _load_lock:
            if self._session is not None:
                return
            if self.model_path is None:
                path = packaged_model_path()
                check_model(path)
            else:
                path = self.model_path
                if not path.is_file():
                    raise EndOfTurnModelError(f"the end-of-turn model file {path} is missing")
            session = _session(path.resolve())
            _extractor()
            self._session = session

    def probability(self, pcm: bytes | np.ndarray, rate: int = MODEL_RATE) -> float:
        """The model's probability that the turn is complete (see :meth:`judge`)."""
        return self.judge(pcm, rate).probability

    def judge(self, pcm: bytes | np.ndarray, rate: int = MODEL_RATE) -> EndOfTurnVerdict:
        """Judge whether the user's turn is over from its audio (blocking;
        loads the model first if :meth:`load` was not called).

        Args:
            pcm: the utterance up to now (its last 8 s are read), 16 kHz mono:
                s16 little-endian bytes, or a 1-D int16 or float array
                (floats in [-1, 1]). Silence after the speech may be included
                (the session calls at about 200 ms of it).
            rate: its sample rate, Hz; only 16,000.

        Returns:
            the verdict (complete, probability, inference ms, audio ms read).

        Raises:
            ValueError: another rate, an odd byte count, empty audio, a
                malformed array (:func:`audio_samples`).
            EndOfTurnModelError: the model cannot be loaded.
        """
        samples = audio_samples(pcm, rate)
        self.load()
        started = time.perf_counter()
        features = log_mel_features(model_window(samples))
        (out,) = self._session.run(None, {_INPUT_NAME: features[np.newaxis]})
        p = float(np.asarray(out).reshape(-1)[0])
        elapsed_ms = (time.perf_counter() - started) * 1000
        audio_ms = min(len(samples), WINDOW_SAMPLES) * 1000 / MODEL_RATE
        return EndOfTurnVerdict(p > self.threshold, p, elapsed_ms, audio_ms)


_shared: dict[tuple[Path | None, float], SmartTurn] = {}
_shared_lock = threading.Lock()


def shared_judge(config: EndOfTurnConfig | None = None) -> SmartTurn:
    """The process's judge for ``config`` (default: the pinned model at
    0.5), created once and shared by every session; not loaded until its
    first :meth:`SmartTurn.load` or :meth:`SmartTurn.judge` (all judges of one
    file share one onnxruntime session)."""
    config = config or EndOfTurnConfig()
    key = (config.model_path, config.threshold)
    with _shared_lock:
        judge = _shared.get(key)
        if judge is None:
            judge = _shared[key] = SmartTurn.from_config(config)
        return judge
