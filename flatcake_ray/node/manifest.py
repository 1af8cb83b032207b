"""The SSD pool's append-only manifest (msgpack), so a restarted node recovers its SSD scopes.

A ``seg`` record is appended after a segment's bytes are on the drive (fdatasync first when
``fsync`` is on), carrying the segment's keys and checksums and its scope's runs; ``free``
and ``quarantine`` records retire a scope. On open the log is replayed, a torn tail (a crash
mid-append) is cut off, and the log is rewritten with only live records so it stays small.
DRAM scopes are not logged: they are gone after a restart, by design.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from flatcake_ray.errors import ConfigError

VERSION = 2  # 2: checksums per block of pages (1: per layer; refused)


@dataclass
class RecoveredScope:
    scope_id: int
    session_id: str
    runs: list[list[int]] = field(default_factory=list)  # [allocator, start, length, used]
    segments: list[dict[str, Any]] = field(default_factory=list)
    quarantined: bool = False


class Manifest:
    def __init__(self, path: str, header: dict[str, Any], fsync: bool) -> None:
        self.path = Path(path)
        self.header = {"t": "hdr", "version": VERSION, **header}
        self.fsync = fsync
        self.recovered = self._replay() if self.path.exists() else {}
        self._rewrite()
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the pool

    def _replay(self) -> dict[int, RecoveredScope]:
        scopes: dict[int, RecoveredScope] = {}
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        unpacker.feed(self.path.read_bytes())
        for record in _complete_records(unpacker):
            self._apply(scopes, record)
        return scopes

    def _apply(self, scopes: dict[int, RecoveredScope], record: dict[str, Any]) -> None:
        kind = record.get("t")
        if kind == "hdr":
            self._check_header(record)
        elif kind == "seg":
            scope = scopes.setdefault(
                record["scope"], RecoveredScope(record["scope"], record["session"])
            )
            scope.runs = record["runs"]
            scope.segments.append(record)
        elif kind == "free":
            scopes.pop(record["scope"], None)
        elif kind == "quarantine":
            scope = scopes.setdefault(record["scope"], RecoveredScope(record["scope"], ""))
            scope.runs, scope.segments, scope.quarantined = record["runs"], [], True

    def _check_header(self, record: dict[str, Any]) -> None:
        for key in ("layers", "page_bytes", "check_pages", "file_bytes", "files"):
            if record.get(key) != self.header[key]:
                raise ConfigError(
                    f"SSD pool at {self.path.parent} was made with {key}={record.get(key)}, "
                    f"this store is configured with {self.header[key]}"
                )

    def _rewrite(self) -> None:
        records = [self.header]
        for scope in self.recovered.values():
            if scope.quarantined:
                records.append({"t": "quarantine", "scope": scope.scope_id, "runs": scope.runs})
            records.extend(scope.segments)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as out:
            for record in records:
                out.write(msgpack.packb(record, use_bin_type=True))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)

    def append(self, record: dict[str, Any]) -> None:
        self._file.write(msgpack.packb(record, use_bin_type=True))
        if self.fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def _complete_records(unpacker: msgpack.Unpacker):
    """Records up to the first torn or foreign one (everything after it is dropped)."""
    try:
        for record in unpacker:
            if not isinstance(record, dict):
                return
            yield record
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError):
        return
