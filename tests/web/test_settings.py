"""Settings from environment and TOML, with validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from web.settings import load_settings


def test_defaults() -> None:
    s = load_settings()
    assert (s.host, s.port) == ("127.0.0.1", 8080)
    assert s.store == "sqlite:///var/turnkeeper.db"
    assert s.vad.onset_ms == 60 and s.vad.offset_ms == 500
    assert s.llm.tokens_per_second == 20


def test_env_and_toml_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "tk.toml"
    cfg.write_text('port = 9000\nhost = "0.0.0.0"\n[vad]\nonset_ms = 80\n[tts]\nvoice = "en-gb"\n')
    monkeypatch.setenv("TURNKEEPER_PORT", "9100")
    monkeypatch.setenv("TURNKEEPER_VAD__OFFSET_MS", "400")
    s = load_settings(cfg)
    assert s.port == 9100  # env beats the file
    assert s.host == "0.0.0.0" and s.tts.voice == "en-gb"
    assert (s.vad.onset_ms, s.vad.offset_ms) == (80, 400)
    assert load_settings(cfg, port=1234).port == 1234  # flags beat env
    monkeypatch.setenv("TURNKEEPER_CONFIG", str(cfg))
    assert load_settings().tts.voice == "en-gb"


def test_bad_values_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[vad]\nonset_ms = 50\n")
    with pytest.raises(ValidationError):
        load_settings(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("colour = 'blue'\n")
    with pytest.raises(ValidationError):
        load_settings(unknown)
    monkeypatch.setenv("TURNKEEPER_PORT", "not-a-port")
    with pytest.raises(ValidationError):
        load_settings()
