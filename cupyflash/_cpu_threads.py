"""The NumPy backend's threads: how many, the pool that runs its tasks, one BLAS thread each.

The backend splits a call into independent tasks (a block of query rows of one kv head in
the forward, a set of key blocks in the backward) and runs them on a pool of threads:
NumPy releases the GIL inside its matrix products and elementwise loops, so the threads
run on separate cores. Inside a task the products are small tiles, and a multithreaded
BLAS would split each of them across threads that then spin-wait for one another, which
gains nothing idle and costs seconds per call when another process holds a core. So for
the duration of a call BLAS is limited to one thread (through threadpoolctl, the only
way to change it once NumPy's BLAS is loaded) and the parallelism comes from the tasks.

The limit is process-wide while a call runs: a BLAS product that another thread of the
program runs at the same time also gets one thread. Nested and concurrent calls count
their entries, so the last one out restores the user's setting.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

__all__ = ["ENV_THREADS", "num_threads", "run"]

ENV_THREADS = "CUPYFLASH_NUM_THREADS"

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_blas = None          # the threadpoolctl controller, made on first use (it scans libraries)
_blas_limit = None    # the active limit, while _blas_users > 0
_blas_users = 0


def num_threads() -> int:
    """Threads a call uses: ``$CUPYFLASH_NUM_THREADS`` if set, else the CPUs this process
    may run on. Read at every call, so a program (or the benchmark) can change it."""
    value = os.environ.get(ENV_THREADS, "").strip()
    if value:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{ENV_THREADS} must be a positive integer, got {value!r}")
        return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _enter_one_blas_thread() -> None:
    global _blas, _blas_limit, _blas_users
    with _lock:
        if _blas_users == 0:
            if _blas is None:
                from threadpoolctl import ThreadpoolController
                _blas = ThreadpoolController()
            _blas_limit = _blas.limit(limits=1, user_api="blas")
        _blas_users += 1


def _leave_one_blas_thread() -> None:
    global _blas_limit, _blas_users
    with _lock:
        _blas_users -= 1
        if _blas_users == 0:
            _blas_limit.restore_original_limits()
            _blas_limit = None


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cupyflash")
            _pool_size = threads
        return _pool


def run(tasks: list, *, threads: int | None = None) -> None:
    """Run every callable of ``tasks`` once, on up to ``threads`` threads (default
    `num_threads`), with BLAS on one thread; returns when all are done.

    Threads take the next task as they finish one, in list order, so listing the longest
    first balances uneven tasks (causal query blocks) without knowing the machine's load.
    The first exception a task raises is raised here after the others have stopped.
    """
    threads = min(num_threads() if threads is None else threads, len(tasks))
    _enter_one_blas_thread()
    try:
        if threads <= 1:
            for task in tasks:
                task()
            return
        order = itertools.count()   # next() on it is atomic under the GIL
        failed = threading.Event()

        def worker():
            while not failed.is_set():
                i = next(order)
                if i >= len(tasks):
                    return
                try:
                    tasks[i]()
                except BaseException:
                    failed.set()
                    raise

        futures = [_executor(threads).submit(worker) for _ in range(threads)]
        wait(futures)   # all stopped before raising: none writes into the outputs after
        for future in futures:
            future.result()
    finally:
        _leave_one_blas_thread()
