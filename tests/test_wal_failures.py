"""Write-ahead log failures (a file-size limit, a full device) and damage in the middle of a
segment: real files, real processes, real OSErrors; nothing of kvindex is mocked."""

from __future__ import annotations

import logging
import os
import resource
import signal
import subprocess
import zlib
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvindex.config import Config
from kvindex.persist.wal import (
    Batch,
    Decision,
    PodRemoved,
    Record,
    RegistrationChange,
    Resync,
    Unknown,
    WriteAheadLog,
    encode_record,
    read_from,
    read_segment,
    segment_path,
    segments,
)
from tests.conftest import engine_config, ipc_endpoint
from tests.faultkit import KVINDEX, free_port, http, loading, stop, stream, wait_http, wait_until

MSGS = [{"role": "system", "content": "you are a disk filler " * 4}]


def _decision(i: int) -> dict[str, Any]:
    return {"pod": f"p{i % 3}", "request": {"model": "m", "messages": MSGS + [
        {"role": "user", "content": f"question {i} " * 60}]}}


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- append failures ---------------------------------------------------------------------------
def test_file_size_limit_hit_mid_record_truncates_and_keeps_serving(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the kernel write part of a record, then refuse (EFBIG): the daemon
    answers every request, cuts the torn record off, counts and reports the failure."""
    limit = 96 << 10
    state_dir, port = tmp_path / "state", free_port()

    def limited() -> None:  # in the child, before exec: every file it writes stops at `limit`
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    with open(tmp_path / "daemon.log", "wb") as err:
        daemon = subprocess.Popen(KVINDEX + ["serve", "--port", str(port), "--state-dir", str(state_dir),
                                             "--snapshot-seconds", "3600"],
                                  stdout=subprocess.DEVNULL, stderr=err, preexec_fn=limited)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        wait_until(lambda: not loading(port), 30, "the state loaded")  # HTTP is up (503 "loading") before
        url = f"http://127.0.0.1:{port}"
        i = 0
        while True:  # until the log has hit the limit, then some more
            status, body = http(url + "/v1/decisions", "POST", _decision(i))
            assert status == 200, (i, body)
            i += 1
            current = segment_path(state_dir, segments(state_dir)[-1])
            if current.stat().st_size + 4096 > limit:
                break
            assert i < 2000, "the log never grew"
        for j in range(i, i + 30):
            status, body = http(url + "/v1/decisions", "POST", _decision(j))
            assert status == 200, (j, body)
        assert http(url + "/healthz")[0] == 200
        _, metrics = http(url + "/metrics")
        metrics = metrics.decode()
        assert _metric(metrics, 'kvindex_wal_errors_total{op="append"}') >= 1
        assert _metric(metrics, "kvindex_wal_degraded ") == 1.0
        records, problem = read_segment(current)  # no torn record left behind: every byte is a record
        assert problem is None and len(records) >= 1
        assert current.stat().st_size <= limit
        assert "write-ahead log" in (tmp_path / "daemon.log").read_text()
    finally:
        stop(daemon, signal.SIGKILL)


async def test_full_device_abandons_segment_and_snapshot_clears_degraded(
        make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    """The segment's file turns into /dev/full (ENOSPC on write, EINVAL on truncate): lanes and
    HTTP handlers never see it; the next append starts a new segment; a snapshot clears
    ``degraded``; a restart restores everything, the lost record included (via the snapshot)."""
    state_dir = tmp_path / "state"
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    h = await make_harness(Config(engines=(engine_config(engine),), state_dir=state_dir, snapshot_seconds=3600))
    await h.wait_connected()
    frames, _ = stream(30)
    for f in frames[:10]:
        await engine.publish(f)
    await h.wait_seq("sim-0", 9)
    wal = h.daemon.recovery.wal
    assert wal is not None and not h.daemon.wal_degraded
    broken = wal.segment
    full = os.open("/dev/full", os.O_WRONLY | os.O_APPEND)
    try:
        os.dup2(full, wal._fd)  # the disk behind the open segment is now full
    finally:
        os.close(full)
    for f in frames[10:11]:  # a lane's journal write fails
        await engine.publish(f)
    await h.wait_seq("sim-0", 10)
    status, _ = await h.post("/v1/decisions", _decision(0))  # so does the decision's
    assert status == 200
    assert h.daemon.wal_degraded
    for f in frames[11:]:  # and later appends land in a new segment
        await engine.publish(f)
    await h.wait_seq("sim-0", 29)
    assert wal.segment == broken + 1 and wal.errors >= 2
    status, metrics = await h.get("/metrics")
    text = metrics.decode()
    assert _metric(text, 'kvindex_wal_errors_total{op="append"}') >= 1
    assert _metric(text, 'kvindex_wal_errors_total{op="truncate"}') >= 1
    assert _metric(text, "kvindex_wal_degraded ") == 1.0
    assert [r.seq for r in read_from(state_dir, broken + 1) if isinstance(r, Batch)] == list(range(11, 30))
    await h.daemon.snapshot()
    assert not h.daemon.wal_degraded
    entries, approx = set(h.daemon.index.export_entries()), h.daemon.approx.export_state()
    await h.daemon.stop()
    again = await make_harness(Config(state_dir=state_dir))
    assert set(again.daemon.index.export_entries()) == entries and again.daemon.approx.export_state() == approx


def test_oversized_record_is_refused_not_written(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr("kvindex.persist.wal.MAX_RECORD", 1024)
    wal = WriteAheadLog(tmp_path, fsync="never")
    assert wal.append(Decision("p", "m", (1,)))
    assert not wal.append(Batch("k", "t", 1, b"x" * 4096))
    assert wal.append(Decision("p", "m", (2,)))
    wal.close()
    assert wal.degraded and wal.errors == 1
    records, problem = read_segment(segment_path(tmp_path, wal.segment))
    assert problem is None and [r.hashes for r in records] == [(1,), (2,)]


# -- damage in the middle of a segment ---------------------------------------------------------
def _segment(tmp_path: Path, bodies: list[Record]) -> tuple[Path, list[int]]:
    starts, data = [], b""
    for body in bodies:
        starts.append(len(data))
        data += encode_record(body)
    path = tmp_path / "wal-00000001.log"
    path.write_bytes(data)
    return path, starts


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["body", "length", "crc", "lost_bytes"])
def test_damage_mid_segment_skips_only_the_damage(tmp_path: Path, where: str, caplog: Any) -> None:
    bodies: list[Record] = [Decision("p", "m", (i, i + 1)) for i in range(10)]
    path, starts = _segment(tmp_path, bodies)
    data = path.read_bytes()
    bad = starts[4]
    if where == "body":
        _flip(path, bad + 12)
    elif where == "length":  # the length field itself: the reader must scan for the next record
        _flip(path, bad + 1)
    elif where == "crc":
        _flip(path, bad + 5)
    else:  # a sector's worth of bytes gone from the middle of record 4
        path.write_bytes(data[:bad + 6] + data[bad + 11:])
    with caplog.at_level(logging.WARNING, "kvindex.persist.wal"):
        records = list(read_from(tmp_path, 0))
    assert [r.hashes[0] for r in records] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert "skipped" in caplog.text and "resynchronised at byte" in caplog.text


def test_resync_skips_a_damaged_record_whole_even_if_its_payload_looks_like_records(tmp_path: Path) -> None:
    """An engine payload is raw bytes inside a record; when that record fails its CRC, the reader
    trusts its length and skips it whole instead of finding the records a payload may contain."""
    crafted = encode_record(PodRemoved("victim")) + encode_record(PodRemoved("victim2"))
    bodies = [Decision("p", "m", (1,)), Batch("config:e", "kv@e@m", 7, crafted), Decision("p", "m", (2,))]
    path, starts = _segment(tmp_path, bodies)
    _flip(path, starts[1] + 6)  # the batch record's CRC
    records, problem = read_segment(path)
    assert [type(r) for r in records] == [Decision, Decision] and "fails its CRC" in problem


def test_damaged_tail_and_garbage_only(tmp_path: Path) -> None:
    path, starts = _segment(tmp_path, [Decision("p", "m", (i,)) for i in range(3)])
    path.write_bytes(path.read_bytes() + os.urandom(3000))
    records, problem = read_segment(path)
    assert len(records) == 3 and "skipped the last 3000 bytes" in problem
    path.write_bytes(b"\x00" * 100)
    records, problem = read_segment(path)
    assert records == [] and "skipped the last 100 bytes" in problem


# -- the record types ----------------------------------------------------------------------------
def _framed(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + zlib.crc32(body).to_bytes(4, "big") + body


def test_segments_of_the_untyped_format_read_as_typed_records(tmp_path: Path) -> None:
    """Earlier releases wrote plain msgpack lists: the same bytes as the tagged array structs."""
    old = [["b", "config:e", "kv@e@m", 7, b"\x93raw"], ["r", "config:e", "e"], ["d", "p", "m", [1, 2**64 - 1]],
           ["x", "p"], ["g", "add", {"instance_id": "i", "dp_rank": 0}]]
    (tmp_path / "wal-00000001.log").write_bytes(b"".join(_framed(msgpack.packb(b, use_bin_type=True)) for b in old))
    records, problem = read_segment(tmp_path / "wal-00000001.log")
    assert problem is None and records == [
        Batch("config:e", "kv@e@m", 7, b"\x93raw"), Resync("config:e", "e"), Decision("p", "m", (1, 2**64 - 1)),
        PodRemoved("p"), RegistrationChange("add", {"instance_id": "i", "dp_rank": 0})]
    assert b"".join(map(encode_record, records)) == (tmp_path / "wal-00000001.log").read_bytes()


def test_an_intact_record_of_an_unknown_kind_is_read_as_unknown(tmp_path: Path) -> None:
    """Not damage (its CRC holds): the reader keeps its place and the replay counts it skipped."""
    data = (encode_record(Decision("p", "m", (1,))) + _framed(msgpack.packb(["q", "from the future"]))
            + _framed(msgpack.packb(["d", 5, "m", [1]])) + encode_record(PodRemoved("p")))
    (tmp_path / "wal-00000001.log").write_bytes(data)
    records, problem = read_segment(tmp_path / "wal-00000001.log")
    assert problem is None and [type(r) for r in records] == [Decision, Unknown, Unknown, PodRemoved]
