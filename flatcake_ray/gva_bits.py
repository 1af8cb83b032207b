"""The FC-GVA's bit layout: ``MediaType[63:60] | NodeID[59:48] | Offset[47:0]``.

Below both the configuration (which bounds node ids and media sizes by it) and the core's
:mod:`~flatcake_ray.core.gva` (which encodes and decodes addresses with it), so neither has
to reach up into the other.
"""

from __future__ import annotations

MEDIA_SHIFT = 60
NODE_SHIFT = 48
MEDIA_BITS = 4
NODE_BITS = 12
OFFSET_BITS = 48
MAX_NODE_ID = (1 << NODE_BITS) - 1
MAX_OFFSET = (1 << OFFSET_BITS) - 1
SSD_FLOOR = 1 << MEDIA_SHIFT  # smallest SSD GVA
