"""Where a running server's CPU goes, by stage of a voice session (issue 33).

:func:`profile_window` samples a server's process tree (the server and its
recogniser workers) with py-spy for a while and :func:`classify` puts each
sample in one stage by the innermost frame of its stack that belongs to a
known stage (``STAGES``, tried in order on each frame from the leaf up): the
Opus encoder called from the outbound track is "outbound encode and SRTP",
the echo reference fed from the same tick is "echo guard". A sample in
native code counts for the Python frame that called it (py-spy without
``--native``). Only running threads are sampled (py-spy's default), so the
shares are of busy time; multiplied by the process tree's CPU from /proc
over the same window they give each stage's share of a core. Threads that
run no Python (CTranslate2's and onnxruntime's own worker threads) are
not seen: their time shows up in the /proc figure only.

Tooling for bench/, not part of the product. Needs py-spy (``pip install
py-spy``; it reads the server's memory with ptrace, as its parent or root).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

#: (stage, pattern on one frame "function (file:line)"), tried in order on
#: each frame from the leaf up; the first frame any pattern matches decides
STAGES: tuple[tuple[str, str], ...] = (
    ("recognition", r"whisper|faster_whisper|ctranslate2|segmented_stt|voice/transcription|pocketsphinx|voice/recognition"),
    ("end of turn judge", r"voice/end_of_turn"),
    ("Silero", r"media/silero|pysilero|speech_confirmation"),
    ("echo guard", r"media/echo_guard"),
    ("VAD and speech onset", r"media/vad\.py|webrtcvad|media/speech_onset|media/bargein|media/noise_floor|media/syllables"),
    ("synthesis", r"voice/tts\.py|voice/synthesis|espeak|voice/reply|media/trim"),
    ("outbound encode and SRTP",
     r"encode \(.*aiortc/codecs|compute_audio_level|rtcrtpsender|pylibsrtp|srtp|media/outbound|media/declick|media/pacing"),
    ("inbound decode and resampling",
     r"decode \(.*aiortc/codecs|rtcrtpreceiver|jitterbuffer|media/inbound|media/reorder|av/audio/resampler|resample"),
    ("transport (ICE, DTLS, SCTP)", r"aioice|rtcicetransport|rtcdtlstransport|rtcsctptransport|aiortc/rtp\.py"),
    ("event log and delivery",
     r"turn/events|turn/store|turn/sqlite|aiosqlite|sqlite3|web/peer\.py.*_follow|voice/transport|event_json|datachannel"),
    ("turn-taking and the agent", r"voice/session|voice/turn_taking|voice/endpointing|voice/turn_handle|voice/respond|voice/llm|turn/"),
    ("metrics and traces", r"web/metrics|prometheus_client|opentelemetry|web/tracing"),
    ("playout", r"media/playout|media/paced_playout"),
)
#: what a sample is when no frame of its stack is in a stage: the event
#: loop's own work (waking tasks, timers, select) and the HTTP server
LOOP = ("asyncio and aiohttp", r"asyncio/|aiohttp/|selectors|uvloop")
_COMPILED = tuple((name, re.compile(pattern)) for name, pattern in STAGES)
_LOOP = re.compile(LOOP[1])
OTHER = "other"
#: leaf frames of a thread that waits (py-spy's idle detection misses
#: some, most of all with --nonblocking): the event loop's epoll, a thread
#: pool's idle workers, condition and event waits, a child watcher
IDLE = re.compile(r"^(EpollSelector\.select|select) \(selectors\.py|^_worker \(concurrent/futures/thread\.py"
                  r"|^(Condition|Event)\.wait \(threading\.py|_do_waitpid|^Queue\.get \(queue\.py")


def stage_of(stack: list[str]) -> str:
    """The stage of one sample: ``stack`` holds its frames root first; the
    innermost frame in a stage decides, else the event loop if any frame
    is in it, else ``OTHER``."""
    for frame in reversed(stack):
        for name, pattern in _COMPILED:
            if pattern.search(frame):
                return name
    return LOOP[0] if any(_LOOP.search(f) for f in stack) else OTHER


def classify(raw: str) -> tuple[dict[str, float], int, dict[str, int]]:
    """py-spy's raw (collapsed) output, one ``frame;frame;... count`` a
    line, as each stage's share (0..1) of the busy samples (those whose
    leaf frame is no wait, ``IDLE``), largest first; the number of busy
    samples; and the leaf frames of the busy samples no stage claimed, with
    their counts (the 20 most frequent)."""
    counts: Counter[str] = Counter()
    unclaimed: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        if IDLE.search(frames[-1]):
            continue
        stage = stage_of(frames)
        counts[stage] += int(n)
        if stage == OTHER:
            unclaimed[frames[-1]] += int(n)
    total = sum(counts.values())
    shares = {k: round(v / total, 4) for k, v in counts.most_common()} if total else {}
    return shares, total, dict(unclaimed.most_common(20))


def profile_window(pid: int, seconds: float, rate: int = 200, keep: Path | None = None) -> dict[str, Any]:
    """Sample process ``pid`` and its children for ``seconds`` s at
    ``rate`` Hz with py-spy (``keep``: also copy its raw output there).

    Returns:
        ``{"stages": {stage: share}, "samples": n, "unclaimed": {leaf frame: n}}``.

    Raises:
        RuntimeError: py-spy is not installed, or failed (its stderr).
    """
    spy = shutil.which("py-spy") or str(Path(__import__("sys").executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise RuntimeError("py-spy is not installed: pip install py-spy")
    with tempfile.TemporaryDirectory(prefix="tk-profile-") as tmp:
        out = Path(tmp) / "raw.txt"
        proc = subprocess.run(
            [spy, "record", "--pid", str(pid), "--subprocesses", "--rate", str(rate), "--format", "raw",
             "--duration", str(max(1, round(seconds))), "--nonblocking", "--output", str(out)],
            capture_output=True, text=True, timeout=seconds + 60,
        )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"py-spy failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
        raw = out.read_text()
        if keep is not None:
            keep.write_text(raw)
        stages, samples, unclaimed = classify(raw)
    return {"stages": stages, "samples": samples, "unclaimed": unclaimed}
