"""A project's output bucket: an S3-compatible store (AWS S3 in a region, or another at an endpoint) that the
project's task outputs go to instead of the plane's file store.

The plane never moves an output's bytes through itself here. It signs URLs with the bucket's credentials
(two vault secrets the project may use, read only to sign): a PUT for one object and a few minutes, which
it gives to the agent that stores the file, a GET it redirects a reader to. It looks an object up (HEAD,
through a presigned URL too) only through the client that refuses internal addresses, since the endpoint
is a tenant's choice. Signing needs no connection at all.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import boto3
import httpx
from botocore.config import Config
from django.db import transaction
from django.utils import timezone

from apps.accounts.models import Project, User
from apps.accounts.permissions import is_project_admin
from apps.accounts.services import REGION
from apps.audit.services import record
from apps.core import outbound
from apps.core.errors import Forbidden, InvalidInput
from apps.fleet.models import OutputDestination
from apps.vault import services as vault
from protocol import outputs as protocol_outputs

BUCKET = re.compile(r"^(?!xn--)(?!.*\.\.)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
PREFIX = re.compile(r"^[A-Za-z0-9!_.*'()/-]{0,200}$")
SECRET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
DOWNLOAD_SECONDS = 300  # how long the link a reader is redirected to is good for


@dataclass(frozen=True)
class Destination:
    """What a project admin asks for, before it is checked."""

    bucket: str
    region: str
    access_key_secret: str
    secret_key_secret: str
    prefix: str = ""
    endpoint: str = ""


def _prefix(prefix: str) -> str:
    if (
        not PREFIX.match(prefix)
        or prefix.startswith("/")
        or any(part in (".", "..") for part in prefix.split("/"))
    ):
        raise InvalidInput(
            f"Prefix {prefix[:60]!r} is not a key prefix: up to 200 letters, digits and !_.*'()/- , not "
            "starting with '/', with no '.' or '..' part.",
            field="prefix",
        )
    return prefix.strip("/") + "/" if prefix.strip("/") else ""


def _endpoint(endpoint: str) -> str:
    """An https:// endpoint at a public address, or any http(s) one in a range the provider allowed for
    tenants (KLIQUE_OUTBOUND_ALLOW): agents PUT outputs there, and the plane looks objects up there."""
    if not endpoint:
        return ""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise InvalidInput(
            f"Endpoint {endpoint[:100]!r} is not an S3 endpoint: give its https:// address with no path, or "
            "leave it empty for AWS S3.",
            field="endpoint",
        )
    try:
        outbound.check_secure_url(endpoint, why="outputs and the bucket's signed URLs cross it")
    except outbound.OutboundRefused as refused:
        raise InvalidInput(str(refused), field="endpoint") from None
    return f"{parts.scheme}://{parts.netloc}"


def _checked(project: Project, asked: Destination) -> Destination:
    if not BUCKET.match(asked.bucket):
        raise InvalidInput(
            f"{asked.bucket[:70]!r} is not a bucket name: 3 to 63 lowercase letters, digits, dots and "
            "dashes, starting and ending with a letter or digit.",
            field="bucket",
        )
    if not REGION.match(asked.region):  # the pools' and projects' region names
        raise InvalidInput(f"{asked.region[:60]!r} is not a region name (eu-west-1).", field="region")
    if project.regions and asked.region not in project.regions:
        raise InvalidInput(
            f"Project {project.name} is limited to {', '.join(project.regions)}: its outputs cannot go to a "
            f"bucket in {asked.region}.",
            field="region",
        )
    for field, name in (
        ("access_key_secret", asked.access_key_secret),
        ("secret_key_secret", asked.secret_key_secret),
    ):
        if not SECRET_NAME.match(name):
            raise InvalidInput(f"{name[:60]!r} is not a secret's name.", field=field)
        problem = vault.project_secret_problem(project, name)
        if problem:
            raise InvalidInput(
                f"The bucket's {field.replace('_', ' ')} cannot be used: {problem}.", field=field
            )
    return Destination(
        bucket=asked.bucket,
        region=asked.region,
        access_key_secret=asked.access_key_secret,
        secret_key_secret=asked.secret_key_secret,
        prefix=_prefix(asked.prefix),
        endpoint=_endpoint(asked.endpoint),
    )


def current(project: Project | None) -> OutputDestination | None:
    """The project's output bucket, or None: the plane's file store."""
    if project is None:
        return None
    return OutputDestination.objects.filter(project=project, retired_at__isnull=True).first()


@transaction.atomic
def destination_set(*, user: User, project: Project, asked: Destination | None) -> OutputDestination | None:
    """Send the project's outputs to a bucket (or, with None, back to the plane's file store). Outputs
    kept before stay where they went. Project admins and tenant admins only."""
    if not is_project_admin(user, project):
        raise Forbidden(
            f"Only an admin of project {project.name} or a tenant admin may set where its outputs go."
        )
    Project.objects.select_for_update().filter(pk=project.pk).first()  # one change at a time per project
    checked = _checked(project, asked) if asked is not None else None
    OutputDestination.objects.filter(project=project, retired_at__isnull=True).update(
        retired_at=timezone.now()
    )
    destination = None
    if checked is not None:
        destination = OutputDestination.objects.create(
            project=project,
            bucket=checked.bucket,
            prefix=checked.prefix,
            region=checked.region,
            endpoint=checked.endpoint,
            access_key_secret=checked.access_key_secret,
            secret_key_secret=checked.secret_key_secret,
            created_by=user.username,
        )
    record(
        actor=user.username,
        action="project.outputs",
        target=f"project {project.name}",
        store=str(destination) if destination else protocol_outputs.PLANE,
    )
    return destination


def _client(destination: OutputDestination, reader: str) -> Any:
    """boto3's S3 client for the bucket, used here to sign URLs only (it opens no connection)."""
    project = destination.project
    session = boto3.session.Session(
        aws_access_key_id=vault.project_secret(project, destination.access_key_secret, reader=reader),
        aws_secret_access_key=vault.project_secret(project, destination.secret_key_secret, reader=reader),
        region_name=destination.region,
    )
    style = "path" if destination.endpoint else "virtual"
    return session.client(
        "s3",
        endpoint_url=destination.endpoint or None,
        config=Config(signature_version="s3v4", s3={"addressing_style": style}),
    )


def key_of(destination: OutputDestination, task_id: str, lease_id: str, name: str) -> str:
    return f"{destination.prefix}{task_id}/{lease_id}/{name}"


def put_ticket(
    destination: OutputDestination, key: str, claim: protocol_outputs.Claim
) -> protocol_outputs.Ticket:
    """A presigned PUT of one object, signed with the content's SHA-256 (the bucket refuses other
    content) and carrying it as metadata, for the plane to compare at the receipt."""
    checksum = base64.b64encode(bytes.fromhex(claim.sha256)).decode()
    url = _client(destination, reader="agent upload").generate_presigned_url(
        "put_object",
        Params={
            "Bucket": destination.bucket,
            "Key": key,
            "ChecksumSHA256": checksum,
            "Metadata": {"klique-sha256": claim.sha256},
            "ContentType": "application/octet-stream",
        },
        ExpiresIn=protocol_outputs.TICKET_SECONDS,
    )
    return protocol_outputs.Ticket(
        store=protocol_outputs.S3,
        url=url,
        headers={
            "x-amz-checksum-sha256": checksum,
            "x-amz-meta-klique-sha256": claim.sha256,
            "Content-Type": "application/octet-stream",
        },
        expires_in=protocol_outputs.TICKET_SECONDS,
    )


class NotInBucket(Exception):
    """The object is missing from the bucket or differs from what was claimed; the message says how.
    `status`: 422 (store it again) or 503 (the bucket cannot be asked now)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def check_object(destination: OutputDestination, key: str, claim: protocol_outputs.Claim) -> None:
    """That the bucket holds the object as claimed (its size, and its SHA-256 where the bucket says it),
    asked through the guarded client: the endpoint is a tenant's choice."""
    url = _client(destination, reader="agent upload").generate_presigned_url(
        "head_object", Params={"Bucket": destination.bucket, "Key": key}, ExpiresIn=60
    )
    where = f"s3://{destination.bucket}/{key}"
    try:
        with outbound.client(timeout=15.0) as http:
            answer = http.head(url)
    except httpx.TransportError as error:
        raise NotInBucket(f"The bucket of {where} cannot be reached from the plane: {error}.", 503) from None
    if answer.status_code == 404:
        raise NotInBucket(f"{where} is not in the bucket; store it again with a new ticket.", 422)
    if answer.status_code >= 400:
        raise NotInBucket(f"The bucket answered {answer.status_code} when asked for {where}.", 503)
    size = int(answer.headers.get("content-length", -1))
    sums = {
        answer.headers.get("x-amz-meta-klique-sha256", claim.sha256),
        _hex(answer.headers.get("x-amz-checksum-sha256", "")) or claim.sha256,
    }
    if size != claim.size or sums != {claim.sha256}:
        raise NotInBucket(
            f"{where} holds {size} bytes, not the {claim.size} bytes with SHA-256 {claim.sha256} claimed; "
            "store it again with a new ticket.",
            422,
        )


def _hex(checksum: str) -> str:
    try:
        return base64.b64decode(checksum, validate=True).hex() if checksum else ""
    except ValueError:
        return "unreadable"


def download_url(destination: OutputDestination, key: str, filename: str, reader: str) -> str:
    """A presigned GET the reader is redirected to, saving the file under its own name."""
    disposition = f"attachment; filename*=UTF-8''{quote(filename)}"
    url: str = _client(destination, reader=reader).generate_presigned_url(
        "get_object",
        Params={"Bucket": destination.bucket, "Key": key, "ResponseContentDisposition": disposition},
        ExpiresIn=DOWNLOAD_SECONDS,
    )
    return url
