"""Prometheus text exposition: samples, a parser, and scraping Ray's metrics agents.

``flatcake-ray status`` and the tests read the service's figures the way Prometheus does:
from each Ray node's metrics agent (``http://<node address>:<MetricsExportPort>/metrics``),
so they see every process's series (clients' restores, nodes' puts and state) at once.
"""

from __future__ import annotations

import math
import re
import urllib.request
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def _unescape(text: str) -> str:
    return re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], text)


def _value(text: str) -> float:
    if text in ("+Inf", "Inf"):
        return math.inf
    if text == "-Inf":
        return -math.inf
    return float(text)


def parse(text: str, prefix: str = "") -> list[Sample]:
    """The samples of an exposition whose names start with ``prefix``."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or not line.startswith(prefix):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line[:200]!r}")
        name, raw_labels, value = match.groups()
        labels = {k: _unescape(v) for k, v in _LABEL.findall(raw_labels or "")}
        out.append(Sample(name, labels, _value(value)))
    return out


def scrape(url: str, timeout_s: float, prefix: str = "") -> list[Sample]:
    """GET ``url`` and parse it (raises OSError when the endpoint does not answer)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return parse(reply.read().decode(), prefix)


@dataclass
class ClusterScrape:
    samples: list[Sample] = field(default_factory=list)
    endpoints: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def ray_endpoints() -> list[str]:
    """The metrics endpoint of every alive Ray node (Ray must be initialized)."""
    import ray

    return [
        f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for node in ray.nodes()
        if node.get("Alive") and node.get("MetricsExportPort")
    ]


def scrape_all(endpoints: Iterable[str], timeout_s: float, prefix: str) -> ClusterScrape:
    """Scrape every endpoint at once; one that fails is named in ``errors``."""
    result = ClusterScrape(endpoints=list(endpoints))
    if not result.endpoints:
        return result
    with ThreadPoolExecutor(max_workers=min(16, len(result.endpoints))) as pool:
        futures = [(url, pool.submit(scrape, url, timeout_s, prefix)) for url in result.endpoints]
        for url, future in futures:
            try:
                result.samples.extend(future.result())
            except (OSError, ValueError) as exc:  # unreachable, or not an exposition
                result.errors.append(f"{url}: {exc}")
    return result
