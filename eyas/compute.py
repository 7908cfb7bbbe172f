"""The one thread of a process that runs torch compute.

Torch's CPU kernels run on OpenMP, and each thread that runs them gets a team of OpenMP threads of
its own. Once a process holds more OpenMP threads than it has cores, libgomp throttles its
spin-waits, and every parallel kernel then pays a sleep and a wake-up. On the project's 2-core
machine, with 2 torch threads, a batched 12-request forward took 48-50 ms on the round loop's
thread once the main thread had loaded the model, against 30-34 ms on the main thread and 37 ms
when one thread did both.

So the engines of a process are driven from one thread: :func:`run` calls a function on the
process's compute thread and returns its result (or raises its exception). A call made on the
compute thread itself runs inline. ``WorkerCalls`` sends every local worker call here, and the
benches load and measure here too.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

_jobs: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None
_lock = threading.Lock()


def _serve() -> None:
    while True:
        fn, args, kwargs, future = _jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            future.set_exception(err)


def compute_thread() -> threading.Thread:
    """The process's compute thread (started on first use; a daemon)."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name="eyas-compute", daemon=True)
            _thread.start()
        return _thread


def run(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` on the compute thread; inline when called there already."""
    thread = compute_thread()
    if threading.current_thread() is thread:
        return fn(*args, **kwargs)
    future: concurrent.futures.Future = concurrent.futures.Future()
    _jobs.put((fn, args, kwargs, future))
    return future.result()


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit


_keeping_freed_memory = False


def _mallopt(settings) -> bool:
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in settings)


def return_freed_memory() -> bool:
    """Let glibc hand every large freed block back to the kernel (a fixed 128 KB mmap threshold: by
    default the threshold rises to the largest block freed so far, up to 32 MB, and blocks under it
    come from a heap that freed memory fragments). A streamed load's transient copies then leave no
    residue: measured on a 1 B-parameter bf16 checkpoint, peak host memory 3.01 -> see
    docs/benchmarks.md. Nothing is changed in a process that asked to keep freed memory
    (:func:`keep_freed_memory`, training), or where the C library is not glibc (-> False)."""
    if _keeping_freed_memory:
        return False
    return _mallopt(((_M_MMAP_THRESHOLD, 128 * 1024),))


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed memory for reuse instead of handing it back to the kernel.

    By default glibc serves a large allocation (from 128 KB, rising with use) with a fresh ``mmap``
    and unmaps it on free, so every large temporary of a training step (a head-sized weight cast,
    a gradient, a ``[rows, vocabulary]`` block) is zero-filled page by page by the kernel again.
    Measured on the project's 2-core CPU: bf16 drafter training 491 -> 695 tok/s
    (``docs/benchmarks.md``). This serves allocations up to glibc's 32 MB ceiling from the heap and
    never trims it. -> False where the C library is not glibc (nothing is changed).

    The engines call it too (``TargetEngine``, ``DrafterEngine``: a process that serves rounds keeps its
    freed memory): a verify of 12 rows returns [12, 49152] logits, 2.4 MB, and glibc's dynamic threshold
    served such a block with a fresh mmap on some runs and from the heap on others; a fresh block's 577
    page faults cost ~0.9 ms here (~1.6 us a fault in this VM) beside ~18 us to write it once reused.
    A loaded model's transient copies are handed back before (the loader's :func:`return_freed_memory`)."""
    global _keeping_freed_memory
    _keeping_freed_memory = _mallopt(
        ((_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 1 << 30))
    )
    return _keeping_freed_memory


HUGE_PAGES_ENV = "EYAS_HUGE_PAGES"  # "0": weights stay where they were allocated (benches compare)
_HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def on_huge_pages(tensors: list) -> list:
    """Copies of ``tensors`` (CPU, contiguous) laid end to end in one anonymous mapping that asks the
    kernel for transparent huge pages (``MADV_HUGEPAGE``), each 4 KB-aligned, the mapping 2 MB-aligned.

    A decode streams every weight once: on 4 KB pages that is a TLB miss and a page walk every 4 KB (96 MB:
    ~24,000 a token), on 2 MB pages one every 2 MB. Measured on a 2-core Xeon
    (Sapphire-Rapids class), the gguf target's 30 layers' linears over one row: 2.28 -> 2.06 ms, rows
    2 / 4 / 8 1.00-1.09x faster (docs/benchmarks.md). The copies keep the mapping alive. -> ``tensors``
    themselves where huge pages cannot be had (``EYAS_HUGE_PAGES=0``, no ``MADV_HUGEPAGE``: not Linux,
    or transparent huge pages ``never``); the kernel may still back the mapping with 4 KB pages (then
    only the layout changed)."""
    import mmap
    import os

    import torch

    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if os.environ.get(HUGE_PAGES_ENV, "1") == "0" or advice is None or not tensors:
        return list(tensors)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors), "tensors: CPU and contiguous"
    spans = [(t.numel() * t.element_size() + 4095) // 4096 * 4096 for t in tensors]
    try:
        mapping = mmap.mmap(-1, sum(spans) + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(advice)
    except (OSError, ValueError):
        return list(tensors)
    arena = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
    offset = -arena.data_ptr() % _HUGE_PAGE
    out = []
    for t, span in zip(tensors, spans):
        nbytes = t.numel() * t.element_size()
        copy = arena[offset : offset + nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
        offset += span
    return out
