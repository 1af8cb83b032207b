"""The two layouts of a paged KV pool a restore scatters into (see ``scatter.py``).

Torch-free, so that code which only names a layout (a storage node's store) loads no torch.
"""

from __future__ import annotations

from typing import Literal

Layout = Literal["layer_first", "page_first"]
LAYER_FIRST: Layout = "layer_first"
PAGE_FIRST: Layout = "page_first"
LAYOUTS: tuple[Layout, ...] = (LAYER_FIRST, PAGE_FIRST)
