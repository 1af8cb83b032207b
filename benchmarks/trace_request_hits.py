"""Request-level prefix hits of trace files, with an infinite cache, in trace order: the
lookup mix ``docs/scaling.md`` models. A request hits when its first block was seen before;
"past the first block" when its first two were (every request of the Mooncake and
synthetic traces starts with one shared system-prompt block).

Run: ``.venv/bin/python benchmarks/trace_request_hits.py TRACE.jsonl.gz [...]`` (Mooncake
format, ``hash_ids``, or ``flatcake-ray trace synth`` output, ``blocks``).
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter
from collections.abc import Iterator


def block_lists(path: str) -> Iterator[list[int]]:
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as lines:
        for line in lines:
            row = json.loads(line)
            yield row.get("hash_ids", row.get("blocks"))


def request_hits(path: str) -> dict[str, float]:
    seen: set[int] = set()
    firsts: Counter[int] = Counter()
    requests = blocks = hit_blocks = hit_any = hit_past_first = 0
    for ids in block_lists(path):
        leading = 0
        while leading < len(ids) and ids[leading] in seen:
            leading += 1
        requests += 1
        blocks += len(ids)
        hit_blocks += leading
        hit_any += leading > 0
        hit_past_first += leading > 1
        firsts[ids[0]] += 1
        seen.update(ids)
    return {
        "requests": requests,
        "blocks_per_request": round(blocks / requests, 1),
        "blocks_hit": round(hit_blocks / blocks, 3),
        "requests_hit": round(hit_any / requests, 3),
        "requests_hit_past_first_block": round(hit_past_first / requests, 3),
        "distinct_first_blocks": len(firsts),
        "top_first_block_share": round(firsts.most_common(1)[0][1] / requests, 3),
    }


if __name__ == "__main__":
    for trace in sys.argv[1:]:
        print(trace, json.dumps(request_hits(trace)))
