"""How the operator's per-sample products use memory: the cached pullbacks or direct products, and the
direct path's chunks of samples (``flguard.risk.operator.JacobianOperator``'s ``products`` setting).

The thresholds are module attributes read at each operator's creation, so a benchmark or a test can set
them here (``CACHED_UP_TO``, the CUDA shares) to force one path.
"""

from __future__ import annotations

import ctypes
import sys

import torch

#: The per-sample path's two ways to apply J_i and J_iᵀ. *Cached*: the pullbacks of the batch's
#: per-sample gradient and input-gradient maps are built at the first product and reused (fastest
#: where they fit: 1.3–2× the direct products on the quickstart CNN and a ResNet-20, benchmarks/
#: bench_operator_products.py), but they hold several [B, dθ] tensors and the double-backward graph
#: of the whole batch (3 GB on a ResNet-18 at B = 8, 10 GB at B = 32). *Direct*: each product is one
#: forward-over-reverse (Jᵀu) or reverse-of-forward (Jv) pass per sample, ``vmap``-ed over chunks of
#: samples, nothing kept between products. ``products="auto"`` takes the cached path while B·dθ is at
#: most this many floats (256 MB in float32) or, on a CUDA device, while it fits the device's memory
#: (``takes_cached``), else the direct one in chunks of samples, so memory stops growing with the batch.
CACHED_UP_TO = 2 ** 26
#: On a CUDA device "auto" also keeps the cached pullbacks while they fit in this share of the device's
#: free memory at the operator's creation, at ``CACHED_FLOATS_PER_PARAMETER`` floats per sample and
#: parameter (measured: 9.6 GB of an H100 at B = 32 on a ResNet-18-GN, 6.3 floats per sample and
#: parameter above training's 0.6 GB). There they made the guard's step 3.3× faster than the direct
#: path's (8.4 s against 27.7 s, benchmarks/gpu_run.sh, docs/results.md "The guard on a GPU"); a
#: GPU's memory, not its time, is what the direct path saves. A quarter leaves the user's training its
#: room: a ResNet-18 at B = 32 (11.4 GB by this count) is cached on an 80 GB card, direct on a 24 GB one.
CUDA_CACHED_SHARE = 0.25
CACHED_FLOATS_PER_PARAMETER = 8
#: Direct path: samples per vmapped call, ⌊min(CACHED_UP_TO, DIRECT_CHUNK_FLOATS)/dθ⌋ (a ResNet-18: 1,
#: a ResNet-20: 61). A chunk holds its samples' double-backward graphs, ~0.2 GB each on a ResNet-18 at
#: 32×32: the clipped K product at B = 32 peaked at 3.6 GB in chunks of 6 and 2.5 GB in chunks of 1,
#: in the same time on one CPU thread (benchmarks/bench_operator_products.py --clip).
DIRECT_CHUNK_FLOATS = 2 ** 24
#: On a CUDA device the direct path's chunks are sized by the device's free memory instead: a GPU wants
#: few, large kernels (a chunk of one sample is one launch-bound pass per sample), and its memory is the
#: limit. A chunk may take this share of the free memory at the operator's creation, counting
#: ``DIRECT_FLOATS_PER_PARAMETER`` floats per sample and parameter (its J_iᵀu and its double-backward
#: graph: ~0.2 GB per sample on a ResNet-18 at 32×32, 4.5 floats per parameter).
CUDA_CHUNK_SHARE = 0.125
DIRECT_FLOATS_PER_PARAMETER = 8


#: The guard's own operator (``flguard.guard.engine``) asks for ``products="ghost"`` on the CPU: batches the cached
#: pullbacks would hold then take the batched ghost K product where the model's layers allow it and the batch's graphs
#: are kept (``DirectProducts.take_ghost_products``) — measured on one CPU thread, the trained quickstart CNN's seeded
#: round at B = 32 491 → 417 ms a step on average over four pairs side by side, the same iterates (docs/results.md,
#: "Ghost products on small models") — and larger batches take it instead of the direct path's vmapped chunks
#: (EfficientNet-B0's K product at B = 32 25.1 → 1.77 s: "Self-attention in the batched products").
#: Elsewhere, and with False, "auto".
GUARD_GHOST_ON_CPU = True
#: The same on a CUDA device, off until measured there (no GPU has been lent since the ghost products were built): the
#: cached pullbacks, 9.6 GB at B = 32 on ResNet-18-GN, were the GPU's fastest path before them (a guarded step 2.0 s,
#: 224× its training step on an H200). ``benchmarks/gpu_run.sh`` runs the guard both ways on a lent card
#: (``bench_guard_models.py --products ghost``); the graphs are kept there while they fit in a share of the card's
#: free memory (``flguard.risk.ghost_products.CUDA_RETAINED_SHARE``).
GUARD_GHOST_ON_CUDA = False


def guard_products(device: torch.device) -> str:
    """The ``products`` setting of the guard's operator on ``device`` (``GUARD_GHOST_ON_CPU``,
    ``GUARD_GHOST_ON_CUDA``)."""
    ghost = GUARD_GHOST_ON_CPU if device.type == "cpu" else GUARD_GHOST_ON_CUDA and device.type == "cuda"
    return "ghost" if ghost else "auto"


def direct_sample_chunk(dtheta: int, batch: int, device: torch.device, element_size: int = 4) -> int:
    """Samples per vmapped call on the direct path (at least 1, at most the batch): on the CPU
    ⌊min(CACHED_UP_TO, DIRECT_CHUNK_FLOATS)/dθ⌋; on a CUDA device as many as ``CUDA_CHUNK_SHARE`` of its
    free memory holds at ``DIRECT_FLOATS_PER_PARAMETER`` floats per sample and parameter."""
    floats = min(CACHED_UP_TO, DIRECT_CHUNK_FLOATS)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        floats = max(floats, int(CUDA_CHUNK_SHARE * free / (element_size * DIRECT_FLOATS_PER_PARAMETER)))
    return max(1, min(batch, floats // dtheta))


def takes_cached(dtheta: int, batch: int, device: torch.device, element_size: int = 4) -> bool:
    """Whether ``products="auto"`` keeps the cached pullbacks: B·dθ ≤ ``CACHED_UP_TO`` floats, or on a CUDA
    device while they fit in ``CUDA_CACHED_SHARE`` of its free memory (``CACHED_FLOATS_PER_PARAMETER``
    floats per sample and parameter)."""
    if batch * dtheta <= CACHED_UP_TO:
        return True
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return batch * dtheta * element_size * CACHED_FLOATS_PER_PARAMETER <= CUDA_CACHED_SHARE * free


#: Return the C heap's free pages to the OS after each guarded step (``release_freed_memory``). False: leave them to
#: the allocator, as before.
RELEASE_FREED_MEMORY = True
#: ... only where the heap holds at least this many free bytes (glibc's ``mallinfo2``: ``fordblks``). Pages handed
#: back are faulted in again when the next step reuses them, so a step that frees little keeps them: the quickstart
#: CNN at B = 32 leaves 28–35 MB free after each step and trimming them cost its step about 7% on an AVX-512 AMD EPYC
#: (docs/results.md, "Weights used several times, … and costs that grew on a faster CPU"); a ResNet-18-GN step at
#: B = 8 leaves 340–400 MB.
RELEASE_FROM_BYTES = 2 ** 26
_heap: list = []  # (glibc's malloc_trim, its mallinfo2 or None), or (None, None) where there is none (looked up once)


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33 and later): the heap's sizes in bytes."""
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def release_freed_memory() -> None:
    """Hand the free pages of the C heap back to the OS (glibc's ``malloc_trim(0)``; nothing elsewhere) where it holds
    at least RELEASE_FROM_BYTES free (every time where glibc cannot say: before 2.33). A guarded step frees gigabytes
    of temporaries of many sizes, which glibc otherwise keeps for later allocations: on a trained ResNet-18-GN round
    at B = 8 (one CPU thread) the process held 1.22–1.23 GB between steps without it and 1.08–1.10 GB with it, the
    same 1.85 GB peak either way (docs/results.md, "One sample at a time with plain autograd"). CUDA memory is the
    caching allocator's."""
    if not RELEASE_FREED_MEMORY:
        return
    if not _heap:
        _heap.extend(_glibc_heap())
    trim, info = _heap
    if trim is not None and (info is None or info().fordblks >= RELEASE_FROM_BYTES):
        trim(0)


def _glibc_heap() -> tuple:
    """(malloc_trim, mallinfo2) from glibc; mallinfo2 None before glibc 2.33, both None off glibc (musl, …)."""
    if not sys.platform.startswith("linux"):
        return None, None
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None, None
    info = getattr(libc, "mallinfo2", None)
    if info is not None:
        info.restype, info.argtypes = _MallInfo2, []
    return trim, info
