"""Makes ``tests/data/end_of_turn_reference.npz``: two clips of the turn
corpus and transformers' Whisper features of each, the reference that
``tests/voice/test_end_of_turn.py`` holds :func:`voice.end_of_turn.log_mel_features` to.

transformers is not a dependency of the project: run the second step in a
scratch venv (``python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install
transformers numpy``; no torch needed). From the repository root::

    .venv/bin/python tests/data/make_end_of_turn_reference.py clips /tmp/clips.npz
    /tmp/tfvenv/bin/python tests/data/make_end_of_turn_reference.py features /tmp/clips.npz tests/data/end_of_turn_reference.npz

The clips (16 kHz s16): ``clip0`` the one-word answer "yes" (en-us, 175 wpm),
``clip1`` "i'd like to order" cut at its pause (en-gb, 130 wpm). Each is
put in the model's window as Smart Turn's users do (the last 8 s, zeros
before it) and run through ``WhisperFeatureExtractor(chunk_length=8)`` with
``do_normalize=True``: ``features0`` and ``features1``, float32 (80, 800).
Made with transformers 5.25.0, numpy 2.4.6.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

RATE = 16000
WINDOW = 8 * RATE
CLIPS = ("one_word-yes-en-us-175", "mid_pause-order-en-gb-130")


def clips(out: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root), str(root / "tests")]
    import turn_corpus as T

    by_name = {r.name: r for r in T.corpus()}
    arrays = {}
    for i, name in enumerate(CLIPS):
        r = T.render(by_name[name])
        pcm = r.until(r.pauses[0][0]) if r.pauses else r.pcm
        arrays[f"clip{i}"] = np.frombuffer(pcm, dtype="<i2").copy()
    np.savez_compressed(out, **arrays)


def features(clips_npz: Path, out: Path) -> None:
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(chunk_length=8)
    data = np.load(clips_npz)
    arrays = {}
    for i in range(len(CLIPS)):
        clip = data[f"clip{i}"]
        x = clip.astype(np.float32) / 32768.0
        x = x[-WINDOW:] if len(x) > WINDOW else np.pad(x, (WINDOW - len(x), 0))
        f = extractor(x, sampling_rate=RATE, return_tensors="np", padding="max_length", max_length=WINDOW,
                      truncation=True, do_normalize=True).input_features[0]
        arrays[f"clip{i}"] = clip
        arrays[f"features{i}"] = f.astype(np.float32)
    np.savez_compressed(out, **arrays)


if __name__ == "__main__":
    if sys.argv[1:2] == ["clips"] and len(sys.argv) == 3:
        clips(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["features"] and len(sys.argv) == 4:
        features(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(__doc__)
