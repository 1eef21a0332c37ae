"""Reply generation: a voice turn's answer, from its transcript through the
agent loop (model and tool calls, :func:`voice.respond.run_agent`) to 20 ms
playout frames, and COMPLETED once every frame was played (:func:`answer`).

Each token is sent to the client (``agent.delta``, or withheld once the turn
is stopped) and fed to a :class:`voice.text.SentenceSplitter`; each sentence
is synthesised on its own, in a ``tts`` child of the turn's cancel scope,
into 48 kHz playout frames tagged with the turn's generation. Each
sentence's first and end sample are recorded in ``TurnHandle.spoken``: the
marks :mod:`voice.heard` cuts the heard text at.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from media.frames import PLAYOUT_RATE, PcmResampler, Reframer, rms_dbfs, samples_per_frame
from media.playout import PlayoutFrame
from turn.event_catalogue import AgentDelta, AgentDone, ToolStarted, Transcript, TtsUsage
from turn.manager import TurnManager
from turn.models import Turn
from turn.scope import TurnScope, mark
from turn.shield import finish_anyway
from voice.providers import LanguageModel, Message
from voice.respond import AgentLoopEvent, run_agent, sink_to
from voice.synthesis import Audio, Restarted, SegmentDone, Synthesiser, SynthesisStream, Words, cancel_and_wait
from voice.text import SentenceSplitter
from voice.tools import Toolbox
from voice.transport import OutputSink
from voice.turn_handle import TurnHandle
from voice.turn_lifecycle import Heard, finish

#: a playout frame quieter than this (dBFS) is a pause, not speech
SILENCE_DBFS = -50.0
#: a reply's synthesis stream is closed within this long, s
CLOSE_S = 2.0


async def answer(
    run: TurnHandle,
    scope: TurnScope,
    turn: Turn,
    *,
    manager: TurnManager,
    llm: LanguageModel,
    tts: Synthesiser,
    tools: Toolbox | None,
    playout: OutputSink,
    history: Callable[[TurnHandle, Turn], Awaitable[list[Message]]],
) -> None:
    """Answer ``run``'s utterance (``turn``: its record) inside its cancel
    scope: the transcript (with the words of the turn it continues, which is
    then marked merged into it), the model's reply on ``history`` spoken
    into ``playout``, and, once every frame was played, the reply recorded
    and the turn COMPLETED in one must-complete step (``agent.done``). An
    utterance with no words fails the turn (``no_speech_recognized``). A
    speculative turn (its utterance ended tentatively) does all of this
    but holds its output and audio, and any side effect, until its end of
    turn is confirmed (:meth:`voice.turn_handle.TurnHandle.confirm`).

    Raises:
        turn.scope.TurnStopped: the turn was stopped.
        Exception: what the recogniser, the model, a tool, TTS or the store raised.
    """
    transcript = await scope.run("stt", run.final_transcript())
    run.note_recognition()  # before the first model request's budget checkpoint
    earlier = await run.earlier_words()
    run.transcript = transcript = " ".join(t for t in (earlier, transcript) if t)
    turn = await manager.record(turn.id, transcript=transcript)
    if run.continues is not None and earlier:
        # its words are this turn's now: no history shows it again
        await manager.record(run.continues.turn_id, merged_into=turn.id)
    run.output(Transcript(turn_id=run.turn_id, generation=run.generation, role="user", text=transcript))
    if not transcript:
        # nothing was said (a silent push-to-talk press, speech the
        # recogniser could not make out): FAILED, told by the turn's own
        # state (error no_speech_recognized); no ``error`` event, which a
        # client shows as something gone wrong
        await manager.fail(turn.id, "no_speech_recognized")
        run.settled = True
        return
    messages = await history(run, turn)
    await generate_reply(run, scope, messages, manager=manager, llm=llm, tts=tts, tools=tools, playout=playout)
    # a speculative reply is held (not played, not delivered) until its end of turn is confirmed
    await run.confirmed.wait()
    await scope.run("playout", playout.wait_empty())
    reply = "".join(run.reply).strip()

    async def played() -> Heard:
        return reply, None  # every frame of it was played

    def done(applied: bool, text: str) -> None:
        run.settled = True  # completed now, or already terminal
        if applied:
            run.output(AgentDone(turn_id=run.turn_id, generation=run.generation, text=text))

    await finish(scope, manager, turn.id, played, done)


async def generate_reply(
    run: TurnHandle,
    scope: TurnScope,
    messages: list[Message],
    *,
    manager: TurnManager,
    llm: LanguageModel,
    tts: Synthesiser,
    tools: Toolbox | None,
    playout: OutputSink,
) -> None:
    """Run the agent loop for ``run`` (model and tool calls, in ``scope``)
    on ``messages`` and speak its answer sentence by sentence; returns when
    every frame is queued for playout.

    Raises:
        turn.scope.TurnStopped: the turn was stopped.
        Exception: what the model, a tool or TTS raised.
    """
    sentences: asyncio.Queue[str | None] = asyncio.Queue()
    splitter = SentenceSplitter()
    speaking = scope.spawn("tts", speak(run, sentences, tts=tts, playout=playout))

    def delivered(token: str) -> None:
        run.reply.append(token)
        run.output(AgentDelta(turn_id=run.turn_id, generation=run.generation, text=token))
        for piece in splitter.feed(token):
            sentences.put_nowait(piece)

    def withheld(token: str) -> None:
        run.output(AgentDelta(turn_id=run.turn_id, generation=run.generation, text=token), withheld=True)

    def on_event(event: AgentLoopEvent) -> None:
        if isinstance(event, ToolStarted) and event.effect != "none":
            run.acted = True  # a read whose result nobody heard does not count
        run.output(event)

    try:
        await run_agent(
            scope=scope,
            manager=manager,
            turn_id=run.turn_id,
            generation=run.generation,
            llm=llm,
            messages=messages,
            toolbox=tools,
            on_token=sink_to(delivered, withheld),
            on_event=on_event,
            # a side effect waits for the end of turn: a speculative turn taken back has done nothing
            before_effect=run.confirmed.wait,
        )
        rest = splitter.flush()
        if rest:
            sentences.put_nowait(rest)
    finally:
        sentences.put_nowait(None)
    await scope.wait(speaking)


async def speak(run: TurnHandle, sentences: asyncio.Queue[str | None], *, tts: Synthesiser, playout: OutputSink) -> None:
    """Speak each clause from ``sentences`` (until None) on one synthesis
    stream of ``tts`` (context ``<turn id>-<generation>``) into 20 ms
    playout frames at 48 kHz tagged with ``run``'s generation, each marked
    audible if louder than ``SILENCE_DBFS``; sets ``run.tts_done`` once all
    are queued. A clause goes to the synthesiser the moment the model has
    produced it, while the earlier ones are still being spoken.

    Records the marks :mod:`voice.heard` cuts the heard text at: each
    finished clause's first and end sample (``run.spoken``), the clause
    still arriving (``run.spoken_open``) and the provider's word timings
    (``run.spoken_words``). Marks ``first_sentence``, ``first_audio`` and
    ``first_queued`` (played: a speculative reply's audio is held until its
    end of turn is confirmed) for the scope's observers. However it ends, the
    stream is cancelled first (the provider told to stop at once: a
    barge-in's fence), then closed, and its usage put on the turn's meter.

    Raises:
        voice.synthesis.SynthesisError: the synthesiser failed and nothing
            was left to take over (``tts.fallback = "none"``).
    """
    reframer = Reframer(PLAYOUT_RATE)
    per_frame = samples_per_frame(PLAYOUT_RATE)
    resamplers: dict[int, PcmResampler] = {}
    position = 0  # samples queued for playout, 48 kHz

    def queued() -> int:
        return position + reframer.pending_bytes // 2

    async def feed() -> None:
        while (sentence := await sentences.get()) is not None:
            mark("first_sentence")  # handed to TTS: its time to first audio starts here
            run.enter("speaking")
            stream.push_text(sentence)
        stream.end_input()

    stream = tts.open(f"{run.turn_id}-{run.generation}")
    feeding = asyncio.ensure_future(feed())
    queued_mark: asyncio.Future[None] | None = None
    try:
        async for event in stream:
            if isinstance(event, Audio):
                pcm = event.pcm
                if event.sample_rate != PLAYOUT_RATE:
                    resampler = resamplers.setdefault(event.sample_rate, PcmResampler(PLAYOUT_RATE))
                    pcm = resampler.pcm(pcm, event.sample_rate)
                if not pcm:
                    continue
                mark("first_audio")  # TTS's first audio of the reply (only the first mark counts)
                if queued_mark is None:
                    # its first frame queued for playout: now, or when a speculative reply is confirmed
                    queued_mark = asyncio.ensure_future(_mark_when_confirmed(run))
                opened = run.spoken_open
                start = opened[0] if opened is not None else queued()
                text = opened[2] if opened is not None else _pending_text(stream)  # looked up once per clause
                for f in reframer.push(pcm):
                    run.play(playout, PlayoutFrame(f, run.generation, position, audible=rms_dbfs(f) > SILENCE_DBFS))
                    position += per_frame
                run.spoken_open = (start, queued(), text)
            elif isinstance(event, Words):
                run.spoken_words.extend(
                    (round(w.start_s * PLAYOUT_RATE), round(w.end_s * PLAYOUT_RATE), w.text)
                    for w in event.words
                )
            elif isinstance(event, Restarted):
                # the clause that was arriving is said again from its start:
                # what came of it before is no mark (nor are its word timings)
                if run.spoken_open is not None:
                    cut = run.spoken_open[0]
                    run.spoken_words = [w for w in run.spoken_words if w[0] < cut]
                run.spoken_open = None
            elif isinstance(event, SegmentDone):
                start = run.spoken_open[0] if run.spoken_open is not None else queued()
                run.spoken.append((start, queued(), event.text))
                run.spoken_open = None
        if feeding.done() and not feeding.cancelled() and feeding.exception() is not None:
            raise feeding.exception()  # type: ignore[misc]
    finally:
        if queued_mark is not None and not queued_mark.done():
            queued_mark.cancel()
        stream.cancel()  # a no-op once it finished; else the provider is told now
        try:
            # closed to its end even if the stop cancels this task again: the
            # record of how the provider was told must not be lost to it
            await finish_anyway(_close_within(feeding, stream, CLOSE_S))
        finally:
            records = stream.records()
            run.note_synthesis(stream)
            stop = stream.stop
            for i, r in enumerate(records):
                last = i == len(records) - 1
                run.output(TtsUsage(
                    turn_id=run.turn_id, generation=run.generation, **r.model_dump(),
                    stop_told_ms=round(stop.tell_ms, 3) if last and stop is not None and stop.tell_ms is not None else None,
                    late_audio_ms=round(stop.late_audio_ms, 1) if last and stop is not None else 0.0,
                ))
    tail = reframer.flush()
    if tail is not None:
        run.play(playout, PlayoutFrame(tail, run.generation, position, audible=rms_dbfs(tail) > SILENCE_DBFS))
    run.tts_done = True


async def _mark_when_confirmed(run: TurnHandle) -> None:
    """Mark ``first_queued`` (the reply's first frame queued for playout:
    what voice-to-voice is measured to) once ``run``'s end of turn is
    confirmed: at once, unless its reply is speculative and still held.
    Run in the TTS child's context (the mark is its scope's)."""
    await run.confirmed.wait()
    mark("first_queued")


async def _close_within(feeding: asyncio.Task[None], stream: SynthesisStream, seconds: float) -> None:
    """End the feeder, then close ``stream``, giving up after ``seconds`` (a
    provider that hangs its close costs the turn no more)."""
    await cancel_and_wait(feeding)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stream.aclose()


def _pending_text(stream: SynthesisStream) -> str:
    """The text of the clause whose audio is arriving (the oldest not yet
    done), "" if unknown."""
    pending = stream.pending_texts
    return pending[0] if pending else ""
