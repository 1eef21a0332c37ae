"""No secret and no content in logs or error answers (issue 16).

A real text turn over the API, on the server's own runner (its access log
included), every logger at DEBUG, with distinctive tokens (API, device,
resume, Twilio, Telnyx), a distinctive transcript and the reply it gets:
none of them appears in any log record or error body. With ``log_content``
on, the transcript does appear (so this test can fail), the tokens still
never do."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from turn import log_content
from turn.log_content import WITHHELD, content, error_text, set_log_content
from web.access_log import redacted_target, runner
from web.app import create_app
from web.settings import Settings

API_TOKEN = "tokA-SECRET-api-7f3a9c"
TWILIO_TOKEN = "twilio-SECRET-auth-51c2"
TELNYX_TOKEN = "telnyx-SECRET-stream-88d1"
TRANSCRIPT = "zanzibar quokka marmalade please tell me a story"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


@pytest.fixture(autouse=True)
def content_off_after() -> Any:
    yield
    set_log_content(False)


async def run_turn(tmp_path: Path, *, on: bool) -> tuple[str, list[str], list[str]]:
    """Serve, run one text turn and poke every secret-bearing path; returns
    (all the log text, the secrets used, the error bodies seen)."""
    settings = Settings(
        store=f"sqlite:///{tmp_path}/t.db", api_tokens=f"tenant_a:{API_TOKEN}", log_content=on, demo_shop=False,
        llm={"tokens_per_second": 400}, telephony={"twilio_auth_token": TWILIO_TOKEN, "telnyx_stream_token": TELNYX_TOKEN},
    )
    app = create_app(settings)
    r = runner(app)
    await r.setup()
    site = aiohttp.web.TCPSite(r, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    errors: list[str] = []
    secrets = [API_TOKEN, TWILIO_TOKEN, TELNYX_TOKEN]
    try:
        async with aiohttp.ClientSession() as http:

            async def call(method: str, path: str, **kw: Any) -> tuple[int, str]:
                async with http.request(method, url + path, **kw) as resp:
                    text = await resp.text()
                    if resp.status >= 400:
                        errors.append(text)
                    return resp.status, text

            async with http.post(f"{url}/v1/turns", json={"text": TRANSCRIPT}, headers=AUTH) as resp:
                assert resp.status == 202
                started = await resp.json()
            turn_id, session_id, resume = started["turn"]["id"], started["session_id"], started["resume_token"]
            secrets.append(resume)
            async with asyncio.timeout(20):
                while True:
                    async with http.get(f"{url}/v1/turns/{turn_id}", headers=AUTH) as resp:
                        turn = await resp.json()
                    if turn["status"] == "COMPLETED":
                        break
                    await asyncio.sleep(0.05)
            reply = turn["reply"]
            assert reply and len(reply) > 20
            # the event stream, resumed with the token in the query (as EventSource does)
            async with http.get(f"{url}/v1/sessions/{session_id}/events?after_seq=0&resume_token={resume}") as resp:
                assert resp.status == 200
                await resp.content.readline()
            # a refused resume (another session) and a forged one
            await call("GET", f"/v1/sessions/{'0' * 32}/events?resume_token={resume}")
            await call("GET", f"/v1/sessions/{session_id}/events?resume_token={resume[:-4]}AAAA")
            # a wrong API token, bad bodies quoting the transcript
            await call("GET", f"/v1/turns/{turn_id}", headers={"Authorization": f"Bearer {API_TOKEN}x"})
            await call("POST", "/v1/turns", data=f'{{"text": "{TRANSCRIPT}', headers=AUTH)
            await call("POST", "/v1/turns", json={"text": TRANSCRIPT * 100}, headers=AUTH)
            await call("POST", "/v1/turns", json={"text": TRANSCRIPT, "deadline_ms": TRANSCRIPT}, headers=AUTH)
            await call("POST", f"/v1/turns/{turn_id}/stop", json={"reason": TRANSCRIPT},
                       headers={**AUTH, "Idempotency-Key": "k1"})
            # a device: issued, used with a wrong token, revoked
            async with http.post(f"{url}/v1/devices", headers=AUTH) as resp:
                device = await resp.json()
            secrets.append(device["token"])
            await call("GET", "/v1/devices/ws", headers={"Authorization": f"Bearer {device['token']}x"})
            await call("DELETE", f"/v1/devices/{device['device_id']}", headers=AUTH)
            await call("GET", "/v1/devices/ws", headers={"Authorization": f"Bearer {device['token']}"})
            # telephony: a bad Twilio signature, Telnyx streams with the token and a wrong one in the URL
            await call("POST", "/v1/telephony/twilio/voice", data={"CallSid": "CA1"},
                       headers={"X-Twilio-Signature": f"{TWILIO_TOKEN}-sig"})
            await call("GET", f"/v1/telephony/telnyx?token={TELNYX_TOKEN}x")
            await call("GET", f"/v1/telephony/telnyx?token={TELNYX_TOKEN}")
    finally:
        await r.cleanup()
    return reply, secrets, errors


def log_text(caplog: pytest.LogCaptureFixture) -> str:
    """Every record as a handler writes it (tracebacks included), and its
    raw message and arguments."""
    out = []
    for record in caplog.records:
        out.append(caplog.handler.format(record))
        out.append(repr(record.msg) + repr(record.args))
    return "\n".join(out)


async def test_no_secret_nor_content_in_logs_or_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    reply, secrets, errors = await run_turn(tmp_path, on=False)
    logs = log_text(caplog)
    access = [r.getMessage() for r in caplog.records if r.name == "web.access"]
    assert any("resume_token=***" in line for line in access), access  # the access log was there to see
    assert any("token=***" in line and "telnyx" in line for line in access), access
    assert any("turn" in r.getMessage() and "opened" in r.getMessage() for r in caplog.records)  # so was the turn's debug
    for secret in secrets:
        assert secret not in logs, secret
        assert not any(secret in e for e in errors), secret
    for words in (TRANSCRIPT, "zanzibar", reply, reply[:30]):
        assert words not in logs, words
        assert not any(words in e for e in errors), (words, errors)
    assert len(errors) >= 10


async def test_with_log_content_on_the_transcript_is_logged_never_a_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    reply, secrets, _ = await run_turn(tmp_path, on=True)
    logs = log_text(caplog)
    assert TRANSCRIPT in logs
    assert reply[:30] in logs
    for secret in secrets:
        assert secret not in logs, secret


def test_a_logged_traceback_keeps_its_frames_not_its_message(caplog: pytest.LogCaptureFixture) -> None:
    set_log_content(False)
    log = logging.getLogger("voice.some_module")

    def tool(args: str) -> None:
        raise ValueError(f"bad arguments {args}")

    for on in (False, True):
        set_log_content(on)
        caplog.clear()
        said = "zanzibar" + "-arg"  # the source lines a traceback shows do not quote it
        try:
            try:
                tool(said)
            except ValueError as exc:
                raise RuntimeError(f"while ordering {said}") from exc
        except RuntimeError as exc:
            log.exception("turn t1 failed: %s", error_text(exc))
        text = caplog.text
        assert "in tool" in text and "ValueError" in text and "RuntimeError" in text  # the frames and types stay
        assert ("zanzibar-arg" in text) is on, text
        assert (WITHHELD in text) is not on
    # another library's records are left as they are
    set_log_content(False)
    caplog.clear()
    try:
        raise KeyError("lib-detail")
    except KeyError:
        logging.getLogger("somelib").exception("x")
    assert "lib-detail" in caplog.text


def test_content_and_error_text() -> None:
    set_log_content(False)
    assert content("hello there") == "<11 chars withheld>"
    assert error_text(ExceptionGroup("g", [ValueError("said x")])) == "ValueError"
    set_log_content(True)
    assert log_content.log_content_on()
    assert content("hello there") == "'hello there'"
    assert error_text(ValueError("said x")) == "ValueError: said x"


def test_the_access_log_redacts_secret_query_parameters() -> None:
    from yarl import URL

    assert redacted_target(URL("/v1/sessions/s/events?after_seq=4&resume_token=abc.def")) == (
        "/v1/sessions/s/events?after_seq=4&resume_token=***"
    )
    assert redacted_target(URL("/v1/telephony/telnyx?token=x&Signature=y&api_key=z&n=1")) == (
        "/v1/telephony/telnyx?token=***&Signature=***&api_key=***&n=1"
    )
    assert redacted_target(URL("/v1/turns/t1")) == "/v1/turns/t1"
