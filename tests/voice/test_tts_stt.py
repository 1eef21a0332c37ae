"""espeak-ng TTS and pocketsphinx STT, for real."""

from __future__ import annotations

import asyncio
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import requires_espeak

from media.frames import VAD_RATE, load_pcm, rms_dbfs
from voice.pocketsphinx_stt import PocketsphinxConfig, PocketsphinxSTT
from voice.recognition import SttError
from voice.tts import EspeakConfig, EspeakTTS, TtsError, _read_wav_header


@requires_espeak
async def test_tts_streams_48k_pcm() -> None:
    tts = EspeakTTS()
    chunks: list[bytes] = []
    await tts.synthesize("Hello there. This is a test.", chunks.append)
    pcm = b"".join(chunks)
    seconds = len(pcm) / 2 / tts.sample_rate
    assert 1.0 < seconds < 5.0
    assert rms_dbfs(pcm) > -40
    assert len(chunks) > 1  # streamed, not one blob
    assert not tts.running


@requires_espeak
async def test_tts_empty_text_is_silent() -> None:
    chunks: list[bytes] = []
    await EspeakTTS().synthesize("   ", chunks.append)
    assert chunks == []


async def speaking(tts: EspeakTTS) -> tuple[asyncio.Task[None], list[asyncio.subprocess.Process]]:
    """A long synthesis, running: its task, and espeak-ng's process once the
    first audio came out."""
    first = asyncio.Event()
    procs: list[asyncio.subprocess.Process] = []

    def sink(pcm: bytes) -> None:
        if not first.is_set():
            procs.extend(tts.running)
            first.set()

    task = asyncio.create_task(tts.synthesize("word " * 400, sink))
    await asyncio.wait_for(first.wait(), 10)
    return task, procs


@requires_espeak
async def test_tts_cancel_kills_the_subprocess() -> None:
    tts = EspeakTTS(EspeakConfig(words_per_minute=80))
    task, procs = await speaking(tts)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert procs and all(p.returncode is not None for p in procs)
    assert not tts.running


async def test_tts_cancel_with_a_full_stdout_buffer_does_not_hang(tmp_path: Path) -> None:
    """Cancelled while its stdout reader is paused on a full buffer, the
    synthesis still reaps the process and ends. A bare ``wait()`` hung here:
    asyncio wakes it only once every pipe is closed, and a paused pipe never
    reads its EOF."""
    fake = tmp_path / "flood-espeak"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import fcntl, struct, sys\n"
        "out = sys.stdout.buffer\n"
        "fcntl.fcntl(out.fileno(), 1031, 1 << 20)  # F_SETPIPE_SZ: one read can overfill the reader\n"
        "fmt = struct.pack('<HHIIHH', 1, 1, 22050, 44100, 2, 16)\n"
        "out.write(b'RIFF' + struct.pack('<I', 0xFFFFFFFF) + b'WAVE' + b'fmt ' + struct.pack('<I', 16) + fmt\n"
        "          + b'data' + struct.pack('<I', 0xFFFFFFFF))\n"
        "block = bytes(range(256)) * 256\n"
        "while True:\n"
        "    out.write(block)\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    tts = EspeakTTS(EspeakConfig(executable=str(fake)))
    procs: list[asyncio.subprocess.Process] = []
    cancelled = asyncio.Event()

    def sink(pcm: bytes) -> None:
        if not procs:
            procs.extend(tts.running)
            time.sleep(0.3)  # a stalled loop: the flood fills the pipe meanwhile
            # Cancelled before the next read: the pipe's next (256 KiB) read
            # lands in a reader nobody reads any more, which pauses it.
            asyncio.get_running_loop().call_soon(task.cancel)
            asyncio.get_running_loop().call_soon(cancelled.set)

    task = asyncio.create_task(tts.synthesize("hello", sink))
    await asyncio.wait_for(cancelled.wait(), 10)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert procs and all(p.returncode is not None for p in procs)
    assert not tts.running


@requires_espeak
async def test_tts_cancelled_twice_still_reaps_before_it_ends() -> None:
    """A second cancel (a scope's grace running out) while the killed
    process is being reaped does not leave it behind: the task ends only
    once the process is reaped, and still ends cancelled."""
    tts = EspeakTTS(EspeakConfig(words_per_minute=80))
    task, procs = await speaking(tts)
    task.cancel()
    for _ in range(3):
        await asyncio.sleep(0)
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert procs and all(p.returncode is not None for p in procs)
    assert not tts.running


async def test_tts_missing_binary() -> None:
    with pytest.raises(TtsError, match="not found"):
        await EspeakTTS(EspeakConfig(executable="/nonexistent/espeak-ng")).synthesize("hi", lambda b: None)


async def test_tts_failing_binary(tmp_path: Path) -> None:
    fake = tmp_path / "fake-espeak"
    fake.write_text("#!/bin/sh\necho 'voice not found' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(TtsError):
        await EspeakTTS(EspeakConfig(executable=str(fake))).synthesize("hi", lambda b: None)


@pytest.mark.parametrize(
    "data",
    [b"", b"NOTAWAVEFILE", b"RIFF\x00\x00\x00\x00WAVEdata\x00\x00\x00\x00",
     b"RIFF\x00\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x02\x00\x22\x56\x00\x00\x88\x58\x01\x00\x04\x00\x10\x00"],
)
async def test_bad_wav_headers(data: bytes) -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    with pytest.raises(TtsError):
        await _read_wav_header(reader)


async def recognise(stt: PocketsphinxSTT, pcm: bytes) -> str:
    stream = stt.open_stream()
    for i in range(0, len(pcm), 640):
        stream.feed(pcm[i : i + 640])
    return await stream.finish()


async def test_stt_with_grammar_is_exact(say: Callable[..., Path], grammar_file: Path) -> None:
    stt = PocketsphinxSTT(PocketsphinxConfig(grammar=grammar_file))
    await stt.start()
    try:
        for phrase in ("what is the weather like today", "tell me a story", "count to twenty"):
            assert await recognise(stt, load_pcm(say(phrase), VAD_RATE)) == phrase
    finally:
        await stt.aclose()


async def test_stt_free_form_on_human_voice(alsa_wav: Callable[[str], Path]) -> None:
    stt = PocketsphinxSTT()
    try:
        text = await recognise(stt, load_pcm(alsa_wav("Front_Center.wav"), VAD_RATE))
        assert "front" in text or "center" in text
        assert await recognise(stt, bytes(640 * 50)) == ""
    finally:
        await stt.aclose()


async def test_stt_abandon_and_errors(grammar_file: Path, tmp_path: Path) -> None:
    stt = PocketsphinxSTT(PocketsphinxConfig(grammar=grammar_file))
    s = stt.open_stream()
    s.feed(bytes(6400))
    await s.aclose()
    await s.aclose()
    with pytest.raises(RuntimeError):
        await s.finish()
    s2 = stt.open_stream()  # the decoder is usable after an abandoned utterance
    assert await s2.finish() == ""
    assert stt.decoders == 1
    await stt.aclose()
    with pytest.raises(RuntimeError):
        stt.open_stream()
    bad = PocketsphinxSTT(PocketsphinxConfig(grammar=tmp_path / "missing.gram"))
    with pytest.raises(FileNotFoundError):
        await bad.start()
    assert bad.decoders == 0  # a decoder that failed to load is not kept
    await bad.aclose()


async def test_stt_overlapping_utterances_do_not_share_a_decoder(
    say: Callable[..., Path], grammar_file: Path
) -> None:
    """An utterance still open (its turn not yet finished) while the next one
    starts: each must get its own decoder or wait, never share one (sharing
    crashed pocketsphinx)."""
    stt = PocketsphinxSTT(PocketsphinxConfig(grammar=grammar_file, max_decoders=1))
    try:
        story = load_pcm(say("tell me a story"), VAD_RATE)
        weather = load_pcm(say("what is the weather like today"), VAD_RATE)
        a = stt.open_stream()
        for i in range(0, len(story), 640):
            a.feed(story[i : i + 640])
        b = stt.open_stream()  # waits: the only decoder is held by a
        for i in range(0, len(weather), 640):
            b.feed(weather[i : i + 640])
        await asyncio.sleep(0.2)
        await a.aclose()  # a is abandoned late, after b began
        assert await b.finish() == "what is the weather like today"
        c = stt.open_stream()
        for i in range(0, len(story), 640):
            c.feed(story[i : i + 640])
        assert await c.finish() == "tell me a story"
        assert stt.decoders == 1
    finally:
        await stt.aclose()


async def test_stt_pool_runs_utterances_side_by_side(say: Callable[..., Path], grammar_file: Path) -> None:
    stt = PocketsphinxSTT(PocketsphinxConfig(grammar=grammar_file, max_decoders=2))
    try:
        phrases = ["tell me a story", "count to twenty"]
        streams = [stt.open_stream() for _ in phrases]
        for s, p in zip(streams, phrases, strict=True):
            pcm = load_pcm(say(p), VAD_RATE)
            for i in range(0, len(pcm), 640):
                s.feed(pcm[i : i + 640])
        assert await asyncio.gather(*(s.finish() for s in streams)) == phrases
        assert stt.decoders == 2
    finally:
        await stt.aclose()


async def test_stt_cancelled_finish_gives_the_decoder_back(say: Callable[..., Path], grammar_file: Path) -> None:
    stt = PocketsphinxSTT(PocketsphinxConfig(grammar=grammar_file, max_decoders=1))
    try:
        s = stt.open_stream()
        s.feed(load_pcm(say("tell me a story"), VAD_RATE))
        task = asyncio.create_task(s.finish())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        s2 = stt.open_stream()
        s2.feed(load_pcm(say("count to twenty"), VAD_RATE))
        assert await asyncio.wait_for(s2.finish(), 10) == "count to twenty"
    finally:
        await stt.aclose()


async def test_recognition_never_stalls_the_event_loop(say: Callable[..., Path]) -> None:
    """pocketsphinx holds the GIL while loading and decoding; in-process that
    froze audio pacing for hundreds of ms. Workers are processes, so the loop
    keeps ticking (the bound is a generous sanity bound, not a benchmark)."""
    import time

    pcm = load_pcm(say("what is the weather like today"), VAD_RATE) * 3
    worst = 0.0
    done = asyncio.Event()

    async def monitor() -> None:
        nonlocal worst
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            worst = max(worst, time.perf_counter() - t - 0.005)

    mon = asyncio.create_task(monitor())
    stt = PocketsphinxSTT(PocketsphinxConfig(max_decoders=2))
    try:
        await stt.start()  # loads two models
        streams = [stt.open_stream() for _ in range(2)]
        for i in range(0, len(pcm), 640):
            for s in streams:
                s.feed(pcm[i : i + 640])
        texts = await asyncio.gather(*(s.finish() for s in streams))
        assert all("weather" in t for t in texts)
    finally:
        done.set()
        await mon
        await stt.aclose()
    assert worst < 0.15, f"event loop stalled {worst * 1000:.0f} ms"


async def test_a_dead_worker_is_replaced(say: Callable[..., Path], grammar_file: Path) -> None:
    import os
    import signal

    stt = PocketsphinxSTT(PocketsphinxConfig(grammar=grammar_file, max_decoders=1))
    try:
        await stt.start()
        [dec] = stt.pool._all
        s = stt.open_stream()
        await asyncio.sleep(0.1)
        for pid in list(dec.executor._processes):  # kill the worker mid-utterance
            os.kill(pid, signal.SIGKILL)
        s.feed(load_pcm(say("tell me a story"), VAD_RATE))
        with pytest.raises(SttError):
            await s.finish()
        s2 = stt.open_stream()  # a fresh worker takes over
        s2.feed(load_pcm(say("count to twenty"), VAD_RATE))
        assert await asyncio.wait_for(s2.finish(), 20) == "count to twenty"
    finally:
        await stt.aclose()
