"""Block layouts (aligned offsets, typed views) and host block storage (per tensor / contiguous slab)."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.offload.host_storage import HostBlockStorage
from worldfoundry.core.offload.pinned import cuda_reports_page_locked, is_page_locked, registered_by_this_process
from worldfoundry.core.offload.layout import (
    MIN_ALIGNMENT,
    TENSOR_ALIGNMENT,
    BlockLayout,
    align_up,
)


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("empty", torch.empty(0, 4)),
        ("ints", torch.arange(9, dtype=torch.int32).view(3, 3)),
    ]


def test_offsets_are_aligned_and_disjoint() -> None:
    layout = BlockLayout.from_tensors(_tensors())
    assert TENSOR_ALIGNMENT % MIN_ALIGNMENT == 0
    end = 0
    for entry in layout.entries:
        assert entry.offset % TENSOR_ALIGNMENT == 0
        assert entry.offset >= end
        end = entry.offset + entry.nbytes
    assert layout.nbytes >= end and layout.nbytes % TENSOR_ALIGNMENT == 0
    assert layout.payload_bytes == sum(t.numel() * t.element_size() for _, t in _tensors())
    assert align_up(0, 16) == 0 and align_up(1, 16) == 16 and align_up(32, 16) == 32


def test_views_round_trip_every_dtype_and_shape() -> None:
    named = _tensors()
    layout = BlockLayout.from_tensors(named, alignment=16)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(buffer)
    for view, (_, tensor) in zip(views, named):
        view.copy_(tensor)
    for view, (_, tensor) in zip(layout.views(buffer), named):
        assert view.dtype == tensor.dtype and view.shape == tensor.shape
        assert torch.equal(view, tensor)
        if view.numel():
            assert (view.data_ptr() - buffer.data_ptr()) % 16 == 0


def test_layout_errors() -> None:
    with pytest.raises(ValueError, match="alignment"):
        BlockLayout.from_tensors(_tensors(), alignment=8)
    with pytest.raises(ValueError, match="not contiguous"):
        BlockLayout.from_tensors([("t", torch.randn(4, 3).t())])
    layout = BlockLayout.from_tensors(_tensors())
    with pytest.raises(ValueError, match="uint8"):
        layout.views(torch.zeros(layout.nbytes, dtype=torch.float32))
    with pytest.raises(ValueError, match=">="):
        layout.views(torch.zeros(layout.nbytes - 1, dtype=torch.uint8))


@pytest.mark.parametrize("contiguous", [False, True])
def test_storage_copies_and_restores_exactly(contiguous: bool) -> None:
    named = _tensors()
    layout = BlockLayout.from_tensors(named)
    storage = HostBlockStorage.from_tensors(layout, [t for _, t in named], contiguous=contiguous, pin=False)
    assert storage.contiguous is contiguous
    assert storage.copies_per_load == (1 if contiguous else len(named))
    assert storage.nbytes == (layout.nbytes if contiguous else layout.payload_bytes)
    for master, (_, tensor) in zip(storage.masters, named):
        assert torch.equal(master, tensor)
        assert master.numel() == 0 or master.data_ptr() != tensor.data_ptr()
    if contiguous:  # masters are views of one slab
        assert all(m.untyped_storage().data_ptr() == storage.slab.data_ptr() for m in storage.masters if m.numel())
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    storage.copy_to(buffer, non_blocking=False)
    for view, (_, tensor) in zip(layout.views(buffer), named):
        assert torch.equal(view, tensor)
    restored = storage.restore_tensors(torch.device("cpu"))
    for fresh, master in zip(restored, storage.masters):
        assert torch.equal(fresh, master) and fresh.is_contiguous()
        assert fresh.numel() == 0 or fresh.data_ptr() != master.data_ptr()
    storage.release()
    assert storage.masters == [] and storage.slab is None


def test_storage_rejects_mismatched_tensors() -> None:
    named = _tensors()
    layout = BlockLayout.from_tensors(named)
    with pytest.raises(ValueError, match="entries"):
        HostBlockStorage.from_tensors(layout, [t for _, t in named][:-1], contiguous=False, pin=False)
    wrong = [t for _, t in named]
    wrong[0] = wrong[0].double()
    with pytest.raises(ValueError, match="'a'"):
        HostBlockStorage.from_tensors(layout, wrong, contiguous=True, pin=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for pinned memory")
@pytest.mark.gpu
@pytest.mark.parametrize("contiguous", [False, True])
def test_pinned_storage_copies_to_the_device(contiguous: bool) -> None:
    named = [(n, t) for n, t in _tensors() if t.dtype != torch.int32]
    layout = BlockLayout.from_tensors(named)
    storage = HostBlockStorage.from_tensors(layout, [t for _, t in named], contiguous=contiguous, pin=True)
    # Tensor.is_pinned() does not see cudaHostRegister memory in recent PyTorch; CUDA (or the record) does
    assert all(is_page_locked(m) for m in storage.masters if m.numel())
    assert storage.pin_method == "cuda_host_register"  # exact size, not rounded to a power of two
    assert storage.locked_bytes < storage.nbytes + len(storage.masters) * 2 * 4096
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8, device="cuda")
    storage.copy_to(buffer, non_blocking=True)
    torch.cuda.synchronize()
    for view, (_, tensor) in zip(layout.views(buffer), named):
        assert torch.equal(view.cpu(), tensor)
    storage.release()
    assert storage.locked_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for pinned memory")
@pytest.mark.gpu
def test_pinned_buffer_is_exact_size_and_unregisters() -> None:
    from worldfoundry.core.offload.pinned import PAGE_BYTES, PinnedBuffer, registered_by_this_process

    buffer = PinnedBuffer(3 * PAGE_BYTES + 5, torch.device("cuda"))
    buffer_ptr = buffer.tensor.data_ptr()
    assert registered_by_this_process(buffer_ptr, buffer.nbytes)
    assert buffer.method == "cuda_host_register" and buffer.tensor.numel() == 3 * PAGE_BYTES + 5
    assert is_page_locked(buffer.tensor) and buffer.locked_bytes == 4 * PAGE_BYTES
    assert cuda_reports_page_locked(buffer.tensor.data_ptr()) in (True, None)  # CUDA agrees where it can be asked
    device = torch.empty(buffer.nbytes, dtype=torch.uint8, device="cuda")
    buffer.tensor.fill_(7)
    device.copy_(buffer.tensor, non_blocking=True)
    torch.cuda.synchronize()
    assert int(device.min()) == 7
    buffer.release()
    buffer.release()  # idempotent
    assert not registered_by_this_process(buffer_ptr, 1)


def test_ordinary_host_memory_is_not_page_locked() -> None:
    x = torch.empty(1024, dtype=torch.uint8)
    assert not is_page_locked(x)
    assert not is_page_locked(torch.empty(4, device="meta"))
    assert not registered_by_this_process(x.data_ptr(), x.numel())
    if not torch.cuda.is_available():
        assert cuda_reports_page_locked(x.data_ptr()) is None  # nothing to ask
    else:
        assert cuda_reports_page_locked(x.data_ptr()) in (False, None)
