"""Typed errors of FlatCake-Ray.

Every error a caller can act on has its own class; all derive from :class:`FlatCakeError`.
A rejected call never changes what is already stored.
"""

from __future__ import annotations


class FlatCakeError(Exception):
    """Base class of every FlatCake-Ray error."""


class GVAError(FlatCakeError, ValueError):
    """A GVA field (medium, node id or offset) is out of range, or a GVA is malformed."""


class InvalidKeyError(FlatCakeError, TypeError):
    """A page key is not bytes, str or int, or is empty."""


class MixedNamespaceError(FlatCakeError, ValueError):
    """One call named pages of more than one namespace."""


class ShapeError(FlatCakeError, ValueError):
    """A KV buffer has the wrong shape, dtype, layout or device for this store."""


class MediumFullError(FlatCakeError):
    """The target medium (and the spill medium) has no room, and nothing is reclaimable."""


class StoreClosedError(FlatCakeError):
    """The store (or service) was closed; no further calls are accepted."""


class TenantError(FlatCakeError, ValueError):
    """A tenant is unknown, its name or secret is malformed, or a call names another
    tenant's lease, put or pages."""


class AccessDeniedError(TenantError, PermissionError):
    """The secret of a call matches no tenant (or not the service), or the call reaches for
    what another tenant owns; refused and counted."""


class QuotaExceededError(FlatCakeError):
    """A tenant's put does not fit its quota on any medium, even after reclaiming its own
    unreferenced scopes; nothing was evicted from other tenants, nothing was written."""


class TenantLimitError(FlatCakeError):
    """A tenant is over one of a node's per-tenant limits (call rate, open leases, open
    puts); the call was refused before it took or changed anything: retry later, or release,
    commit or abort what it holds."""


class StoreInUseError(FlatCakeError):
    """Another store (in this process or another) has the store root open."""


class StoreWriteError(FlatCakeError):
    """Writing a segment failed; nothing of it was published."""


class SealError(StoreWriteError):
    """Sealing or unsealing SSD pages failed: no libcrypto, a malformed key or buffer."""


class TamperedWriteError(StoreWriteError):
    """A layer a client wrote into the owner's memory is not, at landing, what the client
    says it wrote (its checksums): someone else wrote there. The put was aborted."""


class ConfigError(FlatCakeError, ValueError):
    """A configuration value (argument, file, FLATCAKE_* variable or flag) is invalid.

    ``fields`` names the fields at fault, where known (a builder adds their sources)."""

    def __init__(self, message: str, *fields: str) -> None:
        super().__init__(message)
        self.fields = fields


class GeometryMismatchError(ConfigError):
    """``start`` asked for another model geometry than the running service has."""


class ManifestError(FlatCakeError):
    """An SSD pool's manifest cannot be used as it is (e.g. written by an older format)."""


class InvalidSessionError(FlatCakeError, TypeError, ValueError):
    """A session id is not a str, int or bytes, or is too long to store."""


class SegmentTooLargeError(FlatCakeError, ValueError):
    """One put holds more new pages than a segment can address (2**24)."""


class PutTooLargeError(MediumFullError):
    """A put is larger than its medium could ever hold, even with every scope reclaimed;
    nothing was evicted for it."""


class LeaseError(FlatCakeError):
    """A lease is unknown, expired or already released."""


class ServiceError(FlatCakeError):
    """The Ray service is not running, or a storage node cannot be reached."""


class ChannelClosedError(ServiceError):
    """A direct call channel to a node went away (the node died or restarted); the caller
    asks over Ray instead."""


class CallLostError(ChannelClosedError):
    """A direct call was sent and its answer lost: the node may have run it (a caller that
    must not run it twice, like a put's commit, does not ask again over Ray)."""


class UnknownNodeError(FlatCakeError, LookupError):
    """A NodeID names no storage node the coordinator knows (e.g. ``flatcake-ray drain 9``)."""


class TransportUnavailableError(FlatCakeError):
    """A transport needs hardware or a library this machine lacks."""


class TraceFormatError(FlatCakeError, ValueError):
    """A trace line is not in a format the readers know."""


class UnknownRequestError(FlatCakeError, LookupError):
    """A request id is not live in the scheduler (never submitted, dispatched or cancelled)."""


class DuplicateRequestError(FlatCakeError, ValueError):
    """A request id was submitted while a request with that id is still live."""


class ClockError(FlatCakeError, ValueError):
    """A time given to the scheduler is not finite, or is earlier than one already given."""


class InvalidRequestError(FlatCakeError, ValueError):
    """A request's fields or a scheduler call's arguments are malformed (e.g. negative bytes)."""


class RequestStateError(FlatCakeError):
    """A call does not fit the request's phase (e.g. prefetch_done on one not prefetching)."""


class ReadRangeError(FlatCakeError, ValueError):
    """A read batch is malformed, or one of its ranges falls outside its source or destination."""


class TransferError(FlatCakeError):
    """A data transfer failed; the destination ranges of that read hold undefined bytes."""


class ForeignMemoryError(TransferError, PermissionError):
    """Memory not handed to the caller's tenant: an arena chunk another tenant holds, or an
    offset past the chunks it was given. A read of it is a miss."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer did not complete within its deadline; it was cancelled before this was raised."""


class PeerDisconnectedError(TransferError):
    """The peer that owns the source memory is gone (died, or closed its endpoint)."""


class TransportClosedError(FlatCakeError):
    """The transport was closed; no further reads are accepted."""


class RestoreError(FlatCakeError):
    """A pipelined restore failed in a worker; ``__cause__`` is the worker's exception."""


class RestoreTimeoutError(FlatCakeError, TimeoutError):
    """A wait on a restore (or one of its layers) ran past its timeout; the restore goes on."""


class ShipBufferFullError(ServiceError):
    """A storage node's ship buffer has no room for a shipped SSD read right now."""


class ScatterLibraryError(TransportUnavailableError):
    """The scatter library named by ``FLATCAKE_SCATTER_LIB`` (or asked for) cannot be used."""


class ScatterKernelError(FlatCakeError, RuntimeError):
    """The scatter kernel's launch returned a CUDA error."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"scatter kernel failed: CUDA error {code}: {message}")
        self.code = code
