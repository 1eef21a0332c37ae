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
from collections.abc import Awaitable, Callable

from media.frames import PLAYOUT_RATE, Reframer, rms_dbfs, samples_per_frame
from media.playout import PlayoutFrame
from turn.event_catalogue import AgentDelta, AgentDone, ToolStarted, Transcript
from turn.manager import TurnManager
from turn.models import Turn
from turn.scope import TurnScope, mark
from voice.providers import LanguageModel, Message, TextToSpeech
from voice.respond import AgentLoopEvent, run_agent, sink_to
from voice.text import SentenceSplitter
from voice.tools import Toolbox
from voice.transport import OutputSink
from voice.turn_handle import TurnHandle
from voice.turn_lifecycle import Heard, finish

#: a playout frame quieter than this (dBFS) is a pause, not speech
SILENCE_DBFS = -50.0


async def answer(
    run: TurnHandle,
    scope: TurnScope,
    turn: Turn,
    *,
    manager: TurnManager,
    llm: LanguageModel,
    tts: TextToSpeech,
    tools: Toolbox | None,
    playout: OutputSink,
    history: Callable[[TurnHandle, Turn], Awaitable[list[Message]]],
) -> None:
    """Answer ``run``'s utterance (``turn``: its record) inside its cancel
    scope: the transcript (with the words of the turn it continues, which is
    then marked merged into it), the model's reply on ``history`` spoken
    into ``playout``, and, once every frame was played, the reply recorded
    and the turn COMPLETED in one must-complete step (``agent.done``). An
    utterance with no words fails the turn (``no_speech_recognized``).

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
    tts: TextToSpeech,
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
        )
        rest = splitter.flush()
        if rest:
            sentences.put_nowait(rest)
    finally:
        sentences.put_nowait(None)
    await scope.wait(speaking)


async def speak(run: TurnHandle, sentences: asyncio.Queue[str | None], *, tts: TextToSpeech, playout: OutputSink) -> None:
    """TTS each sentence from ``sentences`` (until None) into 20 ms playout
    frames at 48 kHz tagged with ``run``'s generation, each marked audible
    if louder than ``SILENCE_DBFS``; sets ``run.tts_done`` once all are
    queued. Marks ``first_sentence`` and ``first_audio`` for the scope's
    observers (TTS time to first audio)."""
    reframer = Reframer(PLAYOUT_RATE)
    per_frame = samples_per_frame(PLAYOUT_RATE)
    position = 0

    def sink(pcm: bytes) -> None:
        nonlocal position
        mark("first_audio")  # TTS's first audio of the reply (only the first mark counts)
        for f in reframer.push(pcm):
            playout.push(PlayoutFrame(f, run.generation, position, audible=rms_dbfs(f) > SILENCE_DBFS))
            position += per_frame

    while (sentence := await sentences.get()) is not None:
        mark("first_sentence")  # handed to TTS: its time to first audio starts here
        run.enter("speaking")
        start = position + reframer.pending_bytes // 2
        await tts.synthesize(sentence, sink)
        run.spoken.append((start, position + reframer.pending_bytes // 2, sentence))
    tail = reframer.flush()
    if tail is not None:
        playout.push(PlayoutFrame(tail, run.generation, position, audible=rms_dbfs(tail) > SILENCE_DBFS))
    run.tts_done = True
