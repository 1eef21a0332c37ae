"""Cutting a token stream into pieces worth sending to TTS.

TTS is started per sentence so the first audio comes out while the model is
still streaming. The first piece of a reply is cut sooner, at its first
clause boundary (, ; : or a dash) or after ``first_words`` words, whichever
comes first (issue 31, "first clause first": at the local agent's 20 tokens
a second a whole first sentence held the first audio back by about half a
second). After it, a long sentence is also cut at a clause boundary once it
has ``min_clause_words`` words.
"""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s")
_CLAUSE_END = re.compile(r"[,;:]\s")
#: the end of a word (the whitespace after it)
_WORD_END = re.compile(r"(?<=\S)\s+")
#: a clause boundary for the first piece: , ; : or a dash between words
_FIRST_CLAUSE_END = re.compile(r"[,;:]\s|\s[-\u2013\u2014]+\s|\w[\u2013\u2014]\s")


class SentenceSplitter:
    """Feed tokens, get complete sentences (or clauses), the first piece
    as early as a clause allows (see the module doc).

    Args:
        min_clause_words: words a clause after the first piece needs before
            it is cut off on its own.
        first_words: words after which the first piece is cut even without
            a clause boundary (at the end of a word); 0 cuts the first piece
            by the later pieces' rules.
    """

    def __init__(self, min_clause_words: int = 8, first_words: int = 6) -> None:
        self.min_clause_words = min_clause_words
        self.first_words = first_words
        self._buf = ""
        self._first = first_words > 0

    def feed(self, token: str) -> list[str]:
        """Add a token; return the pieces completed by it (maybe none)."""
        self._buf += token
        out: list[str] = []
        while True:
            m = _SENTENCE_END.search(self._buf)
            if self._first:
                first = self._first_clause()
                if first is not None and (m is None or first.end() < m.end()):
                    m = first
            if m is None:
                m = self._long_clause()
            if m is None:
                break
            piece, self._buf = self._buf[: m.end()].strip(), self._buf[m.end():]
            if piece:
                out.append(piece)
                self._first = False
        return out

    def _first_clause(self) -> re.Match[str] | None:
        """The first piece's cut: its first clause boundary, or the end of
        its ``first_words``-th word (the whitespace after it)."""
        m = _FIRST_CLAUSE_END.search(self._buf)
        if m is not None:
            return m
        words = 0
        for w in _WORD_END.finditer(self._buf):
            words += 1
            if words >= self.first_words:
                return w
        return None

    def _long_clause(self) -> re.Match[str] | None:
        for m in _CLAUSE_END.finditer(self._buf):
            if len(self._buf[: m.end()].split()) >= self.min_clause_words:
                return m
        return None

    def flush(self) -> str | None:
        """The unfinished rest, if any (call when the stream ends); the next
        token starts a new reply (its first piece is cut early again)."""
        rest, self._buf = self._buf.strip(), ""
        self._first = self.first_words > 0
        return rest or None
