"""voice/niceness.py: work off the audio path runs below the event loop's
CPU priority, per thread (Linux), its own process and the worker processes
and subprocesses it starts."""

from __future__ import annotations

import asyncio
import os
import threading

from voice import niceness
from voice.end_of_turn import judge_threads


def test_a_background_thread_is_lowered_and_the_caller_is_not() -> None:
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    pool = niceness.background_threads("t", 1)
    try:
        theirs = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, 0)).result(5)
    finally:
        pool.shutdown()
    assert theirs == min(niceness.MAX_NICE, mine + niceness.BACKGROUND_NICE)
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # per thread: the caller keeps its own


def test_the_judge_threads_are_lowered() -> None:
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    theirs = judge_threads().submit(lambda: os.getpriority(os.PRIO_PROCESS, 0)).result(5)
    assert theirs > mine or theirs == niceness.MAX_NICE


async def test_a_subprocess_is_lowered_and_a_gone_one_is_no_error() -> None:
    proc = await asyncio.create_subprocess_exec("sleep", "5")
    try:
        before = os.getpriority(os.PRIO_PROCESS, proc.pid)
        niceness.lower(proc.pid)
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(niceness.MAX_NICE, before + niceness.BACKGROUND_NICE)
    finally:
        proc.kill()
        await proc.wait()
    niceness.lower(proc.pid)  # reaped: logged, never raised


def test_the_worker_initializer_lowers_then_runs_the_real_one() -> None:
    seen: list[int] = []

    def run() -> None:
        niceness.background_initializer(lambda x: seen.append(x), 7)
        seen.append(os.getpriority(os.PRIO_PROCESS, 0))

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    t = threading.Thread(target=run)
    t.start()
    t.join(5)
    assert seen[0] == 7 and seen[1] == min(niceness.MAX_NICE, mine + niceness.BACKGROUND_NICE)
