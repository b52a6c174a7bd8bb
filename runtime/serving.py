"""Serving from many threads: one loop thread drives the generator, callers submit and wait.

A service's request threads cannot share `Runtime.generate` (the generator is not thread-safe,
and each call would batch only its own prompts). `ServingLoop` owns the generator: only its loop
thread touches it. `submit` checks a request in the caller's thread (the checks read only the
config), puts it in an inbox and returns a `RequestHandle` at once, without waiting for a step
in progress; the loop thread admits the inbox between steps and runs steps while any request is
unfinished, so requests from different threads share decode batches; each handle receives its
own events.

    with ServingLoop(Runtime.from_bundle("engines/tiny", backend="ort")) as loop:
        handle = loop.submit("hello", GenerationParams(max_new_tokens=16))   # any thread
        for event in handle: ...            # or handle.result(timeout=30) -> Request
        handle.cancel()                     # frees the slot at the next step boundary
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dsflash.runtime.api import Runtime
from dsflash.runtime.generator import TokenEvent
from dsflash.runtime.request import GenerationParams, Request

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; the package allows 3.10

log = logging.getLogger(__name__)

_END = object()  # a handle's last queue item: no more events


class RequestHandle:
    """One submitted request as its caller sees it. Iterate it for the TokenEvents (one consumer),
    or wait for the finished Request with result(). `request_id` is the generator's id, set when
    the loop admits the request (None before)."""

    def __init__(self, loop: ServingLoop):
        self.loop = loop
        self.request_id: int | None = None
        self._events: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._request: Request | None = None
        self._error: BaseException | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            item = self._events.get()
            if item is _END:
                self._events.put(_END)  # a second iteration ends at once instead of blocking
                break
            yield item
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None) -> Request:
        """The finished request (finish_reason "length", "stop_token", "stop_string" or
        "cancelled"); raises the engine's error if a step failed, TimeoutError after `timeout` s."""
        if not self._done.wait(timeout):
            name = "not yet admitted" if self.request_id is None else self.request_id
            raise TimeoutError(f"request {name} unfinished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._request

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> bool:
        """Ask the loop to finish the request (finish_reason "cancelled") before its next step;
        -> False if it had finished. A step already running may still finish it normally."""
        return self.loop.cancel(self)

    def _put(self, event: TokenEvent) -> None:
        self._events.put(event)

    def _finish(self, request: Request, error: BaseException | None = None) -> None:
        self._request, self._error = request, error
        self._events.put(_END)
        self._done.set()


class ServingLoop:
    """Own `runtime`'s generator and serve it from a loop thread; thread-safe submit / cancel.
    Use it as a context manager or call close(); the runtime must not be used directly meanwhile."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self._gen = runtime.generator
        if self._gen.has_unfinished():
            raise RuntimeError("ServingLoop needs an idle runtime: finish or cancel its requests first")
        self._wake = threading.Condition()  # guards the inbox, the cancels, _live and the two flags
        self._inbox: list[tuple[list[int], GenerationParams, RequestHandle]] = []
        self._cancels: list[RequestHandle] = []
        self._closed = False
        self._stopped_by: BaseException | None = None  # what ended the loop thread, if not close()
        self._live: set[RequestHandle] = set()  # every unfinished handle, for a loop that dies
        self._handles: dict[int, RequestHandle] = {}  # the loop thread's own
        self._thread = threading.Thread(target=self._loop, name="dsflash-serving", daemon=True)
        self._thread.start()

    def submit(self, prompt, params: GenerationParams = GenerationParams()) -> RequestHandle:
        """Queue a prompt (text or ids); raises here, in the caller's thread, what Runtime.generate
        would raise for it (ids outside the vocabulary, over capacity, ...)."""
        ids = self._gen.check_request(self.runtime.encode(prompt), params)
        handle = RequestHandle(self)
        with self._wake:
            if self._stopped_by is not None:
                raise RuntimeError(f"the serving loop stopped: {self._stopped_by!r}") from self._stopped_by
            if self._closed:
                raise RuntimeError("the serving loop is closed")
            self._inbox.append((ids, params, handle))
            self._live.add(handle)
            self._wake.notify()
        return handle

    def cancel(self, handle: RequestHandle) -> bool:
        with self._wake:
            if handle.done() or self._closed:  # close() cancels what is unfinished anyway
                return False
            self._cancels.append(handle)
            self._wake.notify()
        return True

    def close(self) -> None:
        """Cancel what is unfinished (its handles finish as "cancelled") and stop the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _end(self, request_id: int, error: BaseException | None) -> None:
        """Finish a request (cancel it if unfinished) and hand it to its handle."""
        self._gen.cancel(request_id)
        handle = self._handles.pop(request_id)
        with self._wake:
            self._live.discard(handle)
        handle._finish(self._gen.forget(request_id), error)

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as err:
            # a bug outside the engine's step (which _serve catches): no caller may wait forever
            log.exception("the serving loop stopped")
            with self._wake:
                self._closed, self._stopped_by = True, err
                waiting, self._live = list(self._live), set()
            for handle in waiting:
                request = self._gen.requests.get(handle.request_id) if handle.request_id is not None else None
                handle._finish(request, err)

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not (self._closed or self._inbox or self._cancels or self._gen.has_unfinished()):
                    self._wake.wait()
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                closed = self._closed
            for ids, params, handle in inbox:
                handle.request_id = self._gen.add(ids, params)
                self._handles[handle.request_id] = handle
            for handle in cancels:
                if handle.request_id in self._handles:
                    self._end(handle.request_id, None)
            if closed:
                for rid in list(self._handles):
                    self._end(rid, None)
                return
            if not self._gen.has_unfinished():
                continue
            try:
                events = self._gen.step()
            except Exception as err:  # every waiting caller gets the error
                log.exception("generator step failed; failing %d requests", len(self._handles))
                for rid in list(self._handles):
                    self._end(rid, err)
                continue
            for event in events:
                self._handles[event.request_id]._put(event)
                if event.finished:
                    self._end(event.request_id, None)
