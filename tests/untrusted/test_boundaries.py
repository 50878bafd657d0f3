"""Each bound of the layer is exact: what reaches a limit is accepted, one more is refused, and
every refusal says what it refused with the words the readers show."""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from pathlib import Path

import pytest

from gpukit import untrusted
from gpukit.output import dumps, json_safe, write_output
from gpukit.untrusted import (
    DEPTH,
    InvalidInput,
    as_dict,
    as_float,
    as_int,
    as_list,
    as_str,
    open_regular,
    parse_json,
    parse_toml,
    printable,
    read_bounded,
    read_file,
    read_streams,
)

# -- sizes ---------------------------------------------------------------------------------------


def test_a_document_of_exactly_its_limit_is_parsed() -> None:
    assert parse_json(b'"12345"', limit=7) == "12345"
    assert parse_toml(b"a = 1", limit=5) == {"a": 1}


def test_a_file_larger_than_one_read_comes_back_whole_and_in_order(tmp_path: Path) -> None:
    data = bytes(range(256)) * (3 * 4096 + 17)  # over 3 MiB: several reads of 1 MiB
    (tmp_path / "big").write_bytes(data)
    assert read_file(tmp_path / "big", len(data)) == data
    with pytest.raises(InvalidInput, match=f"larger than {len(data) - 1} bytes"):
        read_file(tmp_path / "big", len(data) - 1)


def test_a_stream_written_in_pieces_is_bounded_by_its_total_not_its_last_piece() -> None:
    read_end, write_end = os.pipe()
    for _ in range(3):
        os.write(write_end, b"z" * 40)
    os.close(write_end)
    try:
        with pytest.raises(InvalidInput, match="larger than 100 bytes"):
            read_bounded(read_end, 100)
    finally:
        os.close(read_end)


def test_a_stream_of_many_chunks_is_read_whole_up_to_its_limit() -> None:
    read_end, write_end = os.pipe()
    data = b"q" * 60000
    os.write(write_end, data)
    os.close(write_end)
    try:
        streams = read_streams([read_end], [len(data)], timeout=30)
    finally:
        os.close(read_end)
    assert streams.complete
    assert streams.data == (data,)


def test_a_stream_one_byte_past_its_limit_is_said_to_be_over_it() -> None:
    read_end, write_end = os.pipe()
    os.write(write_end, b"w" * 201)
    os.close(write_end)
    try:
        streams = read_streams([read_end], [200], timeout=30)
    finally:
        os.close(read_end)
    assert streams.over_limit == 0
    assert streams.data[0].startswith(b"w" * 200)


def test_a_stream_that_stays_open_past_the_time_is_said_to_have_timed_out() -> None:
    read_end, write_end = os.pipe()
    os.write(write_end, b"partial")
    try:
        streams = read_streams([read_end], [100], timeout=0.3)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert streams.timed_out
    assert not streams.complete
    assert streams.data == (b"partial",)


# -- depth ---------------------------------------------------------------------------------------


def test_closed_brackets_give_their_depth_back() -> None:
    siblings = "[" + ",".join(["[[]]"] * 100) + "]"
    assert len(parse_json(siblings, limit=1 << 20)) == 100  # type: ignore[arg-type]
    # Closing must lower the level by exactly one: deep, closed, then deep again.
    text = "[" + "[" * (DEPTH - 1) + "]" * (DEPTH - 1) + "," + "[" * (DEPTH - 1) + "]" * DEPTH
    assert parse_json(text, limit=1 << 20) is not None


def test_a_closed_pair_lowers_the_level_by_exactly_one_on_the_way_down() -> None:
    # 20 open, five closed pairs, 15 more open: 35 deep at the end, whatever closed between.
    with pytest.raises(InvalidInput, match="nested more than"):
        parse_json("[" * 20 + "[]," * 5 + "[" * 15, limit=1 << 20)


def test_brackets_in_a_string_never_count_even_beside_real_nesting() -> None:
    inner = "[" * (DEPTH - 2) + json.dumps("]]]]" * 10 + "[" * 100) + "]" * (DEPTH - 2)
    assert parse_json("[" + inner + "]", limit=1 << 20) is not None


def test_toml_literal_strings_hold_brackets_that_do_not_nest() -> None:
    assert parse_toml("a = '" + "[" * 100 + "'", limit=1 << 20) == {"a": "[" * 100}


def test_toml_tables_nested_by_their_headers_are_refused_past_the_depth() -> None:
    # Dotted headers nest without a single bracket pair in the text: the parsed document's own
    # depth is checked too.
    header = ".".join(f"t{i}" for i in range(DEPTH + 2))
    with pytest.raises(InvalidInput, match=f"nested more than {DEPTH} deep"):
        parse_toml(f"[{header}]\nx = 1", limit=1 << 20)
    ok = ".".join(f"t{i}" for i in range(DEPTH - 1))
    assert parse_toml(f"[{ok}]\nx = 1", limit=1 << 20)


def test_a_toml_array_deep_in_lists_is_counted_level_by_level() -> None:
    ok = "a = " + "[" * (DEPTH - 1) + "1" + "]" * (DEPTH - 1)
    assert parse_toml(ok, limit=1 << 20)
    deep = "a = " + "[" * (DEPTH + 1) + "1" + "]" * (DEPTH + 1)
    with pytest.raises(InvalidInput, match="nested more than"):
        parse_toml(deep, limit=1 << 20)


# -- messages ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parse", "document", "message"),
    [
        (parse_json, b'"\xff"', "not valid JSON: not UTF-8 text"),
        (parse_toml, b"a = '\xff'", "not valid TOML: not UTF-8 text"),
        (parse_json, b"[1e999]", "not valid JSON: a number too large to be finite"),
        (parse_toml, b"a = inf", "not valid TOML: a number that is not finite"),
        (parse_json, b'{"a": ', "not valid JSON: JSONDecodeError"),
        (parse_toml, b"a = ", "not valid TOML: TOMLDecodeError"),
    ],
)
def test_each_refusal_says_what_was_wrong_in_the_words_readers_show(
    parse: object, document: bytes, message: str
) -> None:
    assert callable(parse)
    with pytest.raises(InvalidInput) as refused:
        parse(document, limit=1 << 20)
    assert str(refused.value) == message


def test_a_field_refused_without_a_name_is_called_a_field() -> None:
    for check, value in ((as_str, 1), (as_int, "1"), (as_float, "1"), (as_list, 1), (as_dict, 1)):
        with pytest.raises(InvalidInput, match=r"^a field is not "):
            check(value)  # type: ignore[operator]
    with pytest.raises(InvalidInput, match=r"^a pid is out of range \(1 to 9\)$"):
        as_int(10, low=1, high=9, what="a pid")


def test_a_control_character_becomes_exactly_one_question_mark() -> None:
    assert printable("a\x1bb\x07c") == "a?b?c"


def test_the_kind_of_what_was_found_is_named(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    for name, kind in (("fifo", "a FIFO"), ("folder", "a folder")):
        with pytest.raises(InvalidInput) as refused:
            open_regular(tmp_path / name)
        assert str(refused.value) == f"{kind}, not a regular file"
    with pytest.raises(InvalidInput) as refused:
        open_regular("/dev/null", follow=True)
    assert str(refused.value) == "a character device, not a regular file"


def test_kinds_without_a_file_to_open_are_named_too() -> None:
    assert untrusted._kind(stat.S_IFSOCK) == "a socket"  # a socket cannot even be opened
    assert untrusted._kind(stat.S_IFBLK) == "a block device"
    assert untrusted._kind(stat.S_IFLNK) == "a symbolic link"
    assert untrusted._kind(0) == "not a regular file"


def test_a_link_is_refused_with_its_name_and_a_hard_link_counted_only_when_asked(
    tmp_path: Path,
) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    with pytest.raises(InvalidInput) as refused:
        open_regular(tmp_path / "link")  # the default: links are not followed
    assert str(refused.value) == "a symbolic link, not a file"
    os.link(tmp_path / "file", tmp_path / "second")
    os.close(open_regular(tmp_path / "second"))  # the default: any number of links


# -- ranges --------------------------------------------------------------------------------------


def test_the_ends_of_every_range_are_inside_it() -> None:
    assert as_int(1, low=1, high=9) == 1
    assert as_int(9, low=1, high=9) == 9
    assert as_float(0.5, low=0.5, high=2) == 0.5
    assert as_float(2, low=0.5, high=2) == 2.0
    assert as_float(math.floor(1.7e308)) > 0  # below the largest float: finite
    assert as_float(int(sys.float_info.max)) == sys.float_info.max  # the largest float itself
    assert as_str("abc", limit=3) == "abc"
    assert as_list([1, 2], limit=2) == [1, 2]
    assert as_dict({"a": 1, "b": 2}, limit=2) == {"a": 1, "b": 2}


# -- writing -------------------------------------------------------------------------------------


def test_written_json_refuses_nan_from_a_default_hook_too() -> None:
    with pytest.raises(ValueError, match="Out of range float values"):
        dumps({"x": object()}, default=lambda _: math.nan)
    assert dumps({"x": object()}, default=lambda _: "seen") == '{"x": "seen"}'


def test_json_safe_goes_as_deep_as_four_times_the_depth_and_no_further() -> None:
    deep: list[object] = [math.nan]
    for _ in range(4 * DEPTH):
        deep = [deep]
    assert json_safe(deep) is not None  # a list at 4 * DEPTH levels down: still written
    with pytest.raises(InvalidInput, match=r"^nested too deep to write$"):
        json_safe([deep])
    mapping: object = math.inf
    for _ in range(4 * DEPTH):
        mapping = {"k": mapping}
    assert json.loads(dumps(mapping)) is not None
    with pytest.raises(InvalidInput):
        dumps({"k": {"k": mapping}})  # a mapping, not only the number, past the depth


def test_a_name_that_is_a_folder_is_refused_as_one(tmp_path: Path) -> None:
    for name in (".", ".."):
        path = f"{tmp_path}/{name}"  # a string: pathlib would drop the "."
        with pytest.raises(IsADirectoryError) as refused:
            write_output(path, b"x")
        assert refused.value.errno == 21
        assert refused.value.strerror == "names a folder, not a file"
        assert refused.value.filename == path
    with pytest.raises(IsADirectoryError):
        write_output(str(tmp_path) + "/", b"x")


def test_an_output_gets_the_mode_asked_less_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        write_output(tmp_path / "a.json", b"{}")
        write_output(tmp_path / "b.json", b"{}", mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o600


def test_a_temporary_name_someone_took_is_never_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import secrets

    tokens = iter(["aaaaaaaa", "bbbbbbbb"])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(tokens))
    taken = tmp_path / f".out.json.{os.getpid()}.aaaaaaaa.tmp"
    taken.write_text("someone's")
    write_output(tmp_path / "out.json", b"{}")
    assert taken.read_text() == "someone's"
    assert (tmp_path / "out.json").read_bytes() == b"{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [taken.name, "out.json"]
