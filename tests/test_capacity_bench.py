"""bench/capacity.py and bench/stage_profile.py: a short run of the capacity
bench against a real server (one and two speaking callers), and the pieces
its figures rest on: the gap measure and the profile's stages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_espeak

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import stage_profile as P  # noqa: E402


def test_a_sample_counts_for_the_innermost_frame_in_a_stage() -> None:
    loop = "BaseEventLoop._run_once (asyncio/base_events.py:1936);Handle._run (asyncio/events.py:80)"
    raw = "\n".join([
        f"{loop};RTCRtpSender._run_rtp (aiortc/rtcrtpsender.py:340);OpusEncoder.encode (aiortc/codecs/opus.py:61) 7",
        f"{loop};RTCRtpSender._next_encoded_frame (aiortc/rtcrtpsender.py:300);PacedAudioTrack.recv (media/outbound.py:120);"
        "PeerSession._on_sent (web/peer.py:166);EchoReference.played (media/echo_guard.py:244) 2",
        f"{loop};InboundAudio.frames (media/inbound.py:200);PcmResampler.frame (media/frames.py:95) 1",
        f"{loop} 1",  # the loop's own work
        "Thread.run (threading.py:1010);_worker (concurrent/futures/thread.py:81) 50",  # an idle pool thread
        "EpollSelector.select (selectors.py:468) 30",  # the loop waiting
        "garbage line",
    ])
    stages, samples, unclaimed = P.classify(raw)
    assert samples == 11
    assert stages == {"outbound encode and SRTP": round(7 / 11, 4), "echo guard": round(2 / 11, 4),
                      "inbound decode and resampling": round(1 / 11, 4), "asyncio and aiohttp": round(1 / 11, 4)}
    assert unclaimed == {}


def test_an_arrival_gap_is_40_ms_or_more_inside_the_window() -> None:
    import capacity

    frames = [(t, -20.0, 20.0) for t in (0.0, 0.02, 0.04, 0.10, 0.12, 0.159, 0.30)]
    assert capacity.arrival_gaps(frames, 0.0, 0.2) == [60.0]  # 0.04 -> 0.10; 0.12 -> 0.159 is 39 ms
    assert capacity.arrival_gaps(frames, 0.0, 0.4) == [60.0, 141.0]
    assert capacity.arrival_gaps(frames, 0.05, 0.2) == []


@requires_espeak
def test_a_short_capacity_run_reports_every_figure() -> None:
    """Two callers on a fresh server, 2 s windows: every figure is there
    and plausible (the server busy, its ticks counted, nothing broken)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "capacity.py"), "--max-sessions", "2", "--window", "2", "--settle", "1",
         "--reference-s", "8", "--barge-every", "2", "--json"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert [s["sessions"] for s in out["steps"]] == [1, 2]
    for step in out["steps"]:
        assert 0.02 < step["server_cpu_core"] < 2.0, step
        assert step["clients_cpu_core"] > 0 and step["rss_mb"] > 100
        lateness = step["send_lateness"]
        # every session's 50 ticks a second (one of them may still be connecting)
        assert lateness["ticks"] >= 40 * step["window"][1] - 40 * step["window"][0] - 50
        assert lateness["p99_ms"] is not None and lateness["p99_ms"] <= 250
        assert set(step["received_gaps"]) == {"arrival", "arrival_max_ms", "inserted", "inserted_max_ms"}
    assert out["steps"][1]["interrupting"] == 1
    assert out["errors"] == []


@requires_espeak
@pytest.mark.parametrize("transport", ["twilio", "device"])
def test_a_short_capacity_run_over_the_phone_and_device_transports(transport: str) -> None:
    """One phone or device caller: the server's CPU and its paced ticks
    are measured the same way, and what the simulated phone or speaker
    played is judged for inserted silences (no arrival gaps: it played
    every 20 ms)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "capacity.py"), "--transport", transport, "--max-sessions", "1",
         "--window", "2", "--settle", "1", "--reference-s", "8", "--barge-every", "0", "--json"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["transport"] == transport and out["errors"] == []
    [step] = out["steps"]
    assert 0.01 < step["server_cpu_core"] < 2.0, step
    assert step["send_lateness"]["ticks"] >= 40 * (step["window"][1] - step["window"][0]) - 50
    assert step["received_gaps"]["arrival"] == 0 and step["received_gaps"]["arrival_max_ms"] is None


@requires_espeak
def test_a_short_overload_run_on_two_instances_reports_every_figure() -> None:
    """Two instances on one Redis with their admission on, two callers
    (capacity taken as 1, pushed 2x): each call goes to a ready instance;
    the admitted, the refusals by reason per instance and the degraded
    calls are reported."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "capacity.py"), "--capacity", "1", "--overload", "2", "--instances", "2",
         "--window", "2", "--settle", "1", "--overload-windows", "1", "--reference-s", "8", "--barge-every", "0",
         "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    over = out["overload"]
    assert over["instances"] == 2 and over["callers"] == 2 and over["admitted"] == 2
    assert set(over["refusals_by_reason"]) == {"instance 1", "instance 2"}
    assert all(set(r) == {"send_lateness", "cpu", "starting"} for r in over["refusals_by_reason"].values())
    [step] = over["steps"]
    assert step["sessions"] == 2 and sum(step["sessions_per_instance"]) == 2
    assert step["send_lateness"]["ticks"] > 100 and over["degraded_calls"] in (0, 1, 2)
    assert out["steps"] == [] and out["errors"] == []  # no ramp: the capacity was given
