"""Run several engine requests for one HTTP request and merge their outputs, with reliable cleanup.

A completions request with a list of prompts becomes one engine request per prompt; they run
concurrently. Whatever ends the HTTP request early (client disconnect, cancelled task, error in one of
the prompts), every engine request that has not finished is aborted, which frees its cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from nibble.engine.async_engine import AsyncEngine
from nibble.engine.request import RequestOutput
from nibble.engine.sampling_params import SamplingParams
from nibble.models.multimodal import ImageInputs, VideoInputs


@dataclass
class EngineJob:
    """One engine request: its id, prompt (text or token ids), sampling parameters, images and videos
    (preprocessed, the prompt's placeholders expanded)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    images: ImageInputs | None = None
    videos: VideoInputs | None = None


# Called once per engine request when it ends: (index, last output or None, finish reason, end time).
FinishCallback = Callable[[int, RequestOutput | None, str, float], None]


async def _next(gen: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


class EngineStreams:
    """Engine requests for the jobs, started by `start()` and read with `async for index, output in ...`.

    `start()` returns once every request has produced its first output, so admission errors (bad input,
    overload) surface before a response is committed. Call `close()` when done; it is idempotent and also
    runs when iteration ends or is cancelled.
    """

    def __init__(self, engine: AsyncEngine, jobs: list[EngineJob], on_finish: FinishCallback,
                 background: set[asyncio.Task[None]]) -> None:
        """`background` holds cleanup tasks so they are not garbage-collected before they finish."""
        self._engine = engine
        self._jobs = jobs
        self._gens = [engine.generate(j.prompt, j.params, j.request_id, images=j.images, videos=j.videos) for j in jobs]
        self._on_finish = on_finish
        self._background = background
        self._pending: dict[asyncio.Future[RequestOutput | None], int] = {}
        self._first: list[RequestOutput | None] = []
        self.last: list[RequestOutput | None] = [None] * len(jobs)
        self._ended = [False] * len(jobs)
        self._closed = False

    def __len__(self) -> int:
        return len(self._jobs)

    async def start(self) -> None:
        """Submit every job and wait for each one's first output; raises the first admission error."""
        tasks = [asyncio.ensure_future(_next(g)) for g in self._gens]
        self._pending = {t: i for i, t in enumerate(tasks)}
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task, i in self._pending.items():
                if task.done() and not task.cancelled() and task.exception() is None:
                    self.last[i] = task.result()
            self.close()
            raise
        self._pending = {}
        self._first = [t.result() for t in tasks]

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            for i, out in enumerate(self._first):
                if out is None:
                    self._end(i, "abort")
                    continue
                self._observe(i, out)
                yield i, out
                if not out.finished:
                    self._pending[asyncio.ensure_future(_next(self._gens[i]))] = i
            self._first = []
            while self._pending:
                done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
                # Index order keeps the merged stream deterministic when several are ready at once.
                for task in sorted(done, key=lambda t: self._pending[t]):
                    i = self._pending.pop(task)
                    out = task.result()
                    if out is None:
                        self._end(i, "abort")
                        continue
                    self._observe(i, out)
                    yield i, out
                    if not out.finished:
                        self._pending[asyncio.ensure_future(_next(self._gens[i]))] = i
        finally:
            self.close()

    async def drain(self) -> list[RequestOutput]:
        """Read every stream to its end; the final output of each job, in job order."""
        final: dict[int, RequestOutput] = {}
        async for i, out in self:
            final[i] = out
        return [final[i] for i in range(len(self))]

    def _observe(self, i: int, out: RequestOutput) -> None:
        self.last[i] = out
        if out.finished:
            self._end(i, out.outputs[0].finish_reason or "stop")

    def _end(self, i: int, reason: str) -> None:
        if not self._ended[i]:
            self._ended[i] = True
            self._on_finish(i, self.last[i], reason, time.monotonic())

    def close(self) -> None:
        """Abort the unfinished requests and release their generators (in a background task)."""
        if self._closed:
            return
        self._closed = True
        pending = list(self._pending)
        self._pending = {}
        for task in pending:
            task.cancel()
        unfinished = [i for i in range(len(self._jobs)) if not self._ended[i]]
        for i in unfinished:
            if self.last[i] is None:
                self._ended[i] = True  # never admitted (or no output yet): not an engine request to report
            else:
                self._end(i, "abort")
        # An abort queued after the engine saw the add is always honoured, even if the generator never got
        # as far as registering the request; aborting an unknown or finished id is a no-op.
        for i in unfinished:
            self._engine.abort(self._jobs[i].request_id)
        gens = self._gens

        async def release() -> None:
            await asyncio.gather(*pending, return_exceptions=True)
            for gen in gens:
                with contextlib.suppress(Exception):
                    await gen.aclose()  # type: ignore[attr-defined]

        try:
            task = asyncio.get_running_loop().create_task(release())
        except RuntimeError:
            return  # no running loop (interpreter shutdown): the engine aborts above are enough
        self._background.add(task)
        task.add_done_callback(self._background.discard)
