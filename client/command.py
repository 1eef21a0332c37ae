"""The ``turnkeeper call`` command: the headless client as a tool beside the
server (``web/cli.py`` loads it only for that command)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from aiohttp import web

from client.call import CallClient
from client.results import CallResult, Utterance
from media.frames import PLAYOUT_RATE, load_pcm
from web.app import create_app
from web.settings import Settings


async def run_call(args: argparse.Namespace, settings: Settings) -> int:
    """``turnkeeper call``: call a server (or one started here with
    ``--local``) with ``args.wav`` as the microphone, interrupt with
    ``args.barge_in`` ``args.at`` seconds after the agent starts talking,
    write what was heard to ``args.out`` and print the timeline (or JSON).
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
    if args.barge_in:
        barge_ins.append(Utterance(pcm=load_pcm(args.barge_in, PLAYOUT_RATE), at_s=args.at, label=Path(args.barge_in).name))
    runner: web.AppRunner | None = None
    tmp = tempfile.TemporaryDirectory(prefix="turnkeeper-call-")
    try:
        if args.local:
            store = args.store or f"sqlite:///{tmp.name}/turnkeeper.db"
            runner = web.AppRunner(create_app(settings.model_copy(update={"store": store})), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            url = f"http://127.0.0.1:{port}"
        else:
            url = args.server
        client = CallClient(url)
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
        lines.append(f"    states: {' -> '.join(t.states)}")
    for b in result.barge_ins:
        stop = "n/a" if b.stop_ms is None else f"{b.stop_ms:.0f} ms"
        fence = "n/a" if b.server_onset_to_fence_ms is None else f"{b.server_onset_to_fence_ms:.0f} ms"
        speaking = "" if b.speaking_at_onset else " (agent was already silent at onset)"
        lines.append(
            f"  barge-in {b.label} at +{b.at_s:.2f} s: audible stop {stop}{speaking}; server onset->fence {fence}"
        )
    if out:
        lines.append(f"  heard audio: {out} ({result.received_audio_ms / 1000:.1f} s)")
    if result.timed_out:
        lines.append("  TIMED OUT before the last turn ended")
    if result.server_hung_up:
        lines.append("  the server ended the call before the last turn ended")
    return "\n".join(lines)
