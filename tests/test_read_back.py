"""An engine saves a prefix and soon reads it back: a client on the node's machine that put
pages into an arena chunk reads them back without asking the node for that chunk again (the
put was handed it), as the tenant grows chunk by chunk. One Ray node, one storage node, the
arena in four small chunks."""

from __future__ import annotations

import numpy as np
import pytest

from flatcake_ray.core.catalog import PutHints

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

NAMESPACE = "fc-read-back"
LAYERS, PAGE_BYTES, PAGES = 2, 4096, 48  # a put of 384 KiB: a 1 MiB chunk holds two
DRAM = PutHints(turn=2, prior_reply_tokens=1, context_tokens=1)


@pytest.fixture(scope="module")
def service(ray_service):
    from flatcake_ray.client.client import FlatCakeClient

    ray_service(
        NAMESPACE,
        layers=LAYERS,
        page_bytes=PAGE_BYTES,
        dram_bytes=4 << 20,
        dram_chunks=4,
        ssd_file_bytes=8 << 20,
        ramp_seconds=0.0,
    )
    client = FlatCakeClient(NAMESPACE)
    yield client
    client.close()


def handouts(client) -> int:
    (stats,) = client.stats()["nodes"].values()
    return stats["chunk_handouts"]


def test_a_client_reads_back_what_it_put_without_asking_for_its_chunk_again(service):
    client = service
    asked_by_reads = []
    for session in range(6):  # 2.3 MB in all: the tenant grows into new chunks as it goes
        keys = [f"back/{session}/{i}" for i in range(PAGES)]
        kv = np.random.default_rng(session).integers(
            0, 256, (LAYERS, PAGES, PAGE_BYTES), dtype=np.uint8
        )
        result = client.put(keys, kv, session_id=f"back/{session}", hints=DRAM)
        assert result.medium is not None and result.medium.name == "DRAM"
        before = handouts(client)
        out = np.zeros_like(kv)
        assert client.get(keys, out) == PAGES and np.array_equal(out, kv)
        asked_by_reads.append(handouts(client) - before)
    # The first read maps every chunk its tenant holds (one handout); the rest ask nothing,
    # though the puts after it were handed chunks it had not mapped.
    assert asked_by_reads == [1, 0, 0, 0, 0, 0]
    assert handouts(client) >= 1 + 3  # the puts' own: one per chunk they wrote into (3+)


def test_a_warmed_up_client_writes_and_reads_its_tenants_chunks_without_asking(service):
    """``warm_up`` maps the arena chunks the client's tenant holds on its node, for puts and
    for reads: a fresh client's first put into a session there and its first read ask the
    node for no chunk (a put's first write into a chunk paid its page tables: 70-140 ms for
    1.2 GB of 4 KiB pages)."""
    from flatcake_ray.client.client import FlatCakeClient

    keys = [f"warm/{i}" for i in range(8)]
    kv = np.random.default_rng(99).integers(0, 256, (LAYERS, 8, PAGE_BYTES), dtype=np.uint8)
    service.put(keys[:4], kv[:, :4], session_id="warm", hints=DRAM)  # the tenant holds it
    fresh = FlatCakeClient(NAMESPACE)
    try:
        fresh.warm_up()
        before = handouts(fresh)
        result = fresh.put(keys[4:], kv[:, 4:], session_id="warm", hints=DRAM)
        assert result.medium is not None and result.medium.name == "DRAM"
        out = np.zeros_like(kv)
        assert fresh.get(keys, out) == 8 and np.array_equal(out, kv)
        assert handouts(fresh) == before
    finally:
        fresh.close()
