"""A turnkeeper server as a real process (``python -m web.cli serve``),
for the tests that signal or kill it: start, kill (checking its worker
processes do not outlive it), stop."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from conftest import free_port


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, reaped by no one yet, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Server:
    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.env, self.cwd = env, cwd
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        self.log_path = self.cwd / f"server-{self.port}.log"
        with self.log_path.open("ab") as log:  # a file, not a pipe: a chatty server never blocks on it
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "web.cli", "serve", "--port", str(self.port)],
                env=self.env, cwd=self.cwd, stdout=log, stderr=log,
            )
        async with aiohttp.ClientSession() as http:
            for _ in range(300):
                if self.proc.poll() is not None:
                    raise RuntimeError(self.log())
                try:
                    async with http.get(self.url + "/healthz") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError("server did not start")

    def log(self) -> str:
        """What the server printed and logged so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the server; the processes it started (the speech
        recogniser's workers) must not outlive it."""
        assert self.proc is not None
        children = child_pids(self.proc.pid)
        assert children, "the server runs its recogniser in worker processes"
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        for _ in range(100):  # they notice within about half a second
            left = [pid for pid in children if alive(pid)]
            if not left:
                break
            time.sleep(0.1)
        assert left == [], f"processes left behind by the killed server: {left}"


    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
