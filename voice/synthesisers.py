"""Which speech synthesiser speaks the agent's replies, and its settings
(``[tts]``, env ``TURNKEEPER_TTS__*``).

``tts.provider``:

- ``"embedded"`` (default): espeak-ng on this machine (:mod:`voice.tts`);
- ``"openai"``: ``POST {base_url}/audio/speech`` with ``pcm`` output,
  streamed; OpenAI, Kokoro-FastAPI, speaches and other compatible servers
  (:mod:`voice.openai_tts`);
- ``"elevenlabs"``: the multi-context stream-input WebSocket
  (:mod:`voice.elevenlabs_tts`);
- ``"cartesia"``: the TTS WebSocket with a context per reply
  (:mod:`voice.cartesia_tts`);
- ``"deepgram"``: the Aura ``/v1/speak`` WebSocket (:mod:`voice.deepgram_tts`).

With a provider, ``tts.fallback = "embedded"`` (default) has espeak-ng say
what the provider could not (:mod:`voice.tts_failover`); ``"none"`` ends
the reply with an error event instead. Wire formats:
shared/reference/speech-providers.md, section 2.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from voice.providers import plain_base_url
from voice.synthesis import Synthesiser, SynthesisPricing
from voice.tts import EspeakConfig

#: the PCM rates ``tts.sample_rate`` may ask for, Hz
SAMPLE_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
#: the provider's own base URL (``tts.base_url`` empty)
DEFAULT_BASE_URL = {
    "openai": "https://api.openai.com/v1",
    "elevenlabs": "wss://api.elevenlabs.io",
    "cartesia": "wss://api.cartesia.ai",
    "deepgram": "wss://api.deepgram.com",
}
#: the provider's model when ``tts.model`` is empty
DEFAULT_MODEL = {
    "openai": "gpt-4o-mini-tts",
    "elevenlabs": "eleven_flash_v2_5",
    "cartesia": "sonic-2",
    "deepgram": "aura-2-thalia-en",
}
#: the provider's voice when ``tts.voice`` is empty (ElevenLabs and Cartesia: voice ids)
DEFAULT_VOICE = {
    "embedded": "en-us",
    "openai": "alloy",
    "elevenlabs": "21m00Tcm4TlvDq8ikWAM",
    "cartesia": "f786b574-daa5-4673-aa0c-cbe3e8534c02",
    "deepgram": "",
}


class TtsConfig(BaseModel):
    """Speech synthesis settings (env ``TURNKEEPER_TTS__*``, TOML ``[tts]``).

    Attributes:
        provider: ``"embedded"`` (espeak-ng), ``"openai"``,
            ``"elevenlabs"``, ``"cartesia"`` or ``"deepgram"`` (module doc).
        base_url: where the provider is. ``openai``: the URL up to ``/v1``,
            as ``llm.base_url`` (``http://127.0.0.1:8880/v1`` for a local
            Kokoro-FastAPI); the others: the host (``wss://api.cartesia.ai``;
            the client adds the path). Empty: the provider's own.
        api_key: the provider's key (OpenAI: ``Bearer``; ElevenLabs:
            ``xi-api-key``; Cartesia: ``X-API-Key``; Deepgram: ``Token``).
        model: the provider's model (empty: see ``DEFAULT_MODEL``; Deepgram's
            model names the voice too, ``aura-2-thalia-en``).
        voice: the voice: an espeak-ng voice name for ``embedded``
            (``en-gb``, ``en-us+f3``), OpenAI's voice name, an ElevenLabs or
            Cartesia voice id. Empty: the provider's default.
        language: the language of the replies (BCP-47; Cartesia and
            ElevenLabs are told it).
        sample_rate: the rate asked of the provider, Hz (OpenAI's own
            ``pcm`` is always 24 kHz: asked of it as ``sample_rate``, which
            speaches honours and OpenAI ignores). The audio is resampled to
            48 kHz for playout.
        fallback: ``"embedded"`` (espeak-ng says what the provider could
            not) or ``"none"`` (the reply ends with an error event).
        embedded_voice: espeak-ng's voice when it stands in for a provider.
        connect_timeout_s: connecting to the provider at most, s.
        first_audio_timeout_s: a segment whose first audio has not arrived
            this long after it was sent counts as the provider's failure, s.
        cents_per_1k_characters: US cents per 1,000 characters sent.
        executable / words_per_minute / pitch / pause_ms: espeak-ng's
            (:class:`voice.tts.EspeakConfig`).
    """

    model_config = ConfigDict(extra="forbid")

    provider: Literal["embedded", "openai", "elevenlabs", "cartesia", "deepgram"] = "embedded"
    base_url: str = Field("", max_length=2000, pattern=r"^((https?|wss?)://\S+)?$")
    api_key: SecretStr = SecretStr("")
    model: str = Field("", max_length=200)
    voice: str = Field("", max_length=200)
    language: str = Field("en", max_length=35, pattern=r"^[A-Za-z]{2,3}([-_][A-Za-z0-9]{2,8})*$|^$")
    sample_rate: int = 24000
    fallback: Literal["embedded", "none"] = "embedded"
    embedded_voice: str = Field("en-us", min_length=1, max_length=200)
    connect_timeout_s: float = Field(5.0, gt=0, le=120)
    first_audio_timeout_s: float = Field(5.0, gt=0, le=120)
    cents_per_1k_characters: float = Field(0.0, ge=0, allow_inf_nan=False)
    executable: str = "espeak-ng"
    words_per_minute: int = Field(165, ge=80, le=450)
    pitch: int = Field(50, ge=0, le=99)
    pause_ms: int = Field(120, ge=0, le=2000)

    @field_validator("base_url")
    @classmethod
    def _base_url_plain(cls, value: str) -> str:
        return plain_base_url(value)

    @field_validator("sample_rate")
    @classmethod
    def _sample_rate_offered(cls, value: int) -> int:
        """The PCM rates the providers offer (ElevenLabs' ``pcm_*`` set)."""
        if value not in SAMPLE_RATES:
            raise ValueError(f"sample_rate must be one of {', '.join(map(str, SAMPLE_RATES))} Hz")
        return value

    @property
    def url(self) -> str:
        """``base_url``, or the provider's own, without a trailing slash."""
        return (self.base_url or DEFAULT_BASE_URL.get(self.provider, "")).rstrip("/")

    @property
    def model_name(self) -> str:
        """``model``, or the provider's default."""
        return self.model or DEFAULT_MODEL.get(self.provider, "")

    @property
    def voice_name(self) -> str:
        """``voice``, or the provider's default."""
        return self.voice or DEFAULT_VOICE.get(self.provider, "")

    @property
    def pricing(self) -> SynthesisPricing:
        """The provider's prices."""
        return SynthesisPricing(cents_per_1k_characters=self.cents_per_1k_characters)

    @property
    def espeak(self) -> EspeakConfig:
        """espeak-ng's settings: the provider's when it is ``embedded``,
        else the fallback's (``embedded_voice``)."""
        voice = self.voice_name if self.provider == "embedded" else self.embedded_voice
        return EspeakConfig(
            executable=self.executable, voice=voice, words_per_minute=self.words_per_minute, pitch=self.pitch,
            pause_ms=self.pause_ms,
        )


def build_synthesiser(config: TtsConfig, http: object | None = None) -> Synthesiser:
    """The configured provider's synthesiser for one session, unwarmed
    (without its fallback: :func:`voice.tts_failover.with_fallback` adds it).

    Args:
        config: the settings.
        http: an ``aiohttp.ClientSession`` shared by the server's sessions
            (``openai``: its keep-alive pool); None: the synthesiser makes
            its own.
    """
    if config.provider == "embedded":
        from voice.tts import EspeakSynthesiser

        return EspeakSynthesiser(config.espeak)
    if config.provider == "openai":
        from voice.openai_tts import OpenAiSynthesiser

        return OpenAiSynthesiser(config, http)  # type: ignore[arg-type]
    if config.provider == "elevenlabs":
        from voice.elevenlabs_tts import ElevenLabsSynthesiser

        return ElevenLabsSynthesiser(config)
    if config.provider == "cartesia":
        from voice.cartesia_tts import CartesiaSynthesiser

        return CartesiaSynthesiser(config)
    from voice.deepgram_tts import DeepgramSynthesiser

    return DeepgramSynthesiser(config)


async def check_key(config: TtsConfig) -> str | None:
    """One look at the provider at startup, without synthesising anything
    (nothing billed): the WebSocket upgrade its replies use (ElevenLabs,
    Cartesia, Deepgram) or ``GET {base_url}/models`` (OpenAI), with the key.

    Returns:
        None if it answered (or ``provider`` is ``embedded``), else one line
        for the log naming the setting to fix: ``tts.api_key`` when the key
        was refused (401/403), ``tts.base_url`` when it could not be
        reached, and what replies will do meanwhile (``tts.fallback``).
    """
    import aiohttp

    if config.provider == "embedded":
        return None
    key = config.api_key.get_secret_value()
    then = "replies are spoken by espeak-ng (tts.fallback)" if config.fallback == "embedded" else "replies will fail (tts.fallback = none)"
    headers: dict[str, str] = {}
    if config.provider == "openai":
        from voice.openai_tts import speech_url

        url = speech_url(config).rsplit("/audio/speech", 1)[0] + "/models"
        if key:
            headers["Authorization"] = f"Bearer {key}"
    elif config.provider == "elevenlabs":
        from voice.elevenlabs_tts import stream_url

        url = str(stream_url(config))
        headers["xi-api-key"] = key
    elif config.provider == "cartesia":
        from voice.cartesia_tts import API_VERSION, websocket_url

        url = str(websocket_url(config))
        headers.update({"X-API-Key": key, "Cartesia-Version": API_VERSION})
    else:
        from voice.deepgram_tts import speak_url

        url = str(speak_url(config))
        headers["Authorization"] = f"Token {key}"
    timeout = aiohttp.ClientTimeout(total=2 * config.connect_timeout_s, sock_connect=config.connect_timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            if config.provider == "openai":
                async with http.get(url, headers=headers, allow_redirects=False) as resp:
                    status = resp.status
            else:
                async with http.ws_connect(url, headers=headers, autoping=False) as ws:
                    await ws.close()
                    status = 101
    except aiohttp.WSServerHandshakeError as exc:
        status = exc.status
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return f"tts.base_url: {config.provider} could not be reached at {config.url} ({type(exc).__name__}: {exc}); {then}"
    if status in (401, 403):
        return f"tts.api_key: refused by {config.provider} at {config.url} ({status}); {then}"
    return None
