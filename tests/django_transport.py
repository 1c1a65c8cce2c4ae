"""An httpx transport that hands requests to Django's test client, so the SDK and CLI run their real
HTTP code against the app inside the test's transaction (the e2e tests cover a real socket)."""

from __future__ import annotations

from typing import Any

import httpx
from django.test import Client as DjangoClient


class DjangoTransport(httpx.BaseTransport):
    def __init__(self) -> None:
        self.django = DjangoClient()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        headers: dict[str, Any] = {
            f"HTTP_{name.upper().replace('-', '_')}": value
            for name, value in request.headers.items()
            if name.lower() not in {"content-type", "content-length"}
        }
        response = self.django.generic(
            request.method,
            request.url.raw_path.decode(),
            data=request.read(),
            content_type=request.headers.get("content-type", "application/octet-stream"),
            **headers,
        )
        return httpx.Response(
            response.status_code, headers=dict(response.items()), content=response.content, request=request
        )
