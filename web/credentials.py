"""Presented credentials as bytes, and what the store keeps of a token.

A header or message field may carry any text: aiohttp decodes header bytes
that are not UTF-8 with ``surrogateescape``, and a JSON string may hold a
lone surrogate (``"\\udcff"``). Neither encodes as UTF-8, so every
credential is turned into bytes here with unencodable characters replaced:
such a credential then simply matches nothing (401), instead of raising.
"""

from __future__ import annotations

import hashlib


def credential_bytes(text: str) -> bytes:
    """``text`` as UTF-8, each unencodable character as ``?``."""
    return text.encode("utf-8", "replace")


def token_hash(token: str) -> str:
    """What the store keeps of a device or client token: hex SHA-256 of its
    UTF-8 (a random 256-bit token needs no slow hash; the token itself is
    never stored)."""
    return hashlib.sha256(credential_bytes(token)).hexdigest()
