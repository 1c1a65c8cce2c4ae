"""Klique's Python SDK: a small client of the REST API, authenticated by a token. No Django here.

from klique.sdk import Client
client = Client("http://demo.localhost:8000", token)
task = client.submit("Research: 4 GPUs", name="resnet", command=["python", "train.py"])
print(client.why(task["id"])["reason"])
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx


class KliqueError(Exception):
    """The server refused a request, or could not be reached; the message is the server's own sentence."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def loopback(url: str) -> tuple[str, dict[str, str]]:
    """Names under .localhost mean this machine (RFC 6761). Browsers and curl know; many resolvers do not,
    so connect to 127.0.0.1 and name the tenant in the Host header."""
    parts = urlsplit(url.rstrip("/"))
    host = parts.hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        netloc = f"127.0.0.1:{parts.port}" if parts.port else "127.0.0.1"
        return urlunsplit((parts.scheme, netloc, parts.path, "", "")), {"Host": parts.netloc}
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")), {}


class Client:
    def __init__(
        self, url: str, token: str, *, timeout: float = 30, transport: httpx.BaseTransport | None = None
    ) -> None:
        if not url or not token:
            raise KliqueError(
                "Set KLIQUE_URL (your tenant's address, such as http://demo.localhost:8000) and KLIQUE_TOKEN "
                "(a token from POST /api/v1/tokens/; `make demo` prints one), or pass --url and --token."
            )
        base, headers = loopback(url)
        self.http = httpx.Client(
            base_url=base,
            headers={**headers, "Authorization": f"Bearer {token}", "User-Agent": "klique-sdk"},
            timeout=timeout,
            transport=transport,
        )

    @classmethod
    def from_environment(cls, url: str | None = None, token: str | None = None) -> Client:
        return cls(url or os.environ.get("KLIQUE_URL", ""), token or os.environ.get("KLIQUE_TOKEN", ""))

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise KliqueError(f"Could not reach Klique at {self.http.base_url}: {error}.") from None
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail") or response.text
            except ValueError:
                detail = response.text or response.reason_phrase
            raise KliqueError(str(detail), response.status_code)
        return response.json() if response.content else None

    def submit(
        self,
        compute_resource: str,
        *,
        gpus: str | None = None,
        name: str = "",
        project: str | None = None,
        priority: int = 0,
        command: list[str] | None = None,
        outputs: list[str] | None = None,
        idempotency_key: str = "",
        time_limit_seconds: int | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"compute_resource": compute_resource, "name": name, "priority": priority}
        if idempotency_key:
            body["idempotency_key"] = idempotency_key
        if time_limit_seconds is not None:
            body["time_limit_seconds"] = time_limit_seconds
        if gpus is not None:
            body["gpus"] = gpus
        if project is not None:
            body["project"] = project
        spec: dict[str, Any] = {}
        if command:
            spec["command"] = command
        if outputs:
            spec["outputs"] = outputs
        if spec:
            body["spec"] = spec
        result: dict[str, Any] = self.request("POST", "/api/v1/tasks/", json=body)
        return result

    def tasks(
        self,
        *,
        state: str | None = None,
        compute_resource: str | None = None,
        mine: bool = False,
        limit: int = 50,
    ) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit}
        if state:
            params["state"] = state
        if compute_resource:
            params["compute_resource"] = compute_resource
        if mine:
            params["mine"] = "true"
        rows: list[dict[str, Any]] = self.request("GET", "/api/v1/tasks/", params=params)["results"]
        return rows

    def resolve(self, task: str) -> str:
        """A task id from a whole id or a unique prefix of one (as `klique tasks` shows them)."""
        if len(task) == 36:
            return task
        matches = self.request("GET", "/api/v1/tasks/", params={"id_prefix": task, "limit": 2})["results"]
        if len(matches) != 1:
            raise KliqueError(f"{'No' if not matches else 'More than one'} task id starts with {task!r}.")
        return str(matches[0]["id"])

    def task(self, task: str) -> dict[str, Any]:
        result: dict[str, Any] = self.request("GET", f"/api/v1/tasks/{self.resolve(task)}/")
        return result

    def cancel(self, task: str) -> dict[str, Any]:
        result: dict[str, Any] = self.request("POST", f"/api/v1/tasks/{self.resolve(task)}/cancel/")
        return result

    def why(self, task: str) -> dict[str, Any]:
        result: dict[str, Any] = self.request("GET", f"/api/v1/tasks/{self.resolve(task)}/why/")
        return result

    def configuration(self, which: str) -> dict[str, Any]:
        """`active` (what is provisioned) or `draft` (the working copy's document)."""
        if which == "draft":
            document: dict[str, Any] = self.request("GET", "/api/v1/configuration/draft/")["document"]
            return document
        result: dict[str, Any] = self.request("GET", "/api/v1/configuration/")
        return result

    def save_draft(self, document: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self.request(
            "PUT", "/api/v1/configuration/draft/", json={"document": document}
        )
        return result

    def validate(self) -> dict[str, Any]:
        result: dict[str, Any] = self.request("POST", "/api/v1/configuration/draft/validate/")
        return result

    def provision(self) -> dict[str, Any]:
        result: dict[str, Any] = self.request("POST", "/api/v1/configuration/draft/provision/")
        return result

    def simulate(self, *, days: int | None = None, trace: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"days": days, "trace": trace}
        result: dict[str, Any] = self.request("POST", "/api/v1/configuration/draft/simulate/", json=body)
        return result

    def logs(self, task: str) -> list[dict[str, Any]]:
        chunks: list[dict[str, Any]] = self.request("GET", f"/api/v1/tasks/{self.resolve(task)}/logs/")
        return chunks

    async def follow_logs(
        self, task_id: str, *, after: int = 0, reconnects: int = 10
    ) -> AsyncIterator[dict[str, Any]]:
        """The task's output after cursor `after` (all of it by default), then live, until it ends: chunks
        {"type": "log", "cursor": n, "lines": [...]} and a last {"type": "end", "state": ...}. A dropped
        connection is opened again (up to `reconnects` times in a row) from the last cursor received, so
        no chunk is missed or repeated."""
        import asyncio

        import websockets

        parts = urlsplit(str(self.http.base_url))
        scheme = "wss" if parts.scheme == "https" else "ws"
        host = self.http.headers.get("Host") or parts.netloc
        connect: dict[str, Any] = {}
        if "Host" in self.http.headers:  # a .localhost address: connect to the loopback, name the tenant
            connect = {"host": parts.hostname, "port": parts.port}
        cursor, failures = after, 0
        while True:
            try:
                async with websockets.connect(
                    f"{scheme}://{host}/ws/v1/tasks/{task_id}/logs/?after={cursor}",
                    additional_headers={"Authorization": self.http.headers["Authorization"]},
                    **connect,
                ) as stream:
                    async for raw in stream:
                        message: dict[str, Any] = json.loads(raw)
                        if message.get("type") == "error":
                            raise KliqueError(str(message.get("detail")))
                        if isinstance(message.get("cursor"), int):
                            cursor, failures = max(cursor, message["cursor"]), 0
                        yield message
                        if message.get("type") == "end":
                            return
            except (OSError, websockets.WebSocketException) as error:
                problem: Exception = error
            else:
                problem = ConnectionError("the stream closed before the task ended")
            failures += 1
            if failures > reconnects:
                raise KliqueError(f"Following task {task_id}'s output failed: {problem}.")
            await asyncio.sleep(min(5.0, 0.25 * 2**failures))

    def outputs(self, task: str) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.request("GET", f"/api/v1/tasks/{self.resolve(task)}/outputs/")
        return rows

    def download(self, task: str, name: str) -> bytes:
        """An output's bytes, from the plane, or from its project's bucket where the plane redirects (a
        signed URL: fetched without this client's token)."""
        response = self.http.get(f"/api/v1/tasks/{self.resolve(task)}/outputs/{name}")
        if response.is_redirect and "location" in response.headers:
            response = httpx.get(response.headers["location"], timeout=self.http.timeout)
            if response.status_code >= 400:
                raise KliqueError(
                    f"The bucket answered {response.status_code} for output {name}.", response.status_code
                )
        if response.status_code >= 400:
            raise KliqueError(response.json().get("detail", response.text), response.status_code)
        return response.content

    def usage(
        self, *, by: str = "project", since: str | None = None, until: str | None = None
    ) -> dict[str, Any]:
        params = {"by": by, **({"since": since} if since else {}), **({"until": until} if until else {})}
        summary: dict[str, Any] = self.request("GET", "/api/v1/usage/summary/", params=params)
        return summary

    def queues(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.request("GET", "/api/v1/compute-resources/", params={"limit": 500})[
            "results"
        ]
        return rows
