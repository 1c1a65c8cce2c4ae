"""A project's outputs in its own S3 bucket, for real: moto's S3 as the bucket, the real boto3 signing on
the plane, the real HTTP PUT of a presigned URL, and the plane's own API for tickets, receipts, listing and
download. The bucket's keys are project secrets in the vault; nothing of the file passes the plane."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import boto3
import httpx
import pytest
from django.test import override_settings
from django.utils import timezone
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.accounts.models import Project, User
from apps.fleet.models import OutputDestination, TaskOutput
from apps.fleet.outputs import meter_outputs
from apps.metering.models import LedgerEvent
from apps.resources.models import Pool
from apps.scheduling.models import Task, TaskRun, TaskState
from apps.vault.services import secret_set
from tests.cloud.conftest import KEYS
from tests.world import HOST_A, World

BUCKET, REGION = "apollo-outputs", "eu-west-1"
Api = Callable[..., APIClient]


@pytest.fixture
def bucket(moto_endpoint: str, world: World, db: None) -> Any:
    """An empty bucket in REGION on moto, and project apollo's keys to it in the vault."""
    s3 = boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        region_name=REGION,
        aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"],
    )
    httpx.post(f"{moto_endpoint}/moto-api/reset", timeout=10)
    s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
    with schema_context("acme"):
        carol = User.objects.get(username="carol")
        apollo = Project.objects.get(pk=world.project_a)
        secret_set(
            user=carol, scope="project", project=apollo, name="S3_KEY_ID", value=KEYS["AWS_ACCESS_KEY_ID"]
        )
        secret_set(
            user=carol, scope="project", project=apollo, name="S3_SECRET", value=KEYS["AWS_SECRET_ACCESS_KEY"]
        )
    return s3


def destination(at: str, **changes: str) -> dict[str, str]:
    return {
        "store": "s3",
        "bucket": BUCKET,
        "prefix": "runs/",
        "region": REGION,
        "endpoint": at,
        "access_key_secret": "S3_KEY_ID",
        "secret_key_secret": "S3_SECRET",
        **changes,
    }


def outputs_url(world: World) -> str:
    return f"/api/v1/projects/{world.project_a}/outputs/"


def running(world: World) -> uuid.UUID:
    """bob's task, running on h100 in project apollo under a new lease."""
    lease = uuid.uuid4()
    with schema_context("acme"):
        h100 = Pool.objects.get(name="h100")
        Task.objects.filter(pk=world.task_a).update(
            state=TaskState.RUNNING, pool=h100, lease_id=lease, project_id=world.project_a
        )
        TaskRun.objects.create(
            lease_id=lease, task_id=world.task_a, attempt=1, pool=h100, dispatched_at=timezone.now()
        )
    return lease


def agent(world: World, lease: uuid.UUID) -> APIClient:
    return APIClient(
        HTTP_HOST=HOST_A, HTTP_AUTHORIZATION=f"Bearer {world.agent_secret_a}", HTTP_X_KLIQUE_LEASE=str(lease)
    )


def claim(content: bytes) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(content).hexdigest(), "size": len(content)}


def store(world: World, lease: uuid.UUID, name: str, content: bytes) -> dict[str, Any]:
    """What an agent does: a ticket, the PUT to the bucket with the ticket's headers, a receipt."""
    client = agent(world, lease)
    ticket = client.post(
        f"/agents/v1/tasks/{world.task_a}/output-tickets/{name}", claim(content), format="json"
    )
    assert ticket.status_code == 200, ticket.content
    assert ticket.json()["store"] == "s3"
    put = httpx.put(ticket.json()["url"], content=content, headers=ticket.json()["headers"])
    assert put.status_code == 200, put.text
    receipt = client.post(
        f"/agents/v1/tasks/{world.task_a}/output-receipts/{name}", claim(content), format="json"
    )
    assert receipt.status_code == 201, receipt.content
    return dict(receipt.json())


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"bucket": "Not_A_Bucket"}, "bucket", "is not a bucket name"),
        ({"bucket": "ab"}, "bucket", "is not a bucket name"),
        ({"region": "EU West"}, "region", "is not a region name"),
        ({"prefix": "../other-team/"}, "prefix", "is not a key prefix"),
        ({"prefix": "/abs"}, "prefix", "is not a key prefix"),
        (
            {"access_key_secret": "MISSING_KEY"},
            "access_key_secret",
            "project apollo has no secret MISSING_KEY",
        ),
        ({"secret_key_secret": "SHARED_TOKEN"}, "secret_key_secret", "is not granted to project apollo"),
        ({"access_key_secret": "rm -rf /"}, "access_key_secret", "is not a secret's name"),
        ({"endpoint": "ftp://files.example.com"}, "endpoint", "is not an S3 endpoint"),
        ({"endpoint": "https://s3.example.com/some/path"}, "endpoint", "is not an S3 endpoint"),
    ],
)
def test_a_destination_that_cannot_work_is_refused_saying_why(
    api: Api, world: World, bucket: Any, moto_endpoint: str, changes: dict[str, str], field: str, words: str
) -> None:
    answer = api("carol").put(outputs_url(world), destination(moto_endpoint, **changes), format="json")
    assert answer.status_code == 400, answer.content
    assert words in str(answer.json()), answer.json()
    assert field in str(answer.json())
    with schema_context("acme"):
        assert not OutputDestination.objects.exists()


@pytest.mark.parametrize(
    ("endpoint", "words"),
    [
        ("http://127.0.0.1:9000", "loopback"),
        ("http://169.254.169.254", "link-local"),
        ("http://10.1.2.3:9000", "private"),
        ("http://[::ffff:127.0.0.1]:9000", "loopback"),
        ("http://0x7f000001", "loopback"),
    ],
)
def test_an_endpoint_at_an_internal_address_is_refused(
    api: Api, world: World, bucket: Any, endpoint: str, words: str
) -> None:
    with override_settings(KLIQUE_OUTBOUND_ALLOW=[]):
        answer = api("carol").put(outputs_url(world), destination(endpoint), format="json")
    assert answer.status_code == 400, answer.content
    assert words in str(answer.json())


def test_plain_http_is_refused_outside_an_allowed_range(api: Api, world: World, bucket: Any) -> None:
    answer = api("carol").put(outputs_url(world), destination("http://93.184.215.14"), format="json")
    assert answer.status_code == 400
    assert "must use https" in str(answer.json())


def test_a_bucket_outside_the_project_s_regions_is_refused(
    api: Api, world: World, bucket: Any, moto_endpoint: str
) -> None:
    with schema_context("acme"):
        Project.objects.filter(pk=world.project_a).update(regions=["us-east-1"])
    answer = api("carol").put(outputs_url(world), destination(moto_endpoint), format="json")
    assert answer.status_code == 400
    assert "Project apollo is limited to us-east-1: its outputs cannot go to a bucket in eu-west-1" in str(
        answer.json()
    )


def test_only_the_project_s_admins_set_where_its_outputs_go(
    api: Api, world: World, bucket: Any, moto_endpoint: str
) -> None:
    asked = destination(moto_endpoint)
    assert api("bob").put(outputs_url(world), asked, format="json").status_code == 403  # a member
    assert api("dave").put(outputs_url(world), asked, format="json").status_code == 403  # a viewer
    other_tenant = f"/api/v1/projects/{world.project_b}/outputs/"
    assert api("alice").put(other_tenant, asked, format="json").status_code == 404
    assert api("bob").get(outputs_url(world)).json() == {"store": "plane"}
    assert api("carol").put(outputs_url(world), asked, format="json").status_code == 200
    shown = api("bob").get(outputs_url(world)).json()
    assert shown["store"] == "s3"
    assert shown["bucket"] == BUCKET
    assert shown["prefix"] == "runs/"
    assert shown["created_by"] == "carol"
    assert KEYS["AWS_SECRET_ACCESS_KEY"] not in str(shown)  # names of secrets, never their values


def test_outputs_land_in_the_bucket_and_download_through_the_api(
    api: Api, world: World, bucket: Any, moto_endpoint: str
) -> None:
    assert api("carol").put(outputs_url(world), destination(moto_endpoint), format="json").status_code == 200
    lease = running(world)
    content = b"\x00\x01weights" * 1000
    kept = store(world, lease, "model/weights.bin", content)
    key = f"runs/{world.task_a}/{lease}/model/weights.bin"
    assert kept["location"] == f"s3://{BUCKET}/{key}"
    assert bucket.get_object(Bucket=BUCKET, Key=key)["Body"].read() == content
    with schema_context("acme"):
        assert not TaskOutput.objects.filter(
            destination__isnull=True, task_id=world.task_a, lease_id=lease
        ).exists()

    listed = api("bob").get(f"/api/v1/tasks/{world.task_a}/outputs/").json()
    assert ("model/weights.bin", len(content), f"s3://{BUCKET}/{key}") in [
        (item["name"], item["size"], item["location"]) for item in listed
    ]
    download = api("bob").get(f"/api/v1/tasks/{world.task_a}/outputs/model/weights.bin")
    assert download.status_code == 302
    fetched = httpx.get(download["Location"])
    assert fetched.content == content
    assert "attachment" in fetched.headers["content-disposition"]
    assert "weights.bin" in fetched.headers["content-disposition"]
    assert api("dave").get(f"/api/v1/tasks/{world.task_a}/outputs/model/weights.bin").status_code in {
        403,
        404,
    }

    # The plane's file store refuses an output the project keeps in its bucket, saying where it goes.
    refused = agent(world, lease).put(
        f"/agents/v1/tasks/{world.task_a}/outputs/other.bin", b"x", content_type="application/octet-stream"
    )
    assert refused.status_code == 409
    assert f"go to s3://{BUCKET}/runs/" in refused.json()["detail"]


def test_outputs_stored_under_an_earlier_destination_stay_where_they_went(
    api: Api, world: World, bucket: Any, moto_endpoint: str
) -> None:
    assert api("carol").put(outputs_url(world), destination(moto_endpoint), format="json").status_code == 200
    lease = running(world)
    store(world, lease, "first.txt", b"first")
    bucket.create_bucket(Bucket="apollo-archive", CreateBucketConfiguration={"LocationConstraint": REGION})
    moved = destination(moto_endpoint, bucket="apollo-archive", prefix="")
    assert api("carol").put(outputs_url(world), moved, format="json").status_code == 200
    second = store(world, lease, "second.txt", b"second")
    assert second["location"] == f"s3://apollo-archive/{world.task_a}/{lease}/second.txt"
    for name, content in (("first.txt", b"first"), ("second.txt", b"second")):
        download = api("bob").get(f"/api/v1/tasks/{world.task_a}/outputs/{name}")
        assert httpx.get(download["Location"]).content == content
    with schema_context("acme"):
        assert OutputDestination.objects.filter(retired_at__isnull=True).count() == 1
        assert OutputDestination.objects.count() == 2
    back = api("carol").put(outputs_url(world), {"store": "plane"}, format="json")
    assert back.json() == {"store": "plane"}
    ticket = agent(world, lease).post(
        f"/agents/v1/tasks/{world.task_a}/output-tickets/third.txt", claim(b"3"), format="json"
    )
    assert ticket.json() == {"store": "plane"}


def test_a_receipt_for_what_the_bucket_does_not_hold_as_claimed_is_refused(
    api: Api, world: World, bucket: Any, moto_endpoint: str
) -> None:
    assert api("carol").put(outputs_url(world), destination(moto_endpoint), format="json").status_code == 200
    lease = running(world)
    client = agent(world, lease)
    receipts = f"/agents/v1/tasks/{world.task_a}/output-receipts/result.txt"
    never_put = client.post(receipts, claim(b"result"), format="json")
    assert never_put.status_code == 422
    assert "is not in the bucket; store it again" in never_put.json()["detail"]

    ticket = client.post(
        f"/agents/v1/tasks/{world.task_a}/output-tickets/result.txt", claim(b"result"), format="json"
    ).json()
    httpx.put(ticket["url"], content=b"something else", headers=ticket["headers"])
    other = client.post(receipts, claim(b"result"), format="json")
    assert other.status_code == 422
    assert "holds 14 bytes, not the 6 bytes" in other.json()["detail"]
    for malformed in ({"sha256": "abc", "size": 6}, {"sha256": "0" * 64, "size": -1}, ["x"], {"size": True}):
        assert client.post(receipts, malformed, format="json").status_code == 400
    with schema_context("acme"):
        assert not TaskOutput.objects.filter(task_id=world.task_a, lease_id=lease).exists()


def test_tickets_are_for_the_current_run_under_its_lease_only(
    api: Api, world: World, bucket: Any, moto_endpoint: str
) -> None:
    assert api("carol").put(outputs_url(world), destination(moto_endpoint), format="json").status_code == 200
    running(world)
    tickets = f"/agents/v1/tasks/{world.task_a}/output-tickets/result.txt"
    stale = agent(world, uuid.uuid4()).post(tickets, claim(b"x"), format="json")
    assert stale.status_code == 409
    assert stale.json()["verdict"] == "stale"
    user = APIClient(HTTP_HOST=HOST_A, HTTP_AUTHORIZATION=f"Bearer {world.tokens['bob']}")
    assert user.post(tickets, claim(b"x"), format="json").status_code == 403  # user tokens open no agent door
    assert APIClient(HTTP_HOST=HOST_A).post(tickets, claim(b"x"), format="json").status_code == 401
    escape = agent(world, uuid.uuid4()).post(
        f"/agents/v1/tasks/{world.task_a}/output-tickets/../../etc/passwd", claim(b"x"), format="json"
    )
    assert escape.status_code in {400, 404, 409}


def test_a_project_limited_to_other_regions_since_gets_no_ticket(
    api: Api, world: World, bucket: Any, moto_endpoint: str
) -> None:
    assert api("carol").put(outputs_url(world), destination(moto_endpoint), format="json").status_code == 200
    lease = running(world)
    with schema_context("acme"):
        Project.objects.filter(pk=world.project_a).update(regions=["us-east-1"])
    ticket = agent(world, lease).post(
        f"/agents/v1/tasks/{world.task_a}/output-tickets/result.txt", claim(b"x"), format="json"
    )
    assert ticket.status_code == 409
    assert "limited to us-east-1 but its output bucket" in ticket.json()["detail"]


def test_outputs_in_a_bucket_are_not_metered_as_the_plane_s_storage(
    api: Api, world: World, bucket: Any, moto_endpoint: str
) -> None:
    assert api("carol").put(outputs_url(world), destination(moto_endpoint), format="json").status_code == 200
    lease = running(world)
    store(world, lease, "in-bucket.bin", b"b" * 100)
    plane_lease = running(world)
    with schema_context("acme"):
        OutputDestination.objects.update(retired_at=timezone.now())
    on_plane = agent(world, plane_lease).put(
        f"/agents/v1/tasks/{world.task_a}/outputs/on-plane.bin",
        b"p" * 50,
        content_type="application/octet-stream",
    )
    assert on_plane.status_code == 201, on_plane.content
    with schema_context("acme"):
        TaskOutput.objects.update(at=timezone.now() - timedelta(hours=2))
        meter_outputs()
        in_bucket = TaskOutput.objects.get(name="in-bucket.bin").pk
        plane_kept = TaskOutput.objects.get(name="on-plane.bin").pk
        metered = set(LedgerEvent.objects.filter(kind="storage").values_list("event_id", flat=True))
    assert any(event.startswith(f"storage:{plane_kept}:") for event in metered)
    assert not any(event.startswith(f"storage:{in_bucket}:") for event in metered)
