"""bench/shutdown.py runs: one idle WebRTC session on a real server process,
SIGTERM, and the figures it reports hold the drain's promises (the session
told ``session.draining``, hung up at ``drain_timeout_s``, exit 0, no
recogniser worker left). The figures themselves are the bench's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import shutdown as bench  # noqa: E402

pytestmark = pytest.mark.e2e


async def test_the_bench_measures_an_idle_session_through_a_sigterm() -> None:
    settings = bench.Shutdown(lb_delay_s=0.2, drain_timeout_s=1.5, turn_wait_s=1, grace_s=8)
    sc = await bench.run_scenario("idle", 1, settings)
    assert sc["exit_code"] == 0, sc["log_tail"]
    assert sc["workers_before"] > 0 and sc["workers_left"] == 0, sc
    [s] = sc["per_session"]
    assert s["draining_s"] is not None and s["draining_s"] < 1, s
    assert 1.3 <= s["left_s"] <= 1.5 and s["draining_reason"] == "SIGTERM", s  # told at once (0.1 s steps; a loaded machine)
    assert s["server_hung_up"] and 1.5 <= s["ended_s"] < 4, s
    assert 1.5 <= sc["exit_s"] < settings.grace_s, sc
    assert bench.problems(sc) == []
