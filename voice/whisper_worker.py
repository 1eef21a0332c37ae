"""What runs inside one Whisper worker process (:mod:`voice.worker_pool`).

faster-whisper (CTranslate2) holds Python's GIL while it loads the model
and for much of a decode, so the model lives in worker processes and only
these functions run there. They import faster-whisper only here, so the
server's own process never loads it.

Nothing is ever fetched from a hub: the model is loaded by path from the
pinned package's directory, with ``local_files_only`` and the Hugging Face
hub offline (``HF_HUB_OFFLINE=1`` before faster-whisper imports
``huggingface_hub``), so a missing file is an error, never a download.

Every utterance is decoded on its own: beam search (``stt.beam_size``, 5
by default), ``temperature=0`` (no sampling), ``condition_on_previous_text
=False``, no VAD of faster-whisper's own (our endpointing segmented it),
and always the same prompt, :data:`PROMPT` and the server's keyterms: the
same audio gives the same text in a server's first and thousandth session,
whatever any other session said (shared/cases/recognition-drift.md).

On the 68 spoken utterances of tests/recognition_corpus.py, decoded here
directly (2 threads): greedy 21.6% word errors, beam 5 15.7% for 30 ms
more per utterance (p50 304 -> 331 ms); beam 8 15.1%. The demo shop's
item names as keyterms: 13.5%.

The prompt is there for backchannels: without it tiny.en hears espeak-ng's
"mhm" as "M-H-M." and "mm hmm" as "Mm-mm." or "And then, then." (words the
backchannel judge cannot let go), with it as "Mm-hmm."; "two" becomes
"Two." rather than "2". Its cost: on noise or silence the model then says
"Mm-hmm." with a no-speech probability of about 0.8 (without it, nothing),
so segments above :data:`NO_SPEECH_MAX` are dropped (real speech measured
0.02 to 0.3).
"""

from __future__ import annotations

import math
from typing import Any

from voice.recognition import language_code

_model: Any = None
_language: str = "en"
_beam_size: int = 5
_prompt: str = ""
#: the short decode's tokenizer, prompt tokens and suppressed tokens (built at init)
_short: Any = None
#: why the model did not load (reported by :func:`ping`: an initializer that
#: raised would only break the pool, its reason lost)
_load_error: str | None = None

#: 16 kHz mono s16, as voice.recognition.STREAM_RATE
SAMPLE_RATE = 16_000
#: the prompt every decode gets, the same for all (see the module doc)
PROMPT = "Mm-hmm, uh-huh."
#: the prompt of :func:`transcribe_short` (only ever a backchannel
#: candidate's, said while the agent speaks): "I see" first. A phone's band
#: (G.711, nothing above 4 kHz) takes the /s/ of "see", and with
#: :data:`PROMPT` tiny.en heard "I see" as "I-B", "Bye, D" or "I'd be" (1
#: of 9 espeak-ng clips judged a backchannel: 3 voices at 130, 160, 190
#: wpm, mu-law 8 kHz and back), so the backchannel cancelled the reply (15
#: of 16 on the phone path of bench/backchannels.py). With this prompt: 7
#: of 9 ("mm-hmm" 5 -> 7; "uh-huh", "okay", "yeah", "right", "sure" as
#: before; "I want" and "see you" still requests), and 1 "I see" cancel in
#: 19 on that bench path. Other orders did worse ("Mm-hmm, uh-huh, I
#: see." heard "mm-hmm" as "And Mm-hmm." on the phone)
SHORT_PROMPT = "I see. Mm-hmm, uh-huh."
#: a segment whose no-speech probability is above this is dropped
NO_SPEECH_MAX = 0.6
#: the encoder window of :func:`transcribe_short`, s: audio up to this long
#: is decoded on it instead of Whisper's 30 s one
SHORT_WINDOW_S = 6.0
#: most tokens :func:`transcribe_short` writes ("Mm-hmm." is 4; a
#: backchannel phrase fits; a runaway repeat is cut)
SHORT_MAX_TOKENS = 12
#: :func:`transcribe_short`'s repetition penalty: on a short window tiny.en
#: says "yeah" as "yeah yeah yeah ..." without it
SHORT_REPETITION_PENALTY = 1.3


def init(model_dir: str, threads: int, language: str, beam_size: int = 5, keyterms: tuple[str, ...] = ()) -> None:
    """Load the model from ``model_dir`` in this process, on the CPU, int8,
    with ``threads`` threads for its decodes, beam search of ``beam_size``,
    and :data:`PROMPT` followed by ``keyterms`` (names and products to
    listen for) as every decode's prompt (:data:`SHORT_PROMPT` followed by
    them for :func:`transcribe_short`).

    Raises:
        RuntimeError / OSError: the model cannot be loaded from that directory.
    """
    global _model, _language, _beam_size, _prompt, _load_error
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported: never a download
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from voice.pocketsphinx_worker import exit_with_parent

    exit_with_parent(os.getppid())
    from faster_whisper import WhisperModel

    try:
        _model = WhisperModel(
            model_dir, device="cpu", compute_type="int8", cpu_threads=threads, num_workers=1, local_files_only=True
        )
    except Exception as exc:  # told by ping(), in the server's process
        _load_error = f"{type(exc).__name__}: {exc}"
        return
    _language = language_code(language) or "en"
    _beam_size = beam_size
    terms = " " + ", ".join(keyterms) + "." if keyterms else ""
    _prompt = PROMPT + terms
    global _short
    from faster_whisper.tokenizer import Tokenizer
    from faster_whisper.transcribe import get_suppressed_tokens

    tokenizer = Tokenizer(_model.hf_tokenizer, _model.model.is_multilingual, task="transcribe", language=_language)
    prompt = _model.get_prompt(tokenizer, tokenizer.encode(" " + SHORT_PROMPT + terms), without_timestamps=True)
    _short = (tokenizer, prompt, get_suppressed_tokens(tokenizer, (-1,)))


def ping() -> bool:
    """True once the model is loaded (the pool awaits this).

    Raises:
        RuntimeError: it could not be loaded (why, from faster-whisper).
    """
    if _load_error is not None:
        raise RuntimeError(f"the Whisper model did not load: {_load_error}")
    return _model is not None


def transcribe(pcm: bytes) -> tuple[str, float | None]:
    """Recognise one utterance: 16 kHz mono s16 ``pcm``. Returns its text
    ("" if none was heard) and its confidence (the mean token probability,
    0 to 1; None with no text). No word timings: asking faster-whisper for
    them costs a second alignment pass per utterance.

    Raises:
        RuntimeError: the model is not loaded.
    """
    if _model is None:
        raise RuntimeError("the Whisper model is not loaded in this worker")
    import numpy as np

    audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    if audio.size == 0:
        return "", None
    segments, _info = _model.transcribe(
        audio,
        language=_language,
        task="transcribe",
        beam_size=_beam_size,
        temperature=0.0,
        condition_on_previous_text=False,
        initial_prompt=_prompt,
        without_timestamps=True,
        vad_filter=False,
    )
    kept = [s for s in segments if s.text.strip() and s.no_speech_prob <= NO_SPEECH_MAX]
    if not kept:
        return "", None
    text = " ".join(s.text.strip() for s in kept)
    return text, math.exp(sum(s.avg_logprob for s in kept) / len(kept))


def transcribe_short(pcm: bytes) -> tuple[str, float | None]:
    """Recognise a short utterance (16 kHz mono s16 ``pcm``, a backchannel
    candidate's) on a :data:`SHORT_WINDOW_S` encoder window instead of
    Whisper's 30 s one, writing at most :data:`SHORT_MAX_TOKENS` tokens
    with a repetition penalty: about a quarter of :func:`transcribe`'s
    time. Same model, beam and no-speech rule; its prompt is
    :data:`SHORT_PROMPT` (and the key terms). Audio longer than the window
    is decoded by :func:`transcribe`.

    Whisper's positional embeddings are sliced to the window (CTranslate2
    takes any encoder length up to 30 s). On 96 espeak-ng clips (7
    backchannels and 9 interruptions in 3 voices at 2 speeds,
    ``bench/backchannel_decode.py``) the verdict "only backchannel words"
    is right for 95 (the 30 s window: 93), p50 71 ms and p95 97 ms
    against 320 and 392 ms. A 4 s window got 93 to 94; without the
    penalty tiny.en repeats itself ("okay okay okay ...").

    Returns:
        Its text ("" if none was heard) and confidence (the mean token
        probability, 0 to 1; None with no text).

    Raises:
        RuntimeError: the model is not loaded.
    """
    if _model is None or _short is None:
        raise RuntimeError("the Whisper model is not loaded in this worker")
    import numpy as np

    window = int(SHORT_WINDOW_S * SAMPLE_RATE)
    audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    if audio.size == 0:
        return "", None
    if audio.size > window:
        return transcribe(pcm)
    tokenizer, prompt, suppress = _short
    padded = np.zeros(window, dtype=np.float32)
    padded[: audio.size] = audio
    frames = window // _model.feature_extractor.hop_length
    features = _model.feature_extractor(padded)[:, :frames]
    result = _model.model.generate(
        _model.encode(features), [prompt], beam_size=_beam_size, max_length=len(prompt) + SHORT_MAX_TOKENS,
        repetition_penalty=SHORT_REPETITION_PENALTY, return_scores=True, return_no_speech_prob=True,
        suppress_blank=True, suppress_tokens=suppress,
    )[0]
    if result.no_speech_prob > NO_SPEECH_MAX:
        return "", None
    tokens = [t for t in result.sequences_ids[0] if t < tokenizer.eot]
    text = tokenizer.decode(tokens).strip()
    if not text:
        return "", None
    return text, math.exp(result.scores[0] * len(tokens) / (len(tokens) + 1))  # faster-whisper's avg_logprob

