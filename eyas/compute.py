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
from typing import Any, Callable

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
