"""State that outlives the process: snapshot format, write-ahead log, restore, peer recovery."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvindex.config import Config
from kvindex.index.approx import ApproxIndex
from kvindex.persist import snapshot as snapshots
from kvindex.persist.snapshot import State, StateError
from kvindex.persist.wal import (
    Decision,
    PodRemoved,
    WriteAheadLog,
    encode_record,
    read_from,
    read_segment,
    segment_path,
    segments,
)
from kvindex.settings import ApproxConfig, ApproxSettings
from kvindex.types import Entry
from tests.conftest import engine_config, ipc_endpoint, wait_for
from tests.faultkit import stream

MSGS = [{"role": "user", "content": "tell me about the state of things " * 6}]


def precise_state(daemon: Any) -> set[Entry]:
    return set(daemon.index.export_entries())


def streams_of(daemon: Any) -> dict[str, tuple[Any, ...]]:
    return {st.topic: (st.pod, st.last_seq, st.synced) for lane in daemon.fleet.lanes().values()
            for st in lane.state.streams.values()}


async def fill(make_harness: Any, make_engine: Any, tmp_path: Path, state_dir: Path, n: int = 40, **cfg: Any):
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    config = Config(engines=(engine_config(engine),), state_dir=state_dir, **cfg)
    h = await make_harness(config)
    await h.wait_connected()
    frames, cache = stream(n)
    for f in frames:
        await engine.publish(f)
    await h.wait_seq("sim-0", n - 1)
    for i in range(5):
        status, _ = await h.post("/v1/decisions", {"pod": f"p{i % 2}", "request": {"model": "m", "messages": MSGS + [
            {"role": "user", "content": f"q{i}" * 40}]}})
        assert status == 200
    return engine, h, config, frames, cache


def test_snapshot_codec_round_trip() -> None:
    approx = ApproxIndex(ApproxConfig(ApproxSettings(max_hash_cache_size=3), {"g": ApproxSettings.defaults("gie-v1.5")}))
    approx.record("a", "m", [1, 2, 3, 4, 5])
    approx.record("b", "g", list(range(100, 140)))
    st = State(block_sizes={"m": 16}, entries=[Entry("p", 0, "GPU", 2**64 - 1, 7, 2), Entry("p", 1, "CPU", 5, None, 1)],
               approx=approx.export_state(), streams={"config:x": [{"topic": "t", "pod": "p", "last_seq": 9,
                                                                    "expect_from": 0, "synced": False}]},
               registrations=[{"instance_id": "1"}], wal_from=3)
    back = snapshots.decode(snapshots.encode(st))
    assert (back.block_sizes, back.all_entries(), back.streams, back.registrations, back.wal_from) == (
        st.block_sizes, st.entries, st.streams, st.registrations, 3)
    other = ApproxIndex(approx.config)
    other.load_state(back.approx)
    assert other.export_state() == approx.export_state() and other.evictions == approx.evictions
    for model, hashes in (("m", [1, 2, 3, 4, 5]), ("g", list(range(100, 140)))):
        assert other.match(model, hashes, ["a", "b"]) == approx.match(model, hashes, ["a", "b"])
    other.record("a", "m", [9])  # recency order survived: the oldest key goes first
    approx.record("a", "m", [9])
    assert other.export_state() == approx.export_state()


def test_a_version_1_snapshot_still_loads_and_tables_round_trip() -> None:
    """Version 1 held entries as rows only; version 2 adds each table's packed rows."""
    import msgpack
    import zlib

    body = msgpack.packb({"precise": {"block_sizes": {"m": 4}, "entries": [["p", 0, "GPU", 1, 2, 3]]}, "approx": {},
                          "streams": {}, "registrations": []})
    header = msgpack.packb({"format": "kvindex-state", "version": 1, "created": 1.0, "wal_from": 0,
                            "body_len": len(body), "body_crc": zlib.crc32(body)})
    old = snapshots.decode(len(header).to_bytes(4, "big") + header + body)
    assert old.all_entries() == [Entry("p", 0, "GPU", 1, 2, 3)] and old.block_sizes == {"m": 4}
    assert old.entries == [] and len(old.tables) == 1  # version 1's rows come back packed
    from kvindex.index.rows import py_pack_rows
    tables = [("q", 1, "CPU", py_pack_rows([(5, None, 1), (6, 7, 2)]))]
    back = snapshots.decode(snapshots.encode(State(tables=tables, entries=[Entry("p", 0, "GPU", 1, 2, 3)])))
    assert back.tables[0] == tables[0]
    assert sorted(back.all_entries()) == [Entry("p", 0, "GPU", 1, 2, 3), Entry("q", 1, "CPU", 5, None, 1),
                                          Entry("q", 1, "CPU", 6, 7, 2)]
    ragged = State(tables=[("q", 1, "CPU", b"x" * 25)])
    with pytest.raises(StateError, match="multiple of 24"):
        snapshots.decode(snapshots.encode(ragged))


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "foreign", "future", "empty", "json"])
def test_bad_snapshot_is_refused(damage: str) -> None:
    good = snapshots.encode(State(entries=[Entry("p", 0, "GPU", 1, 2, 1)]))
    header, at = snapshots.read_header(good)
    bad = {
        "truncated": good[:-3],
        "corrupt": good[:-1] + bytes([good[-1] ^ 0xFF]),
        "foreign": b"\x00\x00\x00\x05hello world",
        "future": _with_header(good, {**header, "version": snapshots.VERSION + 1}),
        "empty": b"",
        "json": b'{"format": "kvindex-state", "version": 1}',
    }[damage]
    with pytest.raises(StateError) as exc:
        snapshots.decode(bad)
    assert "\n" not in str(exc.value)


def _with_header(data: bytes, header: dict[str, Any]) -> bytes:
    _, at = snapshots.read_header(data)
    h = msgpack.packb(header)
    return len(h).to_bytes(4, "big") + h + data[at:]


def test_wal_torn_tail_is_ignored(tmp_path: Path, caplog: Any) -> None:
    wal = WriteAheadLog(tmp_path, fsync="always")
    for i in range(5):
        wal.append(Decision("p", "m", (i,)))
    wal.close()
    path = segment_path(tmp_path, wal.segment)
    whole = path.read_bytes()
    path.write_bytes(whole + encode_record(Decision("p", "m", (99,)))[:-2])  # a crash mid-write
    records, problem = read_segment(path)
    assert [r.hashes for r in records] == [(i,) for i in range(5)] and "torn" in problem
    path.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]) + encode_record(Decision("p", "m", (7,))))  # bit flip
    records, problem = read_segment(path)  # the damaged record is skipped, the one after it is kept
    assert [r.hashes for r in records] == [(0,), (1,), (2,), (3,), (7,)] and "CRC" in problem and "resynchronised" in problem
    wal2 = WriteAheadLog(tmp_path)  # a restart starts a new segment: the torn one is never appended to
    wal2.append(PodRemoved("p"))
    wal2.close()
    assert segments(tmp_path) == [1, 2]
    with caplog.at_level(logging.WARNING, "kvindex.persist.wal"):
        assert [type(r) for r in read_from(tmp_path, 0)] == [Decision] * 5 + [PodRemoved]
    assert "CRC" in caplog.text and "skipped" in caplog.text


async def test_restart_from_snapshot_and_log_is_exact(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    engine, h, config, frames, cache = await fill(make_harness, make_engine, tmp_path, state_dir)
    await h.daemon.snapshot()
    more, _ = stream(60, seed=0)  # the same engine continues: the next 20 batches are only in the log
    for f in more[40:]:
        await engine.publish(f)
    await h.wait_seq("sim-0", 59)
    await h.post("/v1/decisions", {"pod": "p9", "request": {"model": "m", "prompt": "after the snapshot " * 10}})
    # a SIGKILL at this instant: copy the files as they are on disk, never stopping the daemon
    crashed = tmp_path / "crashed"
    shutil.copytree(state_dir, crashed)
    expected = (precise_state(h.daemon), h.daemon.approx.export_state(), streams_of(h.daemon))
    assert {e.hash for e in expected[0]} == set(stream(60, seed=0)[1].held())
    config2 = Config(engines=(engine_config(engine),), state_dir=crashed, replay_timeout=0.5)
    h2 = await make_harness(config2)
    assert h2.daemon.restored_from == "state-dir"
    assert (precise_state(h2.daemon), h2.daemon.approx.export_state(), streams_of(h2.daemon)) == expected


async def test_restart_catches_up_from_the_engine(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    """Batches published while kvindex was down come from the engine's replay endpoint."""
    state_dir = tmp_path / "state"
    engine, h, config, frames, cache = await fill(make_harness, make_engine, tmp_path, state_dir)
    await h.daemon.stop()
    more, truth = stream(70, seed=0)
    for f in more[40:]:
        await engine.publish(f)  # nobody listening
    h2 = await make_harness(config)
    await wait_for(lambda: (s := h2.stream("sim-0")) is not None and s.last_seq == 69, 5, "catch-up")
    assert {e.hash for e in precise_state(h2.daemon)} == set(truth.held())
    assert h2.stream("sim-0").synced


async def test_snapshot_refused_starts_empty(make_harness: Any, tmp_path: Path, caplog: Any) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / snapshots.SNAPSHOT_NAME).write_bytes(b"\x00\x00\x00\x02{}garbage")
    with caplog.at_level(logging.ERROR, "kvindex.daemon"):
        h = await make_harness(Config(state_dir=state_dir))
    assert "refusing snapshot" in caplog.text and "starting EMPTY" in caplog.text
    assert h.daemon.index.pods() == [] and h.daemon.restored_from is None
    assert any(p.name.startswith("state.snap.refused-") for p in state_dir.iterdir())


def _v2(tables: list, entries: list) -> bytes:
    """A version 2 snapshot whose precise part is exactly ``tables`` and ``entries`` (unchecked)."""
    import zlib
    body = msgpack.packb({"precise": {"block_sizes": {}, "entries": entries, "tables": tables}, "approx": {},
                          "streams": {}, "registrations": []}, use_bin_type=True)
    header = msgpack.packb({"format": "kvindex-state", "version": 2, "created": 1.0, "wal_from": 0,
                            "body_len": len(body), "body_crc": zlib.crc32(body)})
    return len(header).to_bytes(4, "big") + header + body


@pytest.mark.parametrize("tables,entries,why", [
    ([["p", 0, "GPU", bytes(24)]], [], "0 copies"),
    ([["p", 0, "GPU", (5).to_bytes(8, "little") + (7).to_bytes(8, "little") + (1 | 1 << 63).to_bytes(8, "little")]], [],
     "keyless snapshot row with a key"),
    ([], [["p", 0, "GPU", -1, 2, 1]], "not in the row format"),
    ([], [["p", 0, "GPU", 1 << 64 - 1, 2, 1], ["p", 0, "GPU", 1, -2, 1]], "not in the row format"),
    ([], [["p", 0, "GPU", 1, 2, 1 << 63]], "copies must be in"),
    ([["p", -1, "GPU", bytes(0)]], [], "dp_rank must be an integer from 0 to 65535, got -1"),
    ([["p", 1 << 40, "GPU", bytes(0)]], [], "dp_rank must be an integer from 0 to 65535"),
    ([], [["p", 1 << 16, "GPU", 1, 2, 1]], "dp_rank must be an integer from 0 to 65535, got 65536"),
    ([["p", 0, "", bytes(0)]], [], "medium must be a non-empty upper-case name, got ''"),
    ([], [["p", 0, "gpu", 1, 2, 1]], "medium must be a non-empty upper-case name, got 'gpu'"),
    ([["", 0, "GPU", bytes(0)]], [], "pod must be a non-empty string"),
])
def test_rows_and_entries_outside_the_format_are_refused_by_decode(tables: list, entries: list, why: str) -> None:
    """Found by review: these passed ``decode`` and then crashed the daemon's restore mid-load."""
    with pytest.raises(StateError, match=why) as exc:
        snapshots.decode(_v2(tables, entries))
    assert "\n" not in str(exc.value)


async def test_a_state_whose_entries_cannot_be_loaded_is_refused_whole(make_harness: Any, tmp_path: Path,
                                                                      caplog: Any) -> None:
    """A snapshot that a peer serves with a bad row, or a local one: kvindex starts empty and says
    why in one line, instead of exiting with a traceback on every start."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    good = ["p", 0, "GPU", (3).to_bytes(8, "little") + (4).to_bytes(8, "little") + (1).to_bytes(8, "little")]
    (state_dir / snapshots.SNAPSHOT_NAME).write_bytes(_v2([good, ["q", 0, "GPU", bytes(24)]], []))
    with caplog.at_level(logging.ERROR):
        h = await make_harness(Config(state_dir=state_dir))
    assert "refusing snapshot" in caplog.text and "0 copies" in caplog.text
    assert h.daemon.index.pods() == []  # not even the good table went in
    h2 = await make_harness(Config())  # a Dynamo peer's rows (kvindex.persist.dynamo_peer) with a hash out of u64
    caplog.clear()
    assert not await h2.daemon.recovery._install(State(entries=[Entry("p", 0, "GPU", 5, 6, 1), Entry("p", 0, "GPU", -1, 2, 1)]))
    assert "must be a u64" in caplog.text and "starting EMPTY" in caplog.text and h2.daemon.index.pods() == []
    caplog.clear()  # and one whose dp_rank no engine can have (it was loaded as rank -1: a pod no query could name)
    assert not await h2.daemon.recovery._install(State(entries=[Entry("p", 0, "GPU", 5, 6, 1), Entry("q", -1, "GPU", 7, 8, 1)]))
    assert "dp_rank must be an integer from 0 to 65535, got -1" in caplog.text and h2.daemon.index.pods() == []


async def test_registrations_survive(make_harness: Any, tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    h = await make_harness(Config(state_dir=state_dir))
    reg = {"instance_id": 7, "endpoint": ipc_endpoint(tmp_path, "r7"), "model_name": "M", "block_size": 16}
    assert (await h.post("/register", reg))[0] == 201
    assert (await h.post("/register", {**reg, "instance_id": 8}))[0] == 201
    assert (await h.post("/unregister", {"instance_id": 8, "model_name": "M"}))[0] == 200
    crashed = tmp_path / "crashed"
    shutil.copytree(state_dir, crashed)  # from the log alone (no snapshot since)
    h2 = await make_harness(Config(state_dir=crashed))
    status, workers = await h2.get("/workers")
    assert [w["instance_id"] for w in workers] == ["7"] and "register:7:0" in h2.daemon.fleet.lanes()
    await h.daemon.stop()  # and from the final snapshot
    h3 = await make_harness(Config(state_dir=state_dir))
    assert [w["instance_id"] for w in (await h3.get("/workers"))[1]] == ["7"]


async def test_peer_load(make_harness: Any, make_engine: Any, tmp_path: Path, caplog: Any) -> None:
    engine, h, config, frames, cache = await fill(make_harness, make_engine, tmp_path, tmp_path / "a")
    status, raw = await h.get("/v1/state")
    assert status == 200 and snapshots.decode(raw).all_entries()
    peer = Config(engines=config.engines, peer=h.url)
    h2 = await make_harness(peer)
    assert h2.daemon.restored_from == "peer"
    assert precise_state(h2.daemon) == precise_state(h.daemon)
    assert h2.daemon.approx.export_state() == h.daemon.approx.export_state()
    assert streams_of(h2.daemon) == streams_of(h.daemon)
    with caplog.at_level(logging.ERROR, "kvindex.daemon"):
        h3 = await make_harness(Config(peer="http://127.0.0.1:9"))
    assert "cannot load its state" in caplog.text and h3.daemon.index.pods() == []


async def test_state_endpoint_needs_the_token(make_harness: Any) -> None:
    h = await make_harness(token="s3cret")
    assert (await h.get("/v1/state"))[0] == 401
    status, raw = await h.get("/v1/state", headers={"Authorization": "Bearer s3cret"})
    assert status == 200 and snapshots.decode(raw).all_entries() == []


def test_cli_state_flags_and_final_snapshot_on_sigterm(tmp_path: Path) -> None:
    import signal
    import subprocess

    from tests.faultkit import KVINDEX, free_port, http, serve, stop

    help_text = subprocess.run(KVINDEX + ["serve", "--help"], capture_output=True, text=True, timeout=30).stdout
    assert all(flag in help_text for flag in ("--state-dir", "--snapshot-seconds", "--fsync", "--peer"))
    bad = subprocess.run(KVINDEX + ["serve", "--peer", "not-a-url"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "peer" in bad.stderr
    port, state_dir = free_port(), tmp_path / "s"
    p = serve(port, "--state-dir", str(state_dir), "--fsync", "always", "--snapshot-seconds", "3600")
    status, _ = http(f"http://127.0.0.1:{port}/v1/decisions", "POST",
                     {"pod": "a", "request": {"model": "m", "prompt": "persist me " * 20}})
    assert status == 200
    assert stop(p, signal.SIGTERM) == 0
    saved = snapshots.read_file(state_dir / snapshots.SNAPSHOT_NAME)
    assert saved is not None and saved.approx["kthena"]["a"]["keys"]
    port2 = free_port()
    p2 = serve(port2, "--state-dir", str(state_dir))
    try:
        pods = http(f"http://127.0.0.1:{port2}/v1/pods")[1]["pods"]
        assert [(v["pod"], v["approx_entries"] > 0) for v in pods] == [("a", True)]
    finally:
        assert stop(p2) == 0
