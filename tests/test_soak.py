"""A bounded chaos soak: clients put and verify every byte while a driver breaks things.

Two Ray nodes, a storage node on each; two tenants, one client thread each, putting sessions
(DRAM and SSD, alternately) and restoring random committed ones, comparing every restored byte
with what was put. Meanwhile a driver, in turn: kills a storage node (``ray.kill``) and starts
it again (``deploy.start``: it reopens its root and recovers its SSD scopes), kills the
coordinator (Ray restarts it; it rebuilds from the nodes), flips a byte of a committed SSD
page in its pool file, and forges lease releases (random ids, under the other tenant's secret,
its own, or garbage). Every tick it also forges a few releases.

Asserted: 0 wrong bytes delivered; no call outlives ``HANG_S``; a forged release is never
accepted; every error a client sees is typed (``flatcake_ray.errors``); at the end, with both
nodes up again, every committed SSD page is readable unless the driver flipped a byte at or
before it (then it is a miss: the corruption was detected). The counts are printed (``-s``).

About 40 s of chaos here (about ten ticks: each node and the coordinator restarted in turn);
``FLATCAKE_SOAK_S`` sets another length.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest

from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.gva import Medium, decode
from flatcake_ray.errors import AccessDeniedError, FlatCakeError

pytestmark = [pytest.mark.ray, pytest.mark.long]
ray = pytest.importorskip("ray")

NAMESPACE = "fc-soak"
LAYERS, PAGE_BYTES, PAGES = 2, 4096, 4
SOAK_S = float(os.environ.get("FLATCAKE_SOAK_S", "40"))
HANG_S = 60.0  # no client call may take longer, whatever the driver is doing
TICK_S = 3.0
HINTS = {Medium.DRAM: PutHints(turn=2, prior_reply_tokens=1), Medium.SSD: PutHints(turn=1)}


@dataclass
class Session:
    keys: list[str]
    kv: np.ndarray
    medium: Medium
    flipped_at: int | None = None  # the first page the driver corrupted (SSD only)
    detected: bool = False  # a restore saw that page as a miss


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    untyped: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    slowest_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **deltas: int) -> None:
        with self.lock:
            self.counts.update(deltas)

    def timed(self, seconds: float) -> None:
        with self.lock:
            self.slowest_s = max(self.slowest_s, seconds)


@pytest.fixture(scope="module")
def soak_service(ray_service):
    from flatcake_ray.client import deploy, tenants

    config = ray_service(
        NAMESPACE,
        workers=1,
        # Small SSD runs (the nodes inherit it): every SSD session of the soak fits, none is
        # reclaimed, so an SSD page missing at the end is a loss, not an eviction.
        env={"FLATCAKE_SSD_MIN_RUN_BYTES": str(64 << 10)},
        layers=LAYERS,
        page_bytes=PAGE_BYTES,
        dram_bytes=8 << 20,
        # Room for what 60 s of puts write now (a run on 5 Dec: 7,764 puts, 3,883 of them SSD
        # sessions; at 32 MiB a file the oldest were reclaimed once direct calls sped puts up).
        ssd_file_bytes=(128 << 20) * max(1, math.ceil(SOAK_S / 60)),  # a longer soak, more
        fsync=False,  # a killed process loses nothing the kernel has; no machine crashes here
        lease_ttl_s=10.0,
        report_interval_s=0.5,
        node_timeout_s=3.0,
        rpc_timeout_s=5.0,
        ramp_seconds=0.0,
        open_default=False,
    ).config
    secrets = {
        name: tenants.add_tenant(NAMESPACE, name, layers=LAYERS, page_bytes=PAGE_BYTES)
        for name in ("alpha", "beta")
    }
    return {"config": config, "secrets": secrets, "ray_nodes": deploy.service_nodes()}


def make_client(secret: str):
    from flatcake_ray.client.client import FlatCakeClient
    from flatcake_ray.config import ClientConfig

    return FlatCakeClient(NAMESPACE, config=ClientConfig(tenant_secret=secret))


# ---- the clients -----------------------------------------------------------------------------
class Writer(threading.Thread):
    """One tenant's client: puts new sessions and restores random committed ones."""

    def __init__(self, tenant: str, secret: str, stop: threading.Event, tally: Tally) -> None:
        super().__init__(name=f"soak-{tenant}", daemon=True)
        self.tenant, self.secret, self.stop, self.tally = tenant, secret, stop, tally
        self.sessions: list[Session] = []
        self.sessions_lock = threading.Lock()
        self.busy_since: float | None = None
        self.rng = np.random.default_rng(abs(hash(tenant)) % (1 << 32))

    def run(self) -> None:
        client = make_client(self.secret)
        try:
            n = 0
            while not self.stop.is_set():
                self._step(client, n)
                n += 1
        finally:
            client.close()

    def _step(self, client, n: int) -> None:
        self.busy_since = time.monotonic()
        try:
            if n % 2 == 0:
                self._put(client, n)
            else:
                self._restore(client)
        except FlatCakeError as exc:
            self.tally.add(**{f"errors_{type(exc).__name__}": 1})
        except Exception as exc:  # untyped: a failure of the service's contract
            self.tally.untyped.append(_described(self.tenant, exc))
        finally:
            self.tally.timed(time.monotonic() - self.busy_since)
            self.busy_since = None

    def _put(self, client, n: int) -> None:
        medium = Medium.SSD if n % 4 == 0 else Medium.DRAM
        keys = [f"{self.tenant}-{n}/{i}" for i in range(PAGES)]
        kv = self.rng.integers(0, 256, (LAYERS, PAGES, PAGE_BYTES), dtype=np.uint8)
        client.put(keys, kv, session_id=keys[0], hints=HINTS[medium])
        with self.sessions_lock:
            self.sessions.append(Session(keys, kv, medium))
        self.tally.add(puts=1, **{f"puts_{medium.name.lower()}": 1})

    def _restore(self, client) -> None:
        with self.sessions_lock:
            if not self.sessions:
                return
            session = self.sessions[int(self.rng.integers(len(self.sessions)))]
        check(client, session, self.tally, f"{self.tenant} restore")


def check(client, session: Session, tally: Tally, who: str) -> int:
    """Restore ``session``; count its hits and misses; any wrong byte is recorded."""
    out = np.zeros_like(session.kv)
    hits = client.get(session.keys, out)
    if not np.array_equal(out[:, :hits], session.kv[:, :hits]):
        tally.wrong.append(f"{who}: {session.keys[0]} ({session.medium.name}, {hits} hits)")
    flipped = session.flipped_at
    if flipped is not None and hits <= flipped and not session.detected:
        session.detected = True
        tally.add(corruptions_detected=1)
    tally.add(restores=1, pages_verified=hits, pages_missed=PAGES - hits)
    return hits


# ---- the driver ------------------------------------------------------------------------------
class Driver:
    def __init__(self, service, writers: list[Writer], tally: Tally) -> None:
        self.service, self.writers, self.tally = service, writers, tally
        self.rng = random.Random(11)
        self.observer = make_client(service["secrets"]["alpha"])

    def tick(self, n: int) -> None:
        action = (self.restart_node, self.flip_byte, self.restart_coordinator, self.flip_byte)
        action[n % len(action)](n)
        self.forge_releases(8)

    def _node(self, ray_node_id: str):
        from flatcake_ray.actors.protocol import node_actor_name

        return ray.get_actor(node_actor_name(ray_node_id), NAMESPACE)

    def restart_node(self, n: int) -> None:
        from flatcake_ray.client import deploy

        ray_node_id = self.service["ray_nodes"][(n // 4) % len(self.service["ray_nodes"])]
        ray.kill(self._node(ray_node_id), no_restart=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # its name is free once the actor is gone
            try:
                ray.get(self._node(ray_node_id).ping.remote(), timeout=2)
            except (ValueError, ray.exceptions.RayError):
                break
            time.sleep(0.2)
        for attempt in range(3):  # Ray may hold the dead actor's name a moment longer
            try:
                deploy.start(self.service["config"])
                break
            except (FlatCakeError, ray.exceptions.RayError):
                if attempt == 2:
                    raise
                time.sleep(1.0)
        self.tally.add(node_restarts=1)

    def restart_coordinator(self, n: int) -> None:
        from flatcake_ray.actors.protocol import COORDINATOR_NAME

        ray.kill(ray.get_actor(COORDINATOR_NAME, NAMESPACE), no_restart=False)
        self.tally.add(coordinator_restarts=1)

    def flip_byte(self, n: int) -> None:
        """Flip one byte of a committed SSD page in its pool file (layer 0 of that page)."""
        candidates = [
            (w, s)
            for w in self.writers
            for s in list(w.sessions)
            if s.medium is Medium.SSD and s.flipped_at is None
        ]
        if not candidates:
            return
        writer, session = self.rng.choice(candidates)
        client = make_client(writer.secret)
        try:
            gvas = client.gvas(session.keys)
            page = self.rng.randrange(len(gvas)) if len(gvas) else None
            if page is None:
                return
            where = decode(int(gvas[page]))
            if where.medium is not Medium.SSD:
                return
            link = next(
                (lk for lk in client.nodes.links.values() if lk.node_id == where.node_id), None
            )
            if link is None:
                return
            description = link.description
            index, offset = divmod(where.offset, description.pool_file_bytes)
            offset += self.rng.randrange(PAGE_BYTES)
            fd = os.open(description.pool_paths[index], os.O_RDWR)
            try:
                byte = os.pread(fd, 1, offset)
                os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
                os.fsync(fd)
            finally:
                os.close(fd)
            session.flipped_at = page
            self.tally.add(bytes_flipped=1)
        except FlatCakeError:
            self.tally.add(flip_skipped=1)  # the node holding it is restarting
        finally:
            client.close()

    def forge_releases(self, count: int) -> None:
        secrets = self.service["secrets"]
        for node_id in self.service["ray_nodes"]:
            try:
                node = self._node(node_id)
            except ValueError:
                continue  # restarting
            for _ in range(count // len(self.service["ray_nodes"])):
                secret = self.rng.choice([secrets["alpha"], secrets["beta"], None, "f" * 64])
                lease_id = self.rng.getrandbits(63)
                try:
                    answer = ray.get(node.release.remote(secret, lease_id), timeout=HANG_S)
                except AccessDeniedError:
                    answer = False
                except ray.exceptions.RayError:
                    continue  # the node is restarting
                if answer is True:
                    self.tally.wrong.append(f"forged release {lease_id} accepted")
                self.tally.add(forged_releases=1, forged_releases_refused=int(answer is False))


def _described(tenant: str, exc: Exception) -> str:
    """The call's error, its first line and its last (a Ray task error's cause is at its end)."""
    lines = [line for line in str(exc).splitlines() if line.strip()] or [""]
    return f"{tenant}: {type(exc).__name__}: {lines[0][:200]} ... {lines[-1][:400]}"


def test_chaos_soak(soak_service):
    tally = Tally()
    stop = threading.Event()
    writers = [Writer(name, s, stop, tally) for name, s in soak_service["secrets"].items()]
    for writer in writers:
        writer.start()
    driver = Driver(soak_service, writers, tally)
    started = time.monotonic()
    n = 0
    try:
        while time.monotonic() - started < SOAK_S:
            time.sleep(TICK_S)
            driver.tick(n)
            n += 1
            for writer in writers:
                busy = writer.busy_since
                assert busy is None or time.monotonic() - busy < HANG_S, f"{writer.name} hangs"
    finally:
        stop.set()
        for writer in writers:
            writer.join(HANG_S)
        driver.observer.close()
    assert not any(w.is_alive() for w in writers), "a client call outlived the bound"
    final_sweep(soak_service, writers, tally)
    counts = dict(sorted(tally.counts.items()))
    print(f"\nsoak {SOAK_S:.0f} s: {counts}; slowest call {tally.slowest_s:.2f} s")
    assert not tally.wrong, tally.wrong[:5]
    assert not tally.untyped, tally.untyped[:5]
    assert tally.slowest_s < HANG_S
    assert counts.get("forged_releases_refused", 0) == counts.get("forged_releases", 0) > 0
    assert counts.get("node_restarts", 0) >= 1 and counts.get("puts", 0) > 0
    assert counts.get("lost_without_reason", 0) == 0


def final_sweep(service, writers: list[Writer], tally: Tally) -> None:
    """Both nodes up again: every committed SSD page is readable, unless a byte at or before
    it was flipped (then a miss)."""
    from flatcake_ray.client import deploy

    deploy.start(service["config"])
    time.sleep(2 * service["config"].report_interval_s)
    for writer in writers:
        client = make_client(writer.secret)
        try:
            for session in writer.sessions:
                if session.medium is not Medium.SSD:
                    continue
                hits = check(client, session, tally, f"{writer.tenant} final")
                flipped = session.flipped_at
                expected = PAGES if flipped is None else None
                if expected is not None and hits < expected:
                    tally.add(lost_without_reason=1)
                    tally.wrong.append(f"final: {session.keys[0]} {hits}/{PAGES} pages")
                tally.add(final_ssd_sessions=1, final_ssd_readable=int(hits == PAGES))
        finally:
            client.close()
