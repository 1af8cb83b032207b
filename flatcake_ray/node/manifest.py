"""The SSD pool's append-only manifest, so a restarted node recovers its SSD scopes.

A ``seg`` record is appended after a segment's bytes are on the drive (fdatasync first when
``fsync`` is on), carrying the segment's keys and checksums and its scope's runs; ``free``
and ``quarantine`` records retire a scope. On open the log is replayed and rewritten with
only live records so it stays small. DRAM scopes are not logged: they are gone after a
restart, by design.

Format 2 (this one): each record is framed and checked on its own (``manifest_frames.py``:
xxh3 of the payload, a doubled header naming the record's scope). Damage costs only the
scope of the damaged record, never more and never an untyped error:

- a record whose checksum fails, or whose payload is not a well-formed record, drops its
  scope (all its records, before and after); the records after it are still read;
- a header too damaged to name its record's scope drops that record alone (with the
  doubled header this takes damage to both copies); reading resumes at the next intact one;
- a torn tail (a crash mid-append) drops the last record alone; a failed append is cut
  off at once, so a partial record never sits between whole ones;
- a damaged header record (no scope) is skipped: the pool's geometry is then checked only
  through every record's sizes (digests per page, checksums per layer, runs per file);
- where two scopes' runs overlap, the one written last wins: space is reused only after a
  ``free``, so the older one is a scope whose ``free`` record was lost; scopes whose runs
  leave the pool, or that share a segment id, are dropped.

:attr:`Manifest.report` counts the records and scopes dropped, by reason. Format 1
manifests (bare msgpack, written before key digests were length-framed, see
``core/keys.py``) are refused with :class:`ManifestError`, which says what to do: their
digests no longer match any key, so serving them would only hold space.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from flatcake_ray.errors import ConfigError, ManifestError
from flatcake_ray.failpoints import failpoint
from flatcake_ray.node.manifest_frames import MAGIC, encode_frame, encode_record, frames
from flatcake_ray.node.manifest_records import (
    RecordError,
    RecoveredScope,
    check_live_scopes,
    check_record,
)

log = logging.getLogger(__name__)
VERSION = 2  # checksummed frames, and segment checksums per block of pages
RECORD_REASONS = ("checksum", "malformed", "header", "torn")
SCOPE_REASONS = ("checksum", "malformed", "overlap", "duplicate_segment")
MAX_EXAMPLES = 5


@dataclass
class ReplayReport:
    """What the last replay read and what it had to drop, by reason."""

    records: int = 0  # records applied
    records_dropped: Counter[str] = field(default_factory=Counter)
    scopes_dropped: Counter[str] = field(default_factory=Counter)
    bytes_skipped: int = 0  # bytes of records dropped
    dropped_scope_ids: dict[int, str] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)  # why the first malformed records were

    def drop_scope(self, scope_id: int, reason: str) -> None:
        if scope_id not in self.dropped_scope_ids:
            self.dropped_scope_ids[scope_id] = reason
            self.scopes_dropped[reason] += 1

    def counters(self) -> dict[str, int]:
        """Flat counters, one per reason, for the store's stats."""
        out = {f"manifest_records_dropped_{r}": self.records_dropped[r] for r in RECORD_REASONS}
        out.update({f"manifest_scopes_dropped_{r}": self.scopes_dropped[r] for r in SCOPE_REASONS})
        return out


class Manifest:
    def __init__(self, path: str, header: dict[str, Any], fsync: bool) -> None:
        self.path = Path(path)
        self.header = {"t": "hdr", "version": VERSION, **header}
        self.fsync = fsync
        self.report = ReplayReport()
        self.recovered = self._replay(self.path.read_bytes()) if self.path.exists() else {}
        self._rewrite()
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the pool

    # ---- replay ----------------------------------------------------------------------------
    def _replay(self, data: bytes) -> dict[int, RecoveredScope]:
        _refuse_old_format(self.path, data)
        scopes: dict[int, RecoveredScope] = {}
        for frame in frames(data):
            if frame.fault is not None:
                self._drop_record(frame.fault, frame.nbytes, frame.scope)
                continue
            assert frame.scope is not None and frame.payload is not None  # intact frame
            try:
                record = check_record(
                    msgpack.unpackb(frame.payload, raw=False), frame.scope, self.header
                )
            except (RecordError, ValueError, TypeError, msgpack.UnpackException) as exc:
                if len(self.report.examples) < MAX_EXAMPLES:
                    self.report.examples.append(f"record at byte {frame.offset}: {exc}")
                self._drop_record("malformed", frame.nbytes, frame.scope)
                continue
            self.report.records += 1
            self._apply(scopes, record, frame.payload)
        for scope_id in self.report.dropped_scope_ids:
            scopes.pop(scope_id, None)
        for scope_id, reason in check_live_scopes(scopes.values(), self.header).items():
            self.report.drop_scope(scope_id, reason)
            scopes.pop(scope_id)
        if self.report.records_dropped or self.report.scopes_dropped:
            log.warning(
                "manifest %s: dropped records %s and scopes %s %s",
                self.path,
                dict(self.report.records_dropped),
                dict(self.report.scopes_dropped),
                "; ".join(self.report.examples),
            )
        return scopes

    def _drop_record(self, reason: str, nbytes: int, scope: int | None) -> None:
        self.report.records_dropped[reason] += 1
        self.report.bytes_skipped += nbytes
        if scope and reason in ("checksum", "malformed"):  # scope 0: the header record
            self.report.drop_scope(scope, reason)

    def _apply(
        self, scopes: dict[int, RecoveredScope], record: dict[str, Any], payload: bytes
    ) -> None:
        kind = record["t"]
        if kind == "hdr":
            self._check_header(record)
        elif kind == "seg":
            scope = scopes.setdefault(
                record["scope"], RecoveredScope(record["scope"], record["session"])
            )
            if scope.quarantined or scope.session_id != record["session"]:
                self.report.drop_scope(record["scope"], "malformed")
                return
            scope.runs = record["runs"]
            scope.segments.append(record)
            scope.payloads.append(payload)
            scope.last_record = self.report.records
        elif kind == "unseg":  # a segment recorded, then not published: it never was
            self._retract(scopes, record["scope"], record["segment"])
        elif kind == "free":
            scopes.pop(record["scope"], None)
        elif kind == "quarantine":
            scope = scopes.setdefault(record["scope"], RecoveredScope(record["scope"], ""))
            scope.runs, scope.segments, scope.quarantined = record["runs"], [], True
            scope.payloads = []
            scope.last_record = self.report.records

    @staticmethod
    def _retract(scopes: dict[int, RecoveredScope], scope_id: int, segment_id: int) -> None:
        scope = scopes.get(scope_id)
        if scope is None:
            return
        keep = [i for i, seg in enumerate(scope.segments) if seg["segment"] != segment_id]
        scope.segments = [scope.segments[i] for i in keep]
        scope.payloads = [scope.payloads[i] for i in keep]
        if not scope.segments and not scope.quarantined:
            scopes.pop(scope_id)  # its space was given back when the put was aborted

    def _check_header(self, record: dict[str, Any]) -> None:
        if record.get("version") != VERSION:
            raise ManifestError(
                f"the SSD pool in {self.path.parent} has manifest format "
                f"{record.get('version')!r}; this FlatCake-Ray reads format {VERSION}"
            )
        for key in ("layers", "page_bytes", "file_bytes", "files"):
            if record.get(key) != self.header[key]:
                raise ConfigError(
                    f"SSD pool at {self.path.parent} was made with {key}={record.get(key)}, "
                    f"this store is configured with {self.header[key]}"
                )

    # ---- writing ---------------------------------------------------------------------------
    def _rewrite(self) -> None:
        frames_out = [encode_record(0, self.header)]
        for scope in self.recovered.values():
            if scope.quarantined:
                record = {"t": "quarantine", "scope": scope.scope_id, "runs": scope.runs}
                frames_out.append(encode_record(scope.scope_id, record))
            frames_out.extend(encode_frame(scope.scope_id, p) for p in scope.payloads)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as out:
            out.write(b"".join(frames_out))
            out.flush()
            os.fsync(out.fileno())
        failpoint("manifest.rewrite", path=self.path)
        os.replace(tmp, self.path)
        _fsync_folder(self.path.parent)

    def append(self, record: dict[str, Any]) -> None:
        """Append one record; it is durable when this returns (with ``fsync`` on)."""
        scope = record.get("scope", 0)
        try:
            frame = encode_record(scope, record)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ManifestError(
                f"cannot encode manifest record {record.get('t')!r}: {exc}"
            ) from exc
        failpoint("manifest.append", record=record)
        fd = self._file.fileno()
        size = os.fstat(fd).st_size
        try:
            view = memoryview(frame)
            while view:
                written = self._file.write(view)
                if not written:
                    raise OSError(f"short write to {self.path}")
                view = view[written:]
            failpoint("manifest.fsync", record=record)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            # A failed append leaves nothing behind: a partial frame mid-file would make
            # the reader trust its length and step over the records appended after it.
            os.ftruncate(fd, size)
            raise

    def close(self) -> None:
        self._file.close()


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _refuse_old_format(path: Path, data: bytes) -> None:
    """Format 1 was bare msgpack starting with its header map: refuse it, saying what to do."""
    if not data or data.startswith(MAGIC):
        return
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        unpacker.feed(data[:4096])
        first = next(unpacker, None)
    except (ValueError, TypeError, msgpack.UnpackException):
        return  # not format 1 either: damage at the start, which the frame reader skips
    if isinstance(first, dict) and first.get("t") == "hdr":
        raise ManifestError(
            f"the SSD pool in {path.parent} was written by an older FlatCake-Ray (manifest "
            f"format {first.get('version')}; this one reads format {VERSION}: page keys are "
            "now hashed with a length-framed namespace, so none of its pages could be found). "
            f"Delete {path} and the pool files beside it to start this pool empty, or run the "
            "older version to use it"
        )
