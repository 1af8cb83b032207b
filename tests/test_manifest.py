"""The SSD manifest under damage: a bad record costs its own scope only, counted; the records
after it are still read; the store always opens. Real stores on real files."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import ManifestError
from flatcake_ray.node.manifest_frames import FRAME_OVERHEAD, HEADER_BYTES, encode_record, frames
from flatcake_ray.node.store import FlatCakeStore
from tests.conftest import LAYERS, PAGE_BYTES, random_kv, small_config

SESSIONS = 10
TURN_PAGES = 24
SSD = PutHints(context_tokens=1 << 20)  # agentic: every put goes to SSD


@dataclass
class Pool:
    config: object
    manifest: bytes  # as the store left it
    live: dict[str, tuple[list[str], np.ndarray]]  # session -> keys, kv (all on SSD, readable)
    scope_of: dict[str, int]  # live session -> its scope id

    @property
    def frames(self) -> list:
        """The intact manifest's records."""
        return list(frames(self.manifest))


def session_keys(session: str, turn: int) -> list[str]:
    return [f"{session}/{turn}/{i}" for i in range(TURN_PAGES)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Pool:
    """Ten two-turn SSD sessions on a 16 MiB pool reclaimed past 90% down to 80% (SSD is
    otherwise reclaimed only when full): the first ones are freed, so the manifest holds seg
    and free records."""
    root = tmp_path_factory.mktemp("pool")
    config = small_config(root, ssd_high_watermark=0.9, ssd_low_watermark=0.8)
    written: dict[str, tuple[list[str], np.ndarray]] = {}
    with FlatCakeStore(config) as store:
        for number in range(SESSIONS):
            session = f"s{number}"
            keys: list[str] = []
            for turn in range(2):
                turn_keys = session_keys(session, turn)
                kv = random_kv(TURN_PAGES, seed=100 * number + turn)
                result = store.put(turn_keys, kv, session_id=session, hints=SSD)
                assert result.medium.name == "SSD"
                keys += turn_keys
                kv = np.concatenate([written[session][1], kv], axis=1) if turn else kv
                written[session] = (keys, kv)
        live = {s: kw for s, kw in written.items() if store.exists(kw[0]) == len(kw[0])}
        scope_of = {s: store.catalog.sessions[s].scopes[Medium.SSD] for s in live}
        assert store.stats()["reclaimed_scopes"] > 0 and 2 <= len(live) < SESSIONS
        path = store.manifest.path
    yield Pool(config, path.read_bytes(), live, scope_of)
    shutil.rmtree(root, ignore_errors=True)


def reopen_with(pool: Pool, data: bytes) -> FlatCakeStore:
    (path,) = {f"{pool.config.ssd_folders[0]}/manifest.fcm"}
    with open(path, "wb") as out:
        out.write(data)
    return FlatCakeStore(pool.config)


def readable(store: FlatCakeStore, keys: list[str], kv: np.ndarray) -> int:
    """Pages restored from the first key on, after checking every restored byte."""
    out = np.zeros((LAYERS, len(keys), PAGE_BYTES), dtype=np.uint8)
    got = store.get(keys, out)
    assert np.array_equal(out[:, :got], kv[:, :got]), "a restored page holds wrong bytes"
    return got


def frame_at(records: list, offset: int):
    return next(f for f in records if f.offset <= offset < f.offset + f.nbytes)


def dropped_scopes(store: FlatCakeStore) -> int:
    stats = store.stats()
    return sum(v for k, v in stats.items() if k.startswith("manifest_scopes_dropped_"))


def test_one_flipped_bit_mid_file_costs_at_most_one_scope(pool):
    data = bytearray(pool.manifest)
    data[len(data) // 2] ^= 0x10
    with reopen_with(pool, bytes(data)) as store:
        whole = [s for s, (keys, kv) in pool.live.items() if readable(store, keys, kv) == len(keys)]
    assert len(whole) >= len(pool.live) - 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(position=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_a_damaged_byte_costs_only_its_records_scope(pool, position, mask):
    offset = int(position * len(pool.manifest))
    data = bytearray(pool.manifest)
    data[offset] ^= mask
    frame = frame_at(pool.frames, offset)
    in_payload = offset >= frame.offset + FRAME_OVERHEAD
    lost = {frame.scope} if in_payload and frame.scope else set()
    with reopen_with(pool, bytes(data)) as store:
        for session, (keys, kv) in pool.live.items():
            expected = 0 if pool.scope_of[session] in lost else len(keys)
            assert readable(store, keys, kv) == expected, (session, offset)
        assert dropped_scopes(store) == len(lost)
        stats = store.stats()
        if in_payload:
            assert stats["manifest_records_dropped_checksum"] == 1
        else:  # one header copy damaged: the other one is read, nothing is lost
            assert sum(v for k, v in stats.items() if k.startswith("manifest_records_")) == 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    damage=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=2, max_size=6
    )
)
def test_several_damaged_bytes_cost_only_the_scopes_they_touch(pool, damage):
    data = bytearray(pool.manifest)
    records = pool.frames
    touched: set[int] = set()
    for position, mask in damage:
        offset = int(position * len(data))
        data[offset] ^= mask
        touched.add(frame_at(records, offset).scope)
    with reopen_with(pool, bytes(data)) as store:
        for session, (keys, kv) in pool.live.items():
            got = readable(store, keys, kv)  # whatever comes back is the right bytes
            if pool.scope_of[session] not in touched:
                assert got == len(keys), session


def test_both_header_copies_damaged_skips_that_record_alone(pool):
    victim = next(f for f in pool.frames if f.scope == pool.scope_of[next(iter(pool.live))])
    data = bytearray(pool.manifest)
    data[victim.offset + 8] ^= 0xFF
    data[victim.offset + HEADER_BYTES + 8] ^= 0xFF
    with reopen_with(pool, bytes(data)) as store:
        stats = store.stats()
        assert stats["manifest_records_dropped_header"] == 1
        for session, (keys, kv) in pool.live.items():
            got = readable(store, keys, kv)
            if pool.scope_of[session] != victim.scope:
                assert got == len(keys)
            else:  # its first turn's segment is gone, so nothing from its first key
                assert got == 0


@pytest.mark.parametrize(
    "record",
    [
        [1, 2, 3],  # not a map
        {"t": "seg"},  # no fields
        {"t": "seg", "scope": None, "digests": b"short"},
        {"t": "mystery"},
    ],
    ids=["list", "empty-seg", "bad-fields", "unknown-kind"],
)
def test_a_well_checksummed_but_malformed_record_costs_its_scope(pool, record):
    victim = next(iter(pool.live))
    data = pool.manifest + encode_record(pool.scope_of[victim], record)
    with reopen_with(pool, data) as store:
        for session, (keys, kv) in pool.live.items():
            expected = 0 if session == victim else len(keys)
            assert readable(store, keys, kv) == expected
        assert store.stats()["manifest_scopes_dropped_malformed"] == 1


def test_a_torn_tail_costs_the_last_record_alone(pool):
    with reopen_with(pool, pool.manifest[:-5]) as store:
        assert store.stats()["manifest_records_dropped_torn"] == 1
        assert dropped_scopes(store) == 0


def test_a_format_1_manifest_is_refused_with_what_to_do(tmp_path):
    config = small_config(tmp_path)
    with FlatCakeStore(config):
        pass
    header = {"t": "hdr", "version": 1, "layers": LAYERS, "page_bytes": PAGE_BYTES}
    path = f"{config.ssd_folders[0]}/manifest.fcm"
    with open(path, "wb") as out:
        out.write(msgpack.packb(header, use_bin_type=True))
    with pytest.raises(ManifestError, match=r"format 1.*Delete"):
        FlatCakeStore(config)
    with open(path, "wb") as out:  # a newer format, framed as this one
        out.write(encode_record(0, {**header, "version": 3}))
    with pytest.raises(ManifestError, match="format 3"):
        FlatCakeStore(config)


def test_manifest_write_failures_from_failpoints(make_store, failpoints):
    store = make_store()
    size = store.manifest.path.stat().st_size
    failpoints.arm("manifest.append", raises=OSError(28, "No space left on device"))
    with pytest.raises(OSError, match="No space"):
        store.manifest.append({"t": "free", "scope": 5})
    assert store.manifest.path.stat().st_size == size  # nothing of the record was written
    failpoints.arm("manifest.fsync", raises=OSError(5, "Input/output error"))
    with pytest.raises(OSError, match="Input/output"):
        store.manifest.append({"t": "free", "scope": 5})
    assert store.manifest.path.stat().st_size == size  # written, then taken back
    store.manifest.append({"t": "free", "scope": 6})  # both points fired once
    assert store.manifest.path.stat().st_size > size
