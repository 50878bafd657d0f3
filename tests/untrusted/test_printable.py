"""Rule: a string from others reaches a terminal, a page or a metric only through printable()."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpukit.untrusted import printable


def test_escape_sequences_become_question_marks() -> None:
    hostile = "\x1b]0;owned\x07\x1b[2J\x1b]8;;http://x\x1b\\click\x1b]8;;\x1b\\\r\n\x9b31m"
    clean = printable(hostile)
    assert clean is not None
    assert "\x1b" not in clean
    assert "\x07" not in clean
    assert "\x9b" not in clean
    assert "\n" not in clean
    assert "\r" not in clean
    assert "owned" in clean
    assert "click" in clean


def test_a_long_string_is_cut_to_its_limit() -> None:
    assert printable("x" * 1000, limit=10) == "x" * 10


def test_anything_but_a_non_empty_str_is_none() -> None:
    for value in (None, "", 7, b"alice", ["alice"]):
        assert printable(value) is None


def test_printable_text_is_kept_as_it_is() -> None:
    assert printable("python train.py --lr 3e-4 ünïcödé 训练") == (
        "python train.py --lr 3e-4 ünïcödé 训练"
    )


@given(st.text(max_size=200))
def test_nothing_printable_returns_holds_a_control_character(text: str) -> None:
    clean = printable(text)
    assert clean is None or clean.isprintable()
