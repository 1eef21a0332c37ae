"""The reorder buffer Telnyx's media needs: shuffled frames come out in
order, a gap is waited for only ``depth`` frames, late and repeated frames
are dropped and counted."""

from __future__ import annotations

import random

import pytest

from media.reorder import ReorderBuffer


@pytest.mark.parametrize("seed", range(5))
def test_shuffled_frames_come_out_in_order(seed: int) -> None:
    rng = random.Random(seed)
    seqs = list(range(1, 201))
    # local shuffles: each frame at most 3 places from where it belongs (network reordering)
    for i in range(0, len(seqs), 4):
        block = seqs[i : i + 4]
        rng.shuffle(block)
        seqs[i : i + 4] = block
    buf: ReorderBuffer[int] = ReorderBuffer(depth=4)
    out: list[int] = []
    for s in seqs:
        out += buf.push(s, s)
    out += buf.flush()
    assert out == list(range(1, 201))
    assert buf.lost == 0 and buf.late == 0


def test_a_lost_frame_is_given_up_on_after_depth_frames() -> None:
    buf: ReorderBuffer[str] = ReorderBuffer(depth=2)
    assert buf.push(1, "a") == ["a"]
    assert buf.push(3, "c") == []  # 2 is missing: wait
    assert buf.push(4, "d") == []
    assert buf.push(5, "e") == ["c", "d", "e"]  # more than 2 held: 2 is lost
    assert buf.lost == 1
    assert buf.push(2, "b") == [] and buf.late == 1  # too late now
    assert buf.push(5, "e") == [] and buf.late == 2
    assert buf.push(7, "g") == [] and buf.push(7, "g") == [] and buf.duplicates == 1


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ReorderBuffer(depth=0)
