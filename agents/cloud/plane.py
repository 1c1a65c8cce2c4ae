"""The autoscaler's HTTPS calls to the plane (protocol.cloud): mint an instance's token, hand a run to an
instance's agent, report the instances and read the plane's view of their agents."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx

from klique.sdk import loopback
from protocol import cloud
from protocol.messages import ProtocolError


class PlaneError(Exception):
    """The plane refused the call (status 4xx: `refused` is True) or could not be reached."""

    def __init__(self, message: str, *, status: int = 0) -> None:
        super().__init__(message)
        self.status = status

    @property
    def refused(self) -> bool:
        return 400 <= self.status < 500


class Plane:
    def __init__(self, url: str, token: str, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        base, headers = loopback(url)
        self.url = url
        self.http = httpx.AsyncClient(
            base_url=base,
            headers={**headers, "Authorization": f"Bearer {token}"},
            timeout=30,
            transport=transport,
        )

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            response = await self.http.post(path, json=body)
        except httpx.TransportError as error:
            raise PlaneError(f"the plane cannot be reached ({type(error).__name__}: {error})") from None
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        if response.status_code >= 400:
            detail = answer.get("detail") if isinstance(answer, dict) else None
            raise PlaneError(
                f"the plane answered {response.status_code}: {detail or response.reason_phrase}",
                status=response.status_code,
            )
        return answer

    async def mint(self, name: str, seconds: float) -> cloud.Minted:
        answer = await self._post(f"/agents/v1/cloud/instances/{name}/token/", {"seconds": seconds})
        with _readable():
            return cloud.Minted.parse(answer)

    async def handoff(self, handoff: cloud.Handoff) -> cloud.Handed:
        answer = await self._post("/agents/v1/cloud/handoff/", handoff.as_json())
        with _readable():
            return cloud.Handed.parse(answer)

    async def report(self, instances: list[cloud.Instance]) -> cloud.FleetView:
        body = cloud.InstancesReport(tuple(instances)).as_json()
        answer = await self._post("/agents/v1/cloud/instances/", body)
        with _readable():
            return cloud.FleetView.parse(answer)

    async def close(self) -> None:
        await self.http.aclose()


@contextlib.contextmanager
def _readable() -> Iterator[None]:
    try:
        yield
    except ProtocolError as error:
        raise PlaneError(f"the plane's answer cannot be read: {error}") from None
