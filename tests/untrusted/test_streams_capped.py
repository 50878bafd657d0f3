"""Reading another machine's output streams: bounded in bytes and in time, whatever it sends."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from gpukit.untrusted import Streams, read_streams


def _spawn(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _read(proc: subprocess.Popen[bytes], limits: list[int], timeout: float) -> Streams:
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        return read_streams([proc.stdout.fileno(), proc.stderr.fileno()], limits, timeout=timeout)
    finally:
        proc.kill()
        proc.communicate()


def test_both_streams_are_read_whole_when_they_end_within_their_limits() -> None:
    proc = _spawn("import sys; sys.stdout.write('out' * 1000); sys.stderr.write('err')")
    streams = _read(proc, [1 << 20, 1 << 10], timeout=60)
    assert streams.complete
    assert streams.data == (b"out" * 1000, b"err")


def test_an_endless_stream_stops_at_its_limit_and_says_which_stream() -> None:
    proc = _spawn("import os\nwhile True: os.write(2, b'\\0' * 65536)")
    streams = _read(proc, [1 << 20, 1 << 16], timeout=60)
    assert streams.over_limit == 1
    assert not streams.timed_out
    assert len(streams.data[1]) <= (1 << 16) + (1 << 16)


def test_a_silent_writer_that_never_ends_costs_the_timeout() -> None:
    proc = _spawn("import time; print('partial', flush=True); time.sleep(600)")
    start = time.monotonic()
    streams = _read(proc, [1 << 20, 1 << 10], timeout=0.5)
    assert streams.timed_out
    assert streams.over_limit is None
    assert 0.5 <= time.monotonic() - start < 60


def test_streams_are_left_open_for_the_caller() -> None:
    r, w = os.pipe()
    os.write(w, b"abc")
    os.close(w)
    try:
        assert read_streams([r], [10], timeout=5).data == (b"abc",)
        os.fstat(r)  # still open: raises OSError once closed
    finally:
        os.close(r)
