"""AsyncEngine: the LLMEngine driven by a background thread, with an asyncio interface for the server.

The engine thread owns the LLMEngine. Requests and aborts reach it through a command queue that it drains
between steps; outputs go back to each request's asyncio queue with call_soon_threadsafe. A request whose
consumer goes away (client disconnect, cancelled task) is aborted, which frees its blocks and state slot.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import EngineOverloaded, LLMEngine
from nibble.engine.parallel import WorkerError
from nibble.engine.request import RequestOutput
from nibble.engine.sampling_params import SamplingParams
from nibble.models.multimodal import ImageInputs, VideoInputs

logger = logging.getLogger("nibble.engine")


class EngineDead(RuntimeError):
    """The engine thread stopped (fatal error or shutdown)."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]] = {}
        self._stop = False
        self.dead_reason: str | None = None
        # set (under _closing) once the engine thread has taken its last command: a command submitted after
        # that would wait for an answer forever, so _submit refuses it instead
        self._closing = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="nibble-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    @property
    def is_alive(self) -> bool:
        """Whether the engine thread is running and accepts requests."""
        return self.dead_reason is None and self._thread.is_alive()

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       images: ImageInputs | None = None, videos: VideoInputs | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step until it finishes. Raises RequestError/
        SamplingParamsError (bad input), EngineOverloaded or EngineDead before the first output. images,
        videos: the prompt's preprocessed images and videos (`LLMEngine.prepare_media`), its placeholders
        already expanded."""
        if not self.is_alive:
            raise EngineDead(self.dead_reason or "the engine thread has stopped")
        request_id = request_id or uuid.uuid4().hex
        waiting = len(self.engine.scheduler.waiting)
        if waiting >= self.engine.config.max_waiting_requests:
            raise EngineOverloaded(f"the server is overloaded: {waiting} requests are waiting; retry later")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        added: Future[None] = Future()
        self._streams[request_id] = (loop, stream)
        try:
            self._submit(("add", request_id, prompt, params, added, images, videos))
        except EngineDead:
            self._streams.pop(request_id, None)
            raise
        try:
            await asyncio.wrap_future(added)
        except BaseException:
            # Cancelled while the engine thread was adding it: the request may be in the engine already.
            self._streams.pop(request_id, None)
            self.abort(request_id)
            raise
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    async def reset_prefix_cache(self) -> bool:
        """`LLMEngine.reset_prefix_cache` on the engine thread (between steps): whether the cache was dropped
        (False while requests run). Raises EngineDead when the engine thread has stopped."""
        if not self.is_alive:
            raise EngineDead(self.dead_reason or "the engine thread has stopped")
        done: Future[bool] = Future()
        self._submit(("reset_prefix_cache", done))
        return await asyncio.wrap_future(done)

    def _submit(self, cmd: tuple[Any, ...]) -> None:
        """Queue a command whose caller waits for the engine thread's answer; EngineDead once the thread has
        taken its last command."""
        with self._closing:
            if self._closed:
                raise EngineDead(self.dead_reason or "the engine thread has stopped")
            self._commands.put(cmd)
        self._wakeup.set()

    def shutdown(self) -> None:
        self.dead_reason = self.dead_reason or "the engine was shut down"
        self._stop = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    def _deliver(self, output: RequestOutput | BaseException, request_id: str) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        loop, stream = entry
        try:
            loop.call_soon_threadsafe(stream.put_nowait, output)
        except RuntimeError:
            pass  # the consumer's loop is closed: nobody is listening any more

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, request_id, prompt, params, added, images, videos = cmd
                if not added.set_running_or_notify_cancel():
                    continue  # the caller went away before the engine saw the request
                try:
                    self.engine.add_request(request_id, prompt, params, images=images, videos=videos)
                except BaseException as e:  # handed to the caller, who maps it to HTTP
                    added.set_exception(e)
                else:
                    added.set_result(None)
            elif cmd[0] == "abort":
                out = self.engine.abort_request(cmd[1])
                if out is not None:
                    self._deliver(out, cmd[1])
            elif cmd[0] == "reset_prefix_cache" and cmd[1].set_running_or_notify_cancel():
                try:
                    cmd[1].set_result(self.engine.reset_prefix_cache())
                except BaseException as e:
                    cmd[1].set_exception(e)

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:
            self.dead_reason = f"the engine thread stopped: {type(e).__name__}: {e}"
            logger.exception("engine thread stopped")
            self._fail_all(EngineDead(self.dead_reason))
        self.dead_reason = self.dead_reason or "the engine was shut down"
        # Requests handed over after the last drain would otherwise wait forever for their admission.
        with self._closing:
            self._closed = True
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add" and cmd[4].set_running_or_notify_cancel():
                cmd[4].set_exception(EngineDead(self.dead_reason))
            elif cmd[0] == "reset_prefix_cache" and cmd[1].set_running_or_notify_cancel():
                cmd[1].set_exception(EngineDead(self.dead_reason))

    def _run(self) -> None:
        while not self._stop:
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except WorkerError:
                raise  # the tensor-parallel ranks are gone: no later step can run (_loop ends the engine)
            except Exception as e:  # fail the requests, keep serving
                logger.exception("engine step failed; failing the requests in that step")
                self._fail_all(RuntimeError(f"engine error: {type(e).__name__}: {e}"))
                continue
            for out in outputs:
                self._deliver(out, out.request_id)
        self._fail_all(EngineDead("the engine was shut down"))

    def _fail_all(self, error: BaseException) -> None:
        for req in list(self.engine.requests.values()):
            self.engine.abort_request(req.request_id)
            self._deliver(error, req.request_id)
