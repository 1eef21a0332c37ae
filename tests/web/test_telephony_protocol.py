"""The telephony protocols without a socket: Twilio's and Telnyx's messages
as their documents show them, parsed into the same events and built back;
the X-Twilio-Signature check against Twilio's worked example; the TwiML;
the tenant signature; and the webhook and WebSocket upgrade refused (403)
without a valid signature when an auth token is set."""

from __future__ import annotations

import base64
import time
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from conftest import start_app
from twilio.request_validator import RequestValidator

from web.app import create_app
from web.settings import Settings
from web.telephony.dialect import Dtmf, Mark, Media, ProtocolError, Start, Stop, loads
from web.telephony.signature import TENANT_SIG_TTL_S, TenantSigner, twilio_signature_valid
from web.telephony.telnyx import TelnyxDialect, client_state_parameters, encode_client_state
from web.telephony.twilio import TwilioDialect
from web.telephony.twiml import connect_stream

PAYLOAD = bytes(range(160))
B64 = base64.b64encode(PAYLOAD).decode()


def test_twilio_messages_as_documented() -> None:
    d = TwilioDialect()
    start = d.parse(loads(
        '{"event":"start","sequenceNumber":"1","start":{"accountSid":"AC1","streamSid":"MZ1","callSid":"CA1",'
        '"tracks":["inbound"],"customParameters":{"tenant":"t"},'
        '"mediaFormat":{"encoding":"audio/x-mulaw","sampleRate":8000,"channels":1}},"streamSid":"MZ1"}'
    ))
    assert start == Start("MZ1", "CA1", {"tenant": "t"}, "audio/x-mulaw", 8000)
    media = d.parse({"event": "media", "sequenceNumber": "3", "streamSid": "MZ1",
                     "media": {"track": "inbound", "chunk": "1", "timestamp": "5", "payload": B64}})
    assert media == Media(PAYLOAD, 1, "MZ1")
    assert d.parse({"event": "dtmf", "streamSid": "MZ1", "dtmf": {"track": "inbound_track", "digit": "1"}}) == Dtmf("1", "MZ1")
    assert d.parse({"event": "mark", "streamSid": "MZ1", "mark": {"name": "g1.1"}}) == Mark("g1.1", "MZ1")
    assert d.parse({"event": "stop", "streamSid": "MZ1", "stop": {"accountSid": "AC1", "callSid": "CA1"}}) == Stop("MZ1")
    assert d.media("MZ1", PAYLOAD) == {"event": "media", "streamSid": "MZ1", "media": {"payload": B64}}
    assert d.mark("MZ1", "n") == {"event": "mark", "streamSid": "MZ1", "mark": {"name": "n"}}
    assert d.clear("MZ1") == {"event": "clear", "streamSid": "MZ1"}


def test_telnyx_messages_as_documented() -> None:
    d = TelnyxDialect()
    assert d.reorders
    state = encode_client_state({"tenant": "t", "tenant_sig": "s"})
    start = d.parse({"event": "start", "sequence_number": "1", "stream_id": "S1", "start": {
        "user_id": "u", "call_control_id": "v3:abc", "client_state": state,
        "media_format": {"encoding": "PCMU", "sample_rate": 8000, "channels": 1}}})
    assert start == Start("S1", "v3:abc", {"tenant": "t", "tenant_sig": "s"}, "PCMU", 8000)
    media = d.parse({"event": "media", "sequence_number": "4", "stream_id": "S1",
                     "media": {"track": "inbound", "chunk": "2", "timestamp": "5", "payload": B64}})
    assert media == Media(PAYLOAD, 2, "S1")
    assert d.parse({"event": "stop", "sequence_number": "5", "stream_id": "S1", "stop": {"call_control_id": "v3:abc"}}) == Stop("S1")
    assert d.media("S1", PAYLOAD) == {"event": "media", "media": {"payload": B64}}
    assert d.clear("S1") == {"event": "clear"}
    with pytest.raises(ProtocolError) as err:
        d.parse({"event": "error", "payload": {"code": 100003, "title": "malformed_frame"}})
    assert err.value.code == "provider_error" and not err.value.fatal
    with pytest.raises(ProtocolError) as err:
        client_state_parameters("not base64 json!")
    assert err.value.fatal


@pytest.mark.parametrize(
    "message, code, fatal",
    [
        ("not json", "bad_json", False),
        ('{"event": 5}', "bad_json", False),
        ('{"event": "hello"}', "unknown_event", False),
        ('{"event": "media", "media": {"payload": "@@@not base64@@@"}}', "bad_base64", False),
        ('{"event": "media", "media": {"payload": "' + base64.b64encode(bytes(80)).decode() + '"}}', "bad_payload_size", False),
        ('{"event": "media", "media": {"payload": "' + "A" * 100_000 + '"}}', "bad_payload_size", False),
        ('{"event": "media", "media": {"track": "outbound", "payload": "' + B64 + '"}}', "bad_field", False),
        ('{"event": "media"}', "bad_field", False),
        ('{"event": "dtmf", "dtmf": {"digit": "x"}}', "bad_field", False),
        ('{"event": "start", "start": {"streamSid": "MZ", "mediaFormat": {"encoding": "audio/l16", "sampleRate": 16000}}}',
         "unsupported_format", True),
        ('{"event": "start", "start": {}}', "bad_field", True),
    ],
)
def test_bad_twilio_messages_are_named(message: str, code: str, fatal: bool) -> None:
    with pytest.raises(ProtocolError) as err:
        TwilioDialect().parse(loads(message))
    assert err.value.code == code and err.value.fatal is fatal


def test_the_signature_check_matches_twilios_worked_example() -> None:
    # Twilio, "Webhooks security": auth token 12345, this URL and these parameters
    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    params = {"CallSid": "CA1234567890ABCDE", "Caller": "+14158675309", "Digits": "1234",
              "From": "+14158675309", "To": "+18005551212"}
    assert twilio_signature_valid("12345", url, params, "RSOYDt4T1cUTdK1PDd93/VVr8B8=")
    assert not twilio_signature_valid("12345", url, {**params, "Digits": "1235"}, "RSOYDt4T1cUTdK1PDd93/VVr8B8=")
    assert not twilio_signature_valid("54321", url, params, "RSOYDt4T1cUTdK1PDd93/VVr8B8=")
    assert not twilio_signature_valid("12345", url, params, None)


def test_the_tenant_is_ours_bound_to_the_call_and_good_once() -> None:
    now = 1_800_000_000.0
    signer = TenantSigner(b"k" * 32)
    params = signer.parameters("tenant_a", "CA1", now)
    assert set(params) == {"tenant", "tenant_sig", "tenant_ts"}
    assert signer.tenant_of(params, "CA2", now) is None  # another call
    assert signer.tenant_of({**params, "tenant": "tenant_b"}, "CA1", now) is None  # another tenant
    assert signer.tenant_of({**params, "tenant_ts": str(int(now) + 1)}, "CA1", now) is None  # another issue time
    assert signer.tenant_of({"tenant": "tenant_a"}, "CA1", now) is None  # unsigned
    assert signer.tenant_of({**params, "tenant_ts": "x" * 40}, "CA1", now) is None  # garbage
    assert TenantSigner(b"j" * 32).tenant_of(params, "CA1", now) is None  # another key
    assert signer.tenant_of(params, "CA1", now + 5) == "tenant_a"
    assert signer.tenant_of(params, "CA1", now + 6) is None  # a second stream with the same parameters: a replay
    assert signer.tenant_of({}, "CA1", now) == "default"
    assert signer.tenant_of({}, "CA1", now, required=True) is None  # authenticated: our TwiML always names one
    assert signer.tenant_of({**params, "tenant_sig": "\u00e9" * 64}, "CA1", now) is None  # not ASCII: refused, no error
    # expired: the stream must start soon after the webhook
    late = signer.parameters("tenant_a", "CA3", now)
    assert signer.tenant_of(late, "CA3", now + TENANT_SIG_TTL_S + 1) is None
    # issued in the future (beyond another instance's clock skew): refused
    ahead = signer.parameters("tenant_a", "CA4", now + 3600)
    assert signer.tenant_of(ahead, "CA4", now) is None
    # the claims of expired signatures are forgotten, not kept for ever
    for k in range(50):
        signer.tenant_of(signer.parameters("t", f"CB{k}", now), f"CB{k}", now)
    signer.tenant_of(signer.parameters("t", "CC", now + 2 * TENANT_SIG_TTL_S), "CC", now + 2 * TENANT_SIG_TTL_S)
    assert len(signer._claimed) == 1


def test_twiml_connects_the_stream_with_its_parameters() -> None:
    xml = connect_stream("wss://agent.example.com/v1/telephony/twilio", {"tenant": 'a"<b', "tenant_sig": "s"})
    assert xml == (
        '<?xml version="1.0" encoding="UTF-8"?><Response><Connect>'
        '<Stream url="wss://agent.example.com/v1/telephony/twilio">'
        '<Parameter name="tenant" value="a&quot;&lt;b" /><Parameter name="tenant_sig" value="s" />'
        "</Stream></Connect></Response>"
    )
    with pytest.raises(ValueError):
        connect_stream("https://x", {})


@pytest.fixture
async def signed_server(tmp_path: Path) -> AsyncIterator[str]:
    app = create_app(Settings(
        store=f"sqlite:///{tmp_path}/t.db",
        telephony={"twilio_auth_token": "tok", "tenant_by_number": {"+15550100": "tenant_a"}, "tenant_secret": "sec"},
    ))
    runner, url = await start_app(app)
    try:
        yield url
    finally:
        await runner.cleanup()


async def test_webhook_and_upgrade_need_a_valid_signature(signed_server: str) -> None:
    url = signed_server
    form = {"CallSid": "CA9", "To": "+15550100", "From": "+15550199"}
    good = RequestValidator("tok").compute_signature(f"{url}/v1/telephony/twilio/voice", form)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/telephony/twilio/voice", data=form) as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "bad_signature"
        async with http.post(f"{url}/v1/telephony/twilio/voice", data=form, headers={"X-Twilio-Signature": "AAAA"}) as r:
            assert r.status == 403
        async with http.post(f"{url}/v1/telephony/twilio/voice", data=form, headers={"X-Twilio-Signature": good}) as r:
            assert r.status == 200 and r.content_type == "text/xml"
            twiml = await r.text()
        assert '<Stream url="ws://127.0.0.1:' in twiml and "/v1/telephony/twilio" in twiml
        params = {p.get("name"): p.get("value") for p in ET.fromstring(twiml).iter("Parameter")}
        assert params["tenant"] == "tenant_a"
        assert abs(int(params["tenant_ts"]) - time.time()) < 60
        assert TenantSigner(b"sec").tenant_of(params, "CA9", time.time()) == "tenant_a"  # signed with the setting
        ws_url = url.replace("http://", "ws://") + "/v1/telephony/twilio"
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await http.ws_connect(ws_url)
        assert err.value.status == 403
        sig = RequestValidator("tok").compute_signature(ws_url, {})
        ws = await http.ws_connect(ws_url, headers={"X-Twilio-Signature": sig})
        # the upgrade's signature covers the URL alone (a replay passes it): a start
        # that does not bring our signed tenant back is refused
        await ws.send_json({"event": "start", "streamSid": "MZ1", "start": {
            "streamSid": "MZ1", "callSid": "CA-unsigned", "tracks": ["inbound"], "customParameters": {},
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})
        msg = await ws.receive(timeout=5)
        assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1008 and msg.extra == "bad_tenant"
        await ws.close()


async def test_webhook_without_a_token_and_a_stream_url_setting(tmp_path: Path) -> None:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", telephony={"stream_url": "wss://calls.example.com/s"}))
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/telephony/twilio/voice", data={"CallSid": "CA1"}) as r:
                assert r.status == 200 and '<Stream url="wss://calls.example.com/s">' in await r.text()
            async with http.post(f"{url}/v1/telephony/twilio/voice", data={}) as r:
                assert r.status == 400
    finally:
        await runner.cleanup()


def test_telephony_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        Settings(telephony={"send_ahead_ms": 50})
    with pytest.raises(ValueError):
        Settings(telephony={"public_url": "agent.example.com"})


async def test_telnyx_streams_need_their_token_once_calls_are_secured(tmp_path: Path) -> None:
    """Telnyx signs no upgrade: with a Twilio token set and no Telnyx token,
    Telnyx streams are refused (from review: they were open to anyone); with
    a Telnyx token the URL must carry it."""
    for telephony, query, status in (
        ({"twilio_auth_token": "tok"}, "", 403),
        ({"twilio_auth_token": "tok", "telnyx_stream_token": "s3cret"}, "", 403),
        ({"twilio_auth_token": "tok", "telnyx_stream_token": "s3cret"}, "?token=wrong", 403),
        ({"twilio_auth_token": "tok", "telnyx_stream_token": "s3cret"}, "?token=s3cret", 101),
        ({"telnyx_stream_token": "s3cret"}, "?token=nope", 403),
        ({}, "", 101),  # development: no credentials configured at all
    ):
        app = create_app(Settings(store=f"sqlite:///{tmp_path}/t{status}{len(query)}{len(telephony)}.db", telephony=telephony))
        runner, url = await start_app(app)
        try:
            async with aiohttp.ClientSession() as http:
                ws_url = url.replace("http://", "ws://") + "/v1/telephony/telnyx" + query
                if status == 403:
                    with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                        await http.ws_connect(ws_url)
                    assert err.value.status == 403, (telephony, query)
                else:
                    ws = await http.ws_connect(ws_url)
                    await ws.close()
        finally:
            await runner.cleanup()


async def test_a_stream_url_setting_is_what_the_upgrade_signature_covers(tmp_path: Path) -> None:
    """Twilio signs the <Stream> URL it was given: with telephony.stream_url
    set (another host, a proxy's path), the upgrade is checked against it
    (from review: every such call was refused)."""
    stream = "wss://media.example.com/tk/v1/telephony/twilio"
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", telephony={"twilio_auth_token": "tok", "stream_url": stream}))
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as http:
            ws_url = url.replace("http://", "ws://") + "/v1/telephony/twilio"
            with pytest.raises(aiohttp.WSServerHandshakeError) as err:  # signed over our own URL: not what Twilio signs
                await http.ws_connect(ws_url, headers={"X-Twilio-Signature": RequestValidator("tok").compute_signature(ws_url, {})})
            assert err.value.status == 403
            ws = await http.ws_connect(ws_url, headers={"X-Twilio-Signature": RequestValidator("tok").compute_signature(stream, {})})
            await ws.close()
    finally:
        await runner.cleanup()
