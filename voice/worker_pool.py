"""A pool of recogniser worker processes: the embedded recognisers' model,
loaded once per process, shared by every session.

An embedded recogniser holds Python's GIL while it loads and while it
decodes (pocketsphinx up to hundreds of ms at an utterance's end, Whisper
for its whole decode), which in the server's process would freeze the
event loop that paces every session's audio. So each model lives in a
worker process of its own (``spawn``: an asyncio process is never forked),
and only small module-level functions of the recogniser's worker module run
there (:mod:`voice.pocketsphinx_worker`, :mod:`voice.whisper_worker`).

A :class:`Worker` serves one utterance at a time, its calls in order. The
:class:`WorkerPool` hands workers out (:meth:`WorkerPool.acquire`: a free
one, a new one while the pool is under its size, else the next one
released) and takes them back (:meth:`WorkerPool.release`); a worker that
died or failed to load is replaced, so one crash never shrinks the pool.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from voice.recognition import SttError

log = logging.getLogger(__name__)


class Worker:
    """One worker process holding one loaded model.

    Args:
        initializer / initargs: what loads the model in the new process
            (a module-level function of a worker module).
        ping: a module-level function of the worker module that returns
            once the model is loaded (:attr:`loaded` awaits it).
    """

    def __init__(self, initializer: Callable[..., None], initargs: tuple[Any, ...], ping: Callable[[], Any]) -> None:
        self.executor = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),  # never fork an asyncio process
            initializer=initializer,
            initargs=initargs,
        )
        #: why it can no longer be used (it died, or its model did not load)
        self.broken: BaseException | None = None
        #: done once the model is loaded (its exception if it did not)
        self.loaded = self.submit(ping)
        self.loaded.add_done_callback(self._note)

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run ``fn(*args)`` in the worker, after the calls submitted before.

        Returns:
            Its result as a future; a worker that is gone gives a future
            failed with :class:`voice.recognition.SttError`.
        """
        try:
            return asyncio.wrap_future(self.executor.submit(fn, *args))
        except (BrokenProcessPool, RuntimeError) as exc:
            self.broken = exc
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            fut.set_exception(SttError(f"speech worker is gone: {exc}"))
            return fut

    def _note(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.broken = exc

    def shutdown(self) -> None:
        """Stop the process after the calls already queued (blocking: run it in a thread)."""
        self.executor.shutdown(wait=True, cancel_futures=True)


class WorkerPool:
    """At most ``size`` workers made by ``make``, handed out one utterance at a time.

    Args:
        size: workers at most (each is a process holding the model).
        make: makes one worker (it starts loading at once).
    """

    def __init__(self, size: int, make: Callable[[], Worker]) -> None:
        self.size = size
        self._make = make
        self._all: list[Worker] = []
        self._free: asyncio.Queue[Worker] | None = None
        self.closed = False
        self.started = False

    def __len__(self) -> int:
        """Workers loaded or loading now."""
        return len(self._all)

    async def start(self) -> None:
        """Make every worker now and wait for their models, so a model that
        cannot load shows at startup and no utterance waits for a load.
        Idempotent.

        Raises:
            RuntimeError: a model failed to load (the first error, chained).
        """
        if self.started:
            return
        while len(self._all) < self.size:
            worker = self._make()
            self._all.append(worker)
            self._queue().put_nowait(worker)
        results = await asyncio.gather(*(w.loaded for w in self._all), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RuntimeError(f"speech model failed to load: {errors[0]}") from errors[0]
        self.started = True

    def acquire_nowait(self) -> Worker | None:
        """A free worker, or a new one while the pool is under its size;
        None if all are busy."""
        free = self._queue()
        if not free.empty():
            return free.get_nowait()
        if len(self._all) < self.size:
            worker = self._make()
            self._all.append(worker)
            return worker
        return None

    async def acquire(self) -> Worker:
        """A worker for one utterance: at once if one is free, else the next
        one released. A cancelled waiter never loses a worker (nothing
        suspends between the queue's get and the return).

        Raises:
            RuntimeError: the pool is closed.
        """
        if self.closed:
            raise RuntimeError("STT is closed")
        worker = self.acquire_nowait()
        if worker is not None:
            return worker
        return await self._queue().get()

    def release(self, worker: Worker) -> None:
        """Take ``worker`` back after its utterance; a broken one is shut
        down and replaced (once the pool was started)."""
        if self.closed:
            return
        if worker.broken is not None:
            log.warning("speech worker failed (%s); replacing it", worker.broken)
            self._all.remove(worker)
            asyncio.get_running_loop().run_in_executor(None, worker.shutdown)
            if len(self._all) < self.size and self.started:
                fresh = self._make()
                self._all.append(fresh)
                self._queue().put_nowait(fresh)
            return
        self._queue().put_nowait(worker)

    async def aclose(self) -> None:
        """Stop every worker process, after the calls already queued. Idempotent."""
        if self.closed:
            return
        self.closed = True
        loop = asyncio.get_running_loop()
        for worker in self._all:
            await loop.run_in_executor(None, worker.shutdown)
        self._all.clear()

    def _queue(self) -> asyncio.Queue[Worker]:
        if self._free is None:
            self._free = asyncio.Queue()
        return self._free
