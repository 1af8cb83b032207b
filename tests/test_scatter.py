"""Page scatter: torch reference vs plain-Python oracle, and argument errors. The library's
loading and build are in ``test_scatter_build.py``, the kernel on a GPU in
``test_scatter_gpu.py``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flatcake_ray.cuda_ext import build, host_copy
from flatcake_ray.cuda_ext.scatter import (
    LAYER_FIRST,
    LAYOUTS,
    PAGE_FIRST,
    scatter_layer,
    scatter_layer_reference,
    scatter_pages,
    scatter_pages_reference,
)
from flatcake_ray.errors import ShapeError

DTYPES = [
    torch.uint8,
    torch.int8,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int64,
    torch.float8_e4m3fn,
]
NO_CUDA = "no CUDA device here: kernel-vs-reference tests need a GPU (scripts/gpu_check.sh)"
NO_NVCC = "nvcc not found: the scatter kernel cannot be built here"

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
requires_nvcc = pytest.mark.skipif(build.find_nvcc() is None, reason=NO_NVCC)


# ---------------------------------------------------------------------------- helpers


def random_tensor(shape, dtype, seed: int, device="cpu") -> torch.Tensor:
    """Random bytes viewed as ``dtype``: float dtypes get NaN/Inf patterns too."""
    generator = torch.Generator().manual_seed(seed)
    numel = 1
    for size in shape:
        numel *= size
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).view(shape).to(device)


def as_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).tolist())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, on the tensors' device (large GPU pools stay there)."""
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def oracle_layer(pool, staging, slot_ids, layer, layout) -> bytes:
    """Plain-Python scatter over the bytes of a contiguous pool."""
    out = bytearray(as_bytes(pool))
    src = as_bytes(staging)
    page_bytes = len(src) // max(len(slot_ids), 1)
    layers, slots = (pool.shape[0], pool.shape[1])
    if layout == PAGE_FIRST:
        layers, slots = slots, layers
    for i, slot in enumerate(slot_ids):
        flat_page = layer * slots + slot if layout == LAYER_FIRST else slot * layers + layer
        for b in range(page_bytes):
            out[flat_page * page_bytes + b] = src[i * page_bytes + b]
    return bytes(out)


def oracle_offsets(dest, staging, offsets, page_bytes) -> bytes:
    out = bytearray(as_bytes(dest))
    src = as_bytes(staging)
    for i, offset in enumerate(offsets):
        for b in range(page_bytes):
            out[offset + b] = src[i * page_bytes + b]
    return bytes(out)


@dataclass(frozen=True)
class LayerCase:
    layout: str
    dtype: torch.dtype
    layers: int
    slots: int
    page_shape: tuple[int, ...]
    layer: int
    slot_ids: list[int]
    seed: int
    staging_as_bytes: bool

    def pool_shape(self) -> tuple[int, ...]:
        outer = (
            (self.layers, self.slots) if self.layout == LAYER_FIRST else (self.slots, self.layers)
        )
        return (*outer, *self.page_shape)

    def make(self, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        pool = random_tensor(self.pool_shape(), self.dtype, self.seed, device)
        staging = random_tensor(
            (len(self.slot_ids), *self.page_shape), self.dtype, self.seed + 1, device
        )
        if self.staging_as_bytes:
            staging = staging.reshape(-1).view(torch.uint8)
        return pool, staging


@st.composite
def layer_cases(draw) -> LayerCase:
    slots = draw(st.integers(1, 12))
    layers = draw(st.integers(1, 4))
    order = draw(st.permutations(range(slots)))
    return LayerCase(
        layout=draw(st.sampled_from(LAYOUTS)),
        dtype=draw(st.sampled_from(DTYPES)),
        layers=layers,
        slots=slots,
        page_shape=tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))),
        layer=draw(st.integers(0, layers - 1)),
        slot_ids=list(order[: draw(st.integers(0, slots))]),
        seed=draw(st.integers(0, 2**31 - 1)),
        staging_as_bytes=draw(st.booleans()),
    )


# ------------------------------------------------------------------ reference on the CPU


@settings(deadline=None, max_examples=150)
@given(layer_cases())
def test_reference_matches_python_oracle(case: LayerCase) -> None:
    pool, staging = case.make()
    expected = oracle_layer(pool, staging, case.slot_ids, case.layer, case.layout)
    scatter_layer_reference(staging, pool, case.slot_ids, case.layer, case.layout)
    assert as_bytes(pool) == expected


def host_copies(native: bool):
    """The CPU scatters as they run: native copy rows, or (``native=False``) the numpy and
    torch paths taken where ``cuda_ext/_copyhash`` is not built."""
    if native:
        if host_copy.native_module() is None:
            pytest.skip("cuda_ext/_copyhash.c not built (FLATCAKE_NATIVE=0, or no compiler)")
        return contextlib.nullcontext()
    return mock.patch.object(host_copy, "native_module", return_value=None)


@pytest.mark.parametrize("native", [True, False], ids=["native-rows", "numpy"])
@settings(deadline=None, max_examples=50)
@given(layer_cases(), st.sampled_from([torch.int32, torch.int64]))
def test_dispatch_on_cpu_is_the_reference(native: bool, case: LayerCase, index_dtype) -> None:
    pool, staging = case.make()
    expected = oracle_layer(pool, staging, case.slot_ids, case.layer, case.layout)
    ids = torch.tensor(case.slot_ids, dtype=index_dtype)
    with host_copies(native):
        scatter_layer(staging, pool, ids, case.layer, case.layout)
    assert as_bytes(pool) == expected


@pytest.mark.parametrize("layout", LAYOUTS)
def test_half_of_a_kv_pool_is_scattered_in_place(layout) -> None:
    # SGLang's host pools are [2, layers, slots, ...] / [slots, 2, layers, ...]: pass K or V.
    slots, layers, page = 6, 3, (2, 4)
    if layout == LAYER_FIRST:
        kv = random_tensor((2, layers, slots, *page), torch.bfloat16, 7)
        pool = kv[1]
    else:
        kv = random_tensor((slots, 2, layers, *page), torch.bfloat16, 7)
        pool = kv[:, 1]
    untouched = kv.select(0 if layout == LAYER_FIRST else 1, 0).clone()
    staging = random_tensor((3, *page), torch.bfloat16, 8)
    expected = oracle_layer(pool.contiguous(), staging, [5, 0, 2], 1, layout)
    scatter_layer(staging, pool, [5, 0, 2], 1, layout)
    assert as_bytes(pool) == expected
    assert as_bytes(kv.select(0 if layout == LAYER_FIRST else 1, 0)) == as_bytes(untouched)


def test_per_layer_tensor_works_unsqueezed() -> None:
    layer_tensor = torch.zeros(5, 8, dtype=torch.float16)  # SGLang device pool: one per layer
    staging = random_tensor((2, 8), torch.float16, 3)
    scatter_layer(staging, layer_tensor.unsqueeze(0), [4, 1], 0, LAYER_FIRST)
    assert as_bytes(layer_tensor[4]) == as_bytes(staging[0])
    assert as_bytes(layer_tensor[1]) == as_bytes(staging[1])


@st.composite
def offset_cases(draw):
    page_bytes = draw(st.integers(1, 24))
    pages = draw(st.integers(0, 6))
    gaps = draw(st.lists(st.integers(0, 9), min_size=pages, max_size=pages))
    offsets, cursor = [], draw(st.integers(0, 5))
    for gap in gaps:
        offsets.append(cursor)
        cursor += page_bytes + gap
    dest_bytes = max(cursor + draw(st.integers(0, 5)), page_bytes)
    order = draw(st.permutations(range(pages)))
    return page_bytes, [offsets[i] for i in order], dest_bytes, draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("native", [True, False], ids=["native-rows", "torch"])
@settings(deadline=None, max_examples=100)
@given(offset_cases(), st.sampled_from([torch.uint8, torch.int16, torch.float32]))
def test_offsets_reference_matches_python_oracle(native: bool, case, dest_dtype) -> None:
    page_bytes, offsets, dest_bytes, seed = case
    itemsize = torch.empty((), dtype=dest_dtype).element_size()
    dest = random_tensor((-(-dest_bytes // itemsize),), dest_dtype, seed)
    staging = random_tensor((len(offsets) * page_bytes,), torch.uint8, seed + 1)
    expected = oracle_offsets(dest, staging, offsets, page_bytes)
    with host_copies(native):
        scatter_pages(staging, dest, offsets, page_bytes)
    assert as_bytes(dest) == expected
    scatter_pages_reference(staging, dest, offsets, page_bytes)
    assert as_bytes(dest) == expected


# ------------------------------------------------------------------------ argument errors


def _layer_args(**overrides):
    pool = torch.zeros(2, 4, 8, dtype=torch.float16)
    args = {
        "staging": torch.zeros(2, 8, dtype=torch.float16),
        "pool": pool,
        "slot_ids": [0, 3],
        "layer": 1,
        "layout": LAYER_FIRST,
    }
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"layout": "slot_first"}, "layout must be one of"),
        ({"layer": 2}, "layer must be an int in"),
        ({"layer": -1}, "layer must be an int in"),
        ({"layer": True}, "layer must be an int in"),
        ({"pool": torch.zeros(4, 8, dtype=torch.float16)}, "pool must be"),
        ({"pool": torch.zeros(2, 4, 8, 2, dtype=torch.float16).transpose(2, 3)}, "contiguous"),
        ({"pool": torch.zeros(2, 1, 8, dtype=torch.float16).expand(2, 4, 8)}, "slots overlap"),
        ({"pool": torch.zeros(2, 4, 8, dtype=torch.complex64)}, "unsupported pool dtype"),
        ({"pool": "pool"}, "must be a torch.Tensor"),
        ({"staging": torch.zeros(3, 8, dtype=torch.float16)}, "need exactly 32"),
        ({"staging": torch.zeros(2, 8, dtype=torch.float32)}, "staging dtype must be"),
        ({"staging": torch.zeros(8, 2, dtype=torch.float16).t()}, "staging must be contiguous"),
        ({"staging": torch.zeros(32, dtype=torch.uint8, device="meta")}, "staging is on meta"),
        ({"slot_ids": [0, 4]}, r"slot ids must be in \[0, 4\)"),
        ({"slot_ids": [-1, 2]}, r"slot ids must be in \[0, 4\)"),
        ({"slot_ids": [2, 2]}, "must be distinct"),
        ({"slot_ids": torch.tensor([0.0, 1.0])}, "1-D int32 or int64"),
        ({"slot_ids": torch.tensor([[0, 1]])}, "1-D int32 or int64"),
        ({"slot_ids": ["a", "b"]}, "sequence of ints"),
        ({"slot_ids": torch.tensor([0, 1], device="meta")}, "indices are on meta"),
    ],
)
@pytest.mark.parametrize("function", [scatter_layer, scatter_layer_reference])
def test_layer_argument_errors(function, overrides, message) -> None:
    args = _layer_args(**overrides)
    before = args["pool"].clone() if isinstance(args["pool"], torch.Tensor) else None
    with pytest.raises(ShapeError, match=message):
        function(**args)
    if before is not None:
        assert torch.equal(args["pool"], before)


def test_cpu_tensors_refuse_a_stream_and_the_kernel_backend() -> None:
    with pytest.raises(ShapeError, match="stream given"):
        scatter_layer(**_layer_args(), stream=1234)
    with pytest.raises(ShapeError, match="needs CUDA tensors"):
        scatter_layer(**_layer_args(), backend="kernel")
    with pytest.raises(ShapeError, match="backend must be one of"):
        scatter_layer(**_layer_args(), backend="fastest")


def test_cpu_slot_ids_are_checked_even_when_checks_are_off() -> None:
    # Checking ids that live on the host costs no device sync, so it always happens.
    with pytest.raises(ShapeError, match="must be distinct"):
        scatter_layer(**_layer_args(slot_ids=[2, 2]), check_slots=False)
    with pytest.raises(ShapeError, match="need exactly"):
        scatter_layer(**_layer_args(slot_ids=[1]), check_slots=False)


@pytest.mark.parametrize(
    ("offsets", "page_bytes", "message"),
    [
        ([0, 13], 4, r"byte offsets must be in \[0, 12\]"),
        ([-1, 4], 4, r"byte offsets must be in"),
        ([0, 3], 4, "pages overlap"),
        ([5, 5], 4, "pages overlap"),
        ([0], 0, "page_bytes must be in"),
        ([0], 17, "page_bytes must be in"),
    ],
)
def test_offset_argument_errors(offsets, page_bytes, message) -> None:
    dest = torch.zeros(16, dtype=torch.uint8)
    staging = torch.zeros(len(offsets) * max(page_bytes, 0), dtype=torch.uint8)
    with pytest.raises(ShapeError, match=message):
        scatter_pages(staging, dest, offsets, page_bytes)
    assert not dest.any()


def test_offsets_need_a_contiguous_dest() -> None:
    dest = torch.zeros(4, 4, dtype=torch.uint8).t()
    with pytest.raises(ShapeError, match="dest must be contiguous"):
        scatter_pages(torch.zeros(4, dtype=torch.uint8), dest, [0], 4)
