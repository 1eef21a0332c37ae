"""What runs inside one speech-recognition worker process.

pocketsphinx holds Python's GIL while it loads a model (0.4 s) and while it
decodes (up to hundreds of ms at the end of an utterance), which would freeze
the event loop that paces every session's audio. So each decoder lives in
its own process, and only these small functions run there. They are kept in
this module, which imports nothing but pocketsphinx, so a worker starts fast.

One process holds one decoder and serves one utterance at a time; calls for
it arrive in order.

No utterance may change how a later one is heard (the decoders are shared by
every session and tenant). pocketsphinx adapts its cepstral mean
normalisation (CMN) to the audio it decodes and, left alone, carries that
estimate from one utterance to the next: a caller's noise or voice would
change how the next caller is heard, and a server would hear the same words
differently as it ages. So a session's first utterance starts from a fixed
CMN vector (the model's own ``cmninit``, or :data:`SPEECH_CMN`), and each
later utterance of the same session from what that session's last
recognised utterance settled at (:class:`voice.providers.SttAdaptation`,
passed to :func:`start`); nothing carries over on the decoder itself.
pocketsphinx's noise estimate for ``remove_noise`` is reset by
``start_utt`` itself.
"""

from __future__ import annotations

from typing import Any

_decoder: Any = None
_in_utterance = False
#: the CMN vector every utterance starts from (see the module doc)
_cmn_start: str = ""

#: A CMN starting point for speech (13 cepstral means, pocketsphinx's
#: ``set_cmn`` text form): the mean of the estimates the en-us model's live
#: CMN settles at after each of 10 clips at -20 dBFS RMS (espeak-ng en-us,
#: en, en-gb and two variants, and the alsa-utils human recordings). Against
#: the model's own ``cmninit`` (40,3,-1,0...) on 10 held-out clips (other
#: espeak-ng voices and texts, the other alsa-utils recordings) at -30, -20
#: and -14 dBFS it lowers the word error from 61 % to 52 %; the first words
#: of an utterance suffer most from a poor start ("can you tell me a story"
#: was "you tell ya sorry" from the model's vector, "can you tell the story"
#: from this one). Not the default: with the test grammar, one continuation
#: ("like in paris today" after "what is the weather") was cut short from it
#: and heard whole from the model's vector.
SPEECH_CMN = "57.14,4.27,-2.67,22.03,-10.67,-4.16,-6.03,-8.24,3.33,-6.36,3.46,-4.16,-0.07"

#: 16 kHz mono s16, as media.frames.VAD_RATE
SAMPLE_RATE = 16_000


def init(grammar: str | None, cmn_start: str = "model") -> None:
    """Load the model (and the JSGF grammar, if any) in this process.

    Args:
        grammar: a JSGF file, or None for the bundled language model.
        cmn_start: the CMN vector every utterance starts from: ``"speech"``
            (:data:`SPEECH_CMN`), ``"model"`` (the model's own
            ``cmninit``), or 13 comma-separated numbers.

    Raises:
        FileNotFoundError: the grammar file is missing.
        RuntimeError: pocketsphinx cannot load the model or grammar.
        ValueError: ``cmn_start`` is none of the above.
    """
    global _decoder, _cmn_start
    import os

    from pocketsphinx import Decoder

    exit_with_parent(os.getppid())

    kwargs: dict[str, Any] = {"samprate": SAMPLE_RATE, "loglevel": "FATAL"}
    if grammar is not None:
        if not os.path.isfile(grammar):
            raise FileNotFoundError(f"JSGF grammar not found: {grammar}")
        kwargs["jsgf"] = grammar
    _decoder = Decoder(**kwargs)
    _cmn_start = cmn_vector(cmn_start, _decoder.get_cmn())
    _decoder.set_cmn(_cmn_start)


def cmn_vector(cmn_start: str, model: str) -> str:
    """The CMN text for the setting ``cmn_start`` ("speech", "model", or 13
    comma-separated numbers); ``model`` is the model's own.

    Raises:
        ValueError: anything else.
    """
    if cmn_start == "speech":
        return SPEECH_CMN
    if cmn_start == "model":
        return model
    parts = cmn_start.split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 13 or not all(abs(v) < 1e4 for v in values):
        raise ValueError(f'stt.cmn_start must be "speech", "model" or 13 comma-separated numbers, not {cmn_start!r}')
    return ",".join(repr(v) for v in values)


def ping() -> bool:
    """True once the model is loaded (the pool calls this to wait for it)."""
    return _decoder is not None


def start(cmn: str | None = None) -> None:
    """Begin an utterance (ending a previous one left open), from ``cmn``
    (what an earlier utterance of the same session settled at) or else the
    fixed CMN starting point, never from what another utterance left."""
    global _in_utterance
    if _in_utterance:
        _decoder.end_utt()
    _decoder.set_cmn(cmn or _cmn_start)
    _decoder.start_utt()
    _in_utterance = True


def process(pcm: bytes) -> None:
    """Decode more of the utterance (ignored outside one: pocketsphinx would
    crash the process)."""
    if _in_utterance and pcm:
        _decoder.process_raw(pcm, False, False)


def partial() -> str:
    """The best hypothesis of the open utterance so far ("" if none, or
    no utterance is open): pocketsphinx's partial result."""
    if not _in_utterance:
        return ""
    hyp = _decoder.hyp()
    return (hyp.hypstr if hyp is not None else "").strip()


def end() -> tuple[str, str, list[tuple[str, float, float, float]]]:
    """End the utterance; return its best hypothesis ("" if none), the CMN
    vector it settled at (for the same session's next utterance) and its
    words: ``(word, start_s, end_s, posterior)`` with times in seconds from
    the utterance's start (silences, noises and sentence marks left out).

    Raises:
        RuntimeError: no utterance is open.
    """
    global _in_utterance
    if not _in_utterance:
        raise RuntimeError("no utterance is open on the decoder")
    _in_utterance = False
    _decoder.end_utt()
    hyp = _decoder.hyp()
    frate = float(_decoder.config["frate"])
    words = [
        (seg.word.split("(")[0], seg.start_frame / frate, (seg.end_frame + 1) / frate, float(seg.prob))
        for seg in (_decoder.seg() or ())
        if seg.word and seg.word[0] not in "<[+"
    ]
    return (hyp.hypstr if hyp is not None else "").strip(), _decoder.get_cmn(), words


def abandon() -> None:
    """End the utterance without reading it."""
    global _in_utterance
    if _in_utterance:
        _in_utterance = False
        _decoder.end_utt()


def exit_with_parent(parent: int, every_s: float = 0.5) -> None:
    """Exit this worker once the server that started it is gone.

    A server killed outright (SIGKILL, an OOM kill) runs no cleanup, and a
    pool worker would live on as an orphan holding its model (about 200 MB):
    the kernel gives it a new parent, so a daemon thread checks
    ``os.getppid()`` every ``every_s`` seconds and ends the process (with
    ``os._exit``, as nothing of it needs saving) when it changed.
    """
    import os
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
