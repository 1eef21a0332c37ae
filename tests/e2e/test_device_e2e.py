"""End to end over the device path: the real server on loopback, called by
the simulated xiaozhi-esp32 device (client/device.py) with espeak-ng
speech; measured at the device's speaker."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from conftest import plain, requires_espeak, start_app

from client.command import issue_device_token
from client.device_call import DeviceCallClient
from client.results import Utterance
from media.frames import PLAYOUT_RATE, load_pcm
from web.app import create_app
from web.settings import Settings

pytestmark = [pytest.mark.e2e, requires_espeak]
TOKEN = "tok-device-0123456789"


@pytest.fixture
async def device_server(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """(device WebSocket URL, a device token of the default tenant)."""
    app = create_app(
        Settings(store=f"sqlite:///{tmp_path}/var/t.db", api_tokens=f"default:{TOKEN}")
    )
    if not any(getattr(r.resource, "canonical", None) == "/v1/devices/ws" for r in app.router.routes()):
        pytest.skip("this build has no device endpoint (GET /v1/devices/ws) yet")
    runner, url = await start_app(app)
    device_token = await issue_device_token(url, TOKEN)
    yield "ws" + url[len("http"):] + "/v1/devices/ws", device_token
    await runner.cleanup()


def utt(path: Path, at_s: float | None = None, *, abort: bool = False) -> Utterance:
    return Utterance(pcm=load_pcm(path, PLAYOUT_RATE), at_s=at_s, label=path.name, abort=abort)


@pytest.mark.parametrize("version", [1, 3])
async def test_push_to_talk_asks_and_the_device_plays_the_answer(
    device_server: tuple[str, str], say: Callable[..., Path], tmp_path: Path, version: int
) -> None:
    ws, device_token = device_server
    out = tmp_path / "heard.wav"
    result = await DeviceCallClient(ws, mode="manual", device_token=device_token, token=TOKEN, version=version).run(
        utt(say("what is the weather like today")), out_wav=out, timeout_s=45
    )
    assert result.ok and result.protocol_errors == [], result.as_dict()
    [turn] = result.turns
    assert plain(turn.transcript) == "what is the weather like today"
    assert turn.status == "COMPLETED" and "sunny" in turn.reply
    assert result.received_audio_ms >= 1000 and out.stat().st_size > 16_000


async def test_abort_silences_the_device_and_the_turn_says_so(device_server: tuple[str, str], say: Callable[..., Path]) -> None:
    ws, device_token = device_server
    result = await DeviceCallClient(ws, mode="manual", device_token=device_token, token=TOKEN).run(
        utt(say("tell me a story")), [Utterance(b"", at_s=1.0, label="abort", abort=True)], timeout_s=60
    )
    assert result.ok and result.protocol_errors == [], result.as_dict()
    [old] = result.turns
    assert old.status == "CANCELLED" and old.stop_reason == "user_cancel", old
    assert "CANCEL_REQUESTED" in old.states and old.states.index("CANCEL_REQUESTED") < old.states.index("CANCELLED")
    [m] = result.barge_ins
    assert m.speaking_at_onset and m.tts_stop_ms is not None, m.as_dict()
    # sanity bounds (bench/device.py measures): silence at the device soon, nothing after tts stop
    assert m.stop_ms is not None and m.stop_ms < 400, m.as_dict()
    assert m.old_audio_after_tts_stop_ms == 0
    assert m.played_ms_at_ear is not None and m.server_played_ms is not None, m.as_dict()


async def test_the_heard_position_is_what_the_device_played(device_server: tuple[str, str], say: Callable[..., Path]) -> None:
    ws, device_token = device_server
    result = await DeviceCallClient(ws, mode="manual", device_token=device_token, token=TOKEN).run(
        utt(say("tell me a story")), [Utterance(b"", at_s=1.0, label="abort", abort=True)], timeout_s=60
    )
    [m] = result.barge_ins
    assert m.played_ms_at_ear is not None and m.server_played_ms is not None, m.as_dict()
    # within one packet and the send-ahead (20 and 40 ms by default; 120 ms
    # leaves room for 60 ms packets and 60 ms ahead) (it was about 2/3 of
    # it while a tick that found the send-ahead window full ended the
    # stretch, flushing and resetting the encoder mid-reply; it agrees since)
    # (200 ms: room for a scheduling stall at the abort on a loaded machine)
    assert abs(m.played_ms_at_ear - m.server_played_ms) <= 200, m.as_dict()


async def test_a_push_to_talk_press_while_the_agent_speaks_is_a_barge_in(
    device_server: tuple[str, str], say: Callable[..., Path]
) -> None:
    ws, device_token = device_server
    result = await DeviceCallClient(ws, mode="manual", device_token=device_token, token=TOKEN).run(
        utt(say("tell me a story")), [utt(say("what is the weather like today"), at_s=1.0)], timeout_s=60
    )
    assert result.ok and result.protocol_errors == [], result.as_dict()
    old, new = result.turns
    # the firmware sends abort before listen start (Application::StartListening), so the old
    # turn may be stopped by the abort (user_cancel) before the press could barge in
    assert old.status == "CANCELLED" and old.stop_reason in ("user_cancel", "barge_in"), old
    assert plain(new.transcript) == "what is the weather like today" and new.status == "COMPLETED"
    [m] = result.barge_ins
    assert m.initiator == "ptt" and m.speaking_at_onset and m.tts_stop_ms is not None, m.as_dict()
    assert m.stop_ms is not None and m.stop_ms < 400, m.as_dict()


async def test_realtime_mode_barges_in_by_voice(device_server: tuple[str, str], say: Callable[..., Path]) -> None:
    ws, device_token = device_server
    result = await DeviceCallClient(ws, mode="realtime", device_token=device_token, token=TOKEN).run(
        utt(say("tell me a story")), [utt(say("what is the weather like today"), at_s=1.5)], timeout_s=60
    )
    assert result.ok and result.protocol_errors == [], result.as_dict()
    old, new = result.turns
    assert old.status == "CANCELLED" and old.stop_reason == "barge_in"
    assert plain(new.transcript) == "what is the weather like today"
    [m] = result.barge_ins
    assert m.initiator == "voice" and m.barged_in and m.speaking_at_onset
    assert m.stop_ms is not None and m.stop_ms < 800, m.as_dict()
