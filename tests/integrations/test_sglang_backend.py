"""FlatCakeHiCacheStorage built by SGLang's StorageBackendFactory, fed SGLang host pools.

SGLang's host pool classes cannot be imported without its CUDA/triton kernels, so the pools
here are twins built from SGLang's installed source: the buffer is allocated with the dims
``init_kv_buffer`` computes for each layout, and ``get_data_page``,
``get_dummy_flat_data_page`` and ``set_from_flat_data_page`` are SGLang's own methods,
compiled from that source and bound to the twin. The cache controller's calls (exists, then
get or set per batch, ``prefix_keys`` naming what a batch continues) are made as it makes them.
"""

from __future__ import annotations

import ast
import hashlib
import types
from pathlib import Path

import pytest
import torch

from tests.integrations.conftest import require_sglang_storage

require_sglang_storage()

import sglang  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from flatcake_ray.integrations._sglang_layout import host_pool_view  # noqa: E402
from flatcake_ray.integrations.sglang import FlatCakeHiCacheStorage, extra_config  # noqa: E402

PAGE = 16
LAYERS = 3
HEADS = 2
HEAD_DIM = 32
POOL_PAGES = 32
POOL_HOST = Path(sglang.__path__[0]) / "srt" / "mem_cache" / "pool_host"
PAGE_METHODS = ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page")


def _sglang_class(file: str, name: str) -> ast.ClassDef:
    tree = ast.parse((POOL_HOST / file).read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _dims_for(cls: ast.ClassDef, layout: str, pool: types.SimpleNamespace) -> tuple[int, ...]:
    """The ``dims`` init_kv_buffer assigns for ``layout``, evaluated on the twin."""
    method = next(
        n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "init_kv_buffer"
    )
    branch = method.body[0]
    while isinstance(branch, ast.If):
        names = {c.value for c in ast.walk(branch.test) if isinstance(c, ast.Constant)}
        if layout in names:
            assign = next(s for s in branch.body if isinstance(s, ast.Assign))
            return eval(
                compile(ast.Expression(assign.value), "init_kv_buffer", "eval"), {"self": pool}
            )
        branch = branch.orelse[0] if branch.orelse else None
    raise AssertionError(f"SGLang's init_kv_buffer has no {layout} branch")


def host_pool(layout: str, *, mla: bool = False) -> types.SimpleNamespace:
    cls = _sglang_class(
        "mla.py" if mla else "mha.py", "MLATokenToKVPoolHost" if mla else "MHATokenToKVPoolHost"
    )
    pool = types.SimpleNamespace(
        layout=layout,
        layer_num=LAYERS,
        page_size=PAGE,
        page_num=POOL_PAGES,
        size=POOL_PAGES * PAGE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        kv_cache_dim=2 * HEAD_DIM,
        dtype=torch.bfloat16,
        device="cpu",
        pin_memory=False,
    )
    if mla:
        pool.kv_lora_rank = HEAD_DIM
        pool._storage_page_index = lambda index: index  # no decode context parallelism
    pool.kv_buffer = torch.zeros(_dims_for(cls, layout, pool), dtype=torch.bfloat16)
    namespace: dict = {"torch": torch}
    for method in (
        n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in PAGE_METHODS
    ):
        exec(compile(ast.Module([method], []), f"sglang:{method.name}", "exec"), namespace)
        setattr(pool, method.name, types.MethodType(namespace[method.name], pool))
    return pool


def storage_config(options: dict, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1):
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=False,
        model_name="tiny/model",
        extra_config=extra_config(**options),
    )


def attach(options: dict, pool, **config) -> FlatCakeHiCacheStorage:
    """What HiCacheController.attach_storage_backend does."""
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(options, **config), pool
    )
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    assert isinstance(backend, FlatCakeHiCacheStorage)
    return backend


def page_keys(tokens: list[int], prior: str | None = None) -> list[str]:
    """Chained per-page hex hashes, the shape of SGLang's get_storage_hash_str (which needs
    triton to import)."""
    keys = []
    for start in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        digest = hashlib.sha256(
            (prior or "").encode() + repr(tokens[start : start + PAGE]).encode()
        )
        prior = digest.hexdigest()
        keys.append(prior)
    return keys


def fill(pool, first_page: int, pages: int, seed: int) -> torch.Tensor:
    """Host token indices of ``pages`` pages from ``first_page``, filled like a backup would."""
    generator = torch.Generator().manual_seed(seed)
    for page in range(first_page, first_page + pages):
        flat = pool.get_data_page(page * PAGE, flat=True)
        pool.set_from_flat_data_page(
            page * PAGE, torch.randn(flat.shape, generator=generator).to(pool.dtype)
        )
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE)


def token_kv(pool, layer: int, token: int) -> torch.Tensor:
    """K and V (or the MLA latent) of one token, read through the layout's own axes."""
    kv, mla = pool.kv_buffer, hasattr(pool, "kv_lora_rank")
    page, slot = divmod(token, PAGE)
    if pool.layout == "layer_first":
        return kv[layer, token] if mla else kv[:, layer, token]
    if pool.layout == "page_first":
        return kv[token, layer] if mla else kv[:, token, layer]
    if pool.layout == "page_first_direct":
        return kv[page, layer, slot] if mla else kv[:, page, layer, slot]
    assert pool.layout == "page_head"
    return kv[:, page, :, slot, layer]


def assert_same_tokens(pool_a, indices_a, pool_b, indices_b) -> None:
    for layer in range(LAYERS):
        for a, b in zip(indices_a.tolist(), indices_b.tolist(), strict=True):
            assert torch.equal(
                token_kv(pool_a, layer, a).view(torch.uint8),
                token_kv(pool_b, layer, b).view(torch.uint8),
            )


TURN1 = list(range(1000, 1064))  # 4 pages
TURN2 = TURN1 + list(range(7, 39))  # the reply and the next prompt: 2 more pages


@pytest.mark.parametrize(
    ("writer_layout", "reader_layout"),
    [
        ("layer_first", "layer_first"),
        ("page_first", "page_first"),
        ("layer_first", "page_first"),
        ("page_first_direct", "page_head"),
    ],
)
def test_two_turns_restore_byte_exact(
    local_store_options, ray_services, store_kind, writer_layout, reader_layout
):
    pool = host_pool(writer_layout)
    if store_kind == "local":
        options = local_store_options
    else:  # the Ray service, its own namespace per test
        geometry = host_pool_view(pool, is_mla=False).geometry
        options = ray_services(geometry.layers, geometry.page_bytes)
        options = {**options, "namespace": f"{writer_layout}-{reader_layout}"}
    backend = attach(options, pool)
    keys1 = page_keys(TURN1)
    assert backend.batch_exists(keys1, HiCacheStorageExtraInfo(prefix_keys=[])) == 0
    turn1 = fill(pool, 2, 4, seed=1)
    assert all(backend.batch_set_v1(keys1, turn1, HiCacheStorageExtraInfo(prefix_keys=[])))

    keys2 = page_keys(TURN2)
    assert keys2[:4] == keys1
    assert backend.batch_exists(keys2) == 4
    turn2_new = fill(pool, 10, 2, seed=2)
    assert all(
        backend.batch_set_v1(keys2[4:], turn2_new, HiCacheStorageExtraInfo(prefix_keys=keys1))
    )

    reader_pool = host_pool(reader_layout)  # another instance, maybe another host layout
    reader = attach(options, reader_pool)
    assert reader.batch_exists(keys2) == 6
    target = torch.arange(20 * PAGE, 26 * PAGE)
    assert reader.batch_get_v1(keys2, target) == [True] * 6
    assert_same_tokens(pool, torch.cat([turn1, turn2_new]), reader_pool, target)
    if store_kind == "local":
        stats = reader.store_stats()
        assert stats["sessions"] == 1  # turn 2 continued turn 1's session through prefix_keys
    assert sum(reader.get_stats().prefetch_pgs) == 6
    for attached in (backend, reader):
        attached.close()


def test_flat_page_interface_round_trips(local_store_options):
    pool = host_pool("page_first")
    backend = attach({**local_store_options}, pool)
    keys = page_keys(TURN1)
    fill(pool, 0, 4, seed=3)
    pages = [pool.get_data_page(i * PAGE) for i in range(4)]  # _generic_page_set's pages
    assert backend.batch_set(keys, pages)

    reader_pool = host_pool("page_first")
    reader = attach(local_store_options, reader_pool)
    targets = [reader_pool.get_dummy_flat_data_page() for _ in [*keys, "missing"]]
    got = reader.batch_get([*keys, "missing"], targets)
    assert got[-1] is None
    for i, page in enumerate(got[:-1]):
        reader_pool.set_from_flat_data_page(i * PAGE, page)  # _generic_page_get's copy-in
        assert torch.equal(
            reader_pool.get_data_page(i * PAGE).view(torch.uint8), pages[i].view(torch.uint8)
        )


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mla_only_the_writer_rank_writes(local_store_options, layout):
    writer_pool, other_pool = host_pool(layout, mla=True), host_pool(layout, mla=True)
    writer = attach(local_store_options, writer_pool, mla=True, tp_rank=0, tp_size=2)
    other = attach(local_store_options, other_pool, mla=True, tp_rank=1, tp_size=2)
    keys = page_keys(TURN1)
    written = fill(writer_pool, 1, 4, seed=4)
    fill(other_pool, 1, 4, seed=5)  # a replica would hold the same bytes; these differ on purpose
    assert all(other.batch_set_v1(keys, written))
    assert other.batch_exists(keys) == 0  # the non-writer rank wrote nothing
    assert all(writer.batch_set_v1(keys, written))
    assert other.batch_exists(keys) == 4  # one copy serves every rank

    reader_pool = host_pool(layout, mla=True)
    reader = attach(local_store_options, reader_pool, mla=True, tp_rank=1, tp_size=2)
    target = torch.arange(8 * PAGE, 12 * PAGE)
    assert reader.batch_get_v1(keys, target) == [True] * 4
    assert_same_tokens(writer_pool, written, reader_pool, target)


def test_tensor_parallel_ranks_keep_their_own_heads(local_store_options):
    rank0, rank1 = host_pool("layer_first"), host_pool("layer_first")
    backend0 = attach(local_store_options, rank0, tp_rank=0, tp_size=2)
    backend1 = attach(local_store_options, rank1, tp_rank=1, tp_size=2)
    keys = page_keys(TURN1)
    backend0.batch_set_v1(keys, fill(rank0, 0, 4, seed=6))
    assert backend0.batch_exists(keys) == 4
    assert backend1.batch_exists(keys) == 0
