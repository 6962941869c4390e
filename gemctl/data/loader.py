"""Feeding the step: background production, pinned memory, device prefetch, data-wait timing.

``num_workers == 0``: one background thread runs the source's iterator (generation releases the
GIL inside torch ops, so it overlaps the step). ``num_workers > 0``: a torch DataLoader whose
workers make batches by index (``source.train_batch(k)``), in order, with pinned memory. Either
way, batches are validated where they are produced (off the critical path), copied to the device
asynchronously, and the time the trainer spends blocked waiting for one is reported per step.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

import torch

from gemctl.data.batch import JaggedBatch, validate_batch


class _IndexedBatches(torch.utils.data.Dataset):
    def __init__(self, source, validate: bool):
        self.source, self.validate = source, validate

    def __len__(self):  # a very long stream; the trainer stops it
        return 2**62

    def __getitem__(self, step: int) -> JaggedBatch:
        batch = self.source.train_batch(step)
        if self.validate:
            validate_batch(batch, self.source.spec)
        return batch


class _StepSampler(torch.utils.data.Sampler):
    def __init__(self, start: int):
        self.start = start

    def __iter__(self):
        step = self.start
        while True:
            yield step
            step += 1


def _identity(x):
    return x


class _ThreadProducer:
    """Runs an iterator in a daemon thread, keeping up to ``depth`` items ready."""

    _END = object()

    def __init__(self, it: Iterator, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(it,), daemon=True)
        self._thread.start()

    def _run(self, it):
        try:
            for item in it:
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # surfaced in the consumer
            self._error = exc
        while not self._stop.is_set():
            try:
                self._queue.put(self._END, timeout=0.1)
                return
            except queue.Full:
                continue

    def __next__(self):
        item = self._queue.get()
        if item is self._END:
            if self._error is not None:
                raise self._error
            raise StopIteration
        return item

    def close(self):
        """Stop and join the thread. A daemon thread still inside a torch op when the interpreter
        exits aborts the process ("terminate called without an active exception"; seen about
        one torchrun exit in five before this join)."""
        self._stop.set()
        self._thread.join(timeout=60)


class TrainLoader:
    """Iterator of device batches; ``last_wait_s`` is how long the last ``next`` blocked."""

    def __init__(self, source, data_cfg, device: torch.device, start_step: int = 0):
        self.device = device
        self.pin = device.type == "cuda"
        self.last_wait_s = 0.0
        self.last_sample_ids: torch.Tensor | None = None  # host copy of the last batch's ids
        validate = bool(data_cfg.validate)
        if data_cfg.num_workers > 0 and hasattr(source, "train_batch"):
            loader = torch.utils.data.DataLoader(
                _IndexedBatches(source, validate),
                batch_size=None,
                sampler=_StepSampler(start_step),
                num_workers=data_cfg.num_workers,
                prefetch_factor=max(1, data_cfg.prefetch),
                pin_memory=self.pin,
                collate_fn=_identity,
                persistent_workers=False,
            )
            self._it = iter(loader)
            self._producer = None
        else:
            spec = source.spec

            def produce():
                for batch in source.train_batches(start_step):
                    if validate:
                        validate_batch(batch, spec)
                    yield batch.pin_memory() if self.pin else batch

            self._producer = _ThreadProducer(produce(), depth=data_cfg.prefetch)
            self._it = self._producer

    def __iter__(self):
        return self

    def __next__(self) -> JaggedBatch:
        with torch.profiler.record_function("gemctl.data"):
            t0 = time.perf_counter()
            batch = next(self._it)
            self.last_wait_s = time.perf_counter() - t0
            self.last_sample_ids = batch.sample_ids
            # the host-to-device copy is data time too (asynchronous from pinned memory)
            return batch.to(self.device, non_blocking=True) if self.device.type != "cpu" else batch

    def close(self):
        if self._producer is not None:
            self._producer.close()
        else:
            # Stop the worker processes now: after an error the iterator stays referenced by the
            # traceback, and workers left to interpreter exit can stall it for seconds.
            shutdown = getattr(self._it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()


def eval_batches(source, data_cfg, device: torch.device, limit: int = 0) -> Iterator[JaggedBatch]:
    for i, batch in enumerate(source.eval_batches()):
        if limit and i >= limit:
            return
        if data_cfg.validate:
            validate_batch(batch, source.spec)
        yield batch.to(device) if device.type != "cpu" else batch
