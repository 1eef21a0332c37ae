"""Settings from environment and TOML, with validation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from web.settings import Settings, load_settings

README = Path(__file__).resolve().parents[2] / "README.md"


def test_defaults() -> None:
    s = load_settings()
    assert (s.host, s.port) == ("127.0.0.1", 8080)
    assert s.store == "sqlite:///var/turnkeeper.db"
    assert s.vad.preroll_ms == 300 and s.vad.offset_ms == 200
    assert s.bargein.pause_after_ms == 60 and s.bargein.confirm_speech_ms == 160 and s.bargein.confirm_timeout_ms == 600
    assert s.session.endpoint.silence_ms == 500 and s.session.backchannel.enabled
    assert s.llm.tokens_per_second == 20


def test_env_and_toml_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "tk.toml"
    cfg.write_text('port = 9000\nhost = "0.0.0.0"\n[vad]\npreroll_ms = 200\noffset_ms = 300\n[tts]\nvoice = "en-gb"\n')
    monkeypatch.setenv("TURNKEEPER_PORT", "9100")
    monkeypatch.setenv("TURNKEEPER_VAD__OFFSET_MS", "400")
    s = load_settings(cfg)
    assert s.port == 9100  # env beats the file
    assert s.host == "0.0.0.0" and s.tts.voice == "en-gb"
    assert (s.vad.preroll_ms, s.vad.offset_ms) == (200, 400)  # the file's, and env beats the file's 300
    assert load_settings(cfg, port=1234).port == 1234  # flags beat env
    monkeypatch.setenv("TURNKEEPER_CONFIG", str(cfg))
    assert load_settings().tts.voice == "en-gb"


def test_bad_values_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[vad]\noffset_ms = 50\n")
    with pytest.raises(ValidationError):
        load_settings(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("colour = 'blue'\n")
    with pytest.raises(ValidationError):
        load_settings(unknown)
    monkeypatch.setenv("TURNKEEPER_PORT", "not-a-port")
    with pytest.raises(ValidationError):
        load_settings()


def test_plans_per_tenant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "tk.toml"
    cfg.write_text("[plans.acme]\ndeadline_s = 30\nbudget_cents = 5\nmax_steps = 8\n[plans.default]\ndeadline_s = 60\n")
    s = load_settings(cfg)
    assert s.plan_for("acme").deadline_s == 30 and s.plan_for("acme").max_steps == 8
    assert s.plan_for("acme").budget.cents == 5
    assert s.plan_for("someone-else").deadline_s == 60
    assert load_settings().plan_for("anyone").max_steps == 16  # the built-in default plan
    monkeypatch.setenv("TURNKEEPER_PLANS", '{"globex": {"budget_tokens": 500}}')
    s = load_settings()
    assert s.plan_for("globex").budget_tokens == 500 and s.plan_for("default").deadline_s == 300
    monkeypatch.setenv("TURNKEEPER_PLANS", '{"globex": {"deadline_s": -1}}')
    with pytest.raises(ValidationError):
        load_settings()
    monkeypatch.setenv("TURNKEEPER_PLANS", '{"globex": {"deadline_s": 0.2, "shutdown_reserve_ms": 250}}')
    with pytest.raises(ValidationError, match="shutdown_reserve_ms"):
        load_settings()
    monkeypatch.setenv("TURNKEEPER_PLANS", '{"globex": {"colour": "blue"}}')
    with pytest.raises(ValidationError):
        load_settings()


def test_llm_provider_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNKEEPER_LLM__PROVIDER", "openai")
    monkeypatch.setenv("TURNKEEPER_LLM__BASE_URL", "http://127.0.0.1:8000/v1")
    monkeypatch.setenv("TURNKEEPER_LLM__API_KEY", "sk-secret")
    s = load_settings()
    assert s.llm.provider == "openai" and s.llm.base_url.endswith(":8000/v1")
    assert "sk-secret" not in repr(s)  # the key is never logged
    monkeypatch.setenv("TURNKEEPER_LLM__PROVIDER", "gpt-from-the-moon")
    with pytest.raises(ValidationError):
        load_settings()


def test_nested_barge_in_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three levels deep, as the README names them: accepted and validated."""
    monkeypatch.setenv("TURNKEEPER_SESSION__ENDPOINT__SILENCE_MS", "700")
    monkeypatch.setenv("TURNKEEPER_SESSION__BACKCHANNEL__WORDS", '["uh huh", "sure thing"]')
    monkeypatch.setenv("TURNKEEPER_BARGEIN__CONFIRM_TIMEOUT_MS", "800")
    s = load_settings()
    assert s.session.endpoint.silence_ms == 700 and s.bargein.confirm_timeout_ms == 800
    assert s.session.backchannel.matches("Sure thing!")
    monkeypatch.setenv("TURNKEEPER_SESSION__ENDPOINT__MIN_DELAY_MS", "5000")
    with pytest.raises(ValueError, match="min_delay_ms"):
        load_settings()
    monkeypatch.delenv("TURNKEEPER_SESSION__ENDPOINT__MIN_DELAY_MS")
    monkeypatch.setenv("TURNKEEPER_SESSION__ENDPOINT__SILENCE", "700")  # a typo
    with pytest.raises(ValueError, match="TURNKEEPER_SESSION__ENDPOINT__SILENCE_MS"):
        load_settings()
    monkeypatch.delenv("TURNKEEPER_SESSION__ENDPOINT__SILENCE")
    # the client's credentials (turnkeeper call's --token and --device-token defaults) are no typo
    monkeypatch.setenv("TURNKEEPER_TOKEN", "tk_x")
    monkeypatch.setenv("TURNKEEPER_DEVICE_TOKEN", "dev_x")
    assert load_settings().session.endpoint.silence_ms == 700
    monkeypatch.setenv("TURNKEEPER_BARGEIN__SILERO_THRESHOLD", "2")
    with pytest.raises(ValueError):
        load_settings()


def test_new_barge_in_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNKEEPER_INBOUND_STALL_MS", "400")
    monkeypatch.setenv("TURNKEEPER_SESSION__BACKCHANNEL__RESUME_AFTER_MS", "300")
    monkeypatch.setenv("TURNKEEPER_SESSION__BACKCHANNEL__MAX_SYLLABLES", "4")
    s = load_settings()
    assert s.inbound_stall_ms == 400
    assert s.session.backchannel.resume_after_ms == 300 and s.session.backchannel.max_syllables == 4
    for name, bad in (("TURNKEEPER_INBOUND_STALL_MS", "30"), ("TURNKEEPER_INBOUND_STALL_MS", "-20"), ("TURNKEEPER_INBOUND_STALL_MS", "20"),
                      ("TURNKEEPER_SESSION__BACKCHANNEL__MAX_SYLLABLES", "0"),
                      ("TURNKEEPER_SESSION__BACKCHANNEL__RESUME_AFTER_MS", "soon")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError):
            load_settings()
        monkeypatch.delenv(name)


def test_speech_recognition_settings_are_checked(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """stt.*: each bad value is refused naming the setting, never echoing the key."""
    monkeypatch.setenv("TURNKEEPER_STT__PROVIDER", "deepgram")
    monkeypatch.setenv("TURNKEEPER_STT__API_KEY", "dg-secret-key-123")
    monkeypatch.setenv("TURNKEEPER_STT__KEYTERMS", '["Ada", "Turnkeeper"]')
    s = load_settings()
    assert s.stt.provider == "deepgram" and s.stt.url == "wss://api.deepgram.com" and s.stt.model_name == "nova-3"
    assert "dg-secret-key-123" not in repr(s)
    for name, bad in (("TURNKEEPER_STT__PROVIDER", "watson"), ("TURNKEEPER_STT__CENTS_PER_MINUTE", "inf"),
                      ("TURNKEEPER_STT__CENTS_PER_MINUTE", "nan"), ("TURNKEEPER_STT__INPUT_CENTS_PER_1K", "-1"),
                      ("TURNKEEPER_STT__BASE_URL", "api.deepgram.com"),
                      ("TURNKEEPER_STT__BASE_URL", "wss://api.deepgram.com/v1/listen?model=nova-2"),
                      ("TURNKEEPER_STT__FALLBACK", "whisper"), ("TURNKEEPER_STT__KEEPALIVE_S", "12"),
                      ("TURNKEEPER_STT__KEYTERMS", '["' + "x" * 101 + '"]'), ("TURNKEEPER_STT__FINAL_TIMEOUT_MS", "50")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name.removeprefix("TURNKEEPER_STT__").lower()):
            load_settings()
        monkeypatch.delenv(name)
    monkeypatch.setenv("TURNKEEPER_STT__PROVIDER", "openai")
    monkeypatch.setenv("TURNKEEPER_STT__WORD_TIMESTAMPS", "true")
    with pytest.raises(ValueError, match="word_timestamps"):  # gpt-4o-transcribe, the default, has no verbose_json
        load_settings()
    monkeypatch.setenv("TURNKEEPER_STT__MODEL", "whisper-1")
    assert load_settings().stt.word_timestamps


def _setting_names(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted names of every leaf setting (``session.endpoint.silence_ms``)."""
    out: set[str] = set()
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out |= _setting_names(kind, f"{prefix}{name}.")
        else:
            out.add(prefix + name)
    return out


def _readme_setting_names() -> set[str]:
    """The names in the first column of README's settings table; a cell may
    name several (``bargein.energy_margin_db / gate_margin_db``, a later one
    without its section)."""
    out: set[str] = set()
    for line in README.read_text().splitlines():
        if not (line.startswith("| ") and "`TURNKEEPER_" in line):
            continue
        names = [n.strip() for n in re.split(r"[,/]", line.split("|")[1])]
        section = names[0].rpartition(".")[0]
        out |= {n if "." in n or not section else f"{section}.{n}" for n in names}
    return out


def test_readme_lists_every_setting_and_only_settings() -> None:
    """Each setting is documented, and README documents none that does not
    exist (``vad.onset_ms`` did: nothing read it, and it is gone)."""
    documented = _readme_setting_names()
    assert len(documented) > 50  # the table was found
    assert documented == _setting_names(Settings)


def test_device_choices_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A choice of numbers (the downlink's frame and rate) set as text, as
    every environment variable is, is read as the number; one not offered
    is still refused (from a bench run: ``"20"`` was refused)."""
    monkeypatch.setenv("TURNKEEPER_DEVICES__DOWNLINK_FRAME_MS", "20")
    monkeypatch.setenv("TURNKEEPER_DEVICES__DOWNLINK_SAMPLE_RATE", "16000")
    s = load_settings()
    assert s.devices.downlink_frame_ms == 20 and s.devices.downlink_sample_rate == 16000
    monkeypatch.setenv("TURNKEEPER_DEVICES__DOWNLINK_FRAME_MS", "30")
    with pytest.raises(ValueError, match="downlink_frame_ms"):
        load_settings()


def test_the_drain_times_must_fit_in_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNKEEPER_SHUTDOWN__DRAIN_TIMEOUT_S", "40")
    with pytest.raises(ValueError, match="grace_s"):
        load_settings()
    monkeypatch.setenv("TURNKEEPER_SHUTDOWN__GRACE_S", "50")
    s = load_settings()
    assert s.shutdown.drain_timeout_s == 40 and s.shutdown.grace_s == 50 and s.shutdown.turn_wait_s == 10
