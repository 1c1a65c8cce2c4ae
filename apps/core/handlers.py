"""Django's ASGI handler, with each request's middleware and view run in one hop to a thread.

Every middleware of Klique's web stack and every Django view is synchronous. Django's own ASGI handler
builds its middleware chain for async use anyway: the chain runs in a thread (sync_to_async), and where
it reaches the innermost handler, which is async, it hops back to the event loop (async_to_sync) only to
hop into a thread again for the view (sync_to_async). That is two thread switches per request that do
no work (bench/request_path.py: about a third of the web process's samples on an API call were in them).

This handler builds the chain for sync use, as under WSGI, and runs the whole of it, middleware and view
together, in one sync_to_async call, thread-sensitive, in the request's own thread context as Django
does. What it answers is the same: the chain, the exception handling, the signals and the response are
Django's; only where the thread switches happen differs. An async view (Klique has none) would still be
served: Django's sync path runs it with async_to_sync.

**Request threads are kept.** Django gives each request a thread-sensitive context of its own, and
asgiref makes that context a new thread, started for the request and joined after it (a fifth of the
event loop's time on an API call, bench/request_path.py). This handler gives each request's context a
thread from a small stack of idle ones instead, as a WSGI server's thread pool would: one request at a
time per thread, as before, and the thread's Django connection closed (returned to the pool) at the
request's end by Django's own request_finished, as before. A thread that still runs something when its
request is over (a client that left while its view ran) is not kept: it ends when that work does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.db import connections
from django.http import HttpRequest, HttpResponseBase

IDLE_THREADS = 16  # request threads kept idle at most; more are made while more requests run at once


class RequestThread(ThreadPoolExecutor):
    """One thread for one request at a time, which knows whether it still runs anything."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="klique-request")
        self._lock = threading.Lock()
        self.pending = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        with self._lock:
            self.pending += 1
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(self._done)
        return future

    def _done(self, _: Future[Any]) -> None:
        with self._lock:
            self.pending -= 1


class RequestThreads:
    """Idle request threads, taken and given back on the event loop's thread only."""

    def __init__(self, keep: int = IDLE_THREADS) -> None:
        self.keep = keep
        self.idle: list[RequestThread] = []

    def take(self) -> RequestThread:
        return self.idle.pop() if self.idle else RequestThread()

    def give(self, thread: RequestThread, *, finished: bool) -> None:
        if finished and thread.pending == 0 and len(self.idle) < self.keep:
            self.idle.append(thread)
        else:  # busy still, or one too many: it ends once its work is done
            thread.submit(connections.close_all)
            thread.shutdown(wait=False)

    def close(self) -> None:
        """End the idle threads, each closing its database connections first."""
        while self.idle:
            thread = self.idle.pop()
            thread.submit(connections.close_all).result()
            thread.shutdown()


class SyncChainASGIHandler(ASGIHandler):
    def __init__(self) -> None:
        super().__init__()
        self.threads = RequestThreads()

    def load_middleware(self, is_async: bool = False) -> None:
        super().load_middleware(is_async=False)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        thread, finished = self.threads.take(), False
        try:
            async with ThreadSensitiveContext(executor=thread):
                await self.handle(scope, receive, send)
            finished = True
        finally:
            self.threads.give(thread, finished=finished)

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        return await sync_to_async(self.get_response, thread_sensitive=True)(request)
