"""Where recorded values go: a recorder's own series in process, and Ray's metrics agent.

Every :class:`Recorder` (one per store, one per client) keeps its series in process, always:
the in-process store has no Prometheus path (no Ray), and its ``stats()`` shows the same
figures; tests read them exactly, without the agent's export delay. When Ray is initialized
in this process, the same updates are also handed to the process's :class:`RayForwarder`,
which a background thread flushes into ``ray.util.metrics`` every :data:`FLUSH_S`: the
caller's thread (a restore's scatter thread, a put's commit) only adds to a dict. Ray's agent
exports at its own interval (``metrics_report_interval_ms``, 10 s by default), so a second of
batching here costs no freshness. ``ray`` is never imported here: the forwarder only uses a
Ray that some other code already imported and initialized.
"""

from __future__ import annotations

import atexit
import bisect
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from flatcake_ray.metrics.definitions import BY_NAME, Kind, MetricDef
from flatcake_ray.metrics.prometheus import Sample

FLUSH_S = 1.0
# Everything that queues requests to fold later (``record.Metrics``): the forwarder folds
# them before each flush, so queued requests reach Ray within a second too.
_FOLDING: weakref.WeakSet[Any] = weakref.WeakSet()
_FOLDING_LOCK = threading.Lock()


def track(source: Any) -> None:
    """Fold ``source`` (it has ``fold()``) before each flush to Ray; starts the forwarder
    when Ray already runs in this process."""
    with _FOLDING_LOCK:
        _FOLDING.add(source)
    RayForwarder.active()


Key = tuple[str, tuple[str, ...]]  # (metric name, tag values in the definition's order)


@dataclass
class Batch:
    """The updates of one request (or one report), applied together."""

    counts: list[tuple[str, tuple[str, ...], float]] = field(default_factory=list)
    gauges: list[tuple[str, tuple[str, ...], float]] = field(default_factory=list)
    observations: list[tuple[str, tuple[str, ...], float]] = field(default_factory=list)

    def inc(self, name: str, tags: tuple[str, ...], value: float = 1) -> None:
        if value > 0:  # Ray refuses a zero increment; a zero changes nothing anyway
            self.counts.append((name, tags, value))

    def set(self, name: str, tags: tuple[str, ...], value: float) -> None:
        self.gauges.append((name, tags, value))

    def observe(self, name: str, tags: tuple[str, ...], value: float) -> None:
        self.observations.append((name, tags, value))


@dataclass
class _Histogram:
    buckets: list[int]  # per boundary, then +Inf; not cumulative
    total: float = 0.0
    count: int = 0


class Recorder:
    """One store's or client's series, in process (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Key, float] = {}
        self._gauges: dict[Key, float] = {}
        self._histograms: dict[Key, _Histogram] = {}

    def apply(self, batch: Batch) -> None:
        with self._lock:
            for name, tags, value in batch.counts:
                self._counts[name, tags] = self._counts.get((name, tags), 0.0) + value
            for name, tags, value in batch.gauges:
                self._gauges[name, tags] = value
            for name, tags, value in batch.observations:
                self._observe(BY_NAME[name], tags, value)
        forwarder = RayForwarder.active()
        if forwarder is not None:
            forwarder.add(batch)

    def _observe(self, metric: MetricDef, tags: tuple[str, ...], value: float) -> None:
        key = (metric.name, tags)
        histogram = self._histograms.get(key)
        if histogram is None:
            histogram = self._histograms[key] = _Histogram([0] * (len(metric.boundaries) + 1))
        # Prometheus buckets are "less than or equal": a value on a boundary counts in it.
        histogram.buckets[bisect.bisect_left(metric.boundaries, value)] += 1
        histogram.total += value
        histogram.count += 1

    def samples(self) -> list[Sample]:
        """The series as a scrape of Ray's agent would show them (names, ``le``), less
        Ray's own labels."""
        with self._lock:
            counts, gauges = dict(self._counts), dict(self._gauges)
            histograms = {
                k: _Histogram(list(h.buckets), h.total, h.count)
                for k, h in self._histograms.items()
            }
        out = [Sample(BY_NAME[n].exported, _labels(n, t), v) for (n, t), v in counts.items()]
        out += [Sample(BY_NAME[n].exported, _labels(n, t), v) for (n, t), v in gauges.items()]
        for (name, tags), histogram in histograms.items():
            out.extend(_histogram_samples(BY_NAME[name], tags, histogram))
        return out

    def snapshot(self) -> list[dict[str, Any]]:
        """:meth:`samples` as plain data (for ``stats()``)."""
        return [
            {"name": s.name, "labels": dict(s.labels), "value": s.value} for s in self.samples()
        ]


def _labels(name: str, tags: tuple[str, ...]) -> dict[str, str]:
    return dict(zip(BY_NAME[name].tags, tags, strict=True))


def _histogram_samples(
    metric: MetricDef, tags: tuple[str, ...], histogram: _Histogram
) -> Iterator[Sample]:
    labels = _labels(metric.name, tags)
    running = 0
    bounds = [repr(float(b)) for b in metric.boundaries] + ["+Inf"]
    for bound, count in zip(bounds, histogram.buckets, strict=True):
        running += count
        yield Sample(metric.exported + "_bucket", {**labels, "le": bound}, float(running))
    yield Sample(metric.exported + "_sum", labels, histogram.total)
    yield Sample(metric.exported + "_count", labels, float(histogram.count))


class RayForwarder:
    """This process's bridge to ``ray.util.metrics``: pending updates, flushed by a thread."""

    _instance: RayForwarder | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Key, float] = {}
        self._gauges: dict[Key, float] = {}
        self._observations: list[tuple[str, tuple[str, ...], float]] = []
        self._metrics: dict[str, Any] = {}  # name -> the ray.util.metrics object
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flatcake-metrics", daemon=True)
        self._thread.start()
        atexit.register(self.fold_and_flush)

    @classmethod
    def active(cls) -> RayForwarder | None:
        """The forwarder when Ray is initialized in this process (made on first use)."""
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return None
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def add(self, batch: Batch) -> None:
        with self._lock:
            for name, tags, value in batch.counts:
                self._counts[name, tags] = self._counts.get((name, tags), 0.0) + value
            for name, tags, value in batch.gauges:
                self._gauges[name, tags] = value
            self._observations.extend(batch.observations)

    def _run(self) -> None:
        while True:
            self._wake.wait(FLUSH_S)
            self.fold_and_flush()

    def fold_and_flush(self) -> None:
        with _FOLDING_LOCK:
            sources = list(_FOLDING)
        for source in sources:
            source.fold()
        self.flush()

    def flush(self) -> None:
        """Hand everything pending to Ray (dropped when Ray was shut down meanwhile: its
        agent is gone with it)."""
        with self._lock:
            counts, self._counts = self._counts, {}
            gauges, self._gauges = self._gauges, {}
            observations, self._observations = self._observations, []
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return
        for (name, tags), value in counts.items():
            self._metric(name).inc(value, tags=_labels(name, tags))
        for (name, tags), value in gauges.items():
            self._metric(name).set(value, tags=_labels(name, tags))
        for name, tags, value in observations:
            self._metric(name).observe(value, tags=_labels(name, tags))

    def _metric(self, name: str) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            from ray.util import metrics as ray_metrics

            spec = BY_NAME[name]
            if spec.kind is Kind.COUNTER:
                metric = ray_metrics.Counter(name, spec.description, tag_keys=spec.tags)
            elif spec.kind is Kind.GAUGE:
                metric = ray_metrics.Gauge(name, spec.description, tag_keys=spec.tags)
            else:
                metric = ray_metrics.Histogram(
                    name, spec.description, list(spec.boundaries), tag_keys=spec.tags
                )
            self._metrics[name] = metric
        return metric
