"""Every reader of data others control, fed hostile documents: it answers with its documented
result or typed error, never another exception.

The readers: a holder record and a waiter's ticket (any user of the lock folder writes them),
a ledger line (its owner), ``policy.toml`` (the lock folder's owner), the machine's config, a
remote host's answer (JSON and nvidia-smi's CSV). The documents mix the fields each reader
looks for with every value that broke a reader once: nesting tens of thousands deep, numbers of
hundreds of digits or past a float's range, ``NaN`` and ``Infinity``, strings full of terminal
escapes, wrong types.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpukit.errors import GpukitError, LockFolderError, PolicyError
from gpukit.gpus import hosts
from gpukit.sharing import claims, ledger, lock_folder, policy, waiters
from gpukit.untrusted import InvalidInput

FIELDS = [
    "schema", "pid", "uid", "user", "host", "n", "criteria", "command", "since", "time",
    "event", "claim", "gpus", "index", "uuid", "name", "memory_total", "memory_used",
    "utilization", "temperature", "power", "power_limit", "processes", "claims", "mig",
    "limits", "max_gpus_per_user", "lock_dir",
]  # fmt: skip
SCHEMAS = ["gpukit.ticket/1", "gpukit.ledger/1", "gpukit.inventory/1", "gpukit.hosts/1"]
HOSTILE_NUMBERS = ["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "9" * 400, "-0", "1e-999"]
ESCAPES = st.text(alphabet="\x1b\x07\x9b[]0;P\r\n\t\x00abc", max_size=20)


def _leaves() -> st.SearchStrategy[str]:
    """One JSON value as text, valid or not."""
    return st.one_of(
        st.sampled_from(["null", "true", "false", "0", "1", "-1", "4294967296"]),
        st.sampled_from(HOSTILE_NUMBERS),
        st.integers(min_value=-(10**30), max_value=10**30).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(lambda x: json.dumps(x)),
        st.sampled_from(SCHEMAS).map(json.dumps),
        ESCAPES.map(json.dumps),
    )


_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(10**400), max_value=10**400),
        st.integers(min_value=-(2**64), max_value=2**64),
        st.floats(allow_nan=False, allow_infinity=False),
        ESCAPES,
        st.sampled_from(SCHEMAS),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(FIELDS), inner),
    max_leaves=8,
)


def _records() -> st.SearchStrategy[str]:
    """Valid JSON shaped like a record: the fields a reader looks for, each of any type."""
    fields = st.dictionaries(st.sampled_from(FIELDS), _VALUES, max_size=len(FIELDS))
    schema = st.sampled_from(SCHEMAS)
    return st.tuples(schema, fields).map(lambda sf: json.dumps({"schema": sf[0], **sf[1]}))


def _documents() -> st.SearchStrategy[str]:
    def _nest(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        keys = st.one_of(st.sampled_from(FIELDS), ESCAPES).map(json.dumps)
        return st.one_of(
            st.lists(inner, max_size=4).map(lambda items: "[" + ",".join(items) + "]"),
            st.lists(st.tuples(keys, inner), max_size=6).map(
                lambda pairs: "{" + ",".join(f"{k}:{v}" for k, v in pairs) + "}"
            ),
        )

    malformed = st.recursive(_leaves(), _nest, max_leaves=30)
    deep = st.tuples(st.integers(1, 80_000), st.sampled_from(["[", '{"pid":'])).map(
        lambda depth_and_opener: depth_and_opener[1] * depth_and_opener[0]
    )
    return st.one_of(_records(), _records(), _records(), malformed, deep)


def _toml_documents() -> st.SearchStrategy[str]:
    values = st.one_of(
        st.sampled_from(["inf", "nan", "-inf", "1e999", "9" * 400, "true", "[1, [2]]", "{}"]),
        st.integers(min_value=-(10**20), max_value=10**20).map(str),
        ESCAPES.map(json.dumps),
        st.integers(1, 50_000).map(lambda d: "[" * d),
        st.integers(1, 50_000).map(lambda d: "{a = " * d),
    )
    keys = st.sampled_from(["max_gpus_per_user", "lock_dir", "limits", "x", "max_gpus"])
    lines = st.lists(st.tuples(keys, values).map(lambda kv: f"{kv[0]} = {kv[1]}"), max_size=4)
    header = st.sampled_from(["", "[limits]\n", "[[limits]]\n", "[limits.x]\n"])
    return st.tuples(header, lines).map(lambda hl: hl[0] + "\n".join(hl[1]))


def _no_exception_but(allowed: tuple[type[BaseException], ...]) -> Callable[..., None]:
    def run(read: Callable[[], object]) -> None:
        with contextlib.suppress(*allowed):
            read()

    return run


READERS: dict[str, tuple[Callable[[bytes], object], tuple[type[BaseException], ...]]] = {
    "a holder record": (claims._read_holder, ()),
    "a waiter's ticket": (waiters._record, ()),
    "a ledger line": (lambda data: ledger._valid(data, 0), (InvalidInput,)),
    "a host's gpukit answer": (lambda data: hosts.parse_answer("gpu1", data), ()),
    "a host's nvidia-smi answer": (
        lambda data: hosts.parse_nvidia_smi_csv(data.decode(errors="replace")),
        (GpukitError,),
    ),
}


@pytest.mark.parametrize("reader", sorted(READERS))
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(document=_documents())
def test_a_reader_of_json_from_others_never_raises_what_it_does_not_document(
    reader: str, document: str
) -> None:
    read, allowed = READERS[reader]
    _no_exception_but(allowed)(lambda: read(document.encode()))


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_leaves(), min_size=1, max_size=12))
def test_nvidia_smi_rows_of_hostile_numbers_are_a_typed_error_or_a_reading(
    cells: list[str],
) -> None:
    text = ", ".join(cell.strip('"') for cell in cells)
    _no_exception_but((GpukitError,))(lambda: hosts.parse_nvidia_smi_csv(text))


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(document=_toml_documents())
def test_a_policy_from_the_folders_owner_is_limits_or_a_policy_error(document: str) -> None:
    _no_exception_but((PolicyError,))(
        lambda: policy._parse(document.encode(), Path("/locks/policy.toml"))
    )


@settings(
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(document=_toml_documents())
def test_the_machines_config_is_a_table_or_a_lock_folder_error(
    document: str, tmp_path: Path
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(document)
    path.chmod(0o644)
    _no_exception_but((LockFolderError,))(lambda: lock_folder.read_config(path))
