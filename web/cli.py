"""The ``turnkeeper`` command.

    turnkeeper serve [--host H] [--port P] [--config FILE]
    turnkeeper call (--server URL | --local) --wav FILE [--phone twilio|telnyx]
                    [--barge-in FILE --at SECONDS] [--out FILE] [--json]
    turnkeeper call (--device WS_URL | --local --device) --wav FILE [--ptt | --realtime]
                    [--barge-in FILE --at SECONDS] [--abort-at SECONDS] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from aiohttp import web

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
    where = call.add_mutually_exclusive_group()
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
    call.add_argument(
        "--phone", choices=["twilio", "telnyx"],
        help="call as a phone through the telephony bridge (a simulated Twilio or Telnyx media stream) instead of WebRTC",
    )
    call.add_argument("--keys", help="with --phone: press these telephone keys (e.g. 12#) --at seconds after the agent starts talking")
    call.add_argument(
        "--token",
        help="with --phone or --device: a bearer token of the call's tenant, to read its events (default $TURNKEEPER_TOKEN)",
    )
    call.add_argument(
        "--device", nargs="?", const="", metavar="WS_URL",
        help="call as a push-to-talk device (a simulated xiaozhi-esp32 board) at WS_URL, e.g. "
             "ws://127.0.0.1:8080/v1/devices/ws; with --local, no URL",
    )
    mode = call.add_mutually_exclusive_group()
    mode.add_argument("--ptt", action="store_true", help="with --device: hold the button while speaking (the default)")
    mode.add_argument("--realtime", action="store_true", help="with --device: the microphone stays open; barge in by voice")
    call.add_argument("--abort-at", type=float, help="with --device: press abort this many seconds after the agent starts talking")
    call.add_argument("--device-token", help="with --device WS_URL: the device's token (default $TURNKEEPER_DEVICE_TOKEN)")
    call.add_argument("--protocol-version", type=int, choices=[1, 2, 3], default=1,
                      help="with --device: the binary protocol version (default 1)")

    args = parser.parse_args(argv)
    if args.command == "call":
        if not (args.server or args.local or args.device):
            parser.error("call: one of --server, --local or --device WS_URL is required")
        if args.device and (args.server or args.local):
            parser.error("call: --device WS_URL calls that server; leave out --server and --local (or give --local --device)")
        if args.device is not None and args.phone:
            parser.error("call: --phone and --device are two different transports; give one")
        if args.device is None and (args.realtime or args.ptt or args.abort_at is not None):
            parser.error("call: --ptt, --realtime and --abort-at go with --device")
    try:
        if args.command == "serve":
            settings = load_settings(args.config, host=args.host, port=args.port)
            _logging(settings)
            return _serve(settings)
        settings = load_settings(args.config, port=0)
        _logging(settings, quiet=True)  # the in-process server's INFO lines would bury the timeline
        # the headless client is a tool beside the server, loaded only for this command
        from client.command import run_call

        return asyncio.run(run_call(args, settings))
    except FileNotFoundError as exc:
        print(f"turnkeeper: file not found: {exc.filename or exc}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as exc:  # CallError is a RuntimeError
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


if __name__ == "__main__":
    sys.exit(main())
