"""Images decoded beside the loop, a bounded number ahead of the scheduler's need.

A prompt's image (`ImageSpan.pixels`) may be a `LazyPixels`: the encoded bytes and how
to decode and resize them. Token counts and content hashes come from the bytes and the
header alone, so a request queues without its pixels. Before each schedule the
`ImagePrefetcher` starts decoding the images of the waiting requests, in queue order,
in a small thread pool, while at most `max_images_ahead` decoded images are held; the
scheduler is shown only the head of the queue whose images are decoded, so a step never
waits on an image it has not started. Once the tower has encoded an image its pixels are
dropped (the encoded embedding is what the runner keeps; should it be evicted and
needed again - a preempted prompt recomputed - the bytes are decoded again).

An image that fails only at decode (a truncated file whose header was whole) makes its
request an error output; the other requests are answered.

Decoded images held at once: at most max_images_ahead, plus those one step needs beyond
them (a step's images are decoded before its tower runs), plus those whose request
finished before its prefill - they go with the request.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tokenmill.engine.types.config import EngineConfig

# The decode pool's thread names start with this (tools find the threads by it).
THREAD_PREFIX = "tokenmill-image"


class LazyPixels:
    """An image's pixels as the tower's processor resizes them, decoded on demand.

    `load` decodes and resizes (raising the loader's ImageError for a bad image); it is
    called again should the pixels be needed after `drop`.
    """

    def __init__(self, load: Callable[[], torch.Tensor]) -> None:
        self._load = load
        self._future: Future | None = None
        self._lock = threading.Lock()
        self.encoded = False  # the tower has encoded it: no need to decode ahead again

    @property
    def started(self) -> bool:
        return self._future is not None

    def start(self, pool: ThreadPoolExecutor) -> None:
        with self._lock:
            if self._future is None:
                self._future = pool.submit(self._load)

    def done(self) -> bool:
        future = self._future
        return future is not None and future.done()

    def error(self) -> BaseException | None:
        """What decoding raised (waits for it to finish; None: it decoded)."""
        future = self._future
        return None if future is None else future.exception()

    def get(self) -> torch.Tensor:
        """The pixels: those decoded ahead, or decoded now."""
        with self._lock:
            if self._future is None:
                future: Future = Future()
                try:
                    future.set_result(self._load())
                except Exception as exc:  # kept, as a pool's future keeps it
                    future.set_exception(exc)
                self._future = future
            future = self._future
        return future.result()

    def drop(self) -> None:
        """Forget the decoded pixels (the tower has encoded them)."""
        with self._lock:
            self._future = None
            self.encoded = True


def release_pixels(images: Iterable) -> None:
    """Drop the decoded pixels of these ImageSpans, once the tower has encoded them."""
    for image in images:
        if isinstance(image.pixels, LazyPixels):
            image.pixels.drop()


class ImagePrefetcher:
    """Decodes waiting requests' images ahead, in queue order, in a thread pool."""

    def __init__(
        self,
        *,
        image_decode_threads: int = EngineConfig.image_decode_threads,
        max_images_ahead: int = EngineConfig.max_images_ahead,
    ) -> None:
        if image_decode_threads < 1 or max_images_ahead < 1:
            raise ValueError("an image prefetcher needs >= 1 thread and >= 1 image ahead")
        self.max_images_ahead = max_images_ahead
        self._pool = ThreadPoolExecutor(image_decode_threads, thread_name_prefix=THREAD_PREFIX)
        self._held: list[LazyPixels] = []

    def prepare(self, waiting: Iterable, has_running: bool) -> tuple[list, list, list]:
        """Split the waiting sequences (in order) into (those the scheduler may admit now:
        the head whose images are decoded, those held back, those whose image failed to
        decode as (seq, error message)). Starts decodes up to the bound."""
        self._held = [p for p in self._held if p.started]
        waiting = list(waiting)
        for index, seq in enumerate(waiting):
            for pixels in _pending(seq):
                if pixels.started:
                    continue
                if len(self._held) >= self.max_images_ahead and index > 0:
                    break
                pixels.start(self._pool)
                self._held.append(pixels)
        ready, held, failed = [], deque(), []
        for index, seq in enumerate(waiting):
            pending = _pending(seq)
            blocking = index == 0 and not has_running and not ready
            if held or not all(p.done() or (blocking and p.started) for p in pending):
                held.append(seq)
                continue
            error = next((e for e in (p.error() for p in pending) if e is not None), None)
            if error is not None:
                failed.append((seq, str(error)))
            else:
                ready.append(seq)
        return ready, list(held), failed

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _pending(seq) -> list[LazyPixels]:
    """The lazy images of seq still to encode (those past its computed tokens)."""
    return [
        image.pixels
        for image in seq.images
        if isinstance(image.pixels, LazyPixels)
        and not image.pixels.encoded
        and image.end > seq.num_computed_tokens
    ]
