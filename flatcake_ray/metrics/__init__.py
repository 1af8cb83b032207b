"""FlatCake's metrics: one table of definitions, recorded per request, exported through Ray.

- ``definitions``: every metric (name, kind, tags, boundaries, meaning) and the Prometheus
  names Ray exports them under.
- ``record``: :class:`~flatcake_ray.metrics.record.Metrics`, what a store or client records.
- ``registry``: the in-process series and the forwarder into ``ray.util.metrics``.
- ``prometheus``: the text format, scraping Ray's metrics agents.
- ``view``: the per-node, per-tenant figures ``flatcake-ray status`` shows.
- ``tenant``: the ``tenant`` tag of a request.

This floor sits between the node and the restore engine: stores and clients record into it;
it reads the restore engine's outcomes. ``ray`` is never imported at module level.
"""
