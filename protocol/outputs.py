"""How an agent stores a task's output where the task's project keeps them, checked by these types on both
sides.

A project keeps its outputs either on the plane's own file store (the default) or in an S3-compatible
bucket in its region. The agent does not know which: for each file it asks the plane for a ticket, with the
file's SHA-256 and size, under the run's lease (its agent token) or with the task's token (a compute node's
reporter):

    POST /agents/v1/tasks/<id>/output-tickets/<name>    Claim -> Ticket
      store "plane": PUT the file to /agents/v1/tasks/<id>/outputs/<name>, as before tickets existed
      store "s3":    PUT the file to the ticket's presigned url with exactly the ticket's headers (they
                     are signed: the bucket refuses content whose SHA-256 is not the one claimed), then
    POST /agents/v1/tasks/<id>/output-receipts/<name>   Claim -> the output, as listed: the plane looks
                                                         the object up in the bucket and keeps it only if
                                                         its size (and checksum, where the store says) match

The bucket's credentials never leave the plane: a ticket's URL is good for one object and a few minutes. A
failed PUT (the bucket away, the URL expired) starts again from a new ticket. The agent never follows a
redirect from the bucket, so a ticket cannot send the file anywhere but to the URL the plane signed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from protocol.messages import ProtocolError

PLANE = "plane"  # the plane's own file store
S3 = "s3"  # an S3-compatible bucket, through presigned URLs
STORES = (PLANE, S3)
SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_SIZE = 5 * 1024**4  # S3's largest object; the plane's own limit is lower and its own
TICKET_SECONDS = 900  # how long a ticket's URL is good for
MAX_HEADERS = 16


def tickets_path(task_id: str, quoted_name: str) -> str:
    return f"/agents/v1/tasks/{task_id}/output-tickets/{quoted_name}"


def receipts_path(task_id: str, quoted_name: str) -> str:
    return f"/agents/v1/tasks/{task_id}/output-receipts/{quoted_name}"


def plane_path(task_id: str, quoted_name: str) -> str:
    return f"/agents/v1/tasks/{task_id}/outputs/{quoted_name}"


@dataclass(frozen=True)
class Claim:
    """What the agent says of a file it is about to store (a ticket) or has stored (a receipt)."""

    sha256: str  # lowercase hex
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size}

    @classmethod
    def from_json(cls, content: object) -> Claim:
        if not isinstance(content, Mapping):
            raise ProtocolError('Send {"sha256": "<hex>", "size": <bytes>}.')
        sha256, size = content.get("sha256"), content.get("size")
        if not isinstance(sha256, str) or not SHA256.match(sha256):
            raise ProtocolError("sha256 must be the file's SHA-256 in 64 lowercase hex digits.")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_SIZE:
            raise ProtocolError(f"size must be the file's size in bytes, 0 to {MAX_SIZE}.")
        return cls(sha256=sha256, size=size)


@dataclass(frozen=True)
class Ticket:
    """Where to put one file: the plane (no url), or a presigned URL with the headers it was signed with."""

    store: str
    url: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    expires_in: int = 0  # seconds the url is good for

    def to_json(self) -> dict[str, Any]:
        if self.store == PLANE:
            return {"store": PLANE}
        return {
            "store": self.store,
            "url": self.url,
            "headers": dict(self.headers),
            "expires_in": self.expires_in,
        }

    @classmethod
    def from_json(cls, content: object) -> Ticket:
        if not isinstance(content, Mapping) or content.get("store") not in STORES:
            raise ProtocolError(f"A ticket names its store, one of {', '.join(STORES)}.")
        if content["store"] == PLANE:
            return cls(store=PLANE)
        url, headers, expires_in = (
            content.get("url"),
            content.get("headers", {}),
            content.get("expires_in", 0),
        )
        if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https") or len(url) > 8192:
            raise ProtocolError("An S3 ticket carries the presigned http(s) URL to PUT the file to.")
        if (
            not isinstance(headers, Mapping)
            or len(headers) > MAX_HEADERS
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
        ):
            raise ProtocolError("An S3 ticket's headers are a few names and values, all strings.")
        if not isinstance(expires_in, int) or isinstance(expires_in, bool) or expires_in < 0:
            raise ProtocolError("An S3 ticket's expires_in is a whole number of seconds.")
        return cls(store=S3, url=url, headers=dict(headers), expires_in=expires_in)
