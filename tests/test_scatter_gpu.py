"""The scatter kernel on a CUDA GPU against the torch reference, bit for bit (skipped, with the
reason, where there is no GPU or no nvcc)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from flatcake_ray.cuda_ext import _dispatch, _library, build, scatter
from flatcake_ray.cuda_ext.scatter import (
    LAYER_FIRST,
    LAYOUTS,
    PAGE_FIRST,
    ScatterLibraryError,
    scatter_layer,
    scatter_layer_reference,
    scatter_pages,
    scatter_pages_reference,
)
from flatcake_ray.errors import ShapeError
from tests.test_scatter import (
    NO_CUDA,
    NO_NVCC,
    LayerCase,
    as_bytes,
    oracle_layer,
    oracle_offsets,
    random_tensor,
    requires_gpu,
    same_bits,
)

# ------------------------------------------------------------------------ on a CUDA GPU


@pytest.fixture(scope="module")
def kernel() -> Path:
    """The library in the default build folder (built now if absent), loaded."""
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    _library.reset_cache()
    if not scatter.kernel_available():
        if build.find_nvcc() is None:
            pytest.skip(NO_NVCC)
        build.build_library()
        _library.reset_cache()
    loaded = _library.load()
    assert loaded.library is not None, loaded.reason
    return loaded.library.path


def _scatter_both(case: LayerCase, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel result, torch reference result) for ``case`` on the GPU."""
    pool, staging = case.make("cuda")
    expected_pool = pool.clone()
    scatter_layer_reference(staging, expected_pool, case.slot_ids, case.layer, case.layout)
    ids = torch.tensor(case.slot_ids, dtype=torch.int64, device="cuda")
    scatter_layer(staging, pool, ids, case.layer, case.layout, backend="kernel", **kwargs)
    torch.cuda.synchronize()
    return pool, expected_pool


GPU_SHAPES = [
    pytest.param(torch.float16, (8, 128), id="fp16-2KiB-aligned"),
    pytest.param(torch.float8_e4m3fn, (656,), id="fp8-656B-aligned"),
    pytest.param(torch.bfloat16, (1001,), id="bf16-2002B-unaligned"),
    pytest.param(torch.uint8, (13,), id="u8-13B-unaligned"),
    pytest.param(torch.float32, (2, 32 * 1024), id="fp32-256KiB-many-chunks"),
]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize(("dtype", "page_shape"), GPU_SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_matches_reference(kernel, layout, dtype, page_shape) -> None:
    slots = 97
    order = torch.randperm(slots, generator=torch.Generator().manual_seed(5)).tolist()
    case = LayerCase(layout, dtype, 3, slots, page_shape, 2, order[:61], 11, False)
    got, expected = _scatter_both(case)
    assert same_bits(got, expected)


@pytest.mark.gpu
@requires_gpu
def test_kernel_handles_more_pages_than_grid_y_allows(kernel) -> None:
    slots = 70_000  # > 65535: pages must ride grid.x
    order = torch.randperm(slots, generator=torch.Generator().manual_seed(1)).tolist()
    case = LayerCase(PAGE_FIRST, torch.int32, 2, slots, (4,), 1, order, 3, True)
    got, expected = _scatter_both(case)
    assert same_bits(got, expected)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("shift", [1, 4, 8])
def test_kernel_with_misaligned_staging_and_pool(kernel, shift) -> None:
    layers, slots, page_bytes, ids = 2, 9, 64, [8, 0, 3, 5]
    pool_buffer = random_tensor((layers * slots * page_bytes + shift,), torch.uint8, 2, "cuda")
    stage_buffer = random_tensor((len(ids) * page_bytes + shift,), torch.uint8, 4, "cuda")
    pool = pool_buffer[shift:].view(layers, slots, page_bytes)
    staging = stage_buffer[shift:]
    prefix = pool_buffer[:shift].clone()
    expected = pool.clone()
    scatter_layer_reference(staging, expected, ids, 1, LAYER_FIRST)
    scatter_layer(staging, pool, ids, 1, LAYER_FIRST, backend="kernel")
    torch.cuda.synchronize()
    assert same_bits(pool, expected)
    assert same_bits(pool_buffer[:shift], prefix)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("stream_kind", ["torch", "raw-handle"])
def test_kernel_on_a_side_stream(kernel, stream_kind) -> None:
    case = LayerCase(
        LAYER_FIRST, torch.bfloat16, 4, 64, (16, 64), 3, list(range(63, 0, -2)), 9, True
    )
    pool, staging = case.make("cuda")
    expected = pool.clone()
    scatter_layer_reference(staging, expected, case.slot_ids, case.layer, case.layout)
    ids = torch.tensor(case.slot_ids, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # staging, pool and ids are made there
    stream = side if stream_kind == "torch" else side.cuda_stream
    scatter_layer(staging, pool, ids, case.layer, case.layout, stream=stream, backend="kernel")
    side.synchronize()
    assert same_bits(pool, expected)


@pytest.mark.gpu
@requires_gpu
def test_kernel_takes_host_slot_ids_and_checks_device_ones(kernel) -> None:
    case = LayerCase(PAGE_FIRST, torch.float16, 2, 8, (32,), 0, [7, 2, 4], 1, False)
    pool, staging = case.make("cuda")
    expected = pool.clone()
    scatter_layer_reference(staging, expected, case.slot_ids, case.layer, case.layout)
    scatter_layer(staging, pool, case.slot_ids, case.layer, case.layout, backend="kernel")
    torch.cuda.synchronize()
    assert same_bits(pool, expected)
    bad = torch.tensor([7, 8, 1], device="cuda")
    with pytest.raises(ShapeError, match="slot ids must be in"):
        scatter_layer(staging, pool, bad, case.layer, case.layout)


@pytest.mark.gpu
@requires_gpu
def test_kernel_offsets_form_matches_reference(kernel) -> None:
    page_bytes, offsets = 37, [300, 0, 111, 50, 200]
    dest = random_tensor((400,), torch.uint8, 6, "cuda")
    staging = random_tensor((len(offsets) * page_bytes,), torch.uint8, 7, "cuda")
    expected = dest.clone()
    scatter_pages_reference(staging, expected, offsets, page_bytes)
    scatter_pages(staging, dest, offsets, page_bytes, backend="kernel")
    torch.cuda.synchronize()
    assert as_bytes(dest) == oracle_offsets(
        random_tensor((400,), torch.uint8, 6), staging, offsets, page_bytes
    )
    assert same_bits(dest, expected)


@pytest.mark.gpu
@requires_gpu
def test_cuda_without_kernel_uses_torch_and_logs_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(_library, "load", lambda: _library.LoadResult(None, "not built (test)"))
    monkeypatch.setattr(_dispatch, "_fallback_logged", False)
    case = LayerCase(LAYER_FIRST, torch.float16, 2, 8, (32,), 1, [3, 6], 1, False)
    pool, staging = case.make("cuda")
    expected = oracle_layer(pool, staging, case.slot_ids, case.layer, case.layout)
    with caplog.at_level(logging.WARNING, logger=_dispatch.__name__):
        scatter_layer(staging, pool, case.slot_ids, case.layer, case.layout)
        scatter_layer(staging, pool, case.slot_ids, case.layer, case.layout)
    torch.cuda.synchronize()
    assert as_bytes(pool) == expected
    notes = [r for r in caplog.records if "torch reference on the GPU" in r.getMessage()]
    assert len(notes) == 1 and "not built (test)" in notes[0].getMessage()
    with pytest.raises(ScatterLibraryError, match="not built"):
        scatter_layer(staging, pool, case.slot_ids, case.layer, case.layout, backend="kernel")
