"""service.exporters.gguf.mtmd_check and mtmd_session: the comparison's bound (exact where
transformers leads clearly, teacher-forced after a near tie) and the session's line and reply
format, on made-up outputs (the runs themselves: tests/integration/exporters/gguf/test_vlm.py)."""

from __future__ import annotations

import pytest

from service.errors import VerificationFailed
from service.exporters.gguf.mtmd_check import Greedy, compare, forced_texts, teacher_forced
from service.exporters.gguf.mtmd_session import (
    ESCAPES,
    IMAGE_SENTINEL,
    REPLY_MARKER,
    TEMPLATE,
    replies,
    session_line,
)


class _Pieces:
    """A tokenizer whose token i is the piece ``pieces[i]`` (what token_bytes reads)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def convert_ids_to_tokens(self, i: int) -> str:
        return self.pieces[i]


def _greedy(margins: list[float], near: list[set[int]] | None = None) -> Greedy:
    ids = [1, 2, 3, 4]
    return Greedy(ids, margins, [b"a", b"b", b"c", b"d"], near or [{i} for i in ids])


def test_a_whole_agreement_passes_and_a_clear_divergence_fails() -> None:
    assert compare(b"\nabcd\n", _greedy([1.0] * 4))["result"] == "agree"
    with pytest.raises(VerificationFailed, match="diverges from transformers' at token 2"):
        compare(b"\nabxd", _greedy([1.0] * 4))


def test_a_divergence_at_a_near_tie_is_left_to_the_teacher_forced_comparison() -> None:
    report = compare(b"\nabxy", _greedy([1.0, 1.0, 0.01, 1.0]))
    assert report["result"] == "near_tie" and report["near_tie_at"] == 2


def test_teacher_forced_steps_take_transformers_token_or_one_within_the_near_tie() -> None:
    tokenizer = _Pieces(["<eos>", "a", "b", "c", "d", "x"])
    reference = _greedy([1.0, 1.0, 0.01, 1.0], near=[{1}, {2}, {3, 5}, {4}])
    ok = teacher_forced([b"\nx", b"\nd"], reference, 2, tokenizer)
    assert ok["teacher_forced_steps"] == 2 and ok["result"].startswith("agree")
    with pytest.raises(VerificationFailed, match="chose b'x' at step 3"):
        teacher_forced([b"\nc", b"\nx"], reference, 2, tokenizer)


def test_forced_text_that_splits_a_utf8_character_is_inconclusive_not_passed() -> None:
    assert forced_texts(_greedy([1.0, 0.01, 1.0, 1.0]), 1) == ["a", "ab", "abc"]
    split = Greedy([1, 2, 3], [0.01, 1.0, 1.0], [b"x", b"\xc3", b"\xa9"], [{1, 2}, {2}, {3}])
    with pytest.raises(VerificationFailed, match="inconclusive"):
        forced_texts(split, 0)


def test_a_session_line_carries_the_whole_prompt_on_one_console_line() -> None:
    line = session_line("<start_of_turn>user\n", "Describe.<end_of_turn>\n<start_of_turn>model\n")
    assert "\n" not in line and " " not in line and line.count(IMAGE_SENTINEL) == 1
    for char, sent in ESCAPES.items():
        assert f"replace('{sent}'" in TEMPLATE, char
    with pytest.raises(VerificationFailed, match="reserves"):
        session_line("", "<__media__>")


def test_replies_are_found_by_their_marker_with_the_tools_own_log_lines_removed() -> None:
    log = (
        b"0.00.001.000 I loading\n\n> /x.png image loaded\n\n> "
        + REPLY_MARKER.encode() + b"\n0.00.002.000 I encoding image\n\nab> c\n\n> "
        + b"Chat history cleared\n\n\n> /x.png image loaded\n\n> "
        + REPLY_MARKER.encode() + b"\n\nxyz\n> \n\n0.00.009.000 I perf\n"
    )  # fmt: skip
    assert replies(log, 2) == [b"\nab> c\n", b"\nxyz"]
    with pytest.raises(VerificationFailed, match="answered 2 of 3"):
        replies(log, 3)
