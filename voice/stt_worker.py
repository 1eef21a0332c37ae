"""What runs inside one speech-recognition worker process.

pocketsphinx holds Python's GIL while it loads a model (0.4 s) and while it
decodes (up to hundreds of ms at the end of an utterance), which would freeze
the event loop that paces every session's audio. So each decoder lives in
its own process, and only these small functions run there. They are kept in
this module, which imports nothing but pocketsphinx, so a worker starts fast.

One process holds one decoder and serves one utterance at a time; calls for
it arrive in order.
"""

from __future__ import annotations

from typing import Any

_decoder: Any = None
_in_utterance = False

#: 16 kHz mono s16, as media.frames.VAD_RATE
SAMPLE_RATE = 16_000


def init(grammar: str | None) -> None:
    """Load the model (and the JSGF grammar, if any) in this process.

    Raises:
        FileNotFoundError: the grammar file is missing.
        RuntimeError: pocketsphinx cannot load the model or grammar.
    """
    global _decoder
    import os

    from pocketsphinx import Decoder

    kwargs: dict[str, Any] = {"samprate": SAMPLE_RATE, "loglevel": "FATAL"}
    if grammar is not None:
        if not os.path.isfile(grammar):
            raise FileNotFoundError(f"JSGF grammar not found: {grammar}")
        kwargs["jsgf"] = grammar
    _decoder = Decoder(**kwargs)


def ping() -> bool:
    """True once the model is loaded (the pool calls this to wait for it)."""
    return _decoder is not None


def start() -> None:
    """Begin an utterance (ending a previous one left open)."""
    global _in_utterance
    if _in_utterance:
        _decoder.end_utt()
    _decoder.start_utt()
    _in_utterance = True


def process(pcm: bytes) -> None:
    """Decode more of the utterance (ignored outside one: pocketsphinx would
    crash the process)."""
    if _in_utterance and pcm:
        _decoder.process_raw(pcm, False, False)


def end() -> str:
    """End the utterance and return its best hypothesis ("" if none).

    Raises:
        RuntimeError: no utterance is open.
    """
    global _in_utterance
    if not _in_utterance:
        raise RuntimeError("no utterance is open on the decoder")
    _in_utterance = False
    _decoder.end_utt()
    hyp = _decoder.hyp()
    return (hyp.hypstr if hyp is not None else "").strip()


def abandon() -> None:
    """End the utterance without reading it."""
    global _in_utterance
    if _in_utterance:
        _in_utterance = False
        _decoder.end_utt()
