"""A turnkeeper server for a benchmark: its own process on a free loopback
port, a temporary SQLite store, the embedded defaults (Whisper hears free
form: no grammar), logs at WARNING and its stdout discarded (so a bench's
``--json`` prints one object). Tooling for bench/, not part of the product."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """Poll ``url``/healthz until it answers 200.

    Raises:
        RuntimeError: the process exited, or no 200 within ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with http.get(f"{url}/healthz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("server did not become healthy")


@asynccontextmanager
async def server(
    prefix: str = "tk-bench-", env: dict[str, str] | None = None, log_path: Path | None = None
) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start the server (``env``: more environment, e.g. settings; its
    own embedded store unless ``env`` names one); yield
    (base URL, process); terminate it on exit (killed if it has not exited
    10 s later). ``log_path``: write its stdout and log (stderr) to this
    file instead of discarding stdout and passing stderr through.

    Raises:
        RuntimeError: it exited or was not healthy within 30 s.
    """
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        d = Path(tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "TURNKEEPER_STORE": f"sqlite:///{d}/bench.db",
            "TURNKEEPER_LOG_LEVEL": "WARNING",
            **(env or {}),  # e.g. a Redis store for a fleet
            "PYTHONPATH": str(ROOT),
        }
        out = log_path.open("ab") if log_path is not None else None
        try:  # a file, not a pipe: a chatty server never blocks on it
            proc = subprocess.Popen([sys.executable, "-m", "web.cli", "serve", "--port", str(port)], env=env, cwd=d,
                                    stdout=out or subprocess.DEVNULL, stderr=out)
        finally:
            if out is not None:
                out.close()
        try:
            await wait_healthy(url, proc)
            yield url, proc
        finally:
            stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10) -> None:
    """Terminate ``proc`` if it still runs; kill it if it has not exited
    ``timeout_s`` seconds later, and reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the server and its recogniser workers), from /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def tree_usage(pid: int) -> tuple[float, float]:
    """CPU seconds used so far (user + system) and resident MB now, summed
    over ``pid``'s process tree: each process's own and that of its
    children it has reaped (proc(5) cutime, cstime: an espeak-ng run that
    ended in the window counts; a process gone unreaped meanwhile counts 0)."""
    ticks, rss_kb = 0, 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            # utime, stime, cutime, cstime (fields 14-17 of proc(5))
            ticks += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
            with open(f"/proc/{p}/status") as f:
                rss_kb += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return ticks / os.sysconf("SC_CLK_TCK"), rss_kb / 1024
