"""KV-cache traces: readers, Table 1 statistics, session inference, synthetic traces.

:mod:`.readers` (Mooncake, Qwen Bailian, generic JSONL; gzip by magic bytes), :mod:`.records`
(:class:`TraceRequest`, the columnar :class:`Trace`), :mod:`.stats` (the paper's Table 1),
:mod:`.infer` (sessions from prefix chains), :mod:`.synth` (agentic, chat, mixed profiles).
"""

from flatcake_ray.traces.infer import infer_sessions, with_inferred_sessions
from flatcake_ray.traces.readers import iter_requests, load_trace, write_generic
from flatcake_ray.traces.records import Trace, TraceRequest
from flatcake_ray.traces.stats import TraceStats, compute_stats
from flatcake_ray.traces.synth import SyntheticTrace, SynthOptions

__all__ = [
    "SynthOptions",
    "SyntheticTrace",
    "Trace",
    "TraceRequest",
    "TraceStats",
    "compute_stats",
    "infer_sessions",
    "iter_requests",
    "load_trace",
    "with_inferred_sessions",
    "write_generic",
]
