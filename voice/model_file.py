"""Model files shipped in pinned packages: their SHA-256, read in 1 MiB
chunks (the recogniser's weights, voice/whisper_stt.py; the end-of-turn
model, voice/end_of_turn.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_of(path: Path) -> str:
    """The SHA-256 of the file at ``path``, as 64 hex digits.

    Raises:
        OSError: it cannot be read.
    """
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
