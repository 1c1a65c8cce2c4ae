"""A small app for the catalogue's tests, served by uvicorn on the port its agent picked: text at /, the
request echoed at /echo (method, path, headers, body), a body of ?bytes=N at /big, a websocket echo at
/ws, an environment variable at /env?name=NAME, and at /exit its own end."""

from __future__ import annotations

import json
import os
from typing import Any


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        return
    if scope["type"] == "websocket":
        await _websocket(receive, send)
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    path = scope["path"]
    if path == "/echo":
        headers = {name.decode(): value.decode() for name, value in scope["headers"]}
        answer = {"method": scope["method"], "target": path, "query": scope["query_string"].decode()}
        answer |= {"headers": headers, "size": len(body), "body": body[:1000].decode(errors="replace")}
        await _reply(send, 200, json.dumps(answer).encode(), b"application/json")
    elif path == "/big":
        size = int(scope["query_string"].decode().partition("=")[2] or 0)
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % size)]}
        )
        block = bytes(range(256)) * 256
        sent = 0
        while sent < size:
            piece = block[: min(len(block), size - sent)]
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            sent += len(piece)
        await send({"type": "http.response.body", "body": b""})
    elif path == "/env":  # one variable of the app's environment (a test reads its secret through the route)
        name = scope["query_string"].decode().partition("=")[2]
        await _reply(send, 200, os.environ.get(name, "(unset)").encode(), b"text/plain")
    elif path == "/exit":
        await _reply(send, 200, b"bye\n", b"text/plain")
        os._exit(3)
    else:
        await _reply(
            send, 200, f"hello from the app, port {os.environ.get('PORT')}\n".encode(), b"text/plain"
        )


async def _reply(send: Any, status: int, body: bytes, kind: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]})
    await send({"type": "http.response.body", "body": body})


async def _websocket(receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "websocket.accept"})
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return
        if message.get("text") is not None:
            await send({"type": "websocket.send", "text": "echo: " + message["text"]})
        else:
            await send({"type": "websocket.send", "bytes": message["bytes"]})
