"""What a fuzz run of :mod:`testkit.fuzz` did and found, and its printout."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FuzzReport:
    """What a fuzz run did and found.

    Attributes:
        iterations / seed: as asked.
        terminal: turns by terminal state.
        stops: stops injected, by where ("checkpoint", "moment", "none").
        intents: ledger rows by final status.
        effects_applied: keys the external system applied.
        messages_sent / messages_skipped: downstream items.
        kept_through_stop: effects done before a stop that keeps them (each
            must be kept: invariant 4 had this many chances to break).
        histories_checked: follow-up model requests checked (invariant 5).
        violations: every broken invariant, one line each (empty: all held).
    """

    iterations: int
    seed: int
    terminal: Counter[str] = field(default_factory=Counter)
    stops: Counter[str] = field(default_factory=Counter)
    intents: Counter[str] = field(default_factory=Counter)
    effects_applied: int = 0
    messages_sent: int = 0
    messages_skipped: int = 0
    kept_through_stop: int = 0
    histories_checked: int = 0
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """All invariants held."""
        return not self.violations

    def invariants(self) -> dict[str, int]:
        """Violations per invariant (0 everywhere when all held)."""
        out = {
            "no_row_left_pending": 0, "effect_at_most_once": 0, "one_terminal_state_consistent_with_ledger": 0,
            "stop_keeps_done_effects": 0, "history_matches_ledger_and_heard": 0,
        }
        for v in self.violations:
            out[v.split(":", 1)[0]] = out.get(v.split(":", 1)[0], 0) + 1
        return out

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (what `python -m testkit.fuzz --json` prints)."""
        return {
            "iterations": self.iterations, "seed": self.seed, "ok": self.ok,
            "terminal": dict(self.terminal), "stops": dict(self.stops), "intents": dict(self.intents),
            "effects_applied": self.effects_applied, "messages_sent": self.messages_sent,
            "messages_skipped": self.messages_skipped, "kept_through_stop": self.kept_through_stop,
            "histories_checked": self.histories_checked,
            "invariants": self.invariants(),
            "violations": self.violations[:50],
        }


def print_report(report: FuzzReport) -> None:
    """The report as a short table."""
    print(f"fuzz: {report.iterations} iterations, seed {report.seed}")
    print(f"  stops injected: {dict(report.stops)}")
    print(f"  terminal states: {dict(report.terminal)}")
    print(f"  ledger rows: {dict(report.intents)}")
    print(f"  effects applied: {report.effects_applied}; messages sent {report.messages_sent}, skipped {report.messages_skipped}")
    print(f"  effects done before a stop that keeps them: {report.kept_through_stop}")
    print(f"  follow-up requests checked against the ledger and the heard text: {report.histories_checked}")
    print("  invariants (violations):")
    for name, count in report.invariants().items():
        print(f"    {name:<45} {count}")
    for v in report.violations[:20]:
        print(f"  ! {v}")
    print("OK" if report.ok else f"BROKEN: {len(report.violations)} violations")
