"""The engine on its own thread, for the server: a thread-safe command queue in, per-request
outputs out to asyncio.

One thread owns the `LLMEngine` (it is single-threaded by design). Every request in flight is in
the engine's scheduler, so each `step()` serves all of them at once: that is where batching
happens, and a streamed block's transfer is paid once per step for everyone. asyncio code never
touches the engine; it submits and aborts through the queue, and outputs come back through
`loop.call_soon_threadsafe` into the submitting request's `RequestHandle`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from .args import EngineArgs
from .llm_engine import LLMEngine, RequestOutput
from .sampling_params import SamplingParams
from .telemetry import EngineTelemetry

log = logging.getLogger("layerstream")


class EngineNotReadyError(RuntimeError):
    """The model is still loading (or failed to load); the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class EngineStepError(RuntimeError):
    """A step failed (device error, bug); every request in that step fails with this, the engine
    keeps serving new ones."""


class EngineObserver(Protocol):
    """What the engine thread reports (the server turns it into Prometheus metrics). Called on the
    engine thread, so implementations must be cheap and thread-safe. on_step gets the telemetry
    snapshot taken right after the step. on_finished's reason is the request's finish_reason
    ("stop", "length"), "abort" when cancelled, or "error" when an engine step raised while it was
    in flight."""

    def on_queue(self, engine: LLMEngine) -> None: ...

    def on_step(self, telemetry: EngineTelemetry) -> None: ...

    def on_token(self, first: bool, seconds: float) -> None: ...

    def on_finished(self, reason: str, prompt_tokens: int) -> None: ...


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class _Tracked:
    handle: "RequestHandle"
    prompt_tokens: int
    last: float | None = None  # time of the previous token


class RequestHandle:
    """The asyncio side of one HTTP request: one or more engine requests (n > 1, several prompts)
    whose outputs arrive, interleaved, through one asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine_loop: "EngineLoop", requests: list[EngineRequest]):
        self._loop = loop
        self._engine_loop = engine_loop
        self.requests = requests
        self.accepted: asyncio.Future = loop.create_future()  # None, or the exception add_request raised
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished = {r.request_id for r in requests}
        self.arrival = time.perf_counter()  # time to first token counts the wait for the engine thread too

    # -- called on the engine thread --------------------------------------------------------------
    def _post(self, item) -> None:
        self._call(self._queue.put_nowait, item)

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop is gone (server shutting down): nobody is waiting any more

    def _resolve(self, error: BaseException | None) -> None:
        def set_result():
            if not self.accepted.done():
                if error is None:
                    self.accepted.set_result(None)
                else:
                    self.accepted.set_exception(error)
        self._call(set_result)

    # -- called on the event loop -----------------------------------------------------------------
    async def outputs(self):
        """Yield RequestOutputs of all this handle's requests until every one has finished; an
        engine failure is raised here."""
        await self.accepted
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._unfinished.clear()
                raise item
            if item.finished:
                self._unfinished.discard(item.request_id)
            yield item

    def abort(self) -> None:
        """Cancel whatever has not finished (client gone); the engine frees the slots before its
        next step."""
        if self._unfinished:
            self._engine_loop.abort([r for r in self._unfinished])
            self._unfinished.clear()


class EngineLoop:
    """Loads the model and runs the engine on a background thread.

    state: "loading" -> "ready", or "failed" (error in `error`); "stopped" after shutdown()."""

    def __init__(self, args: EngineArgs, observer: EngineObserver | None = None,
                 engine_factory: Callable[[EngineArgs], LLMEngine] = LLMEngine,
                 on_failed: Callable[[BaseException], None] | None = None):
        self.args = args
        self.observer = observer
        self._factory = engine_factory
        self._on_failed = on_failed
        self.state = "loading"
        self.error: BaseException | None = None
        self.engine: LLMEngine | None = None
        self._telemetry: EngineTelemetry | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._thread = threading.Thread(target=self._run, name="layerstream-engine", daemon=True)

    # -- public, any thread -----------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def tokenizer(self):
        self._check_ready()
        return self.engine.tokenizer

    def telemetry(self) -> EngineTelemetry | None:
        """The engine's latest telemetry snapshot (taken after each step on the engine thread, so
        reading it never races a step); None until the model has loaded."""
        return self._telemetry

    @property
    def max_model_len(self) -> int:
        self._check_ready()
        return self.engine.max_model_len

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (text or ids, checked against the vocabulary). Safe off the engine
        thread: it only reads the tokenizer and the config."""
        self._check_ready()
        return self.engine.encode(prompt)

    @property
    def vocab_size(self) -> int:
        self._check_ready()
        return self.engine.model.cfg.vocab_size

    def check_structured(self, so) -> None:
        """Compile a structured-output constraint (cached for the engine), raising InvalidParameter
        if it is not valid. Safe off the engine thread; call it there, since a large schema takes a
        while to compile and the engine thread would otherwise stall every request."""
        self._check_ready()
        self.engine.grammar.check(so)

    def submit(self, requests: list[EngineRequest]) -> RequestHandle:
        """Queue requests for the engine; call from the event loop. Await `handle.accepted` (or
        iterate `handle.outputs()`) to learn whether the engine took them: QueueFullError,
        PromptTooLongError and InvalidParameter surface there, and none of the requests runs."""
        self._check_ready()
        handle = RequestHandle(asyncio.get_running_loop(), self, requests)
        self._commands.put(("add", handle))
        return handle

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(("abort", list(request_ids)))

    def wait_ready(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while self.state == "loading" and (end is None or time.monotonic() < end):
            time.sleep(0.05)
        return self.state == "ready"

    def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _check_ready(self) -> None:
        if self.state == "loading":
            raise EngineNotReadyError("the model is still loading")
        if self.state != "ready":
            raise EngineDeadError(f"the engine is not running ({self.state}): {self.error}")

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._factory(self.args)
        except BaseException as e:  # noqa: BLE001 - any load failure is reported, not raised
            log.error("loading the model failed: %s", e)
            self.error, self.state = e, "failed"
            if self._on_failed:
                self._on_failed(e)
            return
        self._telemetry = self.engine.telemetry()
        self.state = "ready"
        log.info("engine ready: max_model_len %d, max_num_seqs %d", self.engine.max_model_len,
                 self.engine.plan.max_num_seqs)
        try:
            while self._drain(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
        finally:
            self.state = "stopped"
            for t in list(self._tracked.values()):
                t.handle._post(EngineDeadError("the engine stopped"))
            self._tracked.clear()
            self.engine.close()

    def _drain(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when idle); False once asked to stop."""
        while True:
            try:
                kind, arg = self._commands.get(block=block)
            except queue.Empty:  # only a non-blocking get gets here
                if self.observer:
                    self.observer.on_queue(self.engine)
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                for rid in arg:
                    t = self._tracked.pop(rid, None)
                    if t is not None and self.engine.abort(rid):
                        log.info("request %s cancelled, its slot is free", rid)
                        if self.observer:
                            self.observer.on_finished("abort", t.prompt_tokens)

    def _add(self, handle: RequestHandle) -> None:
        added = []
        try:
            for r in handle.requests:
                self.engine.add_request(r.prompt_ids, r.params, r.request_id)
                added.append(r)
        except Exception as e:  # noqa: BLE001 - delivered to the request, which maps it to a status
            for r in added:
                self.engine.abort(r.request_id)
            handle._resolve(e)
            return
        for r in added:
            self._tracked[r.request_id] = _Tracked(handle, len(r.prompt_ids))
        handle._resolve(None)

    def _step(self) -> None:
        try:
            outputs: list[RequestOutput] = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests in this step, keep serving
            log.exception("engine step failed; failing %d requests", len(self._tracked))
            error = EngineStepError(f"the engine failed during a step: {type(e).__name__}: {e}")
            failed = list(self._tracked.items())
            self._tracked.clear()
            for rid, t in failed:  # counted before any client hears of it, as finished requests are
                self.engine.abort(rid)
                if self.observer:
                    self.observer.on_finished("error", t.prompt_tokens)
            for _, t in failed:
                t.handle._post(error)
            return
        now = time.perf_counter()
        self._telemetry = self.engine.telemetry()
        obs = self.observer
        for out in outputs:
            t = self._tracked.get(out.request_id)
            if t is None:
                continue  # aborted while the step ran
            if obs:
                obs.on_token(t.last is None, now - (t.last if t.last is not None else t.handle.arrival))
            t.last = now
            if out.finished:
                del self._tracked[out.request_id]
                if obs:
                    obs.on_finished(out.finish_reason or "stop", t.prompt_tokens)
            t.handle._post(out)
        if obs:
            obs.on_step(self._telemetry)
            obs.on_queue(self.engine)
