"""rl_replay/engine/storage.py: SlabStore, the host chunks that hold a rollout's saved inputs
and CPU outputs.

Covers the copies it hands out (values, dtype and strides of the source, tensors of their
own), the 64-byte alignment inside a chunk, the chunk series (inputs and each output
position apart) and their geometric growth, ``owns``, ``used_bytes``, ``release``, and
chunks going back to the OS as soon as no tensor uses them (directly, and through a
rollout's backward).
"""

from __future__ import annotations

import gc
import re
import sys

import pytest
import torch
import torch.nn as nn

from rl_replay import GradientAccumulator, checkpoint_fsdp_forward
from rl_replay.engine.storage import SlabStore

MiB = 1 << 20


def storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def mapped(address: int) -> bool:
    """Whether ``address`` lies in one of this process's memory mappings."""
    with open("/proc/self/maps") as fh:
        for line in fh:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_a_copy_is_a_tensor_of_its_own_with_the_sources_values_and_strides():
    store = SlabStore()
    sources = [
        torch.randn(3, 4),
        torch.arange(6, dtype=torch.int64),
        torch.randn(4, 3).t(),
        torch.tensor([True, False, True]),
    ]
    copies = [store.copy(t, pinned=False) for t in sources]
    for src, out in zip(sources, copies):
        assert out.dtype == src.dtype and out.shape == src.shape and out.stride() == src.stride()
        assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
        assert out._base is None and not out.requires_grad
    sources[0].add_(1)  # the copy was done before copy() returned
    assert not torch.equal(copies[0], sources[0])
    assert store.copied_bytes == sum(t.numel() * t.element_size() for t in sources)


def test_tensors_start_on_64_byte_boundaries_of_one_chunk():
    store = SlabStore()
    a = store.copy(torch.ones(3), pinned=False)  # 12 bytes
    b = store.copy(torch.ones(5, dtype=torch.uint8), pinned=False)  # 5 bytes
    c = store.copy(torch.ones(6), pinned=False)  # 24 bytes
    assert storage_of(a) == storage_of(b) == storage_of(c) == a.data_ptr()
    assert [t.data_ptr() - a.data_ptr() for t in (a, b, c)] == [0, 64, 128]
    assert all(t.data_ptr() % 64 == 0 for t in (a, b, c))
    assert store.used_bytes() == {a.data_ptr(): 128 + 24}
    assert store.reserved_bytes == MiB and store.copied_bytes == 12 + 5 + 24


def test_chunks_grow_from_1_to_4_mib_and_a_larger_tensor_gets_its_own():
    store = SlabStore()
    half = torch.ones(MiB // 2, dtype=torch.uint8)
    kept = [store.copy(half, pinned=False) for _ in range(2 + 4 + 8 + 2)]
    chunks = {storage_of(t): 0 for t in kept}
    for t in kept:
        chunks[storage_of(t)] += 1
    assert list(chunks.values()) == [2, 4, 8, 2]  # 1, 2, 4 and (capped) 4 MiB, in order
    assert store.reserved_bytes == (1 + 2 + 4 + 4) * MiB
    big = store.copy(torch.ones(5 * MiB + 3, dtype=torch.uint8), pinned=False)
    assert store.reserved_bytes == (1 + 2 + 4 + 4 + 5) * MiB + 64
    assert storage_of(big) not in chunks and store.used_bytes()[storage_of(big)] == 5 * MiB + 3


def test_inputs_and_each_output_position_fill_chunks_of_their_own():
    store = SlabStore()
    x = torch.ones(4)
    inputs = [store.copy(x, pinned=False) for _ in range(2)]
    first = [store.place(x, 0) for _ in range(2)]
    second = [store.place(x, 1) for _ in range(2)]
    series = [{storage_of(t) for t in group} for group in (inputs, first, second)]
    assert all(len(s) == 1 for s in series)
    assert len(set.union(*series)) == 3
    assert store.reserved_bytes == 3 * MiB and len(store.used_bytes()) == 3


def test_owns_the_tensors_in_its_chunks_only():
    store, other = SlabStore(), SlabStore()
    x = torch.randn(4, 4)
    mine, placed, theirs = store.copy(x, pinned=False), store.place(x, 2), other.copy(x, pinned=False)
    assert store.owns(mine) and store.owns(placed) and store.owns(mine[1:])  # a view shares the chunk
    assert not store.owns(x) and not store.owns(theirs) and other.owns(theirs)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_chunk_goes_back_to_the_os_when_its_last_tensor_dies():
    store = SlabStore()
    a = store.copy(torch.ones(8), pinned=False)
    b = store.copy(torch.ones(8), pinned=False)
    address = a.data_ptr()
    assert mapped(address) and list(store.used_bytes()) == [address]
    del b
    gc.collect()
    # The chunk lives while a does, but takes no more: the next tensor opens a new one.
    c = store.copy(torch.ones(8), pinned=False)
    assert storage_of(c) != address and mapped(address)
    assert set(store.used_bytes()) == {address, storage_of(c)}
    del a
    gc.collect()
    assert not mapped(address)
    assert list(store.used_bytes()) == [storage_of(c)]


def test_release_forgets_the_chunks_and_leaves_their_tensors_intact():
    store = SlabStore()
    x = torch.randn(5, 3)
    kept = store.copy(x, pinned=False)
    store.release()
    assert store.used_bytes() == {} and not store.owns(kept)
    assert torch.equal(kept, x)
    after = store.copy(x, pinned=False)  # a new chunk, not the released one's tail
    assert storage_of(after) != storage_of(kept) and store.owns(after)
    assert list(store.used_bytes()) == [storage_of(after)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory)")
def test_pinned_inputs_have_a_series_of_their_own():
    store = SlabStore()
    x = torch.randn(4, 4, device="cuda")
    pinned = store.copy(x, pinned=True)
    pageable = store.copy(x.cpu(), pinned=False)
    assert pinned.device.type == "cpu" and pinned.is_pinned() and not pageable.is_pinned()
    assert torch.equal(pinned, x.cpu()) and storage_of(pinned) != storage_of(pageable)
    assert store.owns(pinned) and store.owns(pageable)


# --------------------------------------------------------------- through a rollout
def _rss() -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(r"^VmRSS:\s+(\d+)", fh.read(), re.M).group(1)) * 1024


def test_slabs_are_freed_when_the_backward_is_done():
    """16 MiB of saved inputs leave the process in one piece once the backward is done
    (munmap, whatever glibc keeps), and stay for a second backward of a retained graph."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 1)
    n = 16
    for retain in (True, False):
        acc = GradientAccumulator()
        inputs = [torch.randn(4096, 64) for _ in range(n)]  # fresh tensors: copied
        gc.collect()
        base = _rss()
        loss = sum(checkpoint_fsdp_forward(lin, acc, input=x).sum() for x in inputs)
        grown = _rss() - base
        assert acc.slabs.copied_bytes >= n * 4096 * 64 * 4
        assert grown >= 0.9 * n * 2**20, grown
        loss.backward(retain_graph=retain)
        if retain:
            assert _rss() - base >= 0.9 * n * 2**20  # the graph still holds its inputs
            loss.backward()
        del loss
        gc.collect()
        assert _rss() - base < 0.25 * n * 2**20, (_rss() - base) / 2**20
