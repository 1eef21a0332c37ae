"""The ``turnkeeper call`` command: the headless client as a tool beside the
server (``web/cli.py`` loads it only for that command)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import tempfile
from pathlib import Path

import aiohttp
from aiohttp import web

from client.call import CallClient
from client.device_call import DeviceCallClient
from client.phone_call import PhoneCallClient
from client.results import BargeInMeasure, CallError, CallResult, Utterance
from media.frames import PLAYOUT_RATE, load_pcm
from web.app import create_app
from web.settings import CALL_DEVICE_TOKEN_ENV, CALL_TOKEN_ENV, Settings


async def run_call(args: argparse.Namespace, settings: Settings) -> int:
    """``turnkeeper call``: call a server (or one started here with
    ``--local``) with ``args.wav`` as the microphone, interrupt with
    ``args.barge_in`` (or, on a phone call, the telephone keys
    ``args.keys``) ``args.at`` seconds after the agent starts talking,
    write what was heard to ``args.out`` and print the timeline (or JSON).
    With ``args.phone`` (``twilio``, ``telnyx``) the call is a simulated
    phone call through the telephony bridge (:mod:`client.phone_call`).
    Returns the exit status: 0, or 1 if the call failed or a turn FAILED.

    Raises:
        FileNotFoundError: a WAV or the folder of ``--out`` is missing.
        ValueError: a bad argument (unwritable ``--out``, a non-http URL).
        client.results.CallError: the server refused the call or the connection failed.
    """
    out = Path(args.out)
    if not out.parent.is_dir():
        raise FileNotFoundError(2, "no such folder for --out", str(out.parent))
    try:  # find out now, not after the whole call, that it cannot be written
        with open(out, "ab"):
            pass
    except OSError as exc:
        raise ValueError(f"cannot write --out {out}: {exc.strerror or exc}") from exc
    if args.server is not None and not args.server.startswith(("http://", "https://")):
        raise ValueError(f"--server must be an http:// or https:// URL, not {args.server!r}")
    opening = Utterance(pcm=load_pcm(args.wav, PLAYOUT_RATE), label=Path(args.wav).name)
    barge_ins = []
    keys = getattr(args, "keys", None)
    if keys:
        if not getattr(args, "phone", None):
            raise ValueError("--keys needs --phone (telephone keys are a phone call's)")
        if not all(k in "0123456789*#ABCD" for k in keys):
            raise ValueError(f"--keys takes 0-9, *, # and A-D, not {keys!r}")
        barge_ins.append(Utterance(pcm=b"", at_s=args.at, label=f"keys {keys}", keys=keys))
    elif args.barge_in:
        barge_ins.append(Utterance(pcm=load_pcm(args.barge_in, PLAYOUT_RATE), at_s=args.at, label=Path(args.barge_in).name))
    device = getattr(args, "device", None)
    if getattr(args, "abort_at", None) is not None:
        barge_ins.append(Utterance(pcm=b"", at_s=args.abort_at, label="abort", abort=True))
    runner: web.AppRunner | None = None
    tmp = tempfile.TemporaryDirectory(prefix="turnkeeper-call-")
    phone = getattr(args, "phone", None)
    token = getattr(args, "token", None) or os.environ.get(CALL_TOKEN_ENV)
    device_token = getattr(args, "device_token", None) or os.environ.get(CALL_DEVICE_TOKEN_ENV)
    try:
        if args.local:
            store = args.store or f"sqlite:///{tmp.name}/turnkeeper.db"
            update: dict[str, object] = {"store": store}
            # a token of the call's tenant: it mints the client token, reads the timeline
            if phone or device is not None or settings.api_tokens:
                token = secrets.token_urlsafe(16)
                tokens = ",".join(p for p in (settings.api_tokens, f"default:{token}") if p)
                update["api_tokens"] = tokens
            runner = web.AppRunner(create_app(settings.model_copy(update=update)), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            url = f"http://127.0.0.1:{port}"
            if device is not None:
                assert token is not None
                device_token = await issue_device_token(url, token)
                device = f"ws://127.0.0.1:{port}/v1/devices/ws"
        else:
            url = args.server
        client: CallClient | PhoneCallClient | DeviceCallClient
        if device:
            mode = "realtime" if getattr(args, "realtime", False) else "manual"
            client = DeviceCallClient(device, mode=mode, device_token=device_token, token=token,
                                      version=getattr(args, "protocol_version", 1))
        elif phone:
            client = PhoneCallClient(url, phone, token=token)
        else:
            client = CallClient(url, token=token, echo_cancellation=getattr(args, "echo_cancellation", True))
        result = await client.run(opening, barge_ins, out_wav=out, timeout_s=args.timeout)
    finally:
        if runner is not None:
            await runner.cleanup()
        tmp.cleanup()
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(format_timeline(result, args.out))
    failed = any(t.status == "FAILED" for t in result.turns)
    return 0 if result.ok and not failed else 1


async def issue_device_token(base_url: str, tenant_token: str) -> str:
    """A device token from ``POST /v1/devices`` (a tenant's bearer token).

    Raises:
        CallError: the server refused or answered without a token.
    """
    async with aiohttp.ClientSession() as http:
        try:
            async with http.post(f"{base_url}/v1/devices", json={"name": "turnkeeper call"},
                                 headers={"Authorization": f"Bearer {tenant_token}"}) as resp:
                body = await resp.json(content_type=None) if resp.status < 300 else await resp.text()
                status = resp.status
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise CallError(f"cannot issue a device token at {base_url}/v1/devices: {exc or type(exc).__name__}") from exc
    if status >= 300 or not isinstance(body, dict) or not isinstance(body.get("token"), str):
        raise CallError(f"POST /v1/devices answered HTTP {status}: {str(body)[:200]!r}")
    return str(body["token"])


def format_timeline(result: CallResult, out: str | None = None) -> str:
    """The human-readable timeline of a call."""
    lines = [f"session {result.session_id}"]
    for t in result.turns:
        reason = f" ({t.stop_reason})" if t.stop_reason else ""
        err = f" [{t.error}]" if t.error else ""
        lines.append(f"  turn {t.id[:8]}  generation {t.generation}  {t.status}{reason}{err}")
        lines.append(f"    user:  {t.transcript!r}")
        reply = t.reply if len(t.reply) <= 160 else t.reply[:157] + "..."
        lines.append(f"    agent: {reply!r}")
        if t.states:
            lines.append(f"    states: {' -> '.join(t.states)}")
    phone = result.transport in ("twilio", "telnyx")
    device = result.transport == "device"
    for b in result.barge_ins:
        if device:
            lines += _device_lines(b)
            continue
        stop = "n/a" if b.stop_ms is None else f"{b.stop_ms:.0f} ms"
        fence = "n/a" if b.server_onset_to_fence_ms is None else f"{b.server_onset_to_fence_ms:.0f} ms"
        speaking = "" if b.speaking_at_onset else " (agent was already silent at onset)"
        where = " at the caller's ear" if phone else ""
        lines.append(
            f"  barge-in {b.label} at +{b.at_s:.2f} s: audible stop{where} {stop}{speaking}; server onset->fence {fence}"
        )
        if phone and b.resumed is not None and not b.barged_in:
            lines.append(f"    no barge-in: the pause was taken back ({b.resumed}); the reply played on from where the ear stopped")
        elif phone:
            clear = "no clear" if b.clear_after_fence_ms is None else f"clear {b.clear_after_fence_ms:+.0f} ms after the fence"
            played = "n/a" if b.played_ms_at_ear is None else f"{b.played_ms_at_ear:.0f} ms"
            counted = "n/a" if b.server_played_ms is None else f"{b.server_played_ms} ms"
            lines.append(f"    {clear}; the ear played {played} of the reply, the server counted {counted} by marks")
            if b.server_heard is not None:
                lines.append(f"    heard (history keeps): {b.server_heard!r}")
    for ev in result.events:
        if ev.get("type") == "session.draining":
            lines.append(f"  the server drains ({ev.get('reason')}): the session may go on {ev.get('left_s')} s, then it ends")
    if out:
        lines.append(f"  heard audio: {out} ({result.received_audio_ms / 1000:.1f} s)")
    if phone or device:
        if phone:
            lines.insert(0, f"phone call ({result.transport} media stream)")
        else:
            d = result.transport_info
            mode = "push-to-talk" if d.get("mode") == "manual" else f"{d.get('mode')} mode"
            lines.insert(0, f"device call (xiaozhi-esp32 protocol v{d.get('protocol_version')}, {mode}, "
                            f"downlink Opus {d.get('downlink_rate')} Hz, {d.get('downlink_frame_ms')} ms packets)")
        for e in result.protocol_errors:
            lines.append(f"  PROTOCOL ERROR from the server: {e}")
    if result.timed_out:
        lines.append("  TIMED OUT before the last turn ended")
    if result.server_hung_up:
        lines.append("  the server ended the call before the last turn ended")
    return "\n".join(lines)


def _ms(v: float | None, signed: bool = False) -> str:
    return "n/a" if v is None else (f"{v:+.0f} ms" if signed else f"{v:.0f} ms")


def _device_lines(b: BargeInMeasure) -> list[str]:
    """A device call's interruption: stop times measured at the device."""
    what = {"abort": "abort pressed", "ptt": "push-to-talk pressed", "voice": "voice barge-in"}.get(b.initiator or "", "barge-in")
    speaking = "" if b.speaking_at_onset else " (the agent was already silent)"
    label = f" {b.label}" if b.label and b.initiator != "abort" else ""
    out = [f"  {what}{label} at +{b.at_s:.2f} s: silent at the device after {_ms(b.stop_ms)}{speaking}; "
           f"tts stop after {_ms(b.tts_stop_ms)}; last old audio received after {_ms(b.received_stop_ms)}"]
    extra = [f"old audio after tts stop {_ms(b.old_audio_after_tts_stop_ms)}"]
    if b.server_onset_to_fence_ms is not None:
        extra.append(f"server onset->fence {_ms(b.server_onset_to_fence_ms)}")
    counted = "" if b.server_played_ms is None else f", the server counted {b.server_played_ms} ms"
    extra.append(f"the device played {_ms(b.played_ms_at_ear)} of the reply{counted}")
    out.append("    " + "; ".join(extra))
    if b.server_heard is not None:
        out.append(f"    heard (history keeps): {b.server_heard!r}")
    return out
