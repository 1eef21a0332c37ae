"""The turnkeeper command's error handling: one clear line, exit status 2,
never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], tmp_path: Path, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
    e.update(env or {})
    e["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "web.cli", *args], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=timeout
    )


def assert_clean_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("turnkeeper: ")
    for n in needles:
        assert n in proc.stderr


def test_call_unreachable_server(tmp_path: Path, say) -> None:
    proc = run(["call", "--server", "http://127.0.0.1:1", "--wav", str(say("hello there"))], tmp_path)
    assert_clean_error(proc, "cannot reach")


def test_call_missing_and_bad_files(tmp_path: Path, say) -> None:
    assert_clean_error(run(["call", "--local", "--wav", "missing.wav"], tmp_path), "file not found", "missing.wav")
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"\x00\x01" * 500)
    assert_clean_error(run(["call", "--local", "--wav", str(junk)], tmp_path), "junk.wav")
    proc = run(["call", "--local", "--wav", str(say("hello there")), "--out", "/nonexistent/dir/heard.wav"], tmp_path)
    assert_clean_error(proc, "/nonexistent/dir")


def test_a_bad_secret_setting_is_named_never_echoed(tmp_path: Path) -> None:
    """Issue 16: a settings error names the setting and the problem, never
    the value given (pydantic's own text quotes it: a token)."""
    proc = run(["serve"], tmp_path, {"TURNKEEPER_API_TOKENS": "a:tok SECRET-91f", "TURNKEEPER_ADMIN_TOKEN": "ADM" * 100})
    assert_clean_error(proc, "api_tokens", "whitespace", "admin_token", "at most 256")
    assert "SECRET-91f" not in proc.stderr and "ADMADM" not in proc.stderr


def test_serve_bad_settings(tmp_path: Path) -> None:
    assert_clean_error(run(["serve"], tmp_path, {"TURNKEEPER_PORT": "abc"}), "port")
    assert_clean_error(run(["serve"], tmp_path, {"TURNKEEPER_VAD__OFFSET_MS": "55"}), "offset_ms")
    assert_clean_error(run(["serve"], tmp_path, {"TURNKEEPER_VAD__OFFSETMS": "200"}), "TURNKEEPER_VAD__OFFSET_MS?")
    bad = tmp_path / "bad.toml"
    bad.write_text("port = \n")
    assert_clean_error(run(["serve", "--config", str(bad)], tmp_path), "bad.toml", "not valid TOML")
    assert_clean_error(run(["serve", "--config", "missing.toml"], tmp_path), "missing.toml")


def test_serve_bad_grammar_fails_before_serving(tmp_path: Path) -> None:
    env = {"TURNKEEPER_STT__PROVIDER": "pocketsphinx", "TURNKEEPER_STT__GRAMMAR": "/nonexistent.gram"}
    proc = run(["serve", "--port", "0"], tmp_path, env)
    assert_clean_error(proc, "grammar not found")
    assert "serving on" not in proc.stdout


def test_serve_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run(["serve", "--port", str(port)], tmp_path)
    assert_clean_error(proc, f"cannot listen on 127.0.0.1:{port}")
    assert "serving on" not in proc.stdout


def test_call_bad_out_server_and_silence(tmp_path: Path, say) -> None:
    wav = str(say("hello there"))
    assert_clean_error(run(["call", "--local", "--wav", wav, "--out", "/proc/heard.wav"], tmp_path), "cannot write --out")
    assert_clean_error(run(["call", "--server", "notaurl", "--wav", wav], tmp_path), "http://")
    import wave

    silent = tmp_path / "silence.wav"
    with wave.open(str(silent), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(bytes(32000 * 2))
    proc = run(["call", "--local", "--wav", str(silent)], tmp_path, timeout=60)
    assert_clean_error(proc, "heard no speech")


def test_config_that_is_a_folder(tmp_path: Path) -> None:
    assert_clean_error(run(["serve", "--config", str(tmp_path)], tmp_path), "is a folder")


def test_serve_makes_its_store_on_first_run(tmp_path: Path) -> None:
    """The embedded default: var/turnkeeper.db under the working folder."""
    import urllib.request

    port = free_port()
    e = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
    e["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "web.cli", "serve", "--port", str(port)], cwd=tmp_path, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    assert r.status == 200
                    break
            except OSError:
                import time

                time.sleep(0.1)
        assert (tmp_path / "var" / "turnkeeper.db").is_file()
        second = run(["serve", "--port", str(free_port())], tmp_path)  # same folder, same file
        assert_clean_error(second, "another turnkeeper process is using")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert f"serving on http://127.0.0.1:{port}" in out
