"""The gateway's transport to a model an app serves: the call goes through the app's tunnel over the channel
layer (a stand-in plays the tunnel consumer here; tests/e2e/test_model_endpoints.py runs the real one),
the answer streams back with credits, a tunnel that drops mid-answer is an error and never a cut answer
taken for whole, and a caller that goes away stops the app's answer."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from channels.layers import get_channel_layer

from apps.core.tunnels import ACCEPTED
from gateway.selfhosted import TunnelTransport
from protocol import tunnel

APP = "5b0a4f4e-8c39-4d39-9d1a-0c1b2a3d4e5f"
URL = f"http://selfhosted.klique.invalid/acme/{APP}/v1/chat/completions"


class FakeTunnel:
    """The tunnel consumer's side: takes one stream, records what came, answers with `frames`."""

    def __init__(self, frames: list[tuple[int, bytes]]) -> None:
        self.frames, self.head, self.body, self.after = frames, {}, b"", []  # type: ignore[var-annotated]

    async def serve(self, layer: Any, channel: str) -> None:
        opened = await layer.receive(channel)
        self.head, reply = opened["head"], opened["reply"]
        await layer.send(reply, {"type": "route.frame", "kind": ACCEPTED, "payload": b""})
        while True:  # the request's body, if any, then its END (which the agent waits for either way)
            frame = await layer.receive(channel)
            if frame["kind"] == tunnel.END:
                break
            self.body += frame["payload"]
        for kind, payload in self.frames:
            await layer.send(reply, {"type": "route.frame", "kind": kind, "payload": payload})
        try:
            while True:  # what the caller sends after the answer (credits, a reset)
                frame = await asyncio.wait_for(layer.receive(channel), 1)
                self.after.append(frame["kind"])
        except TimeoutError:
            return


def head(status: int = 200, content_type: str = "application/json") -> tuple[int, bytes]:
    return tunnel.HEAD, json.dumps({"status": status, "headers": [["content-type", content_type]]}).encode()


async def call(
    fake: FakeTunnel, *, read: int | None = None, method: str = "POST", json_body: Any = None
) -> tuple[Any, ...]:
    layer = get_channel_layer()
    channel = await layer.new_channel("tunnel.")
    transport = TunnelTransport()
    transport.channels[APP] = (channel, time.monotonic())
    transport.touched[APP] = time.monotonic()  # no database here: the call is not written down
    serving = asyncio.create_task(fake.serve(layer, channel))
    async with httpx.AsyncClient(transport=transport) as client:
        request = client.build_request(
            method,
            URL,
            json={"model": "m"} if method == "POST" else json_body,
            headers={"authorization": "Bearer klq_secret", "x-a": "1"},
        )
        try:
            response = await client.send(request, stream=True)
            got = b""
            async for chunk in response.aiter_raw():
                got += chunk
                if read is not None and len(got) >= read:
                    break
            await response.aclose()
            outcome: tuple[Any, ...] = (response.status_code, got)
        except httpx.HTTPError as error:
            outcome = (type(error).__name__, str(error))
    await serving
    return outcome


def test_a_call_reaches_the_app_through_its_tunnel_and_streams_back_with_credits() -> None:
    chunks = [(tunnel.DATA, b"x" * 1000) for _ in range(40)]
    fake = FakeTunnel([head(), *chunks, (tunnel.END, b"")])
    status, body = asyncio.run(call(fake))
    assert (status, len(body)) == (200, 40_000)
    assert fake.head["method"] == "POST"
    assert fake.head["target"] == "/v1/chat/completions"
    assert json.loads(fake.body) == {"model": "m"}
    sent = dict(fake.head["headers"])
    assert sent["content-type"] == "application/json"
    assert "authorization" not in sent  # no credential of the caller's reaches the app
    assert "x-a" not in sent
    assert "host" not in sent
    assert fake.after == [tunnel.CREDIT, tunnel.CREDIT]  # a credit every half window read


@pytest.mark.parametrize(
    "ending",
    [
        (tunnel.RESET, b'{"reason": "The app\'s tunnel dropped; its agent reconnects it. Try again."}'),
        (tunnel.RESET, b""),
        (tunnel.TEXT, b"not a frame an answer has"),
    ],
)
def test_an_answer_cut_off_is_an_error_not_a_short_body(ending: tuple[int, bytes]) -> None:
    fake = FakeTunnel([head(), (tunnel.DATA, b'{"choices": ['), ending])
    kind, said = asyncio.run(call(fake))
    assert kind == "ReadError"
    assert said


def test_no_answer_head_is_an_error_with_the_reason() -> None:
    fake = FakeTunnel([(tunnel.RESET, b'{"reason": "the app refused the connection"}')])
    assert asyncio.run(call(fake)) == ("ReadError", "the app refused the connection")


def test_a_caller_that_goes_away_stops_the_apps_answer() -> None:
    chunks = [(tunnel.DATA, b"y" * 100) for _ in range(5)]
    fake = FakeTunnel([head(content_type="text/event-stream"), *chunks])
    status, body = asyncio.run(call(fake, read=100))
    assert (status, body) == (200, b"y" * 100)
    assert fake.after == [tunnel.RESET]


def test_a_request_without_a_body_still_ends_its_stream() -> None:
    fake = FakeTunnel([head(), (tunnel.DATA, b'{"data": []}'), (tunnel.END, b"")])
    assert asyncio.run(call(fake, method="GET")) == (200, b'{"data": []}')
    assert fake.head["method"] == "GET"
    assert fake.head["body"] is False
    assert fake.body == b""
