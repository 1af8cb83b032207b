"""The single-node store on real files and real shared memory: round trips, layout, reads,
placement across turns, write-once and concurrency, and its arena seen from another process."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from flatcake_ray.config import PlacementConfig
from flatcake_ray.errors import StoreWriteError
from flatcake_ray.node.store import PutHints
from tests.conftest import LAYERS, PAGE_BYTES, random_kv, small_config

SHORT_CHAT = PutHints(turn=2, prior_reply_tokens=10)  # Table 2: DRAM


def restore(store, keys, **options):
    out = np.zeros((LAYERS, len(keys), PAGE_BYTES), dtype=np.uint8)
    return store.get(keys, out, **options), out


@pytest.mark.parametrize(("hints", "medium"), [(None, "SSD"), (SHORT_CHAT, "DRAM")])
def test_round_trip_on_each_medium(make_store, hints, medium):
    store = make_store()
    kv = random_kv(12)
    result = store.put(list(range(12)), kv, hints=hints)
    assert (result.medium.name, result.pages_written) == (medium, 12)
    count, out = restore(store, list(range(12)))
    assert count == 12 and np.array_equal(out, kv)


def test_round_trip_across_turns_and_media(make_store):
    store = make_store()
    kv = random_kv(30, seed=1)
    first = store.put(list(range(10)), kv[:, :10])  # turn 1: SSD
    second = store.put(list(range(20)), kv[:, :20], hints=SHORT_CHAT)  # turn 2: DRAM
    third = store.put(list(range(30)), kv)
    assert (first.medium.name, second.medium.name) == ("SSD", "DRAM")
    assert (second.pages_skipped, third.pages_written) == (10, 10)
    assert first.session_id == second.session_id == third.session_id
    count, out = restore(store, list(range(30)))
    assert count == 30 and np.array_equal(out, kv)


def test_torch_tensors_in_and_out(make_store):
    store = make_store()
    kv = torch.from_numpy(random_kv(5).view(np.float16).copy())
    store.put(["a", "b", "c", "d", "e"], kv)
    out = torch.zeros_like(kv)
    assert store.get(["a", "b", "c", "d", "e"], out) == 5
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))  # bitwise: NaNs included


def test_on_disk_layout_is_layer_major(make_store):
    store = make_store()
    kv = random_kv(6, seed=2)
    store.put(list(range(6)), kv)
    base = int(store.gvas([0])[0]) & ((1 << 48) - 1)
    file_index, offset = store.pool.locate(base)
    with open(store.pool.paths[file_index], "rb") as pool_file:
        pool_file.seek(offset)
        raw = np.frombuffer(pool_file.read(LAYERS * 49152), dtype=np.uint8)
    stride = 49152  # 6 pages x 8 KiB, already 4 KiB aligned
    for layer in range(LAYERS):
        expected = kv[layer].reshape(-1)  # all pages of layer l in one contiguous range
        assert np.array_equal(raw[layer * stride : layer * stride + expected.size], expected)


def test_t_turn_restore_costs_at_most_layers_times_turns_reads(make_store):
    store = make_store(gap_bytes=0)
    turns, pages_per_turn = 5, 3
    kv = random_kv(turns * pages_per_turn, seed=3)
    other = random_kv(2, seed=4)
    for turn in range(1, turns + 1):
        end = turn * pages_per_turn
        store.put(list(range(end)), kv[:, :end])
        store.put([f"other-{turn}-a", f"other-{turn}-b"], other)  # interleaved sessions
    before = store.stats()["ssd_read_commands"]
    count, out = restore(store, list(range(turns * pages_per_turn)))
    commands = store.stats()["ssd_read_commands"] - before
    assert count == turns * pages_per_turn and np.array_equal(out, kv)
    assert commands <= LAYERS * turns


def test_gap_bridging_merges_a_session_into_few_reads(make_store):
    store = make_store(gap_bytes=64 << 10)
    kv = random_kv(12, seed=5)
    for end in (4, 8, 12):
        store.put(list(range(end)), kv[:, :end])
    before = store.stats()["ssd_read_commands"]
    restore(store, list(range(12)))
    assert store.stats()["ssd_read_commands"] - before == 1  # one scope run, holes < 64 KiB


def test_failed_write_publishes_nothing(make_store, failpoints):
    store = make_store()
    store.put(["keep"], random_kv(1))
    failpoints.arm("pool.write", raises=OSError(5, "injected I/O error"), times=None)
    with pytest.raises(StoreWriteError):
        store.put(["x", "y"], random_kv(2))
    failpoints.disarm("pool.write")
    assert store.exists(["x"]) == 0 and store.exists(["keep"]) == 1
    assert store.stats()["write_failures"] == 1
    assert store.put(["x", "y"], random_kv(2)).pages_written == 2  # space was given back


def test_keys_are_invisible_until_the_segment_is_written(make_store):
    store = make_store()
    kv = random_kv(3)
    handle = store.begin_put(["p", "q", "r"])
    seen_during_write = []
    for layer in range(LAYERS):
        handle.write_layer(layer, kv[layer])
        seen_during_write.append(store.exists(["p"]))
    assert seen_during_write == [0] * LAYERS
    handle.commit()
    assert store.exists(["p", "q", "r"]) == 3


def test_an_ssd_layer_is_written_to_the_drive_behind_the_caller(make_store, failpoints):
    store = make_store()
    kv = random_kv(3)
    first_write = threading.Event()
    release = threading.Event()

    def held_drive(**_context) -> None:
        first_write.set()
        assert release.wait(30)

    failpoints.arm("pool.write", call=held_drive)  # the first layer's write waits
    handle = store.begin_put(["p", "q", "r"])  # no hints: a first turn, SSD
    handle.write_layer(0, kv[0])
    assert first_write.wait(30)
    handle.write_layer(1, kv[1])  # copied while layer 0 is still on its way to the drive
    assert store.exists(["p"]) == 0
    release.set()
    for layer in range(2, LAYERS):
        handle.write_layer(layer, kv[layer])
    assert handle.commit().medium.name == "SSD"
    found, out = restore(store, ["p", "q", "r"])
    assert found == 3 and np.array_equal(out, kv)


def test_a_drive_error_behind_the_caller_fails_the_put_and_frees_its_space(make_store, failpoints):
    store = make_store()
    kv = random_kv(2)
    failpoints.arm("pool.write", raises=OSError(5, "injected I/O error"))  # layer 0's write
    handle = store.begin_put(["x", "y"])
    with pytest.raises(StoreWriteError):  # raised by a later call, however late
        for layer in range(LAYERS):
            handle.write_layer(layer, kv[layer])
        handle.commit()
    assert store.exists(["x"]) == 0 and store.stats()["write_failures"] == 1
    assert store.put(["x", "y"], kv).pages_written == 2  # the space went back
    found, out = restore(store, ["x", "y"])
    assert found == 2 and np.array_equal(out, kv)


def test_commit_before_all_layers_is_refused(make_store):
    store = make_store()
    handle = store.begin_put(["p"])
    handle.write_layer(0, random_kv(1)[0])
    with pytest.raises(StoreWriteError):
        handle.commit()
    assert store.exists(["p"]) == 0


def test_chat_that_turns_agentic_keeps_old_blocks_and_moves_new_turns(make_store):
    store = make_store(
        placement=PlacementConfig(page_tokens=256, tau_tokens=1024, l_agent_tokens=256 * 12)
    )
    kv = random_kv(20, seed=9)
    turn1 = store.put(list(range(2)), kv[:, :2])  # one-shot: SSD
    turn2 = store.put(list(range(4)), kv[:, :4])  # 2 pages appended < tau: short chat, DRAM
    turn3 = store.put(list(range(6)), kv[:, :6])
    turn4 = store.put(list(range(14)), kv[:, :14])  # the context crosses L_agent: agentic, SSD
    turn5 = store.put(list(range(16)), kv[:, :16])  # stays agentic: the context only grows
    assert [t.medium.name for t in (turn1, turn2, turn3, turn4, turn5)] == [
        "SSD",
        "DRAM",
        "DRAM",
        "SSD",
        "SSD",
    ]
    assert turn4.rule == "agentic"
    assert len({t.session_id for t in (turn1, turn2, turn3, turn4, turn5)}) == 1
    gvas = store.gvas(list(range(16)))
    assert (gvas[2:6] < 1 << 60).all() and (gvas[6:] >= 1 << 60).all()  # nothing migrated
    count, out = restore(store, list(range(16)))
    assert count == 16 and np.array_equal(out, kv[:, :16])


def test_fork_of_a_shared_prefix_is_a_new_session(make_store):
    store = make_store()
    kv = random_kv(6)
    base = store.put(["sys", "u1"], kv[:, :2])
    first = store.put(["sys", "u1", "a1"], kv[:, :3])
    fork = store.put(["sys", "u1", "b1"], kv[:, :3])
    mid_fork = store.put(["sys", "c1"], kv[:, :2])
    assert first.session_id == base.session_id
    assert len({first.session_id, fork.session_id, mid_fork.session_id}) == 3
    assert (fork.rule, mid_fork.rule) == ("one-shot", "one-shot")  # its own pages: turn 1
    assert store.stats()["forks"] == 2
    shared = store.put(["sys", "d1"], kv[:, :2], hints=PutHints(prefix_refcount=3))
    assert (shared.medium.name, shared.rule) == ("DRAM", "shared")  # the engine knows better


def test_explicit_session_id_wins(make_store):
    store = make_store()
    kv = random_kv(2)
    a = store.put(["x"], kv[:, :1], session_id="conv-7")
    b = store.put(["unrelated"], kv[:, :1], session_id="conv-7")
    assert a.session_id == b.session_id == "conv-7"


def test_write_once_second_put_changes_nothing(make_store):
    store = make_store()
    kv = random_kv(3, seed=10)
    store.put(["a", "b", "c"], kv)
    again = store.put(["a", "b", "c"], random_kv(3, seed=11))
    assert (again.pages_written, again.pages_skipped) == (0, 3)
    count, out = restore(store, ["a", "b", "c"])
    assert count == 3 and np.array_equal(out, kv)


def test_concurrent_puts_and_gets(make_store):
    store = make_store(dram_bytes=16 << 20, ssd_file_bytes=16 << 20)
    kv = random_kv(8, seed=12)
    errors = []

    def worker(worker_id):
        try:
            for i in range(10):
                keys = [f"w{worker_id}-{i}-{p}" for p in range(8)]
                store.put(keys, kv, hints=SHORT_CHAT if i % 2 else None)
                count, out = restore(store, keys)
                assert count == 8 and np.array_equal(out, kv)
        except Exception as exc:  # handed to the main thread, which fails the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_index_memory_is_reported(make_store):
    store = make_store(
        dram_bytes=0, ssd_file_bytes=64 << 20, ssd_files_per_dir=2, page_bytes=4096, layers=1
    )
    kv = np.zeros((1, 1000, 4096), dtype=np.uint8)
    for batch in range(10):
        store.put([f"{batch}-{p}" for p in range(1000)], kv)
    stats = store.stats()
    assert stats["pages_indexed"] == 10_000
    assert 16 < stats["index_bytes_per_page"] < 200


def test_another_process_reads_the_arena_and_cannot_change_it(make_store, tmp_path):
    import subprocess
    import sys

    store = make_store()
    kv = random_kv(2, seed=14)
    store.put(["m0", "m1"], kv, hints=SHORT_CHAT)
    offset = int(store.gvas(["m0"])[0])  # a DRAM GVA is its own arena offset (medium and node 0)
    script = (  # a reader's mapping of a chunk it was handed (transports/local_dram.py)
        "import sys\n"
        "from flatcake_ray.media.chunk_map import ChunkMap\n"
        "fd, nbytes, at = (int(arg) for arg in sys.argv[1:])\n"
        "chunks = ChunkMap(nbytes)\n"
        "chunks.place(0, fd, nbytes, shared=False)\n"
        "view = chunks.view\n"
        "sys.stdout.write(view[at : at + 64].tobytes().hex())\n"
        "view[at : at + 64] = 0  # lands in this process's private copy only\n"
        "sys.stdout.write(' ' + view[at : at + 64].tobytes().hex())\n"
    )
    fd = store.arena.chunk_fd(0)
    shown = subprocess.run(
        [sys.executable, "-c", script, str(fd), str(store.config.dram_bytes), str(offset)],
        capture_output=True,
        text=True,
        check=True,
        pass_fds=(fd,),
    ).stdout
    assert shown == kv[0, 0, :64].tobytes().hex() + " " + "00" * 64
    assert np.array_equal(store.arena.view[offset : offset + 64], kv[0, 0, :64])  # unchanged
    out = np.zeros((LAYERS, 2, PAGE_BYTES), dtype=np.uint8)
    assert store.get(["m0", "m1"], out) == 2 and np.array_equal(out, kv)


def test_an_arena_has_no_path_and_goes_with_its_process(tmp_path):
    """The arena is memfds: no file another process could open by name, and nothing left
    behind by a process that dies without closing its store."""
    import subprocess
    import sys

    config = small_config(tmp_path)
    script = (
        "import os, sys\n"
        "from flatcake_ray.config import StoreConfig\n"
        "from flatcake_ray.node.store import FlatCakeStore\n"
        "store = FlatCakeStore(StoreConfig(**eval(sys.argv[1])))\n"
        "print(os.readlink(f'/proc/self/fd/{store.arena.chunk_fds[0]}'), flush=True)\n"
        "os._exit(0)  # dies without closing\n"
    )
    fields = {
        k: getattr(config, k)
        for k in (
            "root",
            "layers",
            "page_bytes",
            "dram_bytes",
            "ssd_file_bytes",
            "ssd_files_per_dir",
            "fsync",
        )
    }
    folders = [Path("/dev/shm"), Path("/dev/hugepages")]
    before = {p for folder in folders if folder.is_dir() for p in folder.iterdir()}
    link = subprocess.run(
        [sys.executable, "-c", script, repr(fields)], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert link.startswith("/memfd:flatcake-"), link  # anonymous: no directory holds it
    after = {p for folder in folders if folder.is_dir() for p in folder.iterdir()}
    slug = tmp_path.resolve().as_posix().strip("/").replace("/", "-")
    assert not [p for p in after - before if slug in p.name]


TORCH_FREE_STORE = (
    "import sys\n"
    "import numpy as np\n"
    "from flatcake_ray.config import PlacementConfig, StoreConfig\n"
    "from flatcake_ray.node.store import FlatCakeStore, PutHints\n"
    "placement = PlacementConfig(dram_policy='table2')  # SSD pages read from SSD\n"
    "store = FlatCakeStore(StoreConfig(**eval(sys.argv[1]), placement=placement))\n"
    "kv = np.arange(2 * 2 * 4096, dtype=np.uint8).reshape(2, 2, 4096) % 251\n"
    "dram, ssd = PutHints(turn=2, prior_reply_tokens=1), PutHints(turn=1)\n"
    "for hints, name in ((dram, 'dram'), (ssd, 'ssd')):\n"
    "    store.put([name + '0', name + '1'], kv, hints=hints)\n"
    "    probe = store.probe([name + '0', name + '1'])\n"
    "    assert (probe.hits, probe.on_ssd) == (2, name == 'ssd')\n"
    "assert 'torch' not in sys.modules, 'the store loaded torch before a restore'\n"
    "out = np.zeros_like(kv)\n"
    "assert store.get(['ssd0', 'ssd1'], out) == 2 and np.array_equal(out, kv)\n"
    "assert 'torch' in sys.modules\n"
    "if sys.argv[2] == 'cuda':  # made without torch: registered for its first GPU restore\n"
    "    assert not store.arena.cuda_registered\n"
    "    store.pipeline('cuda')\n"
    "    import torch\n"
    "    assert store.arena.cuda_registered and torch.from_numpy(store.arena.view).is_pinned()\n"
    "store.close()\n"
)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
            ],
        ),
    ],
)
def test_a_store_loads_torch_with_its_first_restore(tmp_path, device):
    """Puts and lookups need no torch, so a storage node (which restores only to re-check a
    scope) starts without it; an arena made before torch was loaded is registered with CUDA
    when the store's first restore into a GPU asks."""
    import subprocess
    import sys

    fields = {"root": str(tmp_path), "layers": 2, "page_bytes": 4096, "dram_bytes": 4 << 20}
    fields |= {"ssd_file_bytes": 8 << 20, "ssd_files_per_dir": 2, "fsync": False}
    subprocess.run([sys.executable, "-c", TORCH_FREE_STORE, repr(fields), device], check=True)
