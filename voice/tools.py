"""Tools the agent may call, declared with :func:`tool`.

A tool is an async function with typed keyword arguments. Its JSON Schema
(made by pydantic from the signature) is what the model sees
(:class:`voice.providers.ToolSpec`); the model's arguments are validated
against it before the call.

``effect`` says what a stop may do to a running call:

- ``"none"``: safe to abandon (reads, searches); a stop cancels it;
- ``"complete"``: must finish once started; it runs as a short shielded
  must-complete section (:meth:`turn.scope.TurnScope.commit`), and a stop
  takes effect after it (the turn then needs reconciliation);
- ``"compensate"``: reversed on stop by ``compensate`` when the stop's
  policy says so for the call's stage (:mod:`turn.stop_policy`: a barge-in
  keeps what was done before it); the side-effect ledger runs the
  compensation as a durable job.

``expected_duration_ms``: a call is not started when the turn has less time
left (event ``tool.not_started``, reason ``no_budget``).

Injected parameters: a tool that declares ``idempotency_key: str`` receives
its intent's key (the turn id plus the step index) and must pass it on to
the external system, which applies each key at most once; one that declares
``turn_id: str`` receives its turn's id (to pass downstream, so queued work
of a stopped turn is skipped). Neither is shown to the model.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from turn.intents import LookupAnswer
from voice.providers import ToolSpec

Effect = Literal["none", "complete", "compensate"]

#: parameters filled in by the server, never by the model
INJECTED = frozenset({"idempotency_key", "turn_id"})


class ToolArgumentsError(ValueError):
    """The model's arguments do not fit the tool's schema."""


@dataclass(frozen=True)
class Tool:
    """A declared tool (see :func:`tool`)."""

    name: str
    description: str
    fn: Callable[..., Awaitable[Any]]
    arguments: type[BaseModel]
    effect: Effect = "none"
    expected_duration_ms: float | None = None
    max_duration_ms: float | None = None
    compensate: Callable[..., Awaitable[Any]] | None = None
    lookup: Callable[[str], Awaitable[Any]] | None = None

    @property
    def spec(self) -> ToolSpec:
        """What the model is told."""
        schema = self.arguments.model_json_schema()
        schema.pop("title", None)
        return ToolSpec(name=self.name, description=self.description, parameters=schema)

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The model's arguments, checked and converted.

        Raises:
            ToolArgumentsError: they do not fit the schema.
        """
        try:
            return dict(self.arguments.model_validate(arguments))
        except ValidationError as exc:
            raise ToolArgumentsError(f"bad arguments for {self.name}: {exc.errors(include_url=False)}") from None

    @property
    def injected(self) -> frozenset[str]:
        """The injected parameters this tool declares."""
        return frozenset(inspect.signature(self.fn).parameters) & INJECTED

    async def __call__(self, *, idempotency_key: str = "", turn_id: str = "", **arguments: Any) -> Any:
        """Call the tool with the model's (validated) arguments, adding the
        injected ones it declares."""
        extra = {"idempotency_key": idempotency_key, "turn_id": turn_id}
        return await self.fn(**arguments, **{k: extra[k] for k in self.injected})

    # -- turn.ledger.EffectHandler ------------------------------------------------

    async def compensate_effect(self, key: str, args: dict[str, Any]) -> bool:
        """Undo the effect of ``key`` with the declared ``compensate``.

        Returns:
            False if ``compensate`` returned False: the external system says
            ``key`` was never applied, so nothing was reversed (the ledger
            then records the effect abandoned, "not done"); True otherwise
            (any other answer, None included, means it was reversed).

        Raises:
            RuntimeError: the tool declares no compensation.
            Exception: whatever ``compensate`` raises (the ledger retries).
        """
        if self.compensate is None:
            raise RuntimeError(f"tool {self.name} has no compensation")
        return await self.compensate(key) is not False

    async def lookup_effect(self, key: str) -> LookupAnswer:
        """Ask the external system about ``key`` (UNKNOWN without ``lookup``)."""
        if self.lookup is None:
            return LookupAnswer.UNKNOWN
        return LookupAnswer(await self.lookup(key))

    async def retry_effect(self, key: str, args: dict[str, Any]) -> Any:
        """Apply the effect again under the same key (the system dedupes)."""
        return await self(idempotency_key=key, turn_id=key.split(":", 1)[0], **args)


def tool(
    *,
    name: str | None = None,
    effect: Effect = "none",
    expected_duration_ms: float | None = None,
    max_duration_ms: float | None = None,
    compensate: Callable[..., Awaitable[Any]] | None = None,
    lookup: Callable[[str], Awaitable[Any]] | None = None,
) -> Callable[[Callable[..., Awaitable[Any]]], Tool]:
    """Declare an async function as a tool. Its docstring's first paragraph
    is the description; every parameter needs a type annotation.

    Args:
        name: the tool's name (default: the function's).
        effect: ``"none"``, ``"complete"`` or ``"compensate"`` (module doc).
        expected_duration_ms: how long a call usually takes, ms.
        max_duration_ms: a call is cut off after this long, ms.
        compensate: ``compensate(idempotency_key)`` undoes the effect
            (required for ``"compensate"`` tools; idempotent, a no-op for a
            key never applied). It may return False to say the key was
            never applied (nothing reversed: the call is then recorded "not
            done" rather than "done, then reversed").
        lookup: ``lookup(idempotency_key)`` asks the external system whether
            the effect happened: ``"present"``, ``"absent"`` or ``"unknown"``.

    Raises:
        TypeError: the function is not async, a parameter has no
            annotation, or a "compensate" tool has no compensation.
    """

    def wrap(fn: Callable[..., Awaitable[Any]]) -> Tool:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"tool {fn.__name__} must be an async function")
        if effect == "compensate" and compensate is None:
            raise TypeError(f"tool {fn.__name__}: effect 'compensate' needs a compensate function")
        fields: dict[str, Any] = {}
        hints = typing.get_type_hints(fn, include_extras=True)  # resolves postponed annotations
        for p in inspect.signature(fn).parameters.values():
            if p.name in INJECTED:
                continue
            if p.name not in hints:
                raise TypeError(f"tool {fn.__name__}: parameter {p.name} needs a type annotation")
            default = ... if p.default is inspect.Parameter.empty else p.default
            fields[p.name] = (hints[p.name], default)
        args_model = create_model(f"{fn.__name__}_arguments", __config__=ConfigDict(extra="forbid"), **fields)
        doc = inspect.getdoc(fn) or fn.__name__
        return Tool(
            name=name or fn.__name__,
            description=doc.split("\n\n")[0].replace("\n", " "),
            fn=fn,
            arguments=args_model,
            effect=effect,
            expected_duration_ms=expected_duration_ms,
            max_duration_ms=max_duration_ms,
            compensate=compensate,
            lookup=lookup,
        )

    return wrap


class Toolbox:
    """The tools one agent may call, by name."""

    def __init__(self, tools: list[Tool] | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools or []:
            self.add(t)

    def add(self, t: Tool) -> None:
        """Register a tool.

        Raises:
            ValueError: a tool of that name is registered already.
        """
        if t.name in self._tools:
            raise ValueError(f"two tools named {t.name!r}")
        self._tools[t.name] = t

    def get(self, name: str) -> Tool | None:
        """The tool called ``name``, or None."""
        return self._tools.get(name)

    def specs(self) -> list[ToolSpec]:
        """What the model is told, one spec per tool."""
        return [t.spec for t in self._tools.values()]

    def __len__(self) -> int:
        return len(self._tools)

