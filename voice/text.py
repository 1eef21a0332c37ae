"""Cutting a token stream into pieces worth sending to TTS.

TTS is started per sentence so the first audio comes out while the model is
still streaming. A long sentence is also cut at a clause boundary (, ; :)
once it has ``min_clause_words`` words, so the first audio is not held back
by a long first sentence.
"""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s")
_CLAUSE_END = re.compile(r"[,;:]\s")


class SentenceSplitter:
    """Feed tokens, get complete sentences (or long clauses).

    Args:
        min_clause_words: words a clause needs before it is cut off on its own.
    """

    def __init__(self, min_clause_words: int = 8) -> None:
        self.min_clause_words = min_clause_words
        self._buf = ""

    def feed(self, token: str) -> list[str]:
        """Add a token; return the pieces completed by it (maybe none)."""
        self._buf += token
        out: list[str] = []
        while True:
            m = _SENTENCE_END.search(self._buf)
            if m is None:
                m = self._long_clause()
            if m is None:
                break
            piece, self._buf = self._buf[: m.end()].strip(), self._buf[m.end():]
            if piece:
                out.append(piece)
        return out

    def _long_clause(self) -> re.Match[str] | None:
        for m in _CLAUSE_END.finditer(self._buf):
            if len(self._buf[: m.end()].split()) >= self.min_clause_words:
                return m
        return None

    def flush(self) -> str | None:
        """The unfinished rest, if any (call when the stream ends)."""
        rest, self._buf = self._buf.strip(), ""
        return rest or None
