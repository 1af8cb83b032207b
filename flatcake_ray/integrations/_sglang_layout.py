"""Views of SGLang's HiCache host pools as ``[layers, pages, page_size, *content]``.

Every host layout SGLang 0.5 allocates (``init_kv_buffer`` of ``MHATokenToKVPoolHost`` and
``MLATokenToKVPoolHost``) is a permutation of the same axes, so one strided view per layout
lets a page be gathered or scattered with one indexing call, no copy of the pool. A page is
stored as the bytes of ``view[:, page]`` in that canonical order (MHA content ``(2, H, D)``,
K then V; MLA content ``(1, D)``), so a page saved from a ``layer_first`` pool restores into a
``page_first`` one.

The non-zero-copy interface hands over flat pages in the pool's own order (``get_data_page``);
such a page is the pool's buffer with one page along the token or page axis, so the same
permutation applies to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flatcake_ray.errors import ShapeError
from flatcake_ray.integrations._common import Geometry, byte_view

# (axes of kv_buffer in allocation order) per (is_mla, layout). "S" is the token axis
# (page-aligned), "P"/"T" the page and in-page token axes of the *_direct / page_head forms.
_AXES: dict[tuple[bool, str], str] = {
    (False, "layer_first"): "KLSHD",
    (False, "page_first"): "KSLHD",
    (False, "page_first_direct"): "KPLTHD",
    (False, "page_head"): "KPHTLD",
    (True, "layer_first"): "LSHD",
    (True, "page_first"): "SLHD",
    (True, "page_first_direct"): "PLTHD",
}
_CANONICAL = {False: "LPTKHD", True: "LPTHD"}  # K: the K/V axis; H is 1 for MLA


def _canonical(buffer: torch.Tensor, axes: str, page_size: int, is_mla: bool) -> torch.Tensor:
    if "S" in axes:  # split the token axis into (page, token in page): a view, no copy
        tokens = axes.index("S")
        buffer = buffer.unflatten(tokens, (buffer.shape[tokens] // page_size, page_size))
        axes = axes.replace("S", "PT")
    order = [axes.index(axis) for axis in _CANONICAL[is_mla]]
    return buffer.permute(order)


@dataclass
class HostPoolView:
    """A host pool as canonical pages, bytes only (bfloat16 has no numpy dtype)."""

    pages: torch.Tensor  # uint8 [layers, pool_pages, page_size, *content]
    page_size: int
    layout: str
    is_mla: bool
    flat_page_shape: tuple[int, ...]  # one page of kv_buffer, the pool's own order, in bytes

    @property
    def geometry(self) -> Geometry:
        per_page = self.pages[:, 0]
        return Geometry(self.pages.shape[0], per_page[0].numel())

    def page_ids(self, host_indices: torch.Tensor, count: int) -> torch.Tensor:
        """Host pages of ``count`` pages' token indices (page-aligned, as HiCache allocates)."""
        firsts = host_indices.reshape(count, self.page_size)[:, 0]
        if torch.any(firsts % self.page_size):
            raise ShapeError("host indices do not start on page boundaries")
        return (firsts // self.page_size).to(torch.long)

    def gather(self, page_ids: torch.Tensor) -> torch.Tensor:
        """uint8 [layers, pages, page_bytes] of the given host pages."""
        picked = self.pages[:, page_ids]
        return picked.reshape(picked.shape[0], len(page_ids), -1)

    def gather_layer(self, layer: int, page_ids: torch.Tensor) -> torch.Tensor:
        """uint8 [pages, page_bytes] of one layer of the given host pages."""
        return self.pages[layer, page_ids].reshape(len(page_ids), -1)

    def layer_tensors(self) -> list[torch.Tensor]:
        """One ``[pool_pages, *page]`` view per layer, pages in canonical order (a restore
        destination: ``LayerTensors`` finds each page's contiguous pieces)."""
        return [self.pages[layer] for layer in range(self.pages.shape[0])]

    def scatter(self, page_ids: torch.Tensor, data: torch.Tensor) -> None:
        self.pages[:, page_ids] = data.view(
            self.pages.shape[0], len(page_ids), *self.pages.shape[2:]
        )

    def flat_to_canonical(self, flat_page: torch.Tensor) -> torch.Tensor:
        """A ``get_data_page`` page as a view [layers, 1, page_size, *content]."""
        raw = byte_view(flat_page).reshape(self.flat_page_shape)
        return _canonical(raw, _AXES[(self.is_mla, self.layout)], self.page_size, self.is_mla)


def host_pool_view(pool: Any, *, is_mla: bool) -> HostPoolView:
    """The canonical view of an SGLang host pool (``pool.kv_buffer``, ``layout``, ``page_size``)."""
    layout = pool.layout
    axes = _AXES.get((is_mla, layout))
    if axes is None:
        kind = "MLA" if is_mla else "MHA"
        known = sorted(name for mla, name in _AXES if mla == is_mla)
        raise ShapeError(f"{kind} host layout {layout!r} is not supported (known: {known})")
    buffer = pool.kv_buffer
    if buffer.dim() != len(axes):
        raise ShapeError(f"a {layout} host pool has {len(axes)} axes, this one {buffer.dim()}")
    raw = byte_view(buffer)
    page_size = int(pool.page_size)
    flat = list(raw.shape)
    one_page_axis = axes.index("S") if "S" in axes else axes.index("P")
    flat[one_page_axis] = page_size if "S" in axes else 1
    return HostPoolView(
        pages=_canonical(raw, axes, page_size, is_mla),
        page_size=page_size,
        layout=layout,
        is_mla=is_mla,
        flat_page_shape=tuple(flat),
    )
