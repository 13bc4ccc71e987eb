"""One engine stepping in its own thread, with an asyncio stream per request.

The :class:`~jaxkv.serving.engine.Engine` is single-owner, so :class:`AsyncEngine`
builds it on a thread of its own and only that thread touches it. Callers on an
asyncio event loop (an HTTP server) talk to it through a command queue: a request
added while the engine steps is admitted between two steps, beside the running ones
(no batch barrier), and an abort frees the request's blocks before the next step. Each
step's :class:`~jaxkv.serving.outputs.RequestDelta` s go back to the event loop in one
call and into each request's :class:`RequestStream`; the event loop never waits for a
step, and the engine never waits for a reader.

    engine = AsyncEngine(lambda: Engine.from_pretrained(path, memory_bytes=..., max_model_len=...))
    stream = await engine.add([1, 2, 3], SamplingParams(max_tokens=8))
    async for delta in stream:
        print(delta.token_ids, delta.text)

Each stream also carries its sequences' times on the engine thread (``queued_at``: the
engine took the request; :meth:`RequestStream.scheduled_at`: first scheduled) and
preemptions, what a server's request metrics need (vLLM's queue, prefill and inference
times): the engine's ``step_check`` is chained with one that notes each sequence's first
scheduling.

Text is made on the event loop, not on the engine's thread (vLLM v1 detokenizes in its
frontend too): with a tokenizer the engine's deltas carry token ids only
(:meth:`~jaxkv.serving.engine.Engine.set_inline_text`), and a
:class:`~jaxkv.serving.text_stage.TextStage` gives them their text as they are routed,
stop strings included; a stop string found there ends the sequence in the engine before
its next step, and what the engine drew past it is never reported. A tokenizer error fails
that request alone (its stream ends with the error, the request is aborted).
``inline_text=True`` keeps the text on the engine's thread instead.

The number of unfinished sequences is bounded (``max_requests``; a request of ``n``
sequences counts ``n``): one more is refused with :class:`EngineFullError` at once, so a
server answers "busy" instead of queueing without end.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from jaxkv.errors import JaxkvError
from jaxkv.models.text import TextError
from jaxkv.serving.engine import Engine, EngineError
from jaxkv.serving.output_processor import sequence_key
from jaxkv.serving.outputs import RequestDelta
from jaxkv.serving.sampling_params import SamplingParams
from jaxkv.serving.scheduler import SchedulerOutput
from jaxkv.serving.text_stage import StopAt, TextStage

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Note:
    """What the engine thread saw of one sequence: its first scheduling or its preemptions."""

    request_id: str
    index: int
    scheduled_at: float | None
    num_preemptions: int | None


class EngineFullError(JaxkvError, RuntimeError):
    """``max_requests`` sequences are unfinished: try again later."""


class EngineDeadError(JaxkvError, RuntimeError):
    """The engine thread failed to start or has stopped."""


class RequestStream:
    """The deltas of one request's sequences, as they come (an async iterator), ending
    when all ``n`` have finished. Leaving early (:meth:`abort`, or a consumer that stops
    reading and calls it) aborts the request and frees its blocks."""

    def __init__(self, owner: AsyncEngine, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.n = n
        self.queued_at: float | None = None
        """When the engine took the request (``time.monotonic()``; None before)."""
        self._owner = owner
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._unfinished = n  # as the consumer has read
        self._unrouted = n  # as the engine has reported
        self._scheduled: list[float | None] = [None] * n
        self._preemptions = [0] * n

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return self

    async def __anext__(self) -> RequestDelta:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished = 0
            raise item
        if item.finished:
            self._unfinished -= 1
        return item

    @property
    def finished(self) -> bool:
        return not self._unfinished

    @property
    def num_unfinished_sequences(self) -> int:
        """The request's sequences the engine has not reported finished."""
        return self._unrouted

    def scheduled_at(self, index: int) -> float | None:
        """When sequence ``index`` was first scheduled (``time.monotonic()``; None: not yet)."""
        return self._scheduled[index]

    def num_preemptions(self, index: int) -> int:
        """How often sequence ``index`` was preempted (known once it has finished)."""
        return self._preemptions[index]

    def abort(self) -> None:
        """Abort the request unless it has finished (its blocks are freed before the next step)."""
        if self._unfinished:
            self._owner.abort(self.request_id)

    def note(self, index: int, *, scheduled_at: float | None = None, num_preemptions: int | None = None) -> None:
        """Record what the engine thread saw of sequence ``index`` (on the event loop)."""
        if scheduled_at is not None:
            self._scheduled[index] = scheduled_at
        if num_preemptions is not None:
            self._preemptions[index] = num_preemptions

    def put(self, item: RequestDelta | BaseException) -> bool:
        """Queue a delta (or an error that ends the stream), on the event loop; whether the
        engine is done with the request (every sequence reported finished)."""
        self._queue.put_nowait(item)
        self._unrouted = 0 if isinstance(item, BaseException) else self._unrouted - item.finished
        return not self._unrouted


class AsyncEngine:
    """An engine built by ``build`` on its own thread, stepping whenever a request is
    unfinished (see the module docstring). Create it on the event loop that will use it."""

    def __init__(
        self,
        build: Callable[[], Engine],
        *,
        max_requests: int = 256,
        name: str = "jaxkv-engine",
        inline_text: bool = False,
    ) -> None:
        if not isinstance(inline_text, bool):
            raise EngineError(f"inline_text must be a bool, got {inline_text!r}")
        self._loop = asyncio.get_running_loop()
        self.inline_text = inline_text
        self._text: TextStage | None = None  # set with the engine, when text is made here
        self._commands: queue.SimpleQueue[Callable[[Engine], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self.max_requests = max_requests
        self._ready: asyncio.Future[Engine] = self._loop.create_future()
        self._notes: list[Note] = []  # the engine thread's, handed over with the next deltas
        self._scheduled: set[tuple[str, int]] = set()  # sequences scheduled and unfinished (engine thread)
        self._thread = threading.Thread(target=self._run, args=(build,), name=name, daemon=True)
        self._thread.start()

    async def ready(self) -> Engine:
        """Wait until the engine is built; the engine (read its constant attributes only:
        it belongs to its thread). :class:`EngineDeadError` if building it failed."""
        return await asyncio.shield(self._ready)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._ready.done() and self._ready.exception() is None

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def add(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        branch_points: Sequence[int] = (),
    ) -> RequestStream:
        """Queue a request; its stream once the engine accepted it (the engine's
        :class:`~jaxkv.serving.engine.EngineError` for a bad one, :class:`EngineFullError`
        when ``max_requests`` are unfinished)."""
        await self.ready()
        unfinished = sum(stream.num_unfinished_sequences for stream in self._streams.values())
        if unfinished + params.n > self.max_requests:
            raise EngineFullError(
                f"{unfinished} sequences are unfinished; {params.n} more would pass max_requests={self.max_requests}"
            )
        request_id = f"req-{next(self._ids)}"
        stream = RequestStream(self, request_id, params.n)
        self._streams[request_id] = stream
        if self._text is not None:
            self._text.add(request_id, params)

        def take(engine: Engine) -> float:
            engine.add_request(
                prompt, params, cache_salt=cache_salt, request_id=request_id, branch_points=branch_points
            )
            return time.monotonic()

        try:
            stream.queued_at = await self.call(take)
        except BaseException:
            self._streams.pop(request_id, None)
            if self._text is not None:
                self._text.drop(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request before the next step (its stream ends with an "abort" delta)."""

        def abort(engine: Engine) -> None:
            engine.abort(request_id)  # False: it has just finished

        self._commands.put(abort)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """``fn(engine)`` run on the engine's thread between two steps; its result."""
        await self.ready()
        future: asyncio.Future[T] = self._loop.create_future()

        def run(engine: Engine) -> None:
            try:
                result = fn(engine)
            except BaseException as err:  # handed to the caller, who is waiting for it
                self._loop.call_soon_threadsafe(_settle, future, None, err)
            else:
                self._loop.call_soon_threadsafe(_settle, future, result, None)

        self._commands.put(run)
        return await future

    async def close(self) -> None:
        """Stop the thread after the current step; unfinished streams end with an error."""
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)

    # ------------------------------------------------------------ the engine thread
    def _run(self, build: Callable[[], Engine]) -> None:
        try:
            engine = build()
        except BaseException as err:
            self._loop.call_soon_threadsafe(_settle, self._ready, None, EngineDeadError(f"the engine failed: {err}"))
            return
        engine.step_check = self._noting_schedules(engine.step_check)
        if engine.tokenizer is not None and not self.inline_text:
            engine.set_inline_text(False)
            self._text = TextStage(engine.tokenizer, engine.eos_token_ids)  # read on the event loop only
        self._loop.call_soon_threadsafe(_settle, self._ready, engine, None)
        while True:
            block = not engine.has_unfinished  # idle: wait for a command
            while True:  # every command queued so far, then one step (it reports aborts too)
                try:
                    command = self._commands.get(block=block)
                except queue.Empty:
                    break
                if command is None:
                    self._deliver((), EngineDeadError("the engine was closed"))
                    return
                command(engine)
                block = False
            try:
                step = engine.step()
            except Exception as err:  # the engine dropped every request: each stream ends with the error
                self._scheduled.clear()
                self._deliver((), err)
                continue
            self._notes += [Note(o.request_id, o.index, None, o.num_preemptions) for o in step.finished]
            self._scheduled.difference_update((d.request_id, d.index) for d in step.deltas if d.finished)
            self._deliver(step.deltas, None)

    def _noting_schedules(self, check: Callable[[SchedulerOutput | None], None] | None) -> Callable[..., None]:
        """``check`` (the engine's ``step_check``, run first) chained with a note of when each
        sequence is first scheduled (its id is ``req-N``, or ``req-N#index`` when ``n`` > 1)."""

        def noting(output: SchedulerOutput | None) -> None:
            if check is not None:
                check(output)
            if output is None:
                return
            now = time.monotonic()
            for chunk in output.chunks:
                key = sequence_key(chunk.seq.request_id)
                if key not in self._scheduled:
                    self._scheduled.add(key)
                    self._notes.append(Note(*key, now, None))

        return noting

    def _deliver(self, deltas: Sequence[RequestDelta], error: BaseException | None) -> None:
        """Hand a step's deltas and notes (or an error for every stream) to the event loop in one call."""
        notes, self._notes = tuple(self._notes), []
        if deltas or notes or error is not None:
            self._loop.call_soon_threadsafe(self._route, tuple(deltas), notes, error)

    def _route(self, deltas: tuple[RequestDelta, ...], notes: tuple[Note, ...], error: BaseException | None) -> None:
        """On the event loop: notes and each delta into its request's stream; a finished stream forgotten."""
        for note in notes:
            noted = self._streams.get(note.request_id)
            if noted is not None:
                noted.note(note.index, scheduled_at=note.scheduled_at, num_preemptions=note.num_preemptions)
        if error is not None:
            for request_id, stream in self._streams.items():
                stream.put(error)
                if self._text is not None:
                    self._text.drop(request_id)
            self._streams.clear()
        for delta in deltas:
            target = self._streams.get(delta.request_id)
            if target is None:
                continue
            if self._text is not None and delta.request_id in self._text:
                texted = self._texted(delta, target)
                if texted is None:
                    continue
                delta = texted
            if target.put(delta):
                del self._streams[delta.request_id]

    def _texted(self, delta: RequestDelta, stream: RequestStream) -> RequestDelta | None:
        """On the event loop: ``delta`` with its text (None: nothing to hand on yet); a stop
        string found sends the engine a stop, a tokenizer error fails the request alone."""
        assert self._text is not None
        try:
            texted = self._text.process(delta)
        except Exception as err:  # the tokenizer's: the request's text cannot go on
            self._text.drop(delta.request_id)
            del self._streams[delta.request_id]
            stream.put(TextError(f"detokenizing request {delta.request_id} failed: {err}"[:400]))
            self.abort(delta.request_id)
            return None
        if texted.stop is not None:
            self._commands.put(self._stopping(texted.stop))
        return texted.delta

    def _stopping(self, stop: StopAt) -> Callable[[Engine], None]:
        """The engine-thread command that ends a sequence at the stop string found on the event loop."""

        def run(engine: Engine) -> None:
            output = engine.stop_sequence(stop.request_id, stop.index, stop.num_output_tokens)
            if output is not None:  # else it finished first: its own last delta releases the text
                self._notes.append(Note(stop.request_id, stop.index, None, output.num_preemptions))

        return run


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Resolve ``future`` on its loop (unless its waiter has gone)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
