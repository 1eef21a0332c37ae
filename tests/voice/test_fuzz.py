"""The ledger fuzzer: 1,000 scripted turns cancelled at random checkpoints
and moments, with faults in the external system; every invariant holds. And
the checker is not blind: a ledger that lies is caught."""

from __future__ import annotations

import json

import pytest

import turn.manager
from voice.fuzz import fuzz
from web.cli import main


async def test_a_thousand_iterations_keep_every_invariant() -> None:
    report = await fuzz(1000, seed=20261129)
    assert report.ok, report.violations[:10]
    assert report.invariants() == {
        "no_row_left_pending": 0, "effect_at_most_once": 0, "one_terminal_state_consistent_with_ledger": 0,
    }
    # the run exercised every path, not just the easy one
    assert {"CANCELLED", "RECONCILE_REQUIRED", "COMPLETED"} <= set(report.terminal)
    assert report.stops["checkpoint"] > 300 and report.stops["moment"] > 300
    assert report.intents["effect:compensated"] > 50 and report.intents["effect:abandoned"] > 50
    assert report.messages_skipped > 0 and report.messages_sent > 0


async def test_a_ledger_that_says_nothing_remains_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turn.manager, "terminal_status", lambda report, *, limit, effect_remains=False: turn.manager.TurnStatus.CANCELLED)
    report = await fuzz(80, seed=5)
    assert not report.ok
    assert report.invariants()["one_terminal_state_consistent_with_ledger"] > 0


async def test_a_downstream_worker_that_ignores_stops_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("turn.downstream.turn_stopped", lambda _turn: False)
    report = await fuzz(80, seed=5)
    assert report.invariants()["effect_at_most_once"] > 0
    assert any("sent after the stop" in v for v in report.violations)


def test_cli_exit_status_and_json(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["fuzz", "--iterations", "15", "--seed", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["iterations"] == 15 and set(out["invariants"].values()) == {0}
    assert main(["fuzz", "--iterations", "0"]) == 2
    monkeypatch.setattr("turn.downstream.turn_stopped", lambda _turn: False)
    assert main(["fuzz", "--iterations", "60", "--seed", "5"]) == 1
    assert "BROKEN" in capsys.readouterr().out
