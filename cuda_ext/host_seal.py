"""AES-256-CTR over rows of host memory, in place: a tenant's SSD pages sealed at rest.

Pool files have paths (they outlive the node) and belong to the service's OS user, so any
process of that user can open them. A tenant's pages are written there sealed under a key
only its clients (and, while they call it, the node) can derive from its secret
(``core.tenants.seal_key``); a reader unseals what it read in its own staging slot before
its checked copy (``docs/security.md``).

The unit is a checksum block. Its counter block is the block's recorded checksum (xxh3-64 of
its plain bytes, 8 bytes big-endian) followed by the 16-byte step inside the block: two
different contents written at one place never share keystream (the weakness of a counter
taken from the place alone, which every rewrite of a pool range would reuse), a block needs
nothing stored beside its checksum, and it can be unsealed wherever it sits (a slot, a ship
buffer, another node). Equal blocks seal to equal bytes: a same-user process learns which
blocks are equal, nothing of what they hold.

The cipher is the system's libcrypto (OpenSSL, which Python's own ``hashlib`` links; AES-NI
does the rounds), found through ctypes. With ``cuda_ext/_copyhash.c`` built, its
``ctr_rows`` walks the rows in C with the GIL released, on the idle copy threads at once;
without it, one thread makes a ctypes call a row (each lets the GIL go).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass

import numpy as np

from flatcake_ray.core.layout import SegmentLayout
from flatcake_ray.cuda_ext.host_copy import SPLIT_BYTES, idle_threads, native_module, run_split
from flatcake_ray.errors import SealError

KEY_BYTES = 32
_CTR_BLOCK = 16
_LIBRARIES = ("crypto", "libcrypto.so.3", "libcrypto.so.1.1")


@dataclass(frozen=True)
class _Crypto:
    new: ctypes._CFuncPtr  # type: ignore[name-defined]
    free: ctypes._CFuncPtr  # type: ignore[name-defined]
    cipher: int  # EVP_aes_256_ctr()
    init: ctypes._CFuncPtr  # type: ignore[name-defined]
    update: ctypes._CFuncPtr  # type: ignore[name-defined]

    @property
    def addresses(self) -> tuple[int, int, int, int, int]:
        """What ``_copyhash.ctr_rows`` calls: the cipher, then the four EVP functions."""

        def at(function: ctypes._CFuncPtr) -> int:  # type: ignore[name-defined]
            return ctypes.cast(function, ctypes.c_void_p).value or 0

        return self.cipher, at(self.new), at(self.free), at(self.init), at(self.update)


@functools.cache
def _libcrypto() -> _Crypto | None:
    for name in _LIBRARIES:
        path = ctypes.util.find_library(name) if "." not in name else name
        if path is None:
            continue
        try:
            library = ctypes.CDLL(path)
            return _bind(library)
        except (OSError, AttributeError):
            continue
    return None


def _bind(library: ctypes.CDLL) -> _Crypto:
    new, free = library.EVP_CIPHER_CTX_new, library.EVP_CIPHER_CTX_free
    new.restype, new.argtypes = ctypes.c_void_p, ()
    free.restype, free.argtypes = None, (ctypes.c_void_p,)
    aes = library.EVP_aes_256_ctr
    aes.restype, aes.argtypes = ctypes.c_void_p, ()
    init = library.EVP_EncryptInit_ex
    init.restype = ctypes.c_int
    init.argtypes = (ctypes.c_void_p,) * 5
    update = library.EVP_EncryptUpdate
    update.restype = ctypes.c_int
    update.argtypes = (
        ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
        ctypes.c_void_p, ctypes.c_int,
    )  # fmt: skip
    return _Crypto(new, free, int(aes()), init, update)


def available() -> bool:
    """Whether this process can seal and unseal (libcrypto loads)."""
    return _libcrypto() is not None


def ctr_rows(
    key: bytes,
    base: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    sums: np.ndarray,
    into: np.ndarray | None = None,
) -> None:
    """XOR each row ``base[offset : offset + length]`` in place with the keystream of its
    block: counter block ``sums[i]`` (big-endian) then ``into[i] // 16``, starting
    ``into[i] % 16`` bytes into it (``into``: the row's byte offset inside its block; None:
    every row is a whole block). Sealing and unsealing are the same call."""
    crypto = _libcrypto()
    if crypto is None:
        raise SealError("sealed SSD pages need libcrypto (OpenSSL), which does not load here")
    if len(key) != KEY_BYTES:
        raise SealError(f"a seal key is {KEY_BYTES} bytes, not {len(key)}")
    if base.dtype != np.uint8 or not base.flags.c_contiguous or not base.flags.writeable:
        raise SealError("sealing needs writable contiguous uint8 memory")
    count = len(offsets)
    if not count:  # nothing to cipher (and no counter block for libcrypto's first init)
        return
    at = np.zeros(count, np.int64) if into is None else np.asarray(into, np.int64)
    starts = np.asarray(offsets, np.int64)
    sizes = np.asarray(lengths, np.int64)
    if starts.min() < 0 or int((starts + sizes).max()) > base.nbytes:
        raise SealError("a row to seal lies outside its buffer")
    counters = np.empty((count, 2), dtype=">u8")
    counters[:, 0] = np.asarray(sums, np.uint64)
    counters[:, 1] = at // _CTR_BLOCK
    skips = at % _CTR_BLOCK
    module = native_module()
    if module is None:  # not built: one thread, a ctypes call a row (the GIL let go in each)
        _run(crypto, key, base.ctypes.data, starts, sizes, counters, skips)
        return
    rows = np.stack([base.ctypes.data + starts, sizes, skips], axis=1).astype(np.int64)
    threads = min(idle_threads(), count) if int(sizes.sum()) >= SPLIT_BYTES else 1
    claimed = np.zeros(1, dtype=np.int64)
    step = max(1, count // (8 * threads)) if threads > 1 else count
    cipher = functools.partial(
        module.ctr_rows, rows, counters.view(np.uint8), claimed, key, crypto.addresses, step
    )
    failed: list[int] = []
    run_split([lambda: failed.append(cipher())] * threads)
    if sum(failed):
        raise SealError(f"libcrypto failed on {sum(failed)} rows while sealing")


def _run(
    crypto: _Crypto,
    key: bytes,
    address: int,
    starts: np.ndarray,
    sizes: np.ndarray,
    counters: np.ndarray,
    skips: np.ndarray,
) -> None:
    context = crypto.new()
    if not context:
        raise SealError("libcrypto could not make a cipher context")
    done = ctypes.c_int(0)
    scratch = ctypes.create_string_buffer(_CTR_BLOCK)
    first = counters.ctypes.data
    try:
        if crypto.init(context, crypto.cipher, None, key, first) != 1:
            raise SealError("libcrypto refused the AES-256-CTR key")
        for row, (start, size, skip) in enumerate(
            zip(starts.tolist(), sizes.tolist(), skips.tolist(), strict=True)
        ):
            ok = crypto.init(context, None, None, None, first + row * _CTR_BLOCK) == 1
            if skip:  # the row starts inside a counter block: its keystream so far is spent
                ok &= crypto.update(context, scratch, done, scratch, skip) == 1
            pointer = address + start
            ok &= crypto.update(context, pointer, done, pointer, size) == 1
            if not ok:
                raise SealError("libcrypto failed while sealing a row")
    finally:
        crypto.free(context)


def seal_layer(
    key: bytes,
    layer: np.ndarray,
    layout: SegmentLayout,
    sums: np.ndarray,
    lo: int = 0,
    hi: int | None = None,
) -> None:
    """Seal (or unseal) bytes ``[lo, hi)`` of one layer of a segment in place (its pages
    from byte 0; default: all of them): each checksum block's part there with that block's
    ``sums`` entry, from where the part starts in its block. The padding past the pages
    stays as it is."""
    block_bytes = layout.check_pages * layout.page_bytes
    hi = layout.layer_bytes if hi is None else min(hi, layout.layer_bytes)
    if hi <= lo:
        return
    blocks = np.arange(lo // block_bytes, -(-hi // block_bytes), dtype=np.int64)
    block_lo = blocks * block_bytes
    first = np.maximum(block_lo, lo)
    last = np.minimum(block_lo + block_bytes, hi)
    ctr_rows(key, layer, first, last - first, sums[blocks], first - block_lo)
