"""The ``turnkeeper`` command.

    turnkeeper serve [--host H] [--port P] [--config FILE] [--insecure]
    turnkeeper drain [--server URL] [--config FILE] [--wait [--timeout S]]
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

import aiohttp
from pydantic import ValidationError

from web.serve import serve
from web.settings import Settings, load_settings


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = argparse.ArgumentParser(prog="turnkeeper", description="A real-time voice agent server whose Stop really stops.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve_ = sub.add_parser("serve", help="run the server")
    serve_.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve_.add_argument("--port", type=int, help="TCP port (default 8080)")
    serve_.add_argument("--config", help="TOML settings file (default $TURNKEEPER_CONFIG)")
    serve_.add_argument("--insecure", action="store_true",
                        help="listen beyond loopback without API tokens: anyone who reaches it talks to the agent")

    drain_ = sub.add_parser("drain", help="make a running server drain and exit (a preStop hook)")
    drain_.add_argument("--server", help="server URL (default http://127.0.0.1:<port of the settings>)")
    drain_.add_argument("--config", help="TOML settings file (default $TURNKEEPER_CONFIG): port and admin_token")
    drain_.add_argument("--wait", action="store_true", help="return only once the server has exited (or --timeout)")
    drain_.add_argument("--timeout", type=float, default=60.0, help="with --wait: give up after this many seconds (default 60)")

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
        help="a bearer token of the call's tenant (default $TURNKEEPER_TOKEN): a browser-like call mints a client token "
             "with it (or give a client token ck_... itself); --phone and --device read the call's events with it",
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
    call.add_argument(
        "--echo-cancellation", action=argparse.BooleanOptionalAction, default=True,
        help="WebRTC: the offer declares the microphone's echo canceller on, as the browser page does (default; the "
             "client plays nothing into its microphone); --no-echo-cancellation declares it off",
    )
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
            if args.insecure:
                settings = settings.model_copy(update={"auth": settings.auth.model_copy(update={"insecure": True})})
            _logging(settings)
            return asyncio.run(serve(settings))
        if args.command == "drain":
            settings = load_settings(args.config)
            server = args.server or f"http://127.0.0.1:{settings.port}"
            return asyncio.run(_drain(server, settings.admin_token, args.timeout if args.wait else None))
        settings = load_settings(args.config, port=0)
        _logging(settings, quiet=True)  # the in-process server's INFO lines would bury the timeline
        # the headless client is a tool beside the server, loaded only for this command
        from client.command import run_call

        return asyncio.run(run_call(args, settings))
    except FileNotFoundError as exc:
        print(f"turnkeeper: file not found: {exc.filename or exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        # one line per problem, never the value given: it may be a token
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors())
        print(f"turnkeeper: invalid settings: {problems}", file=sys.stderr)
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


async def _drain(server: str, admin_token: str, wait_s: float | None) -> int:
    """``POST /v1/admin/drain`` on ``server`` and print the answer; with
    ``wait_s``, then wait until the server has exited (its listener gone),
    at most that long. Exit 0 when it drains (and, waiting, exited), 1 otherwise."""
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    base = server.rstrip("/")
    async with aiohttp.ClientSession() as http:
        try:
            async with http.post(f"{base}/v1/admin/drain", headers=headers) as r:
                body, status = await r.text(), r.status
        except aiohttp.ClientError as exc:
            print(f"turnkeeper: cannot reach {server}: {exc}", file=sys.stderr)
            return 1
        if status != 202:
            print(f"turnkeeper: drain refused ({status}): {body}", file=sys.stderr)
            return 1
        print(body)
        if wait_s is None:
            return 0
        loop = asyncio.get_running_loop()
        until = loop.time() + wait_s
        while loop.time() < until:
            try:
                async with http.get(f"{base}/healthz") as r:
                    await r.read()
            except aiohttp.ClientError:
                return 0  # gone: the drain ran and the process exited
            await asyncio.sleep(0.2)
    print(f"turnkeeper: {server} still runs after {wait_s:g} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
