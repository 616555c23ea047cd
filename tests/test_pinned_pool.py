"""A pinned host pool locks exactly its own bytes (cache/pinned.py).

The CUDA runtime is not on this machine, so its two calls are recorded here (a stand-in for
torch.cuda.cudart(), nothing of ours): what is registered, with which flag, what is undone
and when. tests/test_host_tier_cuda.py runs the real calls on a GPU.
"""

from __future__ import annotations

import gc
import mmap
from collections.abc import Iterator

import pytest
import torch

from radixserve.cache.pinned import page_locked_zeros
from radixserve.cache.pool import PagePool


class RecordingCudart:
    """Records cudaHostRegister / cudaHostUnregister; answers `error` to the registration."""

    def __init__(self, error: int = 0) -> None:
        self.error = error
        self.registered: dict[int, tuple[int, int]] = {}  # address -> (bytes, flags), while registered
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        if self.error:
            return self.error
        for other, (size, _) in self.registered.items():
            assert address + nbytes <= other or other + size <= address, "a page registered twice"
        self.registered[address] = (nbytes, flags)
        return 0

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        del self.registered[address]
        self.unregistered.append(address)
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingCudart]:
    runtime = RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    yield runtime
    gc.collect()


def test_the_locked_range_is_whole_pages_holding_the_tensor_and_no_more(cudart: RecordingCudart) -> None:
    page = mmap.PAGESIZE
    tensor = page_locked_zeros((3, 5, 7), torch.float32)  # 420 bytes: one page locked, not 512
    assert tensor.shape == (3, 5, 7) and tensor.dtype == torch.float32 and not tensor.any()
    ((address, (nbytes, flags)),) = cudart.registered.items()
    assert address % page == 0 and nbytes == page and flags == 1  # portable: every device's context
    assert address <= tensor.data_ptr() and tensor.data_ptr() + 420 <= address + nbytes
    big = page_locked_zeros((3 * page + 1,), torch.uint8)
    assert cudart.registered[big.data_ptr()] == (4 * page, 1)  # 3 pages and 1 byte: 4 pages, not 8


def test_a_pinned_pool_registers_k_and_v_apart_and_undoes_both_when_its_memory_goes(cudart: RecordingCudart) -> None:
    pool = PagePool(7, 16, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, pin_memory=True)
    per_tensor = 3 * 7 * 16 * 2 * 8 * 2  # 10,752 bytes each of K and V
    assert sorted(size for size, _ in cudart.registered.values()) == [-(-per_tensor // mmap.PAGESIZE) * mmap.PAGESIZE] * 2
    pool.k_cache[2][6] = 1.5  # views of the locked memory: a page written through them
    assert pool._k_all[2, 6].eq(1.5).all() and not pool._v_all.any()
    view = pool.v_cache[1]
    del pool
    gc.collect()
    assert len(cudart.unregistered) == 1  # K's memory went; V's lives on in `view`
    view += 1
    del view
    gc.collect()
    assert len(cudart.unregistered) == 2 and not cudart.registered


def test_a_refused_registration_says_why(cudart: RecordingCudart) -> None:
    cudart.error = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match=r"cudaHostRegister error 2\).*ulimit -l"):
        PagePool(4, 16, num_layers=1, num_kv_heads=1, head_dim=4, pin_memory=True)


def test_only_a_host_pool_is_pinned() -> None:
    with pytest.raises(ValueError, match="only a host pool is pinned"):
        PagePool(4, 16, num_layers=1, num_kv_heads=1, head_dim=4, device="cuda", pin_memory=True)
