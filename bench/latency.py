#!/usr/bin/env python3
"""Voice-to-voice latency and false cut-offs, as a caller hears them, for
each way of ending the user's turn (issue 31, item 5).

For each endpointing mode named (``--modes``; the server setting
``session.endpoint.mode``), a turnkeeper server is started on loopback on
the embedded defaults (Whisper, the local agent with the demo shop's tools,
espeak-ng) with that mode, and the labelled turn corpus
(tests/turn_corpus.py: complete requests, requests with a 400-800 ms pause
mid-sentence, one-word answers, trailing-off sentences; espeak-ng in three
voices at two speeds) is said over WebRTC calls with the headless client
(client/call.py, ``CallClient.converse``): each session says its share of
the corpus one request after another, each once the reply to the one
before is over (every turn terminal and the agent silent; at most
``REPLY_TIMEOUT_S``), with ``GAP_S`` of silence between.

Modes:

- ``silence``: today's endpointing, a fixed silence after the end of
  speech (``session.endpoint.mode = "silence"``, ``speculative = false``);
- ``speculative``: the same fixed silence, with speculative replies
  (``speculative = true``: the reply starts at the tentative end, held
  until the silence confirms it);
- ``model``: the end-of-turn judge with speculative replies
  (``mode = "model"``, ``speculative = true``): the defaults. A server
  that refuses the setting (it predates it) is reported as such, not
  measured;
- ``model-one-bound``: the same with one bound for every "incomplete"
  (``unsure_silence_ms = incomplete_silence_ms``, 1500 ms): before the
  judge's two halves were weighed apart (finished words in audio the model
  finds unfinished wait ``unsure_silence_ms``, 800 ms);
- ``model-decode-100``: the defaults, with the recogniser starting its
  decode at 100 ms of quiet (``decode_at_ms``) instead of the VAD's
  speech_stopped (200 ms): sooner words, and decodes thrown away when
  the user goes on (the server CPU column shows what they cost).

Figures per mode, measured at the client (what a caller perceives), all
times on the client's clock:

- voice-to-voice, ms (min/p50/p95/max, over all requests answered after
  their end; also per kind): from the moment the last sample of the
  request's speech (the corpus's ``speech_end_s``) was handed to the RTP
  sender to the RTP arrival (before the jitter buffer) of the first packet
  of agent sound (RMS above -50 dBFS) after it. A request the agent began
  answering before it ended (see below) has no voice-to-voice: it is
  counted there instead, not as a fast reply;
- false cut-offs, "k of n" ``mid_pause`` requests and the share: agent
  sound arrived between the start of the mid-sentence pause (as sent) and
  the end of the request's speech (the agent spoke while the user was in
  the pause, or into the second part it interrupted), or a reply to the
  first part alone was heard at all (the request was answered in more than
  one turn and an ``audio.start`` came for one of the earlier turns);
- the first part acted on: ``mid_pause`` requests whose first part got a
  turn of its own that acted on it (the end of turn was confirmed in the
  pause and the model replied, or a tool ran, before the user went on),
  heard or not, and the tools with effects those turns started; split
  requests: of those, the ones whose first part's words were not carried
  into the last turn (its transcript does not begin with them: the server
  did not merge them, so the request was answered in parts);
- talked over: requests of any kind with agent sound before their speech
  ended; no reply: requests after which no agent sound came at all;
- speculative replies started and taken back, per request said (one user
  turn each): the server's ``turnkeeper_speculative_turns_total{outcome}``
  counter read from ``GET /metrics`` at the end of the mode's run
  (started = confirmed + withdrawn; 0 and ``counter_present: false`` when
  the server has no such counter), beside the taken-back turns the calls
  saw (``turn`` events CANCELLED with stop reason ``speculation_withdrawn``);
- tokens spent on taken-back turns: prompt and completion tokens of each
  such turn as stored (``GET /v1/turns/{id}``, its ``usage``), and the
  tools with effects they started (should be 0).

The server's CPU time per request said (its process and its recogniser
workers, from /proc, over the mode's run) and the machine's load average
before and after each mode's run are reported beside the figures (the
machine may be shared: the figures move with it).

Usage: python bench/latency.py [--sessions N] [--per-session K] [--quick] [--modes silence,model] [--json] [--logs DIR]

The whole corpus is 74 requests, 6 per session (13 sessions), about 9
minutes per mode on 2 cores; ``--quick`` takes 12 (three of each kind) in
2 sessions, about 1.5 minutes per mode. ``--sessions N`` runs N sessions of ``--per-session`` requests
each, dealing the corpus (kinds interleaved) again from the start if it
runs out. The exit status is 1 when no mode could be measured.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import turn_corpus as T  # noqa: E402  (the labelled turn corpus)
from bargein import stats  # noqa: E402  (min, p50, p95, max)
from local_server import server, tree_usage  # noqa: E402  (its own process, the embedded defaults; its CPU)

from client.call import SILENCE_DBFS, CallClient  # noqa: E402
from client.results import CallError, CallResult, RequestMeasure, Utterance  # noqa: E402
from media.frames import PLAYOUT_RATE  # noqa: E402
from voice.endpointing import EndpointConfig  # noqa: E402

MODES = ("silence", "speculative", "model-one-bound", "model", "model-decode-100")
#: what runs without ``--modes``: the three ways of ending a turn (the variants of "model" on request)
DEFAULT_MODES = ("silence", "speculative", "model")
BENCH_TOKEN = "bench-latency"  # the bench server's API token (tenant "default"): turns read back over REST
PER_SESSION = 6  # requests said in one session
REPLY_TIMEOUT_S = 30.0  # the longest wait for a reply to be over, s after the request was sent
GAP_S = 1.0  # silence between a reply's end and the next request, s
CALL_SETTLE_S = 0.5
WITHDRAWN = "speculation_withdrawn"
SPECULATIVE_COUNTER = "turnkeeper_speculative_turns_total"
OUTCOMES = ("confirmed", "withdrawn")


#: the server's settings (environment) for each endpointing mode
MODE_ENV: dict[str, dict[str, str]] = {
    "silence": {"TURNKEEPER_SESSION__ENDPOINT__MODE": "silence", "TURNKEEPER_SESSION__ENDPOINT__SPECULATIVE": "false"},
    "speculative": {"TURNKEEPER_SESSION__ENDPOINT__MODE": "silence", "TURNKEEPER_SESSION__ENDPOINT__SPECULATIVE": "true"},
    "model-one-bound": {"TURNKEEPER_SESSION__ENDPOINT__MODE": "model", "TURNKEEPER_SESSION__ENDPOINT__SPECULATIVE": "true",
                        "TURNKEEPER_SESSION__ENDPOINT__UNSURE_SILENCE_MS": "1500"},
    "model": {"TURNKEEPER_SESSION__ENDPOINT__MODE": "model", "TURNKEEPER_SESSION__ENDPOINT__SPECULATIVE": "true"},
    "model-decode-100": {"TURNKEEPER_SESSION__ENDPOINT__MODE": "model", "TURNKEEPER_SESSION__ENDPOINT__SPECULATIVE": "true",
                         "TURNKEEPER_SESSION__ENDPOINT__DECODE_AT_MS": "100"},
}


def mode_env(mode: str) -> dict[str, str] | None:
    """The server's settings for endpointing ``mode`` (environment), or
    None when this server cannot run it (it has no ``session.endpoint.mode``
    setting: only ``silence``, today's fixed silence, runs there).

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`.
    """
    if mode not in MODES:
        raise ValueError(f"unknown endpointing mode {mode!r}: one of {', '.join(MODES)}")
    if "mode" not in EndpointConfig.model_fields:
        return {} if mode == "silence" else None
    return dict(MODE_ENV[mode])


def parse_modes(text: str) -> list[str]:
    """``--modes``: comma-separated, each once, each one of :data:`MODES`.

    Raises:
        argparse.ArgumentTypeError: empty, unknown or repeated.
    """
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise argparse.ArgumentTypeError("name at least one mode")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode {', '.join(unknown)}: one of {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"a mode named twice: {text}")
    return modes


def positive_int(text: str) -> int:
    """An integer >= 1 (``--sessions``, ``--per-session``).

    Raises:
        argparse.ArgumentTypeError: not an integer, or below 1.
    """
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def interleave(requests: list[T.TurnRequest]) -> list[T.TurnRequest]:
    """``requests`` dealt by kind in turn (complete, mid_pause, one_word,
    trailing, complete, ...), each kind in its corpus order, so any stretch
    of them mixes the kinds."""
    by_kind = [[r for r in requests if r.kind == k] for k in T.KINDS]
    return [r for group in itertools.zip_longest(*by_kind) for r in group if r is not None]


def plan(requests: list[T.TurnRequest], sessions: int | None, per_session: int) -> list[list[T.TurnRequest]]:
    """What each session says: the corpus interleaved (:func:`interleave`)
    in sessions of ``per_session`` requests; ``sessions`` None: as many as
    cover it once (the last may be shorter), else exactly that many, full,
    dealing the corpus again from its start when it runs out.

    Raises:
        ValueError: no requests, or ``sessions`` / ``per_session`` below 1.
    """
    if not requests:
        raise ValueError("no requests to say")
    if per_session < 1 or (sessions is not None and sessions < 1):
        raise ValueError(f"sessions and requests per session must be at least 1 (got {sessions}, {per_session})")
    order = interleave(requests)
    total = len(order) if sessions is None else sessions * per_session
    dealt = list(itertools.islice(itertools.cycle(order), total))
    return [dealt[i : i + per_session] for i in range(0, total, per_session)]


def utterance(r: T.RenderedRequest) -> Utterance:
    """A rendered request as the caller's microphone says it (48 kHz)."""
    if r.rate != PLAYOUT_RATE:
        raise ValueError(f"render the corpus at {PLAYOUT_RATE} Hz for the client, not {r.rate}")
    return Utterance(r.pcm, label=r.request.name, kind=r.request.kind, speech_end_s=r.speech_end_s)


def words(text: str | None) -> list[str]:
    """A transcript's words, lower case, without punctuation."""
    return re.findall(r"[a-z0-9']+", (text or "").lower())


def carried_into(earlier: str | None, later: str | None) -> bool:
    """The words of an earlier turn's transcript went into a later turn's
    (it begins with them: the server merged the turns), or the earlier
    one has none to carry."""
    first = words(earlier)
    return not first or words(later)[: len(first)] == first


def turn_first_seen(result: CallResult) -> dict[str, float]:
    """Turn id -> arrival of the first event about it (client clock s)."""
    seen: dict[str, float] = {}
    for at, ev in result.event_times:
        if isinstance(ev.get("turn_id"), str):
            seen.setdefault(ev["turn_id"], at)
    return seen


def judge(rendered: T.RenderedRequest, m: RequestMeasure, result: CallResult, until: float) -> dict[str, Any]:
    """One request's figures from its call (``until``: when the next
    request's first frame was sent, or the end of the call; client clock s).

    Returns:
        {name, kind, pause_ms, replied, voice_to_voice_ms (None: no reply,
        or the agent began before the request ended), talked_over, cut_off
        (None: not a mid_pause request), heard_in_pause, first_part_reply_heard,
        turns (its turns not taken back), first_part_acted (a turn before
        its last one acted on its words alone: the model replied or a tool
        started), split (such a turn's words were not carried into the last
        turn: the request was answered in parts), withdrawn (turn ids taken
        back), effects_partial (tools with effects those earlier turns
        started), effects_withdrawn, transcripts, no_turn, reply_timed_out}.
    """
    start = m.sent_from
    end = m.speech_end_sent
    seen = turn_first_seen(result)
    views = {t.id: t for t in [*result.turns, *result.withdrawn]}
    mine = sorted((tid for tid, at in seen.items() if start is not None and start <= at < until), key=lambda tid: seen[tid])
    withdrawn = [tid for tid in mine if tid in views and views[tid].stop_reason == WITHDRAWN]
    answering = [tid for tid in mine if tid not in withdrawn]
    audio_of = {ev.get("turn_id") for ev in result.events if ev.get("type") == "audio.start"}
    # a turn acted on its words: the model's reply reached the events, or a tool started
    acted = {ev.get("turn_id") for ev in result.events if ev.get("type") in ("agent.delta", "tool.started")}
    acted_early = [t for t in answering[:-1] if t in acted]

    def transcript(tid: str) -> str | None:
        return views[tid].transcript if tid in views else None

    effect_tools: dict[str, int] = {}
    for ev in result.events:
        if ev.get("type") == "tool.started" and ev.get("effect", "none") != "none" and isinstance(ev.get("turn_id"), str):
            effect_tools[ev["turn_id"]] = effect_tools.get(ev["turn_id"], 0) + 1
    row: dict[str, Any] = {
        "name": rendered.request.name, "kind": rendered.request.kind, "pause_ms": rendered.request.pause_ms,
        "replied": m.first_reply_at is not None or m.sound_before_end, "talked_over": m.sound_before_end,
        "voice_to_voice_ms": None, "cut_off": None, "heard_in_pause": None, "first_part_reply_heard": None,
        "turns": len(answering), "first_part_acted": bool(acted_early),
        "split": any(not carried_into(transcript(t), transcript(answering[-1])) for t in acted_early), "withdrawn": withdrawn,
        "effects_partial": sum(effect_tools.get(t, 0) for t in acted_early),
        "effects_withdrawn": sum(effect_tools.get(t, 0) for t in withdrawn),
        "transcripts": [views[t].transcript for t in answering if t in views],
        "no_turn": m.no_turn, "reply_timed_out": m.reply_timed_out,
    }
    if rendered.request.kind == "mid_pause" and end is not None:
        pause_from = [m.sent_at(int(a * PLAYOUT_RATE)) for a, _ in rendered.pauses]
        first_pause = min((t for t in pause_from if t is not None), default=end)
        row["heard_in_pause"] = any(first_pause <= at <= end and level > SILENCE_DBFS for at, level, _ in result.received)
        row["first_part_reply_heard"] = any(t in audio_of for t in answering[:-1])
        row["cut_off"] = row["heard_in_pause"] or row["first_part_reply_heard"]
    if not m.sound_before_end and not row["cut_off"]:
        row["voice_to_voice_ms"] = m.voice_to_voice_ms
    return row


def metric_values(text: str, name: str, label: str) -> dict[str, float]:
    """The samples of counter ``name`` in a Prometheus text exposition,
    by the value of ``label`` ({} if the counter is absent)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{([^}}]*)\}}\s+(\S+)", line)
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m[1]))
        if label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + float(m[2])
    return out


async def read_metrics(url: str) -> str:
    """``GET /metrics`` of the server at ``url``.

    Raises:
        RuntimeError: it did not answer 200.
    """
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET /metrics answered HTTP {resp.status}")
        return await resp.text()


async def stored_usage(url: str, turn_ids: list[str]) -> dict[str, Any]:
    """Model tokens of ``turn_ids`` as stored (``GET /v1/turns/{id}``, its
    ``usage``), summed: {turns, prompt_tokens, completion_tokens, total,
    unread (ids that could not be read)}."""
    out: dict[str, Any] = {"turns": len(turn_ids), "prompt_tokens": 0, "completion_tokens": 0, "unread": []}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {BENCH_TOKEN}"}) as http:
        for tid in turn_ids:
            async with http.get(f"{url}/v1/turns/{tid}") as resp:
                body = await resp.json(content_type=None) if resp.status == 200 else None
            usage = body.get("usage") if isinstance(body, dict) else None
            if not isinstance(usage, dict):
                out["unread"].append(tid)
                continue
            out["prompt_tokens"] += int(usage.get("prompt_tokens", 0))
            out["completion_tokens"] += int(usage.get("completion_tokens", 0))
    out["total"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def summarise(rows: list[dict[str, Any]], sessions: int, counter: dict[str, float] | None,
              withdrawn_usage: dict[str, Any], call_errors: list[str], arrival_unknown: int = 0) -> dict[str, Any]:
    """One mode's figures from its request rows (:func:`judge`), the
    speculative-turn counter read from /metrics (None: absent), the stored
    usage of the taken-back turns, the calls' errors and their received
    frames timed at decoding for want of their RTP arrival (should be 0)."""
    said = len(rows)
    mid = [r for r in rows if r["kind"] == "mid_pause"]
    cut = sum(bool(r["cut_off"]) for r in mid)
    v2v = [r["voice_to_voice_ms"] for r in rows if r["voice_to_voice_ms"] is not None]
    counts = {o: int((counter or {}).get(o, 0)) for o in OUTCOMES}
    started = counts["confirmed"] + counts["withdrawn"]
    withdrawn_seen = sum(len(r["withdrawn"]) for r in rows)
    return {
        "available": True,
        "sessions": sessions,
        "requests": said,
        "replied": sum(r["replied"] for r in rows),
        "voice_to_voice_ms": stats(v2v),
        "voice_to_voice_ms_by_kind": {
            k: stats([r["voice_to_voice_ms"] for r in rows if r["kind"] == k and r["voice_to_voice_ms"] is not None])
            for k in T.KINDS
        },
        "false_cut_offs": {
            "k": cut, "n": len(mid), "share": round(cut / len(mid), 4) if mid else None,
            "heard_in_pause": sum(bool(r["heard_in_pause"]) for r in mid),
            "first_part_reply_heard": sum(bool(r["first_part_reply_heard"]) for r in mid),
        },
        "split_requests": {"k": sum(r["split"] for r in mid), "n": len(mid),
                           "first_part_acted": sum(r["first_part_acted"] for r in mid),
                           "effects_started_by_partial_turns": sum(r["effects_partial"] for r in mid)},
        "talked_over": sum(r["talked_over"] for r in rows),
        "no_reply": sum(not r["replied"] for r in rows),
        "no_reply_by_kind": {k: sum(not r["replied"] for r in rows if r["kind"] == k) for k in T.KINDS},
        "no_turn": sum(r["no_turn"] for r in rows),
        "reply_timed_out": sum(r["reply_timed_out"] for r in rows),
        "speculative": {
            "counter_present": counter is not None,
            **counts,
            "started": started,
            "started_per_turn": round(started / said, 3) if said else None,
            "withdrawn_per_turn": round(counts["withdrawn"] / said, 3) if said else None,
            "withdrawn_seen_by_calls": withdrawn_seen,
        },
        "withdrawn_tokens": {**withdrawn_usage,
                             "per_turn": round(withdrawn_usage["total"] / said, 2) if said else None,
                             "effects_started": sum(r["effects_withdrawn"] for r in rows)},
        "call_errors": call_errors,
        "arrival_unknown_frames": arrival_unknown,
    }


async def converse(url: str, requests: list[T.RenderedRequest]) -> CallResult:
    """One session saying ``requests`` in turn (:meth:`CallClient.converse`)."""
    return await CallClient(url, token=BENCH_TOKEN).converse(
        [utterance(r) for r in requests], reply_timeout_s=REPLY_TIMEOUT_S, gap_s=GAP_S, settle_s=CALL_SETTLE_S
    )


def judge_call(rendered: list[T.RenderedRequest], result: CallResult, session: int) -> list[dict[str, Any]]:
    """The rows of one session's requests (:func:`judge`); a request the
    call never sent (it ended early) has none."""
    rows = []
    for i, (r, m) in enumerate(zip(rendered, result.requests, strict=True)):
        if m.sent_from is None:
            continue
        nxt = result.requests[i + 1].sent_from if i + 1 < len(result.requests) else None
        until = nxt if nxt is not None else math.inf
        rows.append({**judge(r, m, result, until), "session": session})
    return rows


async def bench_mode(mode: str, sessions: list[list[T.RenderedRequest]], log_dir: Path, quiet: bool) -> dict[str, Any]:
    """Start a server in ``mode`` and run ``sessions`` one after another."""
    env = mode_env(mode)
    load_before = os.getloadavg()
    if env is None:
        return {"available": False, "error": "this server has no session.endpoint.mode setting"}
    log_path = log_dir / f"server-{mode}.log"
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    unknown = 0
    t0 = time.monotonic()
    try:
        async with server(f"tk-bench-latency-{mode}-", {**env, "TURNKEEPER_API_TOKENS": f"default:{BENCH_TOKEN}"},
                          log_path) as (url, proc):
            cpu0, _ = tree_usage(proc.pid)
            for n, said in enumerate(sessions, 1):
                try:
                    result = await converse(url, said)
                except CallError as exc:
                    errors.append(f"session {n}: {exc}")
                    continue
                unknown += result.arrival_unknown
                if result.timed_out or result.server_hung_up:
                    errors.append(f"session {n}: {'timed out' if result.timed_out else 'the server hung up'}")
                got = judge_call(said, result, n)
                if len(got) < len(said):
                    errors.append(f"session {n}: {len(said) - len(got)} of its {len(said)} requests never said")
                rows += got
                with (log_dir / f"requests-{mode}.jsonl").open("a") as f:
                    for row in got:
                        f.write(json.dumps(row) + "\n")
                with (log_dir / f"calls-{mode}.jsonl").open("a") as f:
                    f.write(json.dumps({"session": n, "session_id": result.session_id, "requests": [m.as_dict() for m in result.requests],
                                        "events": [[round(at, 4), ev] for at, ev in result.event_times]}) + "\n")
                if not quiet:
                    for row in got:
                        print(f"  {mode} session {n}/{len(sessions)} {row['name']}: v2v {row['voice_to_voice_ms']} ms"
                              + (" CUT OFF" if row["cut_off"] else "") + (" split" if row["split"] else "")
                              + ("" if row["replied"] else " NO REPLY") + f" heard {row['transcripts']}", file=sys.stderr)
            cpu1, _ = tree_usage(proc.pid)
            metrics = await read_metrics(url)
            counts = metric_values(metrics, SPECULATIVE_COUNTER, "outcome")
            withdrawn = await stored_usage(url, [t for r in rows for t in r["withdrawn"]])
    except RuntimeError as exc:  # the server did not start: e.g. it refused the setting
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:] if log_path.exists() else []
        return {"available": False, "env": env, "error": f"{exc}: " + " | ".join(tail)}
    return {**summarise(rows, len(sessions), counts or None, withdrawn, errors, unknown), "env": env,
            "server_cpu_ms_per_request": round(1000 * (cpu1 - cpu0) / max(1, len(rows)), 1),
            "wall_s": round(time.monotonic() - t0, 1), "load_avg_before": [round(x, 2) for x in load_before],
            "load_avg_after": [round(x, 2) for x in os.getloadavg()]}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The bench: every mode of ``args.modes`` over the same sessions."""
    corpus = T.corpus(quick=args.quick)
    sessions = plan(corpus, args.sessions, args.per_session)
    with tempfile.TemporaryDirectory(prefix="tk-bench-latency-") as tmp:
        log_dir = Path(args.logs) if args.logs else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        cache: dict[str, T.RenderedRequest] = {}
        for req in (r for s in sessions for r in s):
            if req.name not in cache:
                cache[req.name] = T.render(req, rate=PLAYOUT_RATE)
        rendered = [[cache[r.name] for r in s] for s in sessions]
        modes = {m: await bench_mode(m, rendered, log_dir, args.json) for m in args.modes}
    said = [r for s in sessions for r in s]
    return {
        "modes": modes,
        "corpus": {"requests": len(corpus), "quick": args.quick, "seed": T.SEED,
                   "by_kind": {k: sum(r.kind == k for r in corpus) for k in T.KINDS}},
        "sessions": len(sessions),
        "requests_said": len(said),
        "per_session": args.per_session,
        "server": {"defaults": "embedded (whisper, local agent with the demo shop, espeak-ng)", "transport": "webrtc"},
    }


def _ms(s: dict[str, Any]) -> str:
    return "-" if not s["n"] else f"{s['min']:.0f} / {s['p50']:.0f} / {s['p95']:.0f} / {s['max']:.0f}"


def table(result: dict[str, Any]) -> str:
    """The figures as text: one row per mode, then voice-to-voice per kind
    with the modes side by side, then the modes not measured."""
    head = ["mode", "requests", "replied", "v2v min/p50/p95/max ms", "false cut-offs", "split (part acted on, effects)",
            "talked over", "no reply",
            "spec started/turn", "withdrawn/turn", "tokens withdrawn", "server CPU ms/request", "load before/after"]
    rows, notes = [head], []
    for mode, r in result["modes"].items():
        if not r["available"]:
            notes.append(f"{mode}: not measured: {r['error']}")
            continue
        fc, sp, spec = r["false_cut_offs"], r["split_requests"], r["speculative"]
        share = "-" if fc["share"] is None else f"{100 * fc['share']:.1f}%"
        rows.append([
            mode, str(r["requests"]), str(r["replied"]), _ms(r["voice_to_voice_ms"]), f"{fc['k']} of {fc['n']} ({share})",
            f"{sp['k']} of {sp['n']} ({sp['first_part_acted']}, {sp['effects_started_by_partial_turns']})",
            str(r["talked_over"]), str(r["no_reply"]),
            f"{spec['started_per_turn']}" + ("" if spec["counter_present"] else " (no counter)"), str(spec["withdrawn_per_turn"]),
            str(r["withdrawn_tokens"]["total"]), str(r.get("server_cpu_ms_per_request", "-")),
            f"{r['load_avg_before'][0]} / {r['load_avg_after'][0]}",
        ])
        if r["call_errors"]:
            notes.append(f"{mode}: call errors: {'; '.join(r['call_errors'])}")
        if r["arrival_unknown_frames"]:
            notes.append(f"{mode}: {r['arrival_unknown_frames']} received frames timed when decoded (RTP arrival not found)")
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    measured = [m for m, r in result["modes"].items() if r["available"]]
    if measured:
        lines += ["", "voice-to-voice by kind, ms: n  p50  p95"]
        kind_rows = [["kind", *measured]]
        for k in T.KINDS:
            cells = []
            for m in measured:
                s = result["modes"][m]["voice_to_voice_ms_by_kind"][k]
                cells.append("-" if not s["n"] else f"{s['n']}  {s['p50']:.0f}  {s['p95']:.0f}")
            kind_rows.append([k, *cells])
        kw = [max(len(row[i]) for row in kind_rows) for i in range(len(kind_rows[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, kw, strict=True)) for row in kind_rows]
    lines += ["", f"{result['requests_said']} requests in {result['sessions']} sessions per mode "
              f"(corpus {result['corpus']['requests']}{', quick' if result['corpus']['quick'] else ''})", *notes]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=positive_int, metavar="N",
                   help="sessions per mode (default: as many as cover the corpus once)")
    p.add_argument("--per-session", type=positive_int, default=PER_SESSION, metavar="K",
                   help=f"requests said in each session (default {PER_SESSION})")
    p.add_argument("--quick", action="store_true", help="the quick corpus: 12 requests, three of each kind")
    p.add_argument("--modes", type=parse_modes, default=list(DEFAULT_MODES), metavar="M[,M]",
                   help=f"endpointing modes to measure, in turn, of {','.join(MODES)} (default {','.join(DEFAULT_MODES)})")
    p.add_argument("--logs", help="keep the servers' logs, each request's row (requests-<mode>.jsonl) and each call's "
                                  "events with their arrival times (calls-<mode>.jsonl) here")
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures (no progress lines)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result) if args.json else table(result))
    return 0 if any(r["available"] for r in result["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
