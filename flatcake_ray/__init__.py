"""FlatCake-Ray: a flat DRAM+SSD KV-cache store for LLM serving, on Ray.

Importing this package imports neither CUDA, NIXL nor pyverbs; those load when used.
"""

from __future__ import annotations

__version__ = "0.1.0"
