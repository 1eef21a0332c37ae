"""Shared fixtures: virtual clock, stores, speech made with espeak-ng, a live
server on loopback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from clock import VirtualClock
from turn.conformance import CONFORMANCE
from turn.redis_store import RedisStore
from turn.sqlite_store import SqliteStore

ALSA_SOUNDS = Path("/usr/share/sounds/alsa")

#: Phrases the tests say; the grammar makes pocketsphinx exact on them
#: (the tests that use pocketsphinx, and the providers' fakes: see GRAMMAR).
TEST_PHRASES = [
    "tell me a story",
    "what is the weather like today",
    "count to twenty",
    "front center",
    "front left",
    "front right",
    "rear center",
    "hello there",
    "please order a coffee",
    "charge my card",
    # a sentence split by a pause (the continuation tests)
    "what is the weather",
    "like in paris today",
    "make it a large one",
    # backchannels (words of pocketsphinx's dictionary)
    "uh huh",
    "mhm",
    "yeah",
    "okay",
    "right",
]

def plain(text: str) -> str:
    """A transcript as the tests compare it: lower case, no punctuation,
    hyphens as spaces, numbers written as words ("Count to 20." -> "count
    to twenty"; :func:`recognition_corpus.normalise`). Whisper writes
    sentences; the tests' phrases are words."""
    from recognition_corpus import normalise

    return normalise(text)


GRAMMAR = "#JSGF V1.0;\ngrammar turnkeeper_test;\npublic <utt> = " + " | ".join(TEST_PHRASES) + ";\n"


#: Every event emitted in any test must match the event catalogue: the check
#: raises at the emitter, and the fixture below fails the test even where the
#: emitter's caller swallowed that (turn.conformance).
CONFORMANCE.strict = True


@pytest.fixture(autouse=True)
def events_match_the_catalogue() -> Iterator[None]:
    CONFORMANCE.seen.clear()
    yield
    seen, CONFORMANCE.seen[:] = list(CONFORMANCE.seen), []
    if seen:
        pytest.fail("events not in the catalogue (turn/event_catalogue.py):\n" + "\n".join(seen[:20]), pytrace=False)


def have(cmd: str) -> bool:
    return shutil.which(cmd) is not None


requires_espeak = pytest.mark.skipif(not have("espeak-ng"), reason="espeak-ng is not installed")


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = SqliteStore(tmp_path / "var" / "turns.db")
    await s.open()
    yield s
    await s.close()


@pytest.fixture(scope="session")
def speech_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("speech")


@pytest.fixture(scope="session")
def say(speech_dir: Path) -> Callable[..., Path]:
    """``say(text, voice="en-us", wpm=140) -> Path`` of a WAV spoken by espeak-ng
    (22.05 kHz mono), cached per session."""

    def _say(text: str, voice: str = "en-us", wpm: int = 140) -> Path:
        if not have("espeak-ng"):
            pytest.skip("espeak-ng is not installed")
        name = f"{voice}-{wpm}-" + "".join(c if c.isalnum() else "_" for c in text)[:60] + ".wav"
        path = speech_dir / name
        if not path.exists():
            subprocess.run(["espeak-ng", "-v", voice, "-s", str(wpm), "-w", str(path), text], check=True)
        return path

    return _say


@pytest.fixture(scope="session")
def grammar_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("grammar") / "test.gram"
    path.write_text(GRAMMAR)
    return path


@pytest.fixture
def alsa_wav() -> Callable[[str], Path]:
    def _get(name: str) -> Path:
        path = ALSA_SOUNDS / name
        if not path.exists():
            pytest.skip(f"{path} missing (Debian package alsa-utils)")
        return path

    return _get


async def start_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """Run ``app`` on a free loopback port; returns (runner, base URL)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis: ``$TEST_REDIS_URL`` if set (CI starts one), otherwise a
    redis-server (Debian package) started here on a free loopback port with
    AOF on, and stopped at the end."""
    url = os.environ.get("TEST_REDIS_URL")
    if url:
        yield url
        return
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (make test installs it)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--appendonly", "yes", "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.fixture
async def redis_store(redis_url: str) -> AsyncIterator[RedisStore]:
    s = RedisStore(redis_url, prefix=f"t{uuid.uuid4().hex[:10]}")
    await s.open()
    yield s
    await s.close()


@pytest.fixture(params=["sqlite", "redis"])
async def any_store(request: pytest.FixtureRequest, tmp_path: Path, redis_url: str) -> AsyncIterator[SqliteStore | RedisStore]:
    """Each store implementation in turn, for the contract suite."""
    if request.param == "sqlite":
        s: SqliteStore | RedisStore = SqliteStore(tmp_path / "var" / "contract.db")
    else:
        s = RedisStore(redis_url, prefix=f"t{uuid.uuid4().hex[:10]}")
    await s.open()
    yield s
    await s.close()


def _pool_workers() -> list[tuple[int, str]]:
    """This process's children that are multiprocessing pool workers (the
    speech recogniser's), as (pid, cmdline)."""
    me = os.getpid()
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != me or fields[0] == "Z":
                continue
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmd:
            out.append((int(stat.parent.name), cmd[:120]))
    return out


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """The suite leaves no process behind: every recogniser worker a test
    started (through a server it ran in this process) has ended within a
    few seconds of the last test (torn down last of the session's
    fixtures); one that has not is an error of the run, in every xdist
    worker too."""
    yield
    left = _pool_workers()
    for _ in range(50):
        if not left:
            return
        time.sleep(0.1)
        left = _pool_workers()
    pytest.fail(f"processes left behind by the tests: {left}", pytrace=False)


@pytest.fixture
async def playwright():  # type: ignore[no-untyped-def]
    """Playwright, for the browser tests (Debian's Chromium; never a download)."""
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        yield p
