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
"""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpRequest, HttpResponseBase


class SyncChainASGIHandler(ASGIHandler):
    def load_middleware(self, is_async: bool = False) -> None:
        super().load_middleware(is_async=False)

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        return await sync_to_async(self.get_response, thread_sensitive=True)(request)
