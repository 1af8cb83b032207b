"""A trace's requests as page keys of the modelled engine, computed once, in numpy.

Block-to-page mapping. A trace names ``B``-token blocks whose ids are prefix-chained (an id
stands for its whole prefix); the engine caches ``P``-token pages. Page ``k`` of a request
covers tokens ``[kP, (k+1)P)``; its key is ``(block holding its last token, that token's
offset in the block)``, which identifies the page's whole prefix whatever ``B`` and ``P``
are (``B > P``: one block yields ``B/P`` pages; ``B < P``: one page spans ``P/B`` blocks). A
request has ``floor(blocks * B / P)`` pages: the engine caches whole pages only, so a
trailing part page is always recomputed. Block ids are first renumbered densely, so a key is
``code * max(B) + offset`` without overflow; its store digest is a splitmix64 hash of the key
(high word, top bit set as the index requires) plus the key itself (low word), so distinct
keys never share a digest.

Reuse. A page is *reusable* when an earlier-arriving request held the same key (an
infinite cache would hit); a request's reusable count is its leading run of such pages (the
prefix an infinite prefix cache delivers). ``next_use`` is the next request holding the key
(-1: none); only the oracle placement looks at it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from flatcake_ray.core.keys import DIGEST_DTYPE, HI_MARK
from flatcake_ray.core.records import PutHints
from flatcake_ray.errors import ConfigError
from flatcake_ray.traces.records import NO_VALUE, Trace

_U64 = np.uint64


def splitmix64(values: np.ndarray) -> np.ndarray:
    z = values.astype(_U64) + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def digests_of(keys: np.ndarray) -> np.ndarray:
    out = np.empty(len(keys), dtype=DIGEST_DTYPE)
    with np.errstate(over="ignore"):
        out["hi"] = splitmix64(keys) | HI_MARK
    out["lo"] = keys.astype(_U64)
    return out


@dataclass(frozen=True)
class TracePages:
    page_tokens: int
    offsets: np.ndarray  # per request: first page in the flat arrays (len = requests + 1)
    keys: np.ndarray  # per page
    digests: np.ndarray  # per page, DIGEST_DTYPE
    next_use: np.ndarray  # per page: next request with this key, -1 none
    reusable: np.ndarray  # per request: leading pages an infinite cache holds
    prompt_tokens: np.ndarray  # per request
    output_tokens: np.ndarray
    sessions: np.ndarray  # per request: session code, -1 none
    session_names: list[str]
    turns: np.ndarray  # per request, -1 unknown
    prior_reply: np.ndarray  # per request: the session's previous output tokens, -1 unknown
    base_arrival: np.ndarray  # per request, seconds from the first

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    def pages_of(self, request: int) -> int:
        return int(self.offsets[request + 1] - self.offsets[request])

    def digests_for(self, request: int) -> np.ndarray:
        return self.digests[self.offsets[request] : self.offsets[request + 1]]

    def session_of(self, request: int) -> str | None:
        code = int(self.sessions[request])
        return None if code < 0 else self.session_names[code]

    @property
    def total_pages(self) -> int:
        return int(self.offsets[-1])


def build_pages(trace: Trace, page_tokens: int) -> TracePages:
    if page_tokens < 1:
        raise ConfigError("page_tokens must be >= 1")
    order = np.argsort(trace.arrival_s, kind="stable")  # replay is in arrival order
    block_tokens = trace.block_tokens.astype(np.int64)[order]
    starts = trace.block_offsets[:-1][order]
    counts = np.diff(trace.block_offsets)[order]
    pages = counts * block_tokens // page_tokens
    offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(pages, out=offsets[1:])
    request_of_page = np.repeat(np.arange(len(order)), pages)
    page_in_request = np.arange(offsets[-1]) - offsets[request_of_page]
    last_token = (page_in_request + 1) * page_tokens - 1
    b = block_tokens[request_of_page]
    position = starts[request_of_page] + last_token // np.maximum(b, 1)
    _, codes = np.unique(trace.block_ids, return_inverse=True)
    width = int(block_tokens.max()) if len(block_tokens) else 1
    keys = codes.reshape(-1)[position].astype(np.int64) * width + last_token % b
    next_use, seen = _reuse_links(keys, request_of_page)
    prompt = np.maximum(trace.input_tokens[order], counts * block_tokens).astype(np.int64)
    prompt = np.where(trace.input_tokens[order] > 0, trace.input_tokens[order], prompt)
    sessions = trace.session_codes[order].astype(np.int64)
    arrival = trace.arrival_s[order]
    return TracePages(
        page_tokens=page_tokens,
        offsets=offsets,
        keys=keys,
        digests=digests_of(keys),
        next_use=next_use,
        reusable=_leading_true(seen, offsets),
        prompt_tokens=prompt,
        output_tokens=trace.output_tokens[order].astype(np.int64),
        sessions=sessions,
        session_names=list(trace.session_names),
        turns=trace.turns[order].astype(np.int64),
        prior_reply=_prior_reply(sessions, trace.output_tokens[order]),
        base_arrival=arrival - (arrival[0] if len(arrival) else 0.0),
    )


def _reuse_links(keys: np.ndarray, request_of_page: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per page: the next request with its key (-1 none), and whether an earlier one had it."""
    count = len(keys)
    order = np.lexsort((request_of_page, keys))
    sorted_keys, sorted_requests = keys[order], request_of_page[order]
    new_key = np.ones(count, dtype=bool)
    new_key[1:] = sorted_keys[1:] != sorted_keys[:-1]
    new_pair = new_key.copy()  # a new (key, request) group starts here
    new_pair[1:] |= sorted_requests[1:] != sorted_requests[:-1]
    key_start = np.maximum.accumulate(np.where(new_key, np.arange(count), 0))
    seen = np.empty(count, dtype=bool)
    seen[order] = sorted_requests > sorted_requests[key_start]
    pair_starts = np.append(np.flatnonzero(new_pair), count)
    following = pair_starts[np.cumsum(new_pair)]  # start of the next (key, request) group
    has_next = following < count
    has_next[has_next] = ~new_key[following[has_next]]
    next_request = np.full(count, -1, dtype=np.int64)
    next_request[order[has_next]] = sorted_requests[following[has_next]]
    return next_request, seen


def _leading_true(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per request: how many of its pages, from the first, are True."""
    counts = np.diff(offsets)
    out = np.zeros(len(counts), dtype=np.int64)
    nonempty = np.flatnonzero(counts)
    if not nonempty.size:
        return out
    position = np.arange(len(flags)) - np.repeat(offsets[:-1], counts)
    first_false = np.where(flags, np.iinfo(np.int64).max, position)
    found = np.minimum.reduceat(first_false, offsets[nonempty])
    out[nonempty] = np.minimum(found, counts[nonempty])
    return out


def _prior_reply(sessions: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    previous = np.full(len(sessions), -1, dtype=np.int64)
    known = np.flatnonzero(sessions != NO_VALUE)
    if not known.size:
        return previous
    order = known[np.argsort(sessions[known], kind="stable")]
    same = sessions[order][1:] == sessions[order][:-1]
    previous[order[1:][same]] = outputs[order[:-1][same]]
    return previous


def put_hints(pages: TracePages, request: int) -> PutHints | None:
    """The placement hints a serving engine gives with ``request``'s put: its turn and its
    session's previous reply length, where the trace knows them. The model's storage and the
    live replay (``cli/replay_live.py``) both put with these."""
    turn = int(pages.turns[request])
    if turn < 1:
        return None
    reply = int(pages.prior_reply[request])
    return PutHints(turn=turn, prior_reply_tokens=reply if reply >= 0 else None)


def select_requests(pages: TracePages, requests: np.ndarray) -> TracePages:
    """The pages of ``requests`` (ascending trace indices) as a trace of their own: one node's
    share of a trace. Reuse (``reusable``, ``next_use``) is among the chosen requests only."""
    counts = np.diff(pages.offsets)[requests]
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    starts = np.repeat(pages.offsets[:-1][requests], counts)
    flat = starts + np.arange(offsets[-1]) - np.repeat(offsets[:-1], counts)
    request_of_page = np.repeat(np.arange(len(requests)), counts)
    next_use, seen = _reuse_links(pages.keys[flat], request_of_page)
    base = pages.base_arrival[requests]
    return dataclasses.replace(
        pages,
        offsets=offsets,
        keys=pages.keys[flat],
        digests=pages.digests[flat],
        next_use=next_use,
        reusable=_leading_true(seen, offsets),
        prompt_tokens=pages.prompt_tokens[requests],
        output_tokens=pages.output_tokens[requests],
        sessions=pages.sessions[requests],
        turns=pages.turns[requests],
        prior_reply=pages.prior_reply[requests],
        base_arrival=base - (base[0] if len(base) else 0.0),
    )
