"""A small OpenAI-compatible model server: the gateway's upstream in the demo, the tests and the benchmark.

Its model answers deterministically: the reply is the last user message's words, repeated until
`max_tokens` words (a word is a token here, and `usage` counts them the same way), so a test can predict
every figure. Model names steer it, so one server plays many deployments:

- `...-fail` answers 500, `...-slow` waits `ECHO_SLOW_SECONDS` before answering, `...-leak` ends its
  reply with an e-mail address (for checks on replies), `...-deaf` ignores `max_tokens` and talks on;
- any other name answers normally; embeddings are 8 numbers derived from the text.

Serve it with `python -m gateway.echo --port 9000` (uvicorn, no Django). It is also the gateway
benchmark's upstream, so it is written to cost as little as possible per request.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

DEFAULT_MAX_TOKENS = 16
SLOW_SECONDS = float(os.environ.get("ECHO_SLOW_SECONDS", "2"))
API_KEY = os.environ.get("ECHO_API_KEY", "")  # when set, calls must bring it, as a hosted API's would


def _words(messages: list[dict[str, Any]]) -> list[str]:
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):  # content parts
                content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
            return str(content or "").split() or ["echo"]
    return ["echo"]


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """The upstream's own count of a chat prompt: its words."""
    return sum(len(str(message.get("content") or "").split()) for message in messages)


def reply_words(words: list[str], max_tokens: int) -> list[str]:
    return [words[index % len(words)] for index in range(max_tokens)]


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _json(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _embeddings(send: Send, request: dict[str, Any], model: str) -> None:
    inputs = request.get("input", "")
    inputs = inputs if isinstance(inputs, list) else [inputs]
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": [b / 255 for b in hashlib.sha256(str(text).encode()).digest()[:8]],
        }
        for index, text in enumerate(inputs)
    ]
    used = sum(len(str(text).split()) for text in inputs)
    usage = {"prompt_tokens": used, "total_tokens": used}
    await _json(send, 200, {"object": "list", "model": model, "data": data, "usage": usage})


async def _completion(send: Send, request: dict[str, Any], model: str, max_tokens: int) -> None:
    prompt = str(request.get("prompt", ""))
    words = reply_words(prompt.split() or ["echo"], max_tokens)
    choice = {"index": 0, "text": " ".join(words), "finish_reason": "length", "logprobs": None}
    await _json(
        send,
        200,
        {
            "id": "cmpl-echo",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": _usage(len(prompt.split()), len(words)),
        },
    )


async def _chat(send: Send, request: dict[str, Any], model: str, max_tokens: int) -> None:
    messages = request.get("messages") or []
    words = reply_words(_words(messages), max_tokens * 4 if model.endswith("-deaf") else max_tokens)
    if model.endswith("-leak"):
        words[-3:] = ["write", "to", "admin@example.com"]
    usage = _usage(prompt_tokens(messages), len(words))
    base = {"id": "chatcmpl-echo", "created": int(time.time()), "model": model}
    if not request.get("stream"):
        message = {"role": "assistant", "content": " ".join(words)}
        choice = {"index": 0, "message": message, "finish_reason": "length"}
        await _json(send, 200, {**base, "object": "chat.completion", "choices": [choice], "usage": usage})
        return
    start = {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"text/event-stream")],
    }
    await send(start)
    base["object"] = "chat.completion.chunk"
    for index, word in enumerate(words):
        delta = {"role": "assistant", "content": word} if index == 0 else {"content": " " + word}
        chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        body = b"data: " + json.dumps(chunk).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": True})
    last = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    tail = b"data: " + json.dumps(last).encode() + b"\n\n"
    if (request.get("stream_options") or {}).get("include_usage"):
        tail += b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]
    if API_KEY and (b"authorization", f"Bearer {API_KEY}".encode()) not in scope["headers"]:
        error = {"message": "Incorrect API key provided.", "type": "invalid_request_error"}
        await _json(send, 401, {"error": error})
    elif scope["method"] == "GET" and path.endswith("/models"):
        models = [{"id": "echo", "object": "model", "owned_by": "echo"}]
        await _json(send, 200, {"object": "list", "data": models})
    else:
        request = json.loads(await _body(receive) or b"{}")
        model = str(request.get("model", "echo"))
        max_tokens = int(
            request.get("max_tokens") or request.get("max_completion_tokens") or DEFAULT_MAX_TOKENS
        )
        if model.endswith("-slow"):
            await asyncio.sleep(SLOW_SECONDS)
        if model.endswith("-fail"):
            await _json(send, 500, {"error": {"message": f"{model} is down", "type": "server_error"}})
        elif path.endswith("/embeddings"):
            await _embeddings(send, request, model)
        elif path.endswith("/chat/completions"):
            await _chat(send, request, model, max_tokens)
        else:
            await _completion(send, request, model, max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description="A deterministic OpenAI-compatible model server.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
