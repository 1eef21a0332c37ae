"""Offer validation: refuse an SDP offer that can never connect, before any
session or pending slot is created for it.

aiortc's ``setRemoteDescription`` accepts many offers that cannot work: no
``a=fingerprint`` (DTLS-SRTP cannot start), an audio m-line with port 0 (the
offerer rejected it), a protocol without DTLS, a microphone the client will
not send. Each such offer used to be answered 200 and kept a pending session
(and one of its client's ``max_pending_per_client`` slots) until
``connect_timeout_s``. :func:`validate_offer` checks the offer first, with
aiortc's own parser (so it judges what aiortc will see), and raises
:class:`OfferRejected` naming the first fault and the rule it breaks.

The rules, and where each comes from, are on the ``_check_*`` functions. They
follow RFC 8829 (JSEP), RFC 8843 (BUNDLE), RFC 8839 (ICE), RFC 8122 and
RFC 8842 (DTLS fingerprints and setup), restricted to what this server and
aiortc can actually use. One is stricter than JSEP on purpose: RFC 8829
section 5.1.2 asks an answerer to accept legacy profile names such as
``RTP/AVP`` when ``a=fingerprint`` is present, but aiortc always answers
``UDP/TLS/RTP/SAVPF``, which the same section forbids (the answer's profile
must match the offer's); such an offer is refused instead of answered wrongly.

The limits below bound the work one offer can cost; the request body itself
is already capped by the ``max_offer_bytes`` setting (413 above it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from aiortc import sdp as aiortc_sdp
from aiortc.codecs import CODECS
from aiortc.rtcdtlstransport import X509_DIGEST_ALGORITHMS
from aiortc.rtcpeerconnection import find_common_codecs
from aiortc.rtcrtpparameters import RTCRtpCodecParameters
from aiortc.rtp import FORBIDDEN_PAYLOAD_TYPES

#: longest accepted SDP line, characters. The longest lines browsers write
#: (ICE candidates with mDNS names, sha-512 fingerprints, H.264 fmtp) are
#: about 200; a 60 KB attribute is no real offer, only parser work.
MAX_LINE_CHARS = 1024
#: most m-sections accepted in one offer. A voice client needs 2 (audio and
#: the ``events`` data channel); a page that also offers a camera or a screen
#: stays well under. Each m-section costs aiortc a transceiver and, when not
#: bundled, its own ICE gathering and DTLS handshake.
MAX_MEDIA_SECTIONS = 8
#: most payload types (formats) on one m-line. An RTP payload type is 7 bits
#: (RFC 3550 section 5.1), so more than 128 can only repeat; Chromium lists
#: about 10 for audio and 40 for video.
MAX_FORMATS_PER_MEDIA = 128
#: most ICE candidates on one m-section. aiortc pairs every remote candidate
#: with every local one and checks each pair; browsers send 2 to 12
#: (host, server-reflexive and relay, per interface and IP version).
MAX_CANDIDATES_PER_MEDIA = 32
#: longest message echoed back, characters (messages quote the offer)
MAX_MESSAGE_CHARS = 300

#: RTP profiles with DTLS-SRTP that aiortc answers correctly: RFC 5764
#: section 9 (UDP/TLS/RTP/SAVPF), RFC 7850 section 3.5 and RFC 8842
#: (TCP/DTLS/RTP/SAVPF)
DTLS_SRTP_PROFILES = ("UDP/TLS/RTP/SAVPF", "TCP/DTLS/RTP/SAVPF")
#: data channel profiles (RFC 8841 section 4.1; DTLS/SCTP is the legacy
#: name aiortc still accepts)
DTLS_SCTP_PROFILES = ("UDP/DTLS/SCTP", "TCP/DTLS/SCTP", "DTLS/SCTP")
#: a=setup values an offer may carry and aiortc understands (RFC 4145
#: section 4, RFC 8842 section 5; ``holdconn`` is not supported by aiortc)
SETUP_VALUES = ("actpass", "active", "passive")
#: directions of the audio m-section in which the client sends its
#: microphone, which the server must receive (RFC 8866 section 6.7)
RECEIVABLE_DIRECTIONS = ("sendrecv", "sendonly")

_LINE = re.compile(r"[a-z]=")
# aiortc's own m-line pattern (aiortc.sdp.SessionDescription.parse)
_MEDIA_LINE = re.compile(r"m=[^ ]+ [0-9]+ [A-Z/]+ .+")
# RFC 8839 section 5.4: ice-char = ALPHA / DIGIT / "+" / "/"
_ICE_UFRAG = re.compile(r"[A-Za-z0-9+/]{4,256}")
_ICE_PWD = re.compile(r"[A-Za-z0-9+/]{22,256}")
# RFC 8122 section 5: 2UHEX *(":" 2UHEX); lower case is accepted as browsers do
_FINGERPRINT = re.compile(r"[0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2})*")


class OfferRejected(Exception):
    """The offer cannot be answered (malformed SDP, no audio, ...).

    Attributes:
        code: machine-readable error code for the JSON body
            (``invalid_sdp`` or ``no_audio``).
    """

    def __init__(self, code: str, message: str) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 3] + "..."
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> OfferRejected:
    return OfferRejected("invalid_sdp", message)


def validate_offer(sdp: str) -> None:
    """Check that ``sdp`` is an offer this server can answer and connect.

    Cheap (one pass over at most ``max_offer_bytes`` of text, then aiortc's
    parser), so it runs before any session or slot is taken.

    Raises:
        OfferRejected: ``no_audio`` when there is no audio m-section,
            ``invalid_sdp`` for anything else, with a message naming the
            first fault found.
    """
    lines = sdp.splitlines()  # what aiortc's parser splits on
    _check_lines(lines)
    try:
        description = aiortc_sdp.SessionDescription.parse(sdp)
    except Exception as exc:  # ValueError, KeyError, AssertionError, StopIteration...
        raise _invalid(f"cannot parse the SDP ({type(exc).__name__}: {exc})") from exc
    _, media_lines = aiortc_sdp.grouplines(sdp)
    _check_groups(description)
    audio = [i for i, m in enumerate(description.media) if m.kind == "audio"]
    if not audio:
        raise OfferRejected("no_audio", "the offer has no audio m-line")
    for index, media in enumerate(description.media):
        _check_transport(index, media)
    if not any(m.ice_candidates for m in description.media):
        raise _invalid(
            "the offer carries no a=candidate: send it once ICE gathering is complete; the server takes "
            "no trickled candidates (RFC 8829 section 5.2.1, RFC 8839 section 5.1)"
        )
    first = audio[0]
    _check_audio(first, description.media[first], media_lines[first])


def _where(index: int, media: aiortc_sdp.MediaDescription) -> str:
    return f"m-line {index + 1} ({media.kind})"


def _check_lines(lines: Sequence[str]) -> None:
    """Shape and size, before anything is parsed (aiortc's parser reports
    some of these only with a bare ``AssertionError``, and not at all under
    ``python -O``).

    - The first line is ``v=0`` (RFC 8866 section 5.1).
    - Every line is ``<type>=<value>`` with a one-letter type (RFC 8866
      section 5); blank lines are tolerated.
    - At most :data:`MAX_MEDIA_SECTIONS` m-lines, each
      ``m=<media> <port> <proto> <fmt> ...`` (RFC 8866 section 5.14) with at
      most :data:`MAX_FORMATS_PER_MEDIA` formats; on audio and video m-lines
      the formats are RTP payload types 0..127 (RFC 3550 section 5.1) other
      than 72..76, which collide with RTCP packet types when RTCP is
      multiplexed (RFC 5761 section 4).
    - No line is longer than :data:`MAX_LINE_CHARS`.
    - ``a=setup`` is actpass, active or passive (RFC 4145 section 4,
      RFC 8842 section 5).
    """
    first = next((line for line in lines if line.strip()), "")
    if first.strip() != "v=0":
        raise _invalid("SDP must start with 'v=0' (RFC 8866 section 5.1)")
    sections = sum(1 for line in lines if line.startswith("m="))
    if sections > MAX_MEDIA_SECTIONS:
        raise _invalid(f"the offer has {sections} m-lines; at most {MAX_MEDIA_SECTIONS} are accepted")
    media = 0
    for number, line in enumerate(lines, start=1):
        if line.startswith("m="):
            media += 1
            _check_media_line(media, line)
        if len(line) > MAX_LINE_CHARS:
            raise _invalid(f"line {number} is {len(line)} characters long; at most {MAX_LINE_CHARS} are accepted")
        if not line.strip():
            continue
        if not _LINE.match(line):
            raise _invalid(f"line {number} is not '<type>=<value>' (RFC 8866 section 5): {line[:40]!r}")
        if line.startswith("a=setup:") and line[8:].strip() not in SETUP_VALUES:
            raise _invalid(
                f"line {number}: a=setup must be {', '.join(SETUP_VALUES)} (RFC 4145 section 4, RFC 8842 section 5): "
                f"{line[:40]!r}"
            )


def _check_media_line(media: int, line: str) -> None:
    fields = line[2:].split()
    formats = len(fields) - 3
    if formats > MAX_FORMATS_PER_MEDIA:
        raise _invalid(
            f"m-line {media} lists {formats} formats; at most {MAX_FORMATS_PER_MEDIA} are accepted "
            "(an RTP payload type is 7 bits, RFC 3550 section 5.1)"
        )
    if not _MEDIA_LINE.fullmatch(line):
        raise _invalid(f"m-line {media} is not 'm=<media> <port> <proto> <fmt> ...' (RFC 8866 section 5.14): {line[:60]!r}")
    if fields[0] in ("audio", "video"):
        for fmt in fields[3:]:
            if not (fmt.isascii() and fmt.isdigit()) or int(fmt) > 127 or int(fmt) in FORBIDDEN_PAYLOAD_TYPES:
                raise _invalid(
                    f"m-line {media} ({fields[0]}) lists payload type {fmt[:10]!r}; RTP payload types are 0..127 "
                    "except 72..76 (RFC 3550 section 5.1, RFC 5761 section 4)"
                )


def _check_groups(description: aiortc_sdp.SessionDescription) -> None:
    """BUNDLE groups name m-sections that exist, by unique ``a=mid`` values
    (RFC 5888 sections 4 and 5)."""
    mids = [m.rtp.muxId for m in description.media if m.rtp.muxId]
    duplicated = sorted({mid for mid in mids if mids.count(mid) > 1})
    if duplicated:
        raise _invalid(f"a=mid {duplicated[0]!r} is used by more than one m-line (RFC 5888 section 4)")
    for group in description.group:
        missing = [mid for mid in group.items if mid not in mids]
        if missing:
            raise _invalid(
                f"a=group:{group.semantic} names mid {str(missing[0])!r}, which no m-line has (RFC 5888 section 5)"
            )


def _check_transport(index: int, media: aiortc_sdp.MediaDescription) -> None:
    """What every m-section needs for aiortc to set up ICE and DTLS on it
    (aiortc uses every m-section of an offer, even one with port 0).

    - Protocol: DTLS-SRTP for RTP media (:data:`DTLS_SRTP_PROFILES`,
      RFC 5764 section 9, RFC 7850 section 3.5, RFC 8829 section 5.1.2 with
      the restriction explained in the module docstring), DTLS/SCTP for data
      (:data:`DTLS_SCTP_PROFILES`, RFC 8841 section 4.1).
    - ``a=rtcp-mux`` on RTP media: JSEP offers always multiplex
      (RFC 8829 section 5.2.1, RFC 8858) and aiortc supports nothing else.
    - ``a=ice-ufrag`` (4 to 256 ice-chars) and ``a=ice-pwd`` (22 to 256), at
      session or media level (RFC 8839 section 5.4).
    - At most :data:`MAX_CANDIDATES_PER_MEDIA` ``a=candidate`` lines, each
      with a port 1..65535 (RFC 8839 section 5.1); and the offer as a whole
      carries at least one (no trickle ICE: an offer sent before gathering
      finished can never connect).
    - ``a=setup`` with actpass, active or passive (RFC 4145 section 4,
      RFC 8842 section 5).
    - At least one ``a=fingerprint`` (session or media level) whose hash
      function aiortc can check (sha-256, sha-384, sha-512), written as
      colon-separated hex bytes of that hash's length (RFC 8122 section 5).
    """
    where = _where(index, media)
    if media.kind in ("audio", "video"):
        if media.profile not in DTLS_SRTP_PROFILES:
            raise _invalid(
                f"{where} uses protocol {media.profile}; DTLS-SRTP is required: "
                f"{' or '.join(DTLS_SRTP_PROFILES)} (RFC 5764, RFC 8842)"
            )
        if not media.rtcp_mux:
            raise _invalid(f"{where} has no a=rtcp-mux; RTP and RTCP must share one port (RFC 8829 section 5.2.1, RFC 5761)")
    elif media.kind == "application":
        if media.profile not in DTLS_SCTP_PROFILES:
            raise _invalid(
                f"{where} uses protocol {media.profile}; data channels need {' or '.join(DTLS_SCTP_PROFILES)} (RFC 8841)"
            )
    ice = media.ice  # aiortc's parser always makes one (typed Optional)
    if ice is None or not ice.usernameFragment or not ice.password:
        raise _invalid(f"{where} has no a=ice-ufrag or no a=ice-pwd, at session or media level (RFC 8839 section 5.4)")
    if not _ICE_UFRAG.fullmatch(ice.usernameFragment):
        raise _invalid(f"{where}: a=ice-ufrag must be 4 to 256 characters of A-Z a-z 0-9 + / (RFC 8839 section 5.4)")
    if not _ICE_PWD.fullmatch(ice.password):
        raise _invalid(f"{where}: a=ice-pwd must be 22 to 256 characters of A-Z a-z 0-9 + / (RFC 8839 section 5.4)")
    if len(media.ice_candidates) > MAX_CANDIDATES_PER_MEDIA:
        raise _invalid(
            f"{where} has {len(media.ice_candidates)} ICE candidates; at most {MAX_CANDIDATES_PER_MEDIA} are accepted"
        )
    for candidate in media.ice_candidates:
        if not 0 < candidate.port <= 65535:
            raise _invalid(f"{where} has an a=candidate with port {candidate.port}; a port is 1..65535 (RFC 8839 section 5.1)")
    if media.dtls is None:  # aiortc's parser drops the DTLS parameters without a=setup
        raise _invalid(f"{where} has no a=setup; an offer says a=setup:actpass (RFC 8842 section 5)")
    fingerprints = media.dtls.fingerprints
    if not fingerprints:
        raise _invalid(
            f"{where} has no a=fingerprint at session or media level; DTLS-SRTP cannot be set up "
            "without the certificate's fingerprint (RFC 8122 section 5, RFC 8842)"
        )
    usable = [f for f in fingerprints if f.algorithm.lower() in X509_DIGEST_ALGORITHMS]
    if not usable:
        offered = ", ".join(sorted({f.algorithm for f in fingerprints}))
        raise _invalid(
            f"{where}: no a=fingerprint uses a hash function the server can check ({offered} offered; "
            f"{', '.join(X509_DIGEST_ALGORITHMS)} supported; RFC 8122 section 5)"
        )
    for f in usable:
        size = X509_DIGEST_ALGORITHMS[f.algorithm.lower()].digest_size
        if not _FINGERPRINT.fullmatch(f.value) or len(f.value.split(":")) != size:
            raise _invalid(
                f"{where}: the {f.algorithm} a=fingerprint is not {size} colon-separated hex bytes (RFC 8122 section 5)"
            )


def _check_audio(index: int, media: aiortc_sdp.MediaDescription, lines: Sequence[str]) -> None:
    """The first audio m-section is the one the server uses (``web.peer``
    takes the first audio transceiver for the microphone and its reply).

    - Its port is not 0: a zero port means the offerer rejects the stream
      (RFC 3264 section 5.1), unless it carries
      ``a=bundle-only`` (RFC 8843 section 6).
    - Its direction lets the client send (sendrecv or sendonly; RFC 8866
      section 6.7): the server must hear the user. An offer without any
      direction attribute is refused too: aiortc then opens no inbound track
      (JSEP offers always carry one, RFC 8829 section 5.2.1).
    - Every ``a=rtpmap`` is for a payload type its m-line lists (RFC 8866
      section 6.6): aiortc would otherwise answer with one the offer never
      lists.
    - It lists a codec aiortc negotiates and decodes (Opus, G.722, PCMU,
      PCMA, each by its ``a=rtpmap``), found with aiortc's own
      ``find_common_codecs``.
    """
    where = _where(index, media)
    if media.port == 0 and "a=bundle-only" not in (line.strip() for line in lines):
        raise _invalid(f"{where} has port 0: the offer rejects its audio stream (RFC 3264 section 5.1)")
    if media.direction is None:
        raise _invalid(f"{where} has no direction attribute; it must be a=sendrecv or a=sendonly (RFC 8866 section 6.7)")
    if media.direction not in RECEIVABLE_DIRECTIONS:
        raise _invalid(
            f"{where} is a={media.direction}: the client would send no audio for the server to hear; "
            f"it must be {' or '.join('a=' + d for d in RECEIVABLE_DIRECTIONS)} (RFC 8866 section 6.7)"
        )
    listed = set(media.fmt)
    for codec in media.rtp.codecs:
        if codec.payloadType not in listed:
            raise _invalid(
                f"{where} has a=rtpmap:{codec.payloadType} for a payload type its m-line does not list "
                "(RFC 8866 section 6.6)"
            )
    if not find_common_codecs(CODECS["audio"], media.rtp.codecs):
        offered = ", ".join(dict.fromkeys(_codec_name(c) for c in media.rtp.codecs)) or "none"
        usable = ", ".join(_codec_name(c) for c in CODECS["audio"])
        raise _invalid(
            f"{where} offers no codec the server can use (a=rtpmap: {offered}); it takes {usable}"
        )


def _codec_name(codec: RTCRtpCodecParameters) -> str:
    return f"{codec.mimeType.split('/', 1)[-1]}/{codec.clockRate}"
