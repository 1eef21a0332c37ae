"""The ``turnkeeper`` command.

    turnkeeper serve [--host H] [--port P] [--config FILE]
    turnkeeper call (--server URL | --local) --wav FILE
                    [--barge-in FILE --at SECONDS] [--out FILE] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path

from aiohttp import web

from client.call import CallClient
from client.results import CallError, CallResult, Utterance
from media.frames import PLAYOUT_RATE, load_pcm
from web.app import create_app
from web.settings import Settings, load_settings


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = argparse.ArgumentParser(prog="turnkeeper", description="A real-time voice agent server whose Stop really stops.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the server")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="TCP port (default 8080)")
    serve.add_argument("--config", help="TOML settings file (default $TURNKEEPER_CONFIG)")

    call = sub.add_parser("call", help="call a server headlessly with WAV files as the microphone")
    where = call.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", help="server URL, e.g. http://127.0.0.1:8080")
    where.add_argument("--local", action="store_true", help="start a server in this process")
    call.add_argument("--config", help="TOML settings file for --local")
    call.add_argument(
        "--store", help="store URL for --local (default: a temporary SQLite file, so a server running here is never touched)"
    )
    call.add_argument("--wav", required=True, help="what to say first (any audio file)")
    call.add_argument("--barge-in", help="what to interrupt the agent with")
    call.add_argument("--at", type=float, default=1.0, help="seconds after the agent starts talking to interrupt (default 1.0)")
    call.add_argument("--out", default="heard.wav", help="where to write what the client heard (default heard.wav)")
    call.add_argument("--timeout", type=float, default=90.0, help="give up after this many seconds (default 90)")
    call.add_argument("--json", action="store_true", help="print one JSON object instead of the timeline")

    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            settings = load_settings(args.config, host=args.host, port=args.port)
            _logging(settings)
            return _serve(settings)
        settings = load_settings(args.config, port=0)
        _logging(settings, quiet=True)  # the in-process server's INFO lines would bury the timeline
        return asyncio.run(_call(args, settings))
    except FileNotFoundError as exc:
        print(f"turnkeeper: file not found: {exc.filename or exc}", file=sys.stderr)
        return 2
    except (ValueError, CallError, RuntimeError) as exc:
        # ValueError covers pydantic's ValidationError: one line per problem.
        print(f"turnkeeper: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # cannot bind, cannot write
        print(f"turnkeeper: {exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _logging(settings: Settings, quiet: bool = False) -> None:
    logging.basicConfig(
        level=logging.WARNING if quiet else settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aioice").setLevel(logging.WARNING)
    logging.getLogger("aiortc").setLevel(logging.WARNING)


def _serve(settings: Settings) -> int:
    app = create_app(settings)

    def ready(_: str) -> None:  # aiohttp calls this once the socket is bound
        print(f"turnkeeper serving on http://{settings.host}:{settings.port}", flush=True)

    try:
        web.run_app(app, host=settings.host, port=settings.port, print=ready, access_log=None)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}") from exc
    return 0


async def _call(args: argparse.Namespace, settings: Settings) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
