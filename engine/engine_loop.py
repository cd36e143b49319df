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
from .kernels.build import stop_builds
from .kernels.prepare import BuildProgress, prepare
from .failures import EngineUnhealthyError
from .llm_engine import LLMEngine
from .lora_serving import ServedAdapter
from .request import RequestOutput
from .sampling_params import SamplingParams
from .telemetry import EngineTelemetry

log = logging.getLogger("layerstream")


class EngineNotReadyError(RuntimeError):
    """The model is still loading (or failed to load); the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (its sampling, detokenizing, or a forward pass that
    failed again when it ran alone); the others in flight went on. Details are in the log."""


class ClientTooSlowError(RuntimeError):
    """The client stopped reading: MAX_UNREAD_OUTPUTS outputs waited for it, so its requests were
    cancelled rather than parked in server memory until they finish."""


# Outputs (one per token and sequence) a handle may hold unread before its requests are cancelled.
# A reading client holds a few; one whose socket is full holds everything the engine makes for it.
MAX_UNREAD_OUTPUTS = 1024


class ShuttingDownError(EngineDeadError):
    """The server is shutting down and the grace period for requests still running has ended."""


class EngineUnhealthyStop(EngineDeadError):
    """Sent to the requests in flight when the engine goes not-ready after a step failure."""


class EngineObserver(Protocol):
    """What the engine thread reports (the server turns it into Prometheus metrics). Called on the
    engine thread, so implementations must be cheap and thread-safe. on_step gets the telemetry
    snapshot taken right after the step. on_finished's reason is the request's finish_reason
    ("stop", "length"), "abort" when cancelled, or "error" when an engine step raised while it was
    in flight."""

    def on_queue(self, engine: LLMEngine) -> None: ...

    def on_step(self, telemetry: EngineTelemetry) -> None: ...

    def on_token(self, first: bool, seconds: float, count: int = 1) -> None:
        """count: tokens in this output (speculative decoding emits several per step)."""

    def on_finished(self, reason: str, prompt_tokens: int) -> None: ...

    def on_health(self, ready: bool, reason: str) -> None: ...


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    lora_name: str | None = None  # a served LoRA adapter; None: the base model


@dataclass
class _Failed:
    request_id: str
    error: BaseException


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
        self.max_unread = MAX_UNREAD_OUTPUTS
        self._overflowed = False
        self.arrival = time.perf_counter()  # time to first token counts the wait for the engine thread too

    # -- called on the engine thread --------------------------------------------------------------
    def _post(self, item) -> None:
        self._call(self._deliver, item)

    def _deliver(self, item) -> None:  # on the event loop
        if self._overflowed:
            return
        if isinstance(item, RequestOutput) and self._queue.qsize() >= self.max_unread:
            self._overflowed = True
            # Cancelled in the engine, but still unfinished here: outputs() reads what is queued,
            # then this error; later deliveries are dropped.
            self._engine_loop.abort(list(self._unfinished))
            self._queue.put_nowait(ClientTooSlowError(
                f"the client left {self.max_unread} outputs unread; its requests were cancelled"))
            return
        self._queue.put_nowait(item)

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
            if isinstance(item, _Failed):
                # One of this handle's requests failed: the others (n > 1) stay unfinished, so the
                # caller's abort() frees their slots.
                self._unfinished.discard(item.request_id)
                raise item.error
            if isinstance(item, BaseException):
                self._unfinished.clear()
                raise item
            if item.finished:
                self._unfinished.discard(item.request_id)
            yield item

    def abort(self) -> None:
        """Cancel whatever has not finished (client gone); the engine frees their KV blocks before its
        next step."""
        if self._unfinished:
            self._engine_loop.abort([r for r in self._unfinished])
            self._unfinished.clear()


class EngineLoop:
    """Loads the model and runs the engine on a background thread.

    state: "loading" -> "ready", or "failed" (the load failed); "ready" -> "unhealthy" when a step
    failure left the engine's state untrustworthy; "stopped" after shutdown(). `error` holds the
    exception, `reason` a short description safe to show clients (no paths, no internal text); while
    loading, which kernels are being built, if any."""

    def __init__(self, args: EngineArgs, observer: EngineObserver | None = None,
                 engine_factory: Callable[[EngineArgs], LLMEngine] = LLMEngine,
                 on_failed: Callable[[BaseException], None] | None = None):
        self.args = args
        self.observer = observer
        self._factory = engine_factory
        self._on_failed = on_failed
        self.state = "loading"
        self.error: BaseException | None = None
        self.reason = ""
        self.draining = False  # shutting down: admit nothing new
        self._stopping = False  # shutdown() was called: a load not started yet never starts
        self._deadline: float | None = None  # monotonic time after which requests in flight are failed
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

    @property
    def capacity(self) -> int:
        """Engine requests (sequences) the engine holds at most: running + waiting."""
        self._check_ready()
        return self.engine.scheduler.capacity

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
        if self.draining:  # only admission stops: requests in flight still read the tokenizer
            raise EngineNotReadyError("the server is shutting down")
        handle = RequestHandle(asyncio.get_running_loop(), self, requests)
        self._commands.put(("add", handle))
        return handle

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(("abort", list(request_ids)))

    def lora_adapters(self) -> tuple[ServedAdapter, ...]:
        """The LoRA adapters served now (from the telemetry snapshot, refreshed by every load and unload)."""
        telemetry = self._telemetry
        return telemetry.lora_adapters if telemetry is not None else ()

    async def load_lora(self, name: str, folder: str) -> ServedAdapter:
        """Serve the adapter in `folder` as `name`: read and checked on a worker thread (LoRAAdapterError),
        then added on the engine thread between two steps."""
        self._check_ready()
        weights = await asyncio.to_thread(self.engine.read_adapter, folder)
        return await self._on_engine(lambda engine: engine.add_lora(name, weights))

    async def unload_lora(self, name: str) -> ServedAdapter:
        """Stop serving adapter `name`: refused while requests using it are in flight (LLMEngine.remove_lora)."""
        return await self._on_engine(lambda engine: engine.remove_lora(name))

    async def _on_engine(self, fn):
        """fn(engine) run on the engine thread between steps, as every change to the engine's state is; its
        result or its exception comes back here."""
        self._check_ready()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", (fn, loop, future)))
        return await future

    def drain(self, grace: float) -> None:
        """Graceful shutdown: admit nothing new (503); requests still running after `grace`
        seconds end with ShuttingDownError, which a stream sends as an error event + [DONE]."""
        self.draining = True
        self._commands.put(("deadline", time.monotonic() + grace))

    def wait_ready(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while self.state == "loading" and (end is None or time.monotonic() < end):
            time.sleep(0.05)
        return self.state == "ready"

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self.state == "loading":
            stop_builds()  # stopped while it builds kernels: no compiler outlives the server
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _check_ready(self) -> None:
        if self.state == "loading":
            raise EngineNotReadyError("the model is still loading")
        if self.state != "ready":
            raise EngineDeadError(f"the engine is not serving ({self.state}: {self.reason})")

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            # The kernels first, with /health saying which are being built: a fresh machine compiles
            # them here, once, and no request ever does.
            prepare(on_progress=self._building)
            if self._stopping:
                self.state = "stopped"
                return
            self.engine = self._factory(self.args)
        except BaseException as e:  # noqa: BLE001 - any load failure is reported, not raised
            log.error("loading the model failed: %s", e)
            # /health shows the reason: the exception's class, never its text (paths, sizes).
            self.error, self.reason, self.state = e, f"the model failed to load ({type(e).__name__})", "failed"
            self._health(False)
            if self._on_failed:
                self._on_failed(e)
            return
        self._telemetry = self.engine.telemetry()
        self.state = "ready"
        self._health(True)
        log.info("engine ready: max_model_len %d, max_num_seqs %d", self.engine.max_model_len,
                 self.engine.plan.max_num_seqs)
        error: BaseException = EngineDeadError("the engine stopped")
        try:
            while self._drain(block=not self.engine.has_unfinished()):
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self._fail_all(ShuttingDownError("the server shut down before this request finished"))
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # noqa: BLE001 - a step failure the engine could not contain
            log.critical("engine step failed; the engine is no longer ready", exc_info=e)
            reason = str(e) if isinstance(e, EngineUnhealthyError) else f"step failed ({type(e).__name__})"
            self.error, self.reason, self.state = e, reason, "unhealthy"
            self._health(False)
            error = EngineUnhealthyStop(f"the engine stopped serving: {reason}")
        finally:
            if self.state != "unhealthy":
                self.state = "stopped"
            for t in list(self._tracked.values()):
                if self.observer:
                    self.observer.on_finished("error", t.prompt_tokens)
                t.handle._post(error)
            self._tracked.clear()
            self._fail_queued(error)
            try:
                self.engine.close()
            except Exception as e:  # noqa: BLE001 - after a fatal device error freeing may fail too
                log.warning("closing the engine failed: %s", e)

    def _fail_all(self, error: BaseException) -> None:
        for rid, t in list(self._tracked.items()):
            self.engine.abort(rid)
            if self.observer:
                self.observer.on_finished("abort", t.prompt_tokens)
            t.handle._post(error)
        self._tracked.clear()

    def _building(self, progress: BuildProgress) -> None:
        self.reason = str(progress) if progress.running else ""

    def _health(self, ready: bool) -> None:
        if self.observer:
            self.observer.on_health(ready, self.reason)

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
            if kind == "deadline":
                self._deadline = arg
            elif kind == "add":
                self._add(arg)
            elif kind == "call":
                self._call(*arg)
            elif kind == "abort":
                for rid in arg:
                    t = self._tracked.pop(rid, None)
                    if t is not None and self.engine.abort(rid):
                        log.info("request %s cancelled, its KV blocks are free", rid)
                        if self.observer:
                            self.observer.on_finished("abort", t.prompt_tokens)

    def _call(self, fn, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        result, error = None, None
        try:
            result = fn(self.engine)
        except Exception as e:  # noqa: BLE001 - delivered to the caller, which maps it to a status
            error = e
        self._telemetry = self.engine.telemetry()  # what the call changed is observable at once
        _settle(loop, future, result, error)

    def _fail_queued(self, error: BaseException) -> None:
        """Commands still queued when the engine thread ends: their callers get `error` rather than wait."""
        while True:
            try:
                kind, arg = self._commands.get(block=False)
            except queue.Empty:
                return
            if kind == "add":
                arg._resolve(error)
            elif kind == "call":
                _settle(arg[1], arg[2], None, error)

    def _add(self, handle: RequestHandle) -> None:
        added = []
        try:
            for r in handle.requests:
                self.engine.add_request(r.prompt_ids, r.params, r.request_id, r.lora_name)
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
        # EngineUnhealthyError (or any exception LLMEngine.step did not contain) propagates: the
        # engine's state is unknown, so _run fails what is in flight and goes not-ready.
        outputs: list[RequestOutput] = self.engine.step()
        now = time.perf_counter()
        self._telemetry = self.engine.telemetry()
        obs = self.observer
        if obs:
            # Before any output is posted: a client that has its last token sees the step in /metrics too.
            obs.on_step(self._telemetry)
        for out in outputs:
            t = self._tracked.get(out.request_id)
            if t is None:
                continue  # aborted while the step ran
            if out.finish_reason == "error":
                del self._tracked[out.request_id]
                if obs:
                    obs.on_finished("error", t.prompt_tokens)
                t.handle._post(_Failed(out.request_id, out.error or RequestFailedError(
                    "the engine failed while generating this request")))
                continue
            if obs:
                obs.on_token(t.last is None, now - (t.last if t.last is not None else t.handle.arrival),
                             len(out.new_token_ids))
            t.last = now
            if out.finished:
                del self._tracked[out.request_id]
                if obs:
                    obs.on_finished(out.finish_reason or "stop", t.prompt_tokens)
            t.handle._post(out)
        if obs:
            obs.on_queue(self.engine)


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result, error: BaseException | None) -> None:
    """Resolve an asyncio future from the engine thread."""
    def settle():
        if not future.done():
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the event loop is gone (server shutting down): nobody is waiting any more
