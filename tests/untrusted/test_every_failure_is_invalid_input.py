"""Rule: whatever goes wrong while parsing others' data is one InvalidInput, never a traceback."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpukit.untrusted import DEPTH, InvalidInput, parse_json, parse_toml

LIMIT = 1 << 22


@pytest.mark.parametrize(
    ("document", "why"),
    [
        (b"[" * 100_000, "nested more than"),
        (b'{"a":' * 60_000, "nested more than"),
        (b"[1e999]", "finite"),
        (b"[-1e999]", "finite"),
        (b"NaN", "NaN"),
        (b"[Infinity]", "Infinity"),
        (b"[-Infinity]", "Infinity"),
        (b"1" * 5000, "not valid JSON"),  # more digits than Python converts to an int
        (b"\xff\xfe", "UTF-8"),
        (b'{"a": 1', "not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_hostile_json_is_invalid_input(document: bytes, why: str) -> None:
    with pytest.raises(InvalidInput, match=why):
        parse_json(document, limit=LIMIT)


def test_nesting_up_to_the_depth_is_accepted_and_one_more_is_not() -> None:
    assert parse_json("[" * DEPTH + "]" * DEPTH, limit=LIMIT) is not None
    with pytest.raises(InvalidInput, match="nested"):
        parse_json("[" * (DEPTH + 1) + "]" * (DEPTH + 1), limit=LIMIT)


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    text = '{"command": "' + "[" * 1000 + '\\" {{{"}'
    assert parse_json(text, limit=LIMIT) == {"command": "[" * 1000 + '" {{{'}


@pytest.mark.parametrize(
    ("document", "why"),
    [
        ("a = " + "[" * 100_000, "nested more than"),
        ("a = " + "{b = " * 60_000, "nested more than"),
        ("a = inf", "finite"),
        ("a = nan", "finite"),
        ("a = 1\na = 2", "not valid TOML"),
        ("[[[", "not valid TOML|nested"),
    ],
)
def test_hostile_toml_is_invalid_input(document: str, why: str) -> None:
    with pytest.raises(InvalidInput, match=why):
        parse_toml(document, limit=LIMIT)


def test_toml_not_utf8_is_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="UTF-8"):
        parse_toml(b"a = '\xff'", limit=LIMIT)


@given(st.binary(max_size=512))
def test_any_bytes_parse_as_json_or_are_invalid_input(data: bytes) -> None:
    with contextlib.suppress(InvalidInput):
        parse_json(data, limit=LIMIT)


@given(st.text(alphabet='[]{}",:0123456789.eE-+ \\aINfty', max_size=400))
def test_any_json_like_text_parses_or_is_invalid_input(text: str) -> None:
    with contextlib.suppress(InvalidInput):
        parse_json(text, limit=LIMIT)


@given(st.text(alphabet="[]{}=\"',.0123456789abinf \n", max_size=400))
def test_any_toml_like_text_parses_or_is_invalid_input(text: str) -> None:
    with contextlib.suppress(InvalidInput):
        parse_toml(text, limit=LIMIT)
