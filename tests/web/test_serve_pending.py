"""What a shutdown that ran out of its grace logs: each task still open,
with the chain of awaits it is stuck in (the bug to fix is in there)."""

from __future__ import annotations

import asyncio

from web.serve import _pending_tasks


async def _stuck_inner(gate: asyncio.Event) -> None:
    await gate.wait()


async def _stuck_outer(gate: asyncio.Event) -> None:
    await _stuck_inner(gate)


async def test_the_log_names_each_open_task_and_where_it_waits() -> None:
    gate = asyncio.Event()
    task = asyncio.get_running_loop().create_task(_stuck_outer(gate), name="held-open")
    await asyncio.sleep(0)
    try:
        text = _pending_tasks()
        line = next(x for x in text.splitlines() if "held-open" in x)
        assert "_stuck_outer" in line and "_stuck_inner" in line and "wait" in line
        assert line.index("_stuck_outer") < line.index("_stuck_inner")  # outermost first
        assert "test_the_log_names" not in text  # not the task asking
    finally:
        gate.set()
        await task
