"""How a device's caching allocator turns tensor storages into allocated and reserved bytes.

The meta-device trace counts every live storage's bytes exactly (``nbytes``). A real device does
not hand out ``nbytes``: PyTorch's caching allocator rounds each request up
(:func:`allocated_size`, what ``torch.cuda.memory_allocated()`` counts), and carves requests out
of segments it reserves from the driver (what ``torch.cuda.memory_reserved()`` counts), which
:func:`reserved_estimate` estimates. Pure functions, no framework.

The constants are PyTorch's, read in ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch,
commit 001074d25084fdb87a799823e395a50f5ec044d3): ``round_size`` rounds a request up to a multiple
of ``kMinBlockSize`` (at least one), ``get_pool`` sends a rounded size of at most ``kSmallSize`` to
the small pool, and ``get_allocation_size`` sizes a new segment; ``allocate(0)`` takes no block.
ROCm builds run the same code. torch_npu's ``NPUCachingAllocator.cpp`` (Ascend/pytorch) has the
same constants and segment sizes, and its ``round_size`` adds 32 bytes before rounding.

Not modelled: ``PYTORCH_CUDA_ALLOC_CONF`` options that change the rounding
(``roundup_power2_divisions``), the segment sizes (``expandable_segments``: pages of 2 MiB / 20 MiB
mapped as needed) or the splitting (``max_split_size_mb``); memory outside the allocator (the
CUDA context, cuBLAS/NCCL workspaces).
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["allocated_size", "segment_size", "reserved_estimate", "K_MIN_BLOCK_SIZE", "K_SMALL_SIZE",
           "K_SMALL_BUFFER", "K_LARGE_BUFFER", "K_MIN_LARGE_ALLOC", "K_ROUND_LARGE", "NPU_PADDING"]

K_MIN_BLOCK_SIZE = 512          # kMinBlockSize: every size is rounded to a multiple of 512 bytes (at least 512)
K_SMALL_SIZE = 1 << 20          # kSmallSize: the largest "small" request, 1 MiB
K_SMALL_BUFFER = 2 << 20        # kSmallBuffer: small requests are packed in 2 MiB segments
K_LARGE_BUFFER = 20 << 20       # kLargeBuffer: requests between 1 and 10 MiB are carved from 20 MiB segments
K_MIN_LARGE_ALLOC = 10 << 20    # kMinLargeAlloc: from 10 MiB on, a request gets a segment of its own size...
K_ROUND_LARGE = 2 << 20         # kRoundLarge: ...rounded up to a multiple of 2 MiB
NPU_PADDING = 32                # torch_npu's round_size: size + 32 before rounding (AclrtMallocAlign32)

_ALLOCATORS = ("cuda_caching", "npu_caching", "exact")


def _check(nbytes: int, allocator: str) -> None:
    if allocator not in _ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator!r}; use one of {', '.join(_ALLOCATORS)}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"a request is a number of bytes (an int >= 0), got {nbytes!r}")


def allocated_size(nbytes: int, allocator: str = "cuda_caching") -> int:
    """The bytes the allocator hands out for a request of ``nbytes`` (what it counts as
    allocated). ``exact``: no rounding (a CPU meter counting storages). Per request: a request of
    the large pool served by a cached block that is not split (1 MiB or less would remain) counts
    the whole block as allocated, which depends on the cache's history and is not modelled.

    >>> allocated_size(0), allocated_size(1), allocated_size(512), allocated_size(513)
    (0, 512, 512, 1024)
    >>> allocated_size(4096 * 4096 * 2)          # a 4096 x 4096 bf16 matrix: already a multiple of 512
    33554432
    >>> allocated_size(1000, "npu_caching"), allocated_size(512, "npu_caching"), allocated_size(0, "npu_caching")
    (1536, 1024, 0)
    """
    _check(nbytes, allocator)
    if nbytes == 0 or allocator == "exact":
        return nbytes  # (CUDA's allocate(0) returns a null pointer: no block)
    if allocator == "npu_caching":
        nbytes += NPU_PADDING
    blocks = -(-nbytes // K_MIN_BLOCK_SIZE)
    return max(1, blocks) * K_MIN_BLOCK_SIZE


def segment_size(nbytes: int, allocator: str = "cuda_caching") -> int:
    """The size of the segment the allocator reserves when no cached block can serve the request
    (``get_allocation_size`` of the rounded size); 0 for a zero-byte request.

    >>> segment_size(1000), segment_size(3 << 20), segment_size(33 << 20), segment_size((10 << 20) + 1)
    (2097152, 20971520, 35651584, 12582912)
    """
    size = allocated_size(nbytes, allocator)
    if allocator == "exact" or size == 0:
        return size
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def reserved_estimate(live: Iterable[int], allocator: str = "cuda_caching") -> int:
    """An ESTIMATE of the bytes the allocator reserves to hold the storages ``live`` (request
    sizes in bytes, e.g. every storage live at the step's peak), packed as fresh segments pack:

    - requests whose rounded size is at most 1 MiB share 2 MiB segments (``kSmallBuffer``);
    - rounded sizes above 1 MiB and below 10 MiB share 20 MiB segments (``kLargeBuffer``; a
      segment is split while more than 1 MiB would remain);
    - 10 MiB and more: a segment each, rounded up to 2 MiB (``kRoundLarge``).

    Each group is packed by its total, first-fit-decreasing for the 20 MiB segments. It is an
    estimate, not a bound: the real reserve also holds freed blocks the cache keeps from earlier
    in the step (more), fragmentation between phases (more), and can serve a request from a larger
    cached block (less). ``exact``: the sum of the sizes.

    >>> reserved_estimate([1000] * 3)                       # three small blocks in one 2 MiB segment
    2097152
    >>> reserved_estimate([3 << 20] * 7)                    # 6 x 3 MiB fit a 20 MiB segment (2 MiB left), the 7th opens one
    41943040
    >>> reserved_estimate([33 << 20, 0, 1])                 # 34 MiB, and one 2 MiB small segment
    37748736
    """
    sizes = [allocated_size(n, allocator) for n in live]
    if allocator == "exact":
        return sum(sizes)
    small = sum(s for s in sizes if 0 < s <= K_SMALL_SIZE)
    total = -(-small // K_SMALL_BUFFER) * K_SMALL_BUFFER
    segments: list = []  # free bytes of each 20 MiB segment opened so far
    for s in sorted((s for s in sizes if K_SMALL_SIZE < s < K_MIN_LARGE_ALLOC), reverse=True):
        for i, free in enumerate(segments):
            # (the allocator splits a block only when more than kSmallSize would remain; a block
            # that fits with less remaining is handed out whole, its tail unusable)
            if free >= s:
                segments[i] = free - s if free - s > K_SMALL_SIZE else 0
                break
        else:
            rest = K_LARGE_BUFFER - s
            segments.append(rest if rest > K_SMALL_SIZE else 0)
    total += len(segments) * K_LARGE_BUFFER
    total += sum(-(-s // K_ROUND_LARGE) * K_ROUND_LARGE for s in sizes if s >= K_MIN_LARGE_ALLOC)
    return total
