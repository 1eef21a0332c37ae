"""End to end: the real server on loopback, driven over WebRTC by the aiortc
client with real speech (espeak-ng and the alsa-utils human recordings)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp import web
from conftest import plain, requires_espeak, start_app

from client.call import CallClient
from client.results import Utterance
from media.frames import PLAYOUT_RATE, load_pcm
from turn.models import StopReasonKind, TurnStatus
from web.app import MANAGER, PEERS, create_app
from web.peer import PeerSession
from web.settings import Settings

pytestmark = [pytest.mark.e2e, requires_espeak]
TOKEN = "tok-default-0123456789"


class Server:
    def __init__(self, app: web.Application, url: str) -> None:
        self.app = app
        self.url = url
        self.seen: dict[str, PeerSession] = {}

    async def watch(self) -> None:
        """Keep a reference to every session, to audit it after it closed."""
        while True:
            self.seen.update(self.app[PEERS])
            await asyncio.sleep(0.01)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    app = create_app(
        Settings(store=f"sqlite:///{tmp_path}/var/t.db", api_tokens=f"default:{TOKEN}")
    )
    runner, url = await start_app(app)
    srv = Server(app, url)
    watcher = asyncio.create_task(srv.watch())
    yield srv
    watcher.cancel()
    await runner.cleanup()


def utt(path: Path, at_s: float | None = None) -> Utterance:
    return Utterance(pcm=load_pcm(path, PLAYOUT_RATE), at_s=at_s, label=path.name)


async def test_barge_in_mid_answer(server: Server, say: Callable[..., Path], tmp_path: Path) -> None:
    client = CallClient(server.url, token=TOKEN)
    out = tmp_path / "heard.wav"
    result = await client.run(
        utt(say("tell me a story")), [utt(say("what is the weather like today"), at_s=1.0)], out_wav=out, timeout_s=60
    )
    assert not result.timed_out
    old, new = result.turns
    # the old turn: stopping, then cancelled, for barge_in
    assert plain(old.transcript) == "tell me a story"
    assert old.states == ["QUEUED", "RUNNING", "CANCEL_REQUESTED", "CANCELLED"]
    assert old.status == "CANCELLED" and old.stop_reason == "barge_in"
    # what was heard of the story in about a second (its first clause,
    # "Once upon a time,", goes to TTS on its own: the cut falls inside it)
    assert old.reply.startswith("Once upon a")
    # the new turn gets its answer
    assert plain(new.transcript) == "what is the weather like today"
    assert new.status == "COMPLETED" and "sunny" in new.reply
    assert new.generation == old.generation + 1
    # the client heard the agent, and a measured stop
    [barge] = result.barge_ins
    assert barge.stop_ms is not None and barge.stop_ms < 2000  # sanity bound only; bench/ measures
    assert barge.server_onset_to_fence_ms is not None
    assert out.stat().st_size > PLAYOUT_RATE * 2  # more than a second of audio
    # server side: nothing of the old generation left after the fence
    [peer] = server.seen.values()
    fenced_at = peer.fence.fenced_at(old.generation)
    sent_old = peer.transport.outbound.audit.per_generation[old.generation]
    assert fenced_at is not None and sent_old.frames > 0
    assert sent_old.last_sent_at is not None and sent_old.last_sent_at <= fenced_at
    assert peer.transport.outbound.audit.per_generation[new.generation].frames > 50
    # audio segments were logged and delivered: the new turn's start and end
    kinds = [(e["type"], e["generation"]) for e in result.events if e["type"].startswith("audio.")]
    assert ("audio.start", old.generation) in kinds
    assert ("audio.start", new.generation) in kinds and ("audio.end", new.generation) in kinds
    seqs = [e["seq"] for e in result.events if "seq" in e]
    assert seqs == sorted(seqs) and len(seqs) == len(set(seqs))  # the log's order, nothing twice
    # and the store agrees
    stored = await server.app[MANAGER].store.list_session(result.session_id)
    assert [t.status for t in stored] == [TurnStatus.CANCELLED, TurnStatus.COMPLETED]
    assert stored[0].stop_reason is not None and stored[0].stop_reason.kind is StopReasonKind.BARGE_IN
    # everything is freed once the peer hung up
    for _ in range(100):
        if not server.app[PEERS]:
            break
        await asyncio.sleep(0.05)
    assert server.app[PEERS] == {}
    assert not peer.agent.providers.tts.tts.running  # type: ignore[attr-defined]


async def test_human_voice_gets_an_answer(server: Server, alsa_wav: Callable[[str], Path]) -> None:
    result = await CallClient(server.url, token=TOKEN).run(utt(alsa_wav("Front_Center.wav")), timeout_s=40)
    assert not result.timed_out
    # "front ... center": a reply started speculatively at the pause between
    # the words may be taken back (speculation_withdrawn: the client keeps
    # those apart); one turn answers
    [turn] = result.turns
    assert all(t.status == "CANCELLED" and t.stop_reason == "speculation_withdrawn" for t in result.withdrawn)
    assert plain(turn.transcript) == "front center"
    assert turn.status == "COMPLETED" and turn.reply == f"You said: {turn.transcript}."
    assert result.received_audio_ms > 0
    [peer] = server.seen.values()
    assert peer.transport.outbound.audit.per_generation[turn.generation].frames > 25  # about a second of speech


async def test_cli_call_local_json(say: Callable[..., Path], tmp_path: Path) -> None:
    """The main job as a newcomer runs it: `turnkeeper call --local ... --json`."""
    env = dict(os.environ)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "web.cli", "call", "--local",
        "--wav", str(say("tell me a story")),
        "--barge-in", str(say("please count to twenty")), "--at", "0.8",
        "--out", str(tmp_path / "heard.wav"), "--json",
        cwd=tmp_path, env={**env, "PYTHONPATH": str(Path(__file__).parents[2])},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, stderr.decode()
    out = json.loads(stdout)
    turns = out["turns"]
    assert [t["state"] for t in turns] == ["CANCELLED", "COMPLETED"]
    assert turns[0]["stop_reason"] == "barge_in"
    assert turns[1]["reply"].startswith("One, two, three")
    assert out["barge_ins"][0]["stop_ms"] is not None
    assert (tmp_path / "heard.wav").exists()
    assert not (tmp_path / "var").exists()  # --local keeps its store out of the way of a server running here


async def test_server_shutdown_mid_answer(tmp_path: Path, say: Callable[..., Path]) -> None:
    """Shutting the server down mid-answer stops the turn with worker_shutdown,
    the client is told so before the connection goes, and nothing is left."""
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/var/t.db"))
    runner, url = await start_app(app)
    client = CallClient(url)
    call = asyncio.create_task(client.run(utt(say("tell me a story")), [], timeout_s=60))
    try:
        async with asyncio.timeout(30):
            while not any(e.get("phase") == "speaking" for e in client._events):
                await asyncio.sleep(0.05)
        [peer] = app[PEERS].values()
        session_id = peer.id
        store = app[MANAGER].store
    finally:
        t0 = asyncio.get_running_loop().time()
        await runner.shutdown()
    result = await asyncio.wait_for(call, 20)
    assert asyncio.get_running_loop().time() - t0 < 15
    [turn] = result.turns
    assert turn.states[-2:] == ["CANCEL_REQUESTED", "CANCELLED"]
    assert turn.stop_reason == "worker_shutdown"
    [stored] = await store.list_session(session_id)
    assert stored.status is TurnStatus.CANCELLED
    assert stored.stop_reason is not None and stored.stop_reason.kind is StopReasonKind.WORKER_SHUTDOWN
    assert app[PEERS] == {}
    await runner.cleanup()


async def test_rest_stop_silences_a_voice_turn(server: Server, say: Callable[..., Path]) -> None:
    """A stop asked over the REST API (any instance could take it) reaches the
    voice session: the agent goes silent and the turn ends user_cancel."""
    import aiohttp

    client = CallClient(server.url, token=TOKEN)
    call = asyncio.create_task(client.run(utt(say("tell me a story")), [], timeout_s=60))
    async with asyncio.timeout(30):
        while not any(e.get("phase") == "speaking" for e in client._events):
            await asyncio.sleep(0.05)
    [turn_id] = {e["turn_id"] for e in client._events if e["type"] == "turn"}
    [peer] = server.seen.values()
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{server.url}/v1/turns/{turn_id}/stop",
            headers={"Authorization": f"Bearer {TOKEN}", "Idempotency-Key": "stop-voice"},
            json={"reason": "user_cancel", "detail": "pressed Stop"},
        ) as r:
            assert r.status == 202 and (await r.json())["answer"] == "accepted"
    result = await asyncio.wait_for(call, 30)
    [turn] = result.turns
    assert turn.states[-2:] == ["CANCEL_REQUESTED", "CANCELLED"] and turn.stop_reason == "user_cancel"
    stored = await server.app[MANAGER].get(turn_id)
    assert stored.stop_reason is not None and stored.stop_reason.detail == "pressed Stop"
    assert stored.terminal_at is not None
    # the audio stopped within a sanity bound of the stop request (the stop
    # may even land before the first frame went out)
    sent = peer.transport.outbound.audit.per_generation.get(turn.generation)
    assert sent is None or sent.frames < 25 * 50  # far less than the whole story (about a minute)
