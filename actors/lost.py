"""Lost storage nodes, kept in Ray's GCS so that a restarted coordinator still knows them.

The coordinator's node table is rebuilt from the storage nodes that answer by name
(``coordinator._rebuild``); a lost node answers nothing (its Ray node is dead), so without
this record a coordinator restart would forget it: its row (and the DRAM it lost) would
leave ``status`` and its NodeID would no longer be kept for its comeback. The coordinator
writes an entry when it first sees a node lost, with the DRAM of the node's last report, and
removes it when a node takes that NodeID again or the operator forgets it. Same KV namespace
as the drained set (``actors/drain.py``).
"""

from __future__ import annotations

import json
from typing import Any

from flatcake_ray.actors.drain import KV_NAMESPACE, kv_store
from flatcake_ray.actors.node_records import NodeRecord
from flatcake_ray.actors.protocol import NodeUsage
from flatcake_ray.errors import ServiceError

FIELDS = ("ray_node_id", "actor_name", "joined_at", "dram_bytes", "dram_scopes", "dram_pages")


def _key(namespace: str) -> bytes:
    return f"{namespace}/lost".encode()


def entry(record: NodeRecord) -> dict[str, Any]:
    usage = record.usage
    return {
        "ray_node_id": record.ray_node_id,
        "actor_name": record.actor_name,
        "joined_at": record.joined_at,
        "dram_bytes": usage.dram_used if usage else 0,
        "dram_scopes": usage.dram_scopes if usage else 0,
        "dram_pages": usage.dram_pages if usage else 0,
    }


def record_of(node_id: int, stored: dict[str, Any]) -> NodeRecord:
    """The coordinator's record of a lost node, as stored (never seen since: last_seen 0)."""
    usage = NodeUsage(
        node_id, 0, stored["dram_bytes"], 0, 0, 0, 0, stored["dram_scopes"], stored["dram_pages"]
    )
    joined = float(stored["joined_at"])
    name = stored["actor_name"]
    return NodeRecord(node_id, stored["ray_node_id"], name, joined, 0.0, usage, lost_noted=True)


def decode(raw: bytes | None) -> dict[int, dict[str, Any]]:
    """The entries a stored value holds; a value this module did not write is an error."""
    if raw is None:
        return {}
    try:
        table = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ServiceError(f"the lost-node record is not JSON: {raw[:64]!r}") from exc
    valid = isinstance(table, dict) and all(
        key.isdigit() and isinstance(value, dict) and set(value) == set(FIELDS)
        for key, value in table.items()
    )
    if not valid:
        raise ServiceError(f"the lost-node record is not a table of lost nodes: {raw[:64]!r}")
    return {int(key): value for key, value in table.items()}


def read_lost(namespace: str) -> dict[int, dict[str, Any]]:
    return decode(kv_store()._internal_kv_get(_key(namespace), namespace=KV_NAMESPACE))


def _write(namespace: str, table: dict[int, dict[str, Any]]) -> None:
    raw = json.dumps({str(node_id): value for node_id, value in sorted(table.items())})
    kv_store()._internal_kv_put(
        _key(namespace), raw.encode(), overwrite=True, namespace=KV_NAMESPACE
    )


def remember_lost(namespace: str, record: NodeRecord) -> None:
    _write(namespace, {**read_lost(namespace), record.node_id: entry(record)})


def forget_lost(namespace: str, node_id: int) -> None:
    table = read_lost(namespace)
    if table.pop(node_id, None) is not None:
        _write(namespace, table)
