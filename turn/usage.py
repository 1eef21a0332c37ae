"""Honest model usage of a turn: every request, every token, and which of
them came after the stop request.

A :class:`UsageMeter` belongs to one turn. Each model request opens a
:class:`RequestMeter`; the provider client feeds it as the stream arrives
(one call per streamed chunk, and the stream's usage chunk when there is
one). When a request is aborted, its record is kept as *partial*: prompt
tokens plus the completion tokens streamed so far (issue 4: "usage on
abort").

Spend after a stop is never claimed to be zero when it is not known.
Closing a provider's connection does not prove that it stopped generating
(a provider may bill the whole completion whatever the client does), and
turnkeeper cannot count tokens it no longer reads. So a request in flight
at a stop is recorded ``after_stop="confirmed"`` only when the provider is
known to have stopped (an in-process model, or a stream that ran to its
end), else ``"unconfirmed"`` with an upper bound: the tokens seen after the
stop plus what is left of the request's ``max_tokens`` (every request is
sent with a cap so the bound is finite).

Prices make cents: ``Pricing`` is in US cents per 1,000 tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from turn.models import RecognitionRecord, Spent, SynthesisRecord, Usage, UsageRecord


class Pricing(BaseModel):
    """What a model's tokens cost, US cents per 1,000 tokens.

    Attributes:
        prompt_cents_per_1k: price of 1,000 prompt (input) tokens.
        completion_cents_per_1k: price of 1,000 completion (output) tokens.
    """

    model_config = ConfigDict(frozen=True)

    prompt_cents_per_1k: float = Field(0.0, ge=0, allow_inf_nan=False)
    completion_cents_per_1k: float = Field(0.0, ge=0, allow_inf_nan=False)

    def cents(self, prompt_tokens: int, completion_tokens: int) -> float:
        """The price of that many tokens, cents."""
        return (prompt_tokens * self.prompt_cents_per_1k + completion_tokens * self.completion_cents_per_1k) / 1000


def estimate_tokens(text: str) -> int:
    """A provider-independent token estimate for text whose count the
    provider did not report: about 4 characters a token (OpenAI's rule of
    thumb for English), at least 1 for non-empty text."""
    return 0 if not text else max(1, round(len(text) / 4))


class RequestMeter:
    """The usage of one model request while it streams.

    Use :meth:`chunk` for every streamed content or tool-call chunk,
    :meth:`reported` when the provider reports usage, and :meth:`finish`
    when the stream ends or is aborted.
    """

    def __init__(
        self, meter: UsageMeter, number: int, prompt_estimate: int, started_after_stop: bool, started_at: datetime | None
    ) -> None:
        self._meter = meter
        self.number = number
        self.started_at = started_at
        self.billed = True
        self.prompt_tokens = prompt_estimate
        self.completion_tokens = 0
        self.after_stop = 0
        self.reported_usage = False
        self.started_after_stop = started_after_stop
        self.finished = False
        self.partial = False
        #: the completion cap the provider was sent, tokens (None: none)
        self.max_tokens: int | None = None
        #: the provider is known to have stopped generating (see finish)
        self.provider_stopped = False

    def chunk(self, tokens: int = 1) -> None:
        """``tokens`` completion tokens arrived (a streamed chunk is one
        token unless the provider says otherwise)."""
        self.completion_tokens += tokens
        if self._meter.stopped:
            self.after_stop += tokens

    def reported(self, prompt_tokens: int, completion_tokens: int) -> None:
        """The provider's own usage figures (they replace the counted ones;
        tokens past the counted ones are attributed like the last chunk)."""
        extra = completion_tokens - self.completion_tokens
        if extra > 0 and self._meter.stopped:
            self.after_stop += extra
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.after_stop = min(self.after_stop, completion_tokens)
        self.reported_usage = True

    def not_billed(self) -> None:
        """The request was refused before any generation (connection
        refused, an HTTP error answer): nothing is billed for it."""
        self.billed = False
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.after_stop = 0

    def finish(self, *, partial: bool, provider_stopped: bool | None = None) -> None:
        """The request ended; ``partial`` if it was aborted before its end.
        Idempotent (the first call decides).

        Args:
            partial: aborted before the end of the completion.
            provider_stopped: whether the provider is known to have stopped
                generating. Default: True for a complete stream (every token
                was seen), False for an aborted one (a closed connection
                proves nothing); an in-process model that stops when it is
                closed passes True.
        """
        if self.finished:
            return
        self.finished = True
        self.partial = partial
        self.provider_stopped = (not partial) if provider_stopped is None else provider_stopped

    def record(self) -> UsageRecord:
        """This request as a :class:`turn.models.UsageRecord`, with its
        after-stop status and bound (module doc)."""
        stop_at = self._meter.stop_at
        late = stop_at is not None and self.started_at is not None and self.started_at > stop_at
        status: str | None = None
        bound: int | None = self.after_stop
        if self.billed and (self._meter.stopped or stop_at is not None):
            in_flight = self.partial or not self.finished or self.after_stop > 0
            if in_flight:
                status = "confirmed" if self.finished and self.provider_stopped else "unconfirmed"
            if status == "unconfirmed":
                bound = None if self.max_tokens is None else self.after_stop + max(0, self.max_tokens - self.completion_tokens)
        return UsageRecord(
            request=self.number,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            completion_tokens_after_stop=self.after_stop,
            partial=(self.partial or not self.finished) and self.billed,
            source="not_billed" if not self.billed else "usage_chunk" if self.reported_usage else "counted",
            started_after_stop=self.started_after_stop or late,
            max_tokens=self.max_tokens,
            after_stop=status,
            completion_tokens_after_stop_bound=bound,
        )


class UsageMeter:
    """All model usage of one turn.

    Args:
        pricing: token prices (cents per 1,000).
        now: wall clock (UTC) for each request's start, so requests can be
            compared with the stored time of the stop request.
    """

    def __init__(
        self,
        pricing: Pricing | None = None,
        now: Callable[[], datetime] | None = None,
        earlier: list[UsageRecord] | None = None,
    ) -> None:
        self.pricing = pricing or Pricing()
        #: requests of this turn made by a worker before this one (a resumed turn): counted, not metered again
        self.earlier: list[UsageRecord] = list(earlier or [])
        self.requests: list[RequestMeter] = []
        self.stopped = False
        #: the stop request's time as the store recorded it (see :meth:`reconcile_stop`)
        self.stop_at: datetime | None = None
        #: what recognising the turn's words cost (see :meth:`add_recognition`)
        self.recognition: list[RecognitionRecord] = []
        #: what speaking the turn's reply cost (see :meth:`add_synthesis`)
        self._synthesis: list[Callable[[], list[SynthesisRecord]]] = []
        self._now = now

    def mark_stopped(self) -> None:
        """This process learnt that the turn is stopping: tokens from now on
        are waste."""
        self.stopped = True

    def reconcile_stop(self, at: datetime) -> None:
        """The stop request's time as stored (possibly by another instance,
        before this one heard of it): a request started after it counts in
        ``requests_after_stop`` even if this process had not heard yet."""
        self.stop_at = at

    def start_request(self, prompt_estimate: int) -> RequestMeter:
        """A model request begins (``prompt_estimate`` tokens until the
        provider reports the real count)."""
        started_at = self._now() if self._now is not None else None
        req = RequestMeter(self, len(self.earlier) + len(self.requests) + 1, prompt_estimate, self.stopped, started_at)
        self.requests.append(req)
        return req


    def add_recognition(self, records: list[RecognitionRecord]) -> None:
        """What recognising the turn's words cost (one record per
        recogniser); their cents count in :meth:`spent`, so a budget
        checkpoint sees them before the first model request."""
        self.recognition.extend(records)

    def add_synthesis(self, records: Callable[[], list[SynthesisRecord]]) -> None:
        """What speaking a reply cost: ``records`` gives its records (one
        per synthesiser stream) as they stand when asked, so a stop the
        provider acknowledges later is written as confirmed by a later
        flush; their cents count in :meth:`spent`."""
        self._synthesis.append(records)

    @property
    def synthesis(self) -> list[SynthesisRecord]:
        """The synthesis records now (see :meth:`add_synthesis`)."""
        return [r for records in self._synthesis for r in records()]

    @property
    def total_tokens(self) -> int:
        """Prompt and completion tokens of every request (earlier ones too)."""
        return sum(r.prompt_tokens + r.completion_tokens for r in self._all())

    def _all(self) -> list[UsageRecord | RequestMeter]:
        return [*self.earlier, *self.requests]

    def usage(self) -> Usage:
        """The turn's :class:`turn.models.Usage` now."""
        records = [*self.earlier, *(r.record() for r in self.requests)]
        statuses = {r.after_stop for r in records} - {None}
        bounds = [r.completion_tokens_after_stop_bound for r in records]
        return Usage(
            prompt_tokens=sum(r.prompt_tokens for r in records),
            completion_tokens=sum(r.completion_tokens for r in records),
            completion_tokens_after_stop=sum(r.completion_tokens_after_stop for r in records),
            after_stop="unconfirmed" if "unconfirmed" in statuses else "confirmed" if statuses else None,
            completion_tokens_after_stop_bound=None if None in bounds else sum(b for b in bounds if b is not None),
            requests_after_stop=sum(1 for r in records if r.started_after_stop),
            model_requests=len(records),
            records=records,
            recognition=list(self.recognition),
            synthesis=list(self.synthesis),
        )

    def spent(self) -> Spent:
        """Model tokens, and cents of the model, recognition and synthesis, used so far."""
        return Spent(
            tokens=self.total_tokens,
            cents=sum(self.pricing.cents(r.prompt_tokens, r.completion_tokens) for r in self._all())
            + sum(r.cents for r in self.recognition)
            + sum(r.cents for r in self.synthesis),
        )
