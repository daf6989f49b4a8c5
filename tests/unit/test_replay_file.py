"""``replay_file``: a log file replayed by two processes taking turns gives what one process
reading it in one go gives, the view or the first error alike (no services)."""

from __future__ import annotations

import functools
import io
import itertools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from controlplane.bench.replay import write_synthetic_log
from controlplane.core.records import StoredEvent
from controlplane.postmortem import replay
from controlplane.postmortem.logfile import LogFormatError, encode_line, read_log, write_log
from controlplane.postmortem.replay import (
    ReplayError,
    Until,
    replay_file,
    replay_log,
    replay_processes,
)
from tests.factories import T0, Events


@functools.cache
def _synthetic(tmp: Path) -> bytes:
    path = tmp / "synthetic.jsonl"
    write_synthetic_log(path, events=3000, members=8)
    return path.read_bytes()


@pytest.fixture
def data(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return _synthetic(tmp_path_factory.getbasetemp())


def _outcome(fn):  # the result, or the error as a user sees it
    try:
        replayed = fn()
    except (LogFormatError, ReplayError) as exc:
        return type(exc).__name__, str(exc)
    return replayed.view, replayed.events, replayed.stopped


def _both(tmp_path: Path, data: bytes, parts=(20_000, 65_536), **kwargs):
    """The outcome of one process reading ``data`` in one go; asserts that two processes
    taking turns over parts of each size in ``parts`` come to the same, whether they hand
    the view over at every turn or one of them goes on alone after the first hand-over
    (``HANDOVER_SHARE`` 0: as when the view costs more to hand over than a part to read)."""
    path = tmp_path / "log.jsonl"
    path.write_bytes(data)
    alone = _outcome(lambda: replay_log(read_log(io.BytesIO(data), source="f"), **kwargs))
    assert _outcome(lambda: replay_file(path, source="f", processes=1, **kwargs)) == alone
    for part_bytes, share in itertools.product(parts, (1e9, 0.0)):
        assert replay_processes(len(data), 2, part_bytes) == 2
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(replay, "HANDOVER_SHARE", share)
            two = _outcome(
                functools.partial(
                    replay_file, path, source="f", processes=2, part_bytes=part_bytes, **kwargs
                )
            )
        assert two == alone, (part_bytes, share)
    assert not multiprocessing.active_children()  # the second process exited and was reaped
    return alone


def test_two_processes_fold_the_view_one_process_folds(tmp_path, data):
    view, events, stopped = _both(tmp_path, data, parts=(7_000, 20_000, 65_536, 200_000))
    assert events == 3000 and not stopped and view.last_step > 0


def test_a_view_dearer_to_hand_over_than_a_part_to_read_is_handed_over_once(
    tmp_path, data, monkeypatch
):
    path = tmp_path / "log.jsonl"
    path.write_bytes(data)
    monkeypatch.setattr(replay, "HANDOVER_SHARE", 1e9)  # never dearer: a turn each part
    turns = replay_file(path, processes=2, part_bytes=20_000)
    parts = replay._cut(path, len(data), 20_000)  # whole lines: each part at least 20 kB
    assert len(parts) > 2
    assert turns.handovers == len(parts) - 1  # every part but the last hands it on
    monkeypatch.setattr(replay, "HANDOVER_SHARE", 0.0)  # always dearer
    once = replay_file(path, processes=2, part_bytes=20_000)
    assert once.handovers == 1 and (once.view, once.events) == (turns.view, turns.events)


@pytest.mark.parametrize("until", [1, 5, 1234, 2999, 3000, 10**6])
def test_up_to_a_position(tmp_path, data, until):
    _, events, stopped = _both(tmp_path, data, until=until)
    assert events == min(until, 3000) and stopped == (until < 3000)


def test_up_to_a_time(tmp_path, data):
    lines = data.splitlines()
    at = read_log([lines[1700]])
    point: Until = next(at).recorded_at + timedelta(microseconds=1)
    _, events, stopped = _both(tmp_path, data, until=point)
    assert stopped and 1600 < events < 1800


def _lines(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


@pytest.mark.parametrize("number", [1, 2, 61, 62, 63, 1500, 2999, 3000])
def test_the_first_bad_line_is_named_wherever_it_is(tmp_path, data, number):
    lines = _lines(data)
    lines[number - 1] = lines[number - 1].replace(b'"v":1', b'"v":2')
    kind, message = _both(tmp_path, b"".join(lines), parts=(7_000, 20_000))
    assert kind == "LogFormatError" and message.startswith(f"f:{number}: unknown schema version")


def test_a_bad_line_after_the_point_is_not_read(tmp_path, data):
    lines = _lines(data)
    lines[2500] = b"nope\n"
    assert _both(tmp_path, b"".join(lines), until=2000)[1:] == (2000, True)
    assert _both(tmp_path, b"".join(lines))[1].startswith("f:2501: not JSON")


def test_positions_out_of_order_across_parts(tmp_path, data):
    lines = _lines(data)
    lines[1000], lines[1001] = lines[1001], lines[1000]
    _, message = _both(tmp_path, b"".join(lines), parts=(7_000, 20_000, 65_536))
    assert message == "f:1002: position 1001 after 1002: a log file is in position order" + (
        " (one log, each event once)"
    )
    # Every line before a part's start out of order, in another key order, or blank.
    for number in range(30, 3000, 37):
        obj = json.loads(lines[number])
        lines[number] = json.dumps(dict(reversed(list(obj.items())))).encode() + b"\n\n"
    assert _both(tmp_path, b"".join(lines), parts=(7_000, 20_000))[0] == "LogFormatError"
    lines[1000], lines[1001] = lines[1001], lines[1000]
    assert _both(tmp_path, b"".join(lines), parts=(7_000, 20_000))[1] == 3000


def test_several_jobs(tmp_path, data):
    ev = Events(job_id="other")
    mixed = data + encode_line(StoredEvent(5000, T0, ev.heartbeat("m0")))
    kind, message = _both(tmp_path, mixed)
    assert kind == "ReplayError" and "several jobs (job-bench, other" in message
    assert _both(tmp_path, mixed, until=3000)[1] == 3000
    assert _both(tmp_path, mixed, job_id="job-bench")[1] == 3000
    assert _both(tmp_path, mixed, job_id="other")[1] == 1
    assert _both(tmp_path, mixed, job_id="nope")[0] == "ReplayError"


def test_progress_counts_every_byte(tmp_path, data):
    path = tmp_path / "log.jsonl"
    path.write_bytes(data)
    for processes in (1, 2):
        seen: list[int] = []
        replay_file(path, processes=processes, part_bytes=20_000, progress=seen.append)
        assert sum(seen) == len(data) and all(n > 0 for n in seen)


def test_a_small_file_is_replayed_in_one_process():
    assert replay_processes(1000, 2, part_bytes=4096) == 1
    assert replay_processes(10_000, 1, part_bytes=4096) == 1
    assert replay_processes(10_000, 2, part_bytes=4096) == 2


def test_a_part_read_against_the_wrong_previous_position_is_read_again(tmp_path, data, monkeypatch):
    """Each part is read against the position its cut found before it; where that was
    wrong (here: never found), the part is read again once its turn comes."""
    from controlplane.postmortem import replay

    def unreadable(line: bytes) -> StoredEvent:
        raise ValueError("not this time")

    monkeypatch.setattr(replay, "decode_line", unreadable)
    assert _both(tmp_path, data, parts=(20_000,))[1] == 3000
    lines = _lines(data)
    lines[1000], lines[1001] = lines[1001], lines[1000]
    assert _both(tmp_path, b"".join(lines), parts=(20_000,))[1].startswith("f:1002: position")


def test_a_recorded_run_with_incidents(tmp_path):
    from tests.recorded import two_incidents

    out = io.BytesIO()
    write_log(out, two_incidents())
    for until in (None, 300, 700):
        view, _, _ = _both(tmp_path, out.getvalue(), parts=(3_000, 20_000), until=until)
        assert view.incidents or until == 300


def _patch_read(monkeypatch, index: int, what) -> None:
    """``_TwoProcesses._read`` runs ``what()`` first when reading part ``index`` (the forked
    process reads the even parts, the parent the odd ones)."""
    from controlplane.postmortem import replay

    read = replay._TwoProcesses._read

    def _read(self, part, previous):
        if part is self.parts[index]:
            what()
        return read(self, part, previous)

    monkeypatch.setattr(replay._TwoProcesses, "_read", _read)
    # The processes take turns to the end (which reads which part is what is tested), however
    # long the view takes to hand over next to reading these small parts.
    monkeypatch.setattr(replay, "HANDOVER_SHARE", 1e9)


def test_a_second_process_that_dies_ends_the_replay_with_an_error(tmp_path, data, monkeypatch):
    """The second process killed mid-replay (here: as it starts its second part) ends the
    replay with an error that says so, and nothing is left behind."""
    path = tmp_path / "log.jsonl"
    path.write_bytes(data)
    _patch_read(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGKILL))
    with pytest.raises(RuntimeError, match=r"^the replay's second process exited \(-9\)$"):
        replay_file(path, processes=2, part_bytes=7_000)
    assert not multiprocessing.active_children()


def test_ctrl_c_stops_the_second_process(tmp_path, data, monkeypatch):
    path = tmp_path / "log.jsonl"
    path.write_bytes(data)

    def interrupt() -> None:
        raise KeyboardInterrupt

    _patch_read(monkeypatch, 5, interrupt)  # in the parent, while the child reads part 4
    with pytest.raises(KeyboardInterrupt):
        replay_file(path, processes=2, part_bytes=7_000)
    assert not multiprocessing.active_children()


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status  # exited, not yet reaped by whoever adopted it


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_the_second_process_ends_when_the_replay_is_killed(tmp_path, data):
    """``kill -9`` of the replaying process while the second one waits for its turn: the
    second one sees its parent gone and exits."""
    path = tmp_path / "log.jsonl"
    path.write_bytes(data)
    pids = tmp_path / "pids"
    pids.mkdir()
    script = f"""
import os, pathlib, time
from controlplane.postmortem import replay
read = replay._TwoProcesses._read
def _read(self, part, previous):
    if part is self.parts[1]:  # the parent: never done, so the child waits for part 2's turn
        pathlib.Path({str(pids)!r}, "parent").write_text(str(os.getpid()))
        time.sleep(60)
    if part is self.parts[2]:
        pathlib.Path({str(pids)!r}, "child").write_text(str(os.getpid()))
    return read(self, part, previous)
replay._TwoProcesses._read = _read
replay.HANDOVER_SHARE = 1e9  # turns to the end, whatever a hand-over costs
replay.replay_file({str(path)!r}, processes=2, part_bytes=7_000)
"""
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 30
        while len(list(pids.iterdir())) < 2:
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.01)
        parent.kill()
        parent.wait()
        child = int((pids / "child").read_text())
        deadline = time.monotonic() + 10
        while not _gone(child):
            assert time.monotonic() < deadline, "the second process outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
