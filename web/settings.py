"""Settings: environment variables and an optional TOML file.

Precedence, highest first: values passed in code (CLI flags), environment
variables (``TURNKEEPER_*``; nested with ``__``, e.g.
``TURNKEEPER_VAD__OFFSET_MS=300``), the TOML file named by ``--config`` or
``TURNKEEPER_CONFIG`` (tables ``[vad]``, ``[tts]``, ...), then the defaults.
Every field documents its unit; README.md lists them all.
"""

from __future__ import annotations

import contextvars
import difflib
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from media.bargein_config import BargeInConfig
from media.inbound import MIN_STALL_MS
from media.vad import VadConfig
from turn.models import Plan
from voice.llm import LlmConfig
from voice.recognisers import SttConfig
from voice.session_config import SessionConfig
from voice.synthesisers import TtsConfig
from web.capacity import CapacitySettings
from web.limits import LimitSettings

_CONFIG_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("turnkeeper_config", default=None)


class TelephonySettings(BaseModel):
    """Phone calls through media-stream bridges (env ``TURNKEEPER_TELEPHONY__*``;
    see README "Phone calls").

    Attributes:
        twilio_auth_token: the Twilio account's Auth Token; when set, the
            voice webhook and the stream's WebSocket upgrade need a valid
            ``X-Twilio-Signature`` (else 403). Empty: not checked.
        public_url: the server's URL as the provider reaches it
            (``https://agent.example.com``, behind a proxy); signatures are
            checked against it and stream URLs built from it. Empty: the
            request's own URL.
        stream_url: the ``wss://`` URL the TwiML points the stream at.
            Empty: built from ``public_url`` or the request.
        tenant_secret: the key the tenant in the TwiML is signed with.
            Empty: a secret kept in the store.
        telnyx_stream_token: the shared secret a Telnyx stream URL carries
            (``?token=``); empty: Telnyx streams are refused once
            ``twilio_auth_token`` is set (open in development only).
        tenant_by_number: the tenant of each called number (E.164), by
            number; others are ``default``. Env as JSON.
        send_ahead_ms: audio the provider may hold beyond what is due, ms
            (what a ``clear`` throws away at most; a multiple of 20).
        mark_every_ms: a mark after this much audio at most, ms (and at the
            end of each stretch of audio).
        max_message_bytes: largest WebSocket message accepted, bytes (a
            larger one closes the socket, 1009).
        max_messages_per_s: messages a second a stream may send (20 ms
            media is 50); more closes the socket (1008).
    """

    twilio_auth_token: str = Field("", repr=False)
    public_url: str = Field("", pattern=r"^(https?://[^/\s]+)?$")
    stream_url: str = Field("", pattern=r"^(wss?://\S+)?$")
    tenant_secret: str = Field("", repr=False)
    telnyx_stream_token: str = Field("", repr=False)
    tenant_by_number: dict[str, str] = Field(default_factory=dict)
    send_ahead_ms: int = Field(60, ge=20, le=2000, multiple_of=20)
    mark_every_ms: int = Field(200, ge=20, le=10_000)
    max_message_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024)
    max_messages_per_s: int = Field(500, ge=60, le=100_000)


class DeviceSettings(BaseModel):
    """Push-to-talk devices on the xiaozhi-esp32 protocol (env
    ``TURNKEEPER_DEVICES__*``; see README "Push-to-talk devices").

    Attributes:
        downlink_sample_rate: the rate of the Opus the server sends, Hz (in
            the server ``hello``'s ``audio_params``).
        downlink_frame_ms: each downlink Opus packet's duration, ms (20 by
            default: a device plays at most one packet it has begun after an
            abort, so the packet is part of the stop time).
        send_ahead_ms: audio the device may hold beyond what is due, ms (a
            multiple of 20; 40 by default): what it still plays after an
            abort, at most, and what the heard position subtracts as in
            flight. Raise it on a jittery Wi-Fi link; the stop at the device
            grows by the same amount.
        max_frame_bytes: largest binary message accepted, bytes (a 60 ms
            Opus packet is a few hundred); larger closes the socket (1009).
        max_messages_per_s: messages a second a device may send (60 ms
            audio is about 17); more closes the socket (1008).
        hello_timeout_s: a device that sends no ``hello`` this long after
            connecting is closed (1008).
    """

    downlink_sample_rate: Literal[16000, 24000, 48000] = 24000
    downlink_frame_ms: Literal[20, 40, 60] = 20
    send_ahead_ms: int = Field(40, ge=20, le=2000, multiple_of=20)
    max_frame_bytes: int = Field(4096, ge=512, le=1024 * 1024)
    max_messages_per_s: int = Field(200, ge=30, le=100_000)
    hello_timeout_s: float = Field(10.0, gt=0, le=600)

    @field_validator("downlink_sample_rate", "downlink_frame_ms", mode="before")
    @classmethod
    def _int_from_env(cls, value: object) -> object:
        """An environment variable is text: ``"20"`` is read as 20 before
        the choice is checked (a ``Literal`` of ints does not coerce)."""
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        return value


class AuthSettings(BaseModel):
    """Credentials of voice clients (env ``TURNKEEPER_AUTH__*``; see
    :mod:`web.auth` and README "Who may talk to the agent").

    Attributes:
        client_token_ttl_s: how long a client token minted by
            ``POST /v1/sessions`` may start its session, s.
        insecure: serve on an address other than loopback with no API
            tokens (anyone who reaches it talks to the agent on the
            ``default`` tenant). The CLI's ``--insecure`` sets it.
    """

    client_token_ttl_s: float = Field(60.0, ge=5, le=3600)
    insecure: bool = False


class TraceSettings(BaseModel):
    """Where traces go (env ``TURNKEEPER_TRACES__*``; see :mod:`web.tracing`).

    Attributes:
        otlp_endpoint: an OTLP/HTTP traces URL, e.g.
            ``http://collector:4318/v1/traces``; empty: no export.
            Empty: the standard ``OTEL_EXPORTER_OTLP_*`` environment
            variables decide (none set: no export).
        service_name: the ``service.name`` resource attribute
            (``OTEL_SERVICE_NAME`` wins when set).
        include_content: put what people said and were told in spans (the
            transcript, the reply, tool arguments). Off by default: spans
            carry ids, states, times and counts, never content.
    """

    otlp_endpoint: str = Field("", max_length=2000, pattern=r"^(https?://\S+)?$")
    service_name: str = Field("turnkeeper", min_length=1, max_length=200)
    include_content: bool = False


class ShutdownSettings(BaseModel):
    """How an instance drains before it exits (env ``TURNKEEPER_SHUTDOWN__*``;
    see :mod:`web.drain` and README "Rolling deploys"). Every time counts
    from the drain's start (SIGTERM or ``POST /v1/admin/drain``).

    Attributes:
        lb_delay_s: the least a drain lasts, s: load balancers see
            ``/readyz`` fail and stop routing here while this instance still
            answers new work with 503 (never a refused connection).
        drain_timeout_s: voice sessions may go on this long, s; then they
            end ``worker_shutdown``.
        turn_wait_s: text turns may run this long, s; then they get a
            cooperative stop ``worker_shutdown`` at their next checkpoint.
        grace_s: the whole drain at most, s: then the process exits at once
            (keep it below Kubernetes' ``terminationGracePeriodSeconds``).
    """

    lb_delay_s: float = Field(2.0, ge=0, le=600)
    drain_timeout_s: float = Field(20.0, ge=0, le=24 * 3600)
    turn_wait_s: float = Field(10.0, ge=0, le=24 * 3600)
    grace_s: float = Field(25.0, gt=0, le=24 * 3600)

    @model_validator(mode="after")
    def _within_grace(self) -> ShutdownSettings:
        longest = max(self.lb_delay_s, self.drain_timeout_s, self.turn_wait_s)
        if longest >= self.grace_s:
            raise ValueError(f"grace_s ({self.grace_s:g}) must exceed lb_delay_s, drain_timeout_s and turn_wait_s "
                             f"(the longest is {longest:g}): the steps run inside it")
        return self


class Settings(BaseSettings):
    """All of turnkeeper's settings.

    Attributes:
        host: address to listen on.
        port: TCP port (0 picks a free one).
        store: where turns live; ``sqlite:///var/turnkeeper.db`` (relative to
            the working directory) is the embedded default.
        max_offer_bytes: largest accepted request body, bytes (SDP offers are
            a few KiB).
        max_sessions: concurrent sessions (WebRTC peers, phone calls,
            devices), a hard cap; more get 503 ``too_many_sessions``
            (the server may count as full earlier: ``capacity``).
        max_pending_sessions: sessions answered but not yet connected, at
            most (offers that never connect cannot fill ``max_sessions``).
        max_pending_per_client: of those, from one client address.
        connect_timeout_s: a peer that is not connected this many seconds
            after its offer is closed (a phone stream without ``start``, too).
        media_timeout_s: a connected peer (or phone call) whose audio stops
            arriving for this many seconds is closed (0 turns this off; clients that use Opus
            DTX, sending nothing in silence, need 0 or a long timeout).
        jitter_prefetch_packets: inbound jitter buffer prefetch, 20 ms packets
            (see ``media.inbound.set_jitter_prefetch`` for the trade-off).
        inbound_stall_ms: a stretch this long (ms) with no inbound audio is
            filled with silence, so barge-in and endpointing timers run on
            (0: wait for audio; otherwise at least 100 ms; see
            ``media.inbound.InboundAudio``).
        log_level: Python logging level name.
        log_content: put content in logs and logged errors (what users said
            or typed, replies, prompts, tool arguments, exception texts;
            see :mod:`turn.log_content`), for debugging. Off by default:
            logs carry ids, states, codes and counts only. Secrets (tokens,
            signatures) are never logged either way.
        redis_prefix: key prefix in Redis (several deployments can share a server).
        lease_ttl_s: a running turn whose worker has not heartbeated for this
            many seconds is taken to have lost its worker.
        stop_flag_staleness_ms: how old a cached read of a turn's stop flag may
            be at a checkpoint, ms (a worker that missed the stop signal sees
            the stop within this long).
        api_tokens: bearer tokens of the REST API, ``tenant:token`` pairs
            separated by commas (``tenant:sha256:<64 hex>`` gives a
            token's SHA-256 instead of the token); empty disables the REST
            turn API and puts voice sessions in development mode (see
            ``auth``).
        auth: client tokens and development mode (:class:`AuthSettings`).
        resume_token_ttl_s: lifetime of an event-stream resume token, s.
        demo_shop: run the demo shop (package ``demo_shop``): its tools
            for the agent, their in-process external system and the worker
            sending its queued messages. False: the agent has no tools and
            no demo worker runs.
        demo_service_db: the SQLite file of the demo tools' external system
            (empty: next to the SQLite store's file, or
            ``var/demo-service.db`` with Redis).
        demo_faults: faults the demo's external system starts with, for
            trying crashes and stops by hand and for the chaos tests:
            ``op:fault`` pairs separated by commas, each for one call
            (:meth:`demo_shop.service.DemoService.inject_spec`), e.g.
            ``order:slow_after``. Empty: none.
        plans: each tenant's limits for every turn (deadline, budget, max
            steps, shutdown reserve; see :class:`turn.models.Plan`), by
            tenant id; ``default`` applies to tenants without one (and to
            browser and phone sessions). TOML ``[plans.default]``,
            ``[plans.tenant_a]``; env ``TURNKEEPER_PLANS`` as JSON.
        telephony: phone calls (:class:`TelephonySettings`).
        devices: push-to-talk devices (:class:`DeviceSettings`).
        shutdown: draining before exit (:class:`ShutdownSettings`).
        traces: OpenTelemetry export (:class:`TraceSettings`).
        limits: rate limits and quotas per tenant and per client address
            (:class:`web.limits.LimitSettings`).
        capacity: when the server counts as full and refuses new calls
            (:class:`web.capacity.CapacitySettings`).
        admin_token: bearer token of the admin endpoints (``/v1/admin/*``);
            empty: they answer loopback clients only (a preStop hook runs
            in the pod).
        advertise_url: where other instances and clients reach this one
            (its registration in the fleet); empty: ``http://<host>:<port>``.
    """

    model_config = SettingsConfigDict(
        env_prefix="TURNKEEPER_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    store: str = "sqlite:///var/turnkeeper.db"
    max_offer_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024)
    max_sessions: int = Field(32, ge=1, le=10_000)
    max_pending_sessions: int = Field(8, ge=1, le=10_000)
    max_pending_per_client: int = Field(3, ge=1, le=10_000)
    connect_timeout_s: float = Field(15.0, gt=0, le=600)
    media_timeout_s: float = Field(5.0, ge=0, le=3600)
    jitter_prefetch_packets: int = Field(0, ge=0, le=8)
    inbound_stall_ms: int = Field(240, ge=0, le=10_000, multiple_of=20)

    @field_validator("inbound_stall_ms")
    @classmethod
    def _stall_off_or_long(cls, v: int) -> int:
        if 0 < v < MIN_STALL_MS:
            raise ValueError(f"must be 0 (off) or at least {MIN_STALL_MS} ms: ordinary packet jitter is not a stall")
        return v
    log_level: str = "INFO"
    log_content: bool = False
    redis_prefix: str = Field("tk", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    lease_ttl_s: float = Field(10.0, ge=1, le=3600)
    stop_flag_staleness_ms: int = Field(100, ge=0, le=60_000)
    api_tokens: str = Field("", repr=False)
    resume_token_ttl_s: int = Field(3600, ge=10, le=7 * 24 * 3600)
    demo_shop: bool = True
    demo_service_db: str = ""
    demo_faults: str = Field("", max_length=1000)

    @field_validator("api_tokens")
    @classmethod
    def _tokens_parse(cls, value: str) -> str:
        parse_api_tokens(value)  # raises ValueError with the reason
        return value

    @field_validator("plans")
    @classmethod
    def _default_plan(cls, value: dict[str, Plan]) -> dict[str, Plan]:
        return {"default": Plan(), **value}

    def plan_for(self, tenant_id: str) -> Plan:
        """The plan of ``tenant_id`` (``plans["default"]`` if it has none)."""
        return self.plans.get(tenant_id) or self.plans["default"]

    @property
    def tenants_by_token(self) -> dict[str, str]:
        """``api_tokens`` as token -> tenant."""
        return parse_api_tokens(self.api_tokens)
    vad: VadConfig = VadConfig()
    bargein: BargeInConfig = BargeInConfig()
    session: SessionConfig = SessionConfig()
    stt: SttConfig = SttConfig()
    llm: LlmConfig = LlmConfig()
    plans: dict[str, Plan] = Field(default_factory=lambda: {"default": Plan()})
    tts: TtsConfig = TtsConfig()
    telephony: TelephonySettings = TelephonySettings()
    devices: DeviceSettings = DeviceSettings()
    shutdown: ShutdownSettings = ShutdownSettings()
    traces: TraceSettings = TraceSettings()
    auth: AuthSettings = AuthSettings()
    limits: LimitSettings = LimitSettings()
    capacity: CapacitySettings = CapacitySettings()
    admin_token: str = Field("", repr=False, max_length=256)
    advertise_url: str = Field("", max_length=512, pattern=r"^(https?://\S+)?$")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _CONFIG_FILE.get()
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)


def parse_api_tokens(spec: str) -> dict[str, str]:
    """Parse ``"tenant_a:token_a,tenant_b:token_b"`` into token -> tenant.

    Raises:
        ValueError: a pair without ``:``, an empty tenant or token, a token
            with whitespace, or one token given to two tenants.
    """
    out: dict[str, str] = {}
    for pair in (p.strip() for p in spec.split(",")):
        if not pair:
            continue
        tenant, sep, token = pair.partition(":")
        tenant, token = tenant.strip(), token.strip()
        if not sep or not tenant or not token:
            raise ValueError("api_tokens must be tenant:token pairs separated by commas")
        if any(c.isspace() for c in token):
            raise ValueError(f"the token of tenant {tenant!r} contains whitespace")
        if token.startswith("sha256:") and not _is_sha256_hex(token[len("sha256:"):]):
            raise ValueError(f"the token of tenant {tenant!r} starts with sha256: but is not 64 hex digits after it")
        if token.startswith("ck_"):
            raise ValueError(f"the token of tenant {tenant!r} starts with ck_, which marks client tokens")
        if token in out and out[token] != tenant:
            raise ValueError("one token is given to two tenants")
        out[token] = tenant
    return out


def _is_sha256_hex(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


def load_settings(config: str | Path | None = None, **overrides: Any) -> Settings:
    """Build :class:`Settings` from ``config`` (or ``$TURNKEEPER_CONFIG``), the
    environment and ``overrides`` (None values are ignored).

    Raises:
        FileNotFoundError: the named TOML file does not exist.
        pydantic.ValidationError: a value is out of range or unknown.
        tomllib.TOMLDecodeError: the file is not valid TOML.
    """
    path = config or os.environ.get("TURNKEEPER_CONFIG")
    toml_path = Path(path) if path else None
    if toml_path is not None and toml_path.is_dir():
        raise ValueError(f"config file {toml_path} is a folder, not a TOML file")
    if toml_path is not None and not toml_path.is_file():
        raise FileNotFoundError(2, "config file not found", str(toml_path))
    check_environment(os.environ)
    token = _CONFIG_FILE.set(toml_path)
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {toml_path} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"config file {toml_path} is not UTF-8 text") from exc
    finally:
        _CONFIG_FILE.reset(token)


#: ``TURNKEEPER_*`` variables that are no setting: the credentials
#: ``turnkeeper call`` reads (the defaults of ``--token`` and ``--device-token``)
CALL_TOKEN_ENV = "TURNKEEPER_TOKEN"
CALL_DEVICE_TOKEN_ENV = "TURNKEEPER_DEVICE_TOKEN"


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuse ``TURNKEEPER_*`` variables that name no setting, so a typo does
    not silently leave a default in place (``TURNKEEPER_CONFIG`` and the
    client's ``CALL_TOKEN_ENV`` and ``CALL_DEVICE_TOKEN_ENV`` are known).

    Raises:
        ValueError: naming the unknown variables and the known ones.
    """
    known = {"TURNKEEPER_CONFIG", CALL_TOKEN_ENV, CALL_DEVICE_TOKEN_ENV}

    def add(prefix: str, model: Any) -> None:
        # every level of nested settings (session.endpoint.silence_ms, ...)
        for name, field in model.model_fields.items():
            env = f"{prefix}{name.upper()}"
            known.add(env)
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                add(f"{env}__", field.annotation)

    add("TURNKEEPER_", Settings)
    unknown = sorted(k for k in environ if k.upper().startswith("TURNKEEPER_") and k.upper() not in known)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name.upper(), known, n=1)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise ValueError(f"unknown setting in the environment: {', '.join(hints)}; README.md lists the settings")
