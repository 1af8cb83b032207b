"""``make bench-peers``: FlatCake-Ray side by side with the peers a user would pick.

The same workload (pages x layers x page bytes, seeded bytes every process regenerates) runs
against FlatCake-Ray (a 2-node local Ray cluster, service started here), Mooncake Store (a
master and two clients on 127.0.0.1, zero-copy batch APIs, DRAM and SSD offload) and LMCache
(its engine over the local CPU and local disk backends), in one process tree and one run,
each path beside its physical limit measured in the same run. Run:
``.venv-peers/bin/python -m benchmarks.peers --help``.

FlatCake is driven only through its public API (``FlatCakeClient``, ``deploy``,
``ServiceConfig``), so rewrites of its put path and restore engine need no change here.
"""
