"""The owner's side of a streamed shipped SSD read (``ShipBuffer.stream``), on a real pool."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from flatcake_ray.actors.shipping import STREAM_AHEAD, ShipBuffer
from flatcake_ray.errors import ReadRangeError, TransferTimeoutError
from flatcake_ray.media.buffers import AlignedBuffer
from flatcake_ray.media.pool import SsdPool

WINDOW = 64 << 10


@pytest.fixture
def ship(tmp_path):
    pool = SsdPool((str(tmp_path),), 1, 1 << 20)
    data = AlignedBuffer(1 << 20)
    data.array[:] = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    pool.write(0, data.array)
    buffer = ShipBuffer(4 * WINDOW, pool, ttl_s=60)
    yield buffer, data.array.copy()
    buffer.close()
    pool.close()


def windows(count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.array([i * WINDOW]), np.array([WINDOW])) for i in range(count)]


def allow_all(src: np.ndarray, sizes: np.ndarray) -> None:
    return None


def test_windows_are_yielded_in_order_and_run_ahead_only_as_far_as_the_buffer(ship):
    buffer, image = ship
    stream = buffer.stream(windows(8), "t", 1, 5.0, allow_all)
    held = [next(stream) for _ in range(4)]  # four regions fill the buffer
    for i, reply in enumerate(held):
        region = buffer.buffer.array[reply.offset : reply.offset + reply.nbytes]
        assert np.array_equal(region, image[i * WINDOW : (i + 1) * WINDOW])
    got: list = []
    later = threading.Thread(target=lambda: got.append(next(stream)))
    later.start()
    later.join(0.3)
    assert later.is_alive()  # the fifth window waits for the reader
    assert buffer.unship(held[0].region_id, "t")
    later.join(5)
    assert got and np.array_equal(
        buffer.buffer.array[got[0].offset : got[0].offset + WINDOW], image[4 * WINDOW : 5 * WINDOW]
    )
    buffer.stop("t", 1)
    assert list(stream) == []  # stopped: nothing more, and the stream is gone
    assert buffer.counters["ship_stream_waits"] >= 1


def test_a_buffer_that_stays_full_ends_the_stream_with_a_timeout(ship):
    buffer, _ = ship
    stream = buffer.stream(windows(5), "t", 2, 0.2, allow_all)
    for _ in range(4):
        next(stream)
    with pytest.raises(TransferTimeoutError):
        next(stream)


def test_a_lapsed_lease_stops_the_stream_before_its_window_is_read(ship):
    buffer, _ = ship
    lapsed = threading.Event()

    def leased(src: np.ndarray, sizes: np.ndarray) -> None:
        if lapsed.is_set():
            raise ReadRangeError("no lease")

    stream = buffer.stream(windows(STREAM_AHEAD + 2), "t", 3, 5.0, leased)
    given = [next(stream)]
    lapsed.set()
    # The windows read ahead were checked before the lease lapsed: they still come.
    given += [next(stream) for _ in range(STREAM_AHEAD - 1)]
    with pytest.raises(ReadRangeError):
        next(stream)
    assert buffer.counters["ships"] == STREAM_AHEAD  # nothing read after the lapse
    assert buffer.regions.held == len(given)  # only the regions the reader was given
    for reply in given:
        assert buffer.unship(reply.region_id, "t")
    assert buffer.regions.held == 0


def test_the_next_windows_are_read_while_the_reader_holds_the_first(ship):
    buffer, image = ship
    checked: list[int] = []

    def leased(src: np.ndarray, sizes: np.ndarray) -> None:
        checked.append(int(src[0]))

    stream = buffer.stream(windows(6), "t", 5, 5.0, leased)
    first = next(stream)
    assert checked == [i * WINDOW for i in range(STREAM_AHEAD)]  # started before the first came
    reply, got = first, 0
    while reply is not None:  # in order, each window's bytes; the reader frees each
        region = buffer.buffer.array[reply.offset : reply.offset + reply.nbytes]
        assert np.array_equal(region, image[got * WINDOW : (got + 1) * WINDOW])
        assert buffer.unship(reply.region_id, "t")
        got += 1
        reply = next(stream, None)
    assert got == 6 and buffer.regions.held == 0


def test_a_stream_that_ends_early_gives_back_the_windows_it_read_ahead(ship):
    buffer, _ = ship
    stream = buffer.stream(windows(6), "t", 6, 5.0, allow_all)
    first = next(stream)
    stream.close()  # the reader is gone: what was read ahead is nobody's
    assert buffer.regions.held == 1  # only the window it was given
    assert buffer.unship(first.region_id, "t") and buffer.regions.held == 0


def test_a_stream_id_runs_once_per_tenant_and_another_tenant_cannot_stop_it(ship):
    buffer, _ = ship
    stream = buffer.stream(windows(2), "t", 4, 5.0, allow_all)
    next(stream)
    with pytest.raises(ReadRangeError):
        next(buffer.stream(windows(1), "t", 4, 5.0, allow_all))
    buffer.stop("other", 4)
    assert len(list(stream)) == 1  # not stopped: the second window still comes
