"""The ledger fuzzer: 1,000 scripted turns cancelled at random checkpoints
and moments, with faults in the external system; every invariant holds. And
the checker is not blind: a ledger that lies is caught."""

from __future__ import annotations

import json

import pytest

import turn.stop_path
import voice.history
from testkit.fuzz import fuzz, main
from voice.text_turns import TextTurns


async def test_a_thousand_iterations_keep_every_invariant() -> None:
    report = await fuzz(1000, seed=20261129)
    assert report.ok, report.violations[:10]
    assert report.invariants() == {
        "no_row_left_pending": 0, "effect_at_most_once": 0, "one_terminal_state_consistent_with_ledger": 0,
        "stop_keeps_done_effects": 0, "history_matches_ledger_and_heard": 0,
    }
    # the run exercised every path, not just the easy one
    assert {"CANCELLED", "RECONCILE_REQUIRED", "COMPLETED"} <= set(report.terminal)
    assert report.stops["checkpoint"] > 300 and report.stops["moment"] > 300
    assert report.intents["effect:compensated"] > 25 and report.intents["effect:abandoned"] > 50
    assert report.messages_skipped > 0 and report.messages_sent > 0
    assert report.kept_through_stop > 100  # invariant 4 had real chances to break
    assert report.histories_checked == 1000  # every turn's follow-up request was read


async def test_a_ledger_that_says_nothing_remains_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        turn.stop_path, "terminal_status", lambda report, *, limit, effect_remains=False: turn.stop_path.TurnStatus.CANCELLED
    )
    report = await fuzz(80, seed=5)
    assert not report.ok
    assert report.invariants()["one_terminal_state_consistent_with_ledger"] > 0


async def test_a_downstream_worker_that_ignores_stops_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("turn.downstream.turn_stopped", lambda _turn: False)
    report = await fuzz(80, seed=5)
    assert report.invariants()["effect_at_most_once"] > 0
    assert any("sent after the stop" in v for v in report.violations)


async def test_a_history_that_differs_from_what_was_heard_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn store that files the words the client received as unheard
    (so the next request is told the interrupted turn said nothing) is
    caught by what that request is sent, against the event log."""
    original = TextTurns._heard

    async def misfile(self, events, turn_id, generated):  # type: ignore[no-untyped-def]
        shown, rest = await original(self, events, turn_id, generated)
        return None, " ".join(filter(None, (shown, rest))) or None

    monkeypatch.setattr(TextTurns, "_heard", misfile)
    report = await fuzz(150, seed=7)
    assert report.invariants()["history_matches_ledger_and_heard"] > 0
    assert any("the client received" in v for v in report.violations)


async def test_a_history_that_says_reversed_for_nothing_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A history that calls every cancelled call "done, then reversed" (the
    defect of issue 10.5) is caught against the external system."""
    original = voice.history.tool_messages

    def always_reversed(intents):  # type: ignore[no-untyped-def]
        out = original(intents)
        return [m.model_copy(update={"status": "compensated"}) if m.status == "abandoned" else m for m in out]

    monkeypatch.setattr(voice.history, "tool_messages", always_reversed)
    report = await fuzz(150, seed=7)
    assert report.invariants()["history_matches_ledger_and_heard"] > 0


def test_cli_exit_status_and_json(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["--iterations", "15", "--seed", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["iterations"] == 15 and set(out["invariants"].values()) == {0}
    assert main(["--iterations", "0"]) == 2
    monkeypatch.setattr("turn.downstream.turn_stopped", lambda _turn: False)
    assert main(["--iterations", "60", "--seed", "5"]) == 1
    assert "BROKEN" in capsys.readouterr().out
