"""Which speech recogniser the server uses: the ``stt.*`` settings and the
recognisers they name (issue 28).

``stt.provider`` picks one:

- ``whisper`` (the default): Whisper tiny.en, embedded (offline, no key,
  weights from a pinned package), segmented by our own endpointing
  (:mod:`voice.whisper_stt`);
- ``pocketsphinx``: the light embedded recogniser for the smallest
  machines, far less accurate (:mod:`voice.pocketsphinx_stt`);
- ``deepgram``: Deepgram's live WebSocket (:mod:`voice.deepgram_stt`);
- ``openai_realtime``: an OpenAI Realtime transcription session, GA or the
  older beta shape that speaches speaks (:mod:`voice.openai_realtime_stt`);
- ``openai``: ``POST /v1/audio/transcriptions`` once per utterance, the
  moment our endpointing ends it (OpenAI, speaches, vLLM, whisper.cpp with
  its path remapped; :mod:`voice.openai_stt`).

With a provider, ``stt.fallback = "embedded"`` (the default) keeps the
embedded recogniser ``stt.embedded`` (Whisper unless set) loaded and
takes over when the provider fails (:mod:`voice.stt_failover`); ``"none"``
ends the waiting turns FAILED.
Wire formats: shared/reference/speech-providers.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from voice import pocketsphinx_worker
from voice.pocketsphinx_stt import PocketsphinxConfig, PocketsphinxSTT
from voice.providers import plain_base_url
from voice.recognition import Recogniser, SpeechPricing
from voice.whisper_stt import WhisperConfig, WhisperSTT

#: each provider's base URL when ``stt.base_url`` is empty
DEFAULT_BASE_URL = {
    "deepgram": "wss://api.deepgram.com",
    "openai_realtime": "https://api.openai.com/v1",
    "openai": "https://api.openai.com/v1",
}
#: each provider's model when ``stt.model`` is empty
DEFAULT_MODEL = {
    "deepgram": "nova-3",
    "openai_realtime": "gpt-4o-transcribe",
    "openai": "gpt-4o-transcribe",
}


class SttConfig(BaseModel):
    """Speech recognition settings (env ``TURNKEEPER_STT__*``, TOML ``[stt]``).

    Attributes:
        provider: ``"whisper"`` or ``"pocketsphinx"`` (embedded),
            ``"deepgram"``, ``"openai_realtime"`` or ``"openai"`` (see the
            module doc).
        base_url: where the provider is. Deepgram: the host
            (``wss://api.deepgram.com``; the client adds ``/v1/listen``);
            the OpenAI ones: the URL up to ``/v1``, as ``llm.base_url``
            (``http://127.0.0.1:8000/v1`` for a local speaches). Empty:
            the provider's own.
        api_key: the provider's key (Deepgram: sent as ``Token``; OpenAI:
            ``Bearer``). Empty: none (local servers).
        model: the provider's model (empty: ``nova-3`` for Deepgram,
            ``gpt-4o-transcribe`` for OpenAI).
        language: the language spoken (BCP-47, e.g. ``en``, ``en-US``).
        fallback: ``"embedded"`` (the embedded recogniser takes over when
            the provider fails) or ``"none"`` (the turns waiting end FAILED).
        keyterms: words to listen for (names, products): Deepgram
            ``keyterm`` (nova-3) or ``keywords`` (older models); the OpenAI
            ones get them as the transcription ``prompt``.
        endpointing_ms: Deepgram's own endpointing silence, ms (its
            ``speech_final``; our endpointing still ends each utterance
            with ``Finalize``).
        utterance_end_ms: Deepgram's ``utterance_end_ms``, ms (>= 1000).
        interim_results: ask for interim text where the provider has it
            (Deepgram ``interim_results``; the barge-in rule and the
            backchannel judge read it).
        stream: ``openai``: ask for the transcript streamed
            (``stream=true``: OpenAI's, speaches' and vLLM's SSE shapes are
            all read).
        word_timestamps: ``openai``: ask for ``verbose_json`` with word
            timings (``whisper-1`` and most local servers support it;
            OpenAI's ``gpt-4o-*-transcribe`` models do not).
        realtime_shape: ``openai_realtime``: ``"ga"`` (OpenAI's
            ``session.update`` with ``type: transcription``), ``"beta"``
            (OpenAI's legacy ``transcription_session.update``, then the flat
            beta ``session.update`` that speaches speaks) or ``"auto"`` (GA,
            then those two, guided by the server's first event).
        connect_timeout_s: connecting to the provider at most, s.
        final_timeout_ms: a final the provider still owes this long after
            an utterance's end counts as its failure, ms.
        keepalive_s: Deepgram: a ``KeepAlive`` after this long with no
            audio sent, s (it closes an idle socket after 10 s).
        cents_per_minute: US cents per minute of audio (Deepgram nova-3
            streaming: about 0.77).
        input_cents_per_1k / output_cents_per_1k: US cents per 1,000
            audio input / text output tokens, for providers that bill tokens.
        billed_by: ``"audio"`` or ``"connection"``: what a session's
            minutes are priced on (see :class:`voice.recognition.SpeechPricing`).
        embedded: the embedded recogniser a provider falls back to.
        max_decoders: utterances an embedded recogniser decodes at once,
            across sessions: its worker processes (Whisper: about 150 MB each).
        threads: CPU threads of each Whisper decode.
        beam_size: Whisper's beam search width (1: greedy).
        model_dir: a faster-whisper model directory to load instead of the
            pinned package's tiny.en (not checked: it is yours).
        grammar / cmn_start: the embedded pocketsphinx recogniser's
            (:class:`voice.pocketsphinx_stt.PocketsphinxConfig`).
    """

    model_config = ConfigDict(extra="forbid")

    provider: Literal["whisper", "pocketsphinx", "deepgram", "openai_realtime", "openai"] = "whisper"
    base_url: str = Field("", max_length=2000, pattern=r"^((https?|wss?)://\S+)?$")
    api_key: SecretStr = SecretStr("")
    model: str = Field("", max_length=200)
    language: str = Field("en", max_length=35, pattern=r"^[A-Za-z]{2,3}([-_][A-Za-z0-9]{2,8})*$|^$")
    fallback: Literal["embedded", "none"] = "embedded"
    keyterms: list[str] = Field(default_factory=list, max_length=100)
    endpointing_ms: int = Field(300, ge=10, le=10_000)
    utterance_end_ms: int = Field(1000, ge=1000, le=10_000)
    interim_results: bool = True
    stream: bool = False
    word_timestamps: bool = False
    realtime_shape: Literal["auto", "ga", "beta"] = "auto"
    connect_timeout_s: float = Field(5.0, gt=0, le=120)
    final_timeout_ms: int = Field(4000, ge=200, le=60_000)
    keepalive_s: float = Field(4.0, gt=0, le=9.0)
    cents_per_minute: float = Field(0.0, ge=0, allow_inf_nan=False)
    input_cents_per_1k: float = Field(0.0, ge=0, allow_inf_nan=False)
    output_cents_per_1k: float = Field(0.0, ge=0, allow_inf_nan=False)
    billed_by: Literal["audio", "connection"] = "audio"
    embedded: Literal["whisper", "pocketsphinx"] = "whisper"
    max_decoders: int = Field(2, ge=1, le=64)
    threads: int = Field(2, ge=1, le=32)
    beam_size: int = Field(5, ge=1, le=16)
    model_dir: Path | None = None
    grammar: Path | None = None
    cmn_start: str = "model"

    @field_validator("cmn_start")
    @classmethod
    def _cmn_start_known(cls, value: str) -> str:
        pocketsphinx_worker.cmn_vector(value, "")
        return value

    @field_validator("base_url")
    @classmethod
    def _base_url_plain(cls, value: str) -> str:
        return plain_base_url(value)

    @field_validator("keyterms")
    @classmethod
    def _keyterms_short(cls, value: list[str]) -> list[str]:
        if any(not t.strip() or len(t) > 100 for t in value):
            raise ValueError("each keyterm must be 1 to 100 characters")
        return value

    @model_validator(mode="after")
    def _word_timestamps_possible(self) -> SttConfig:
        """OpenAI's ``gpt-4o-*-transcribe`` models refuse ``verbose_json``
        (400): asking for word timings from them would fail every utterance
        (reference section 1.3)."""
        if self.provider == "openai" and self.word_timestamps and self.model_name.startswith("gpt-4o"):
            raise ValueError(f"word_timestamps needs a model that answers verbose_json (whisper-1, a local Whisper), "
                             f"not {self.model_name}")
        return self

    @model_validator(mode="after")
    def _pocketsphinx_settings_for_pocketsphinx(self) -> SttConfig:
        """A grammar set for a recogniser that does not read one would be
        ignored silently: the transcripts would not be what it promises."""
        if self.embedded_name != "pocketsphinx" and (self.grammar is not None or self.cmn_start != "model"):
            raise ValueError("grammar and cmn_start are pocketsphinx settings: set stt.provider (or, with a provider, "
                             "stt.embedded) to pocketsphinx to use them")
        return self

    @model_validator(mode="after")
    def _embedded_hears_the_language(self) -> SttConfig:
        """The packaged Whisper model hears English only: say so now, not
        as English words made of another language's speech."""
        if self.embedded_name == "whisper" and (self.provider == "whisper" or self.fallback == "embedded"):
            self.whisper  # noqa: B018 (validates)
        return self

    @property
    def pocketsphinx(self) -> PocketsphinxConfig:
        """The embedded recogniser's settings."""
        return PocketsphinxConfig(grammar=self.grammar, max_decoders=self.max_decoders, cmn_start=self.cmn_start)

    @property
    def whisper(self) -> WhisperConfig:
        """The embedded Whisper recogniser's settings."""
        return WhisperConfig(
            model_dir=self.model_dir, workers=self.max_decoders, threads=self.threads, language=self.language or "en",
            beam_size=self.beam_size, keyterms=tuple(self.keyterms),
        )

    @property
    def embedded_name(self) -> Literal["whisper", "pocketsphinx"]:
        """The embedded recogniser in use: the provider if it is one, else ``embedded``."""
        if self.provider in ("whisper", "pocketsphinx"):
            return self.provider
        return self.embedded

    @property
    def pricing(self) -> SpeechPricing:
        """The provider's prices."""
        return SpeechPricing(
            cents_per_minute=self.cents_per_minute, input_cents_per_1k=self.input_cents_per_1k,
            output_cents_per_1k=self.output_cents_per_1k, billed_by=self.billed_by,
        )

    @property
    def url(self) -> str:
        """``base_url``, or the provider's own, without a trailing slash."""
        return (self.base_url or DEFAULT_BASE_URL.get(self.provider, "")).rstrip("/")

    @property
    def model_name(self) -> str:
        """``model``, or the provider's default."""
        return self.model or DEFAULT_MODEL.get(self.provider, "")


def build_recognisers(config: SttConfig) -> tuple[Recogniser, Recogniser | None]:
    """The configured recogniser and its fallback (None: none), unstarted.

    With an embedded provider (``whisper``, ``pocketsphinx``) it is the
    recogniser and there is no fallback; with another, the fallback is the
    ``embedded`` one (or none).
    """
    embedded: Recogniser = (
        WhisperSTT(config.whisper) if config.embedded_name == "whisper" else PocketsphinxSTT(config.pocketsphinx)
    )
    primary: Recogniser
    if config.provider in ("whisper", "pocketsphinx"):
        return embedded, None
    if config.provider == "deepgram":
        from voice.deepgram_stt import DeepgramRecogniser

        primary = DeepgramRecogniser(config)
    elif config.provider == "openai_realtime":
        from voice.openai_realtime_stt import OpenAiRealtimeRecogniser

        primary = OpenAiRealtimeRecogniser(config)
    else:
        from voice.openai_stt import OpenAiTranscriptionRecogniser

        primary = OpenAiTranscriptionRecogniser(config)
    return primary, embedded if config.fallback == "embedded" else None
