"""A task's `image` goes onto a container engine's command line (podman, docker, apptainer): one rule,
an allow-list of the image reference grammar (protocol.images), checked when a task is submitted and again
by the agent, so that no value is ever read as an option, a second word or shell syntax."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.scheduling.models import Task
from protocol import images
from tests.world import World

REFUSED = [
    "--privileged",
    "-v/:/host",
    "--volume=/:/host",
    "-it",
    "busybox --privileged",
    "busybox\t--privileged",
    "busybox\n--privileged",
    "busybox\x00",
    "x$(id)",
    "x`id`",
    "x;id",
    "x|id",
    "x&&id",
    "'busybox'",
    '"busybox"',
    "busybox:",
    "busybox:-tag",
    ":latest",
    "@sha256:" + "a" * 64,
    "busybox@sha256:short",
    "Busybox",  # repository names are lower case
    "registry.example.com:port/x",
    "a/../b",
    "docker://--privileged",
    "docker-archive:/tmp/x.tar",
    "oci:/tmp/layout",
    "http://registry.example.com/x",
    "x" * 300,
    "/etc/../root/x.sif",
    "/images/x.sif --bind /:/host",
    "/images/$(id).sif",
]

ACCEPTED = [
    "busybox",
    "python:3.11-slim",
    "localhost/trainer:2.1",
    "localhost:5000/team/trainer:2024.05_rc1",
    "nvcr.io/nvidia/pytorch:24.05-py3",
    "ghcr.io/acme/train:1.2",
    "docker://nvcr.io/nvidia/pytorch:24.05-py3",
    "registry.example.com/a__b/c-d.e:latest",
    "busybox@sha256:" + "0123456789abcdef" * 4,
    "busybox:1.36@sha256:" + "0123456789abcdef" * 4,
]


@pytest.mark.parametrize("image", REFUSED)
def test_the_rule_refuses_what_an_engine_could_read_as_something_else(image: str) -> None:
    with pytest.raises(images.ImageRefused):
        images.checked(image, paths=True)
    with pytest.raises(images.ImageRefused):
        images.engine_reference(image)


@pytest.mark.parametrize("image", ACCEPTED)
def test_the_rule_takes_real_image_references(image: str) -> None:
    assert images.checked(image) == image
    assert images.engine_reference(image) == image.removeprefix("docker://")


@pytest.mark.parametrize("value", [None, 7, ["busybox"], {"name": "busybox"}, ""])
def test_an_image_is_text(value: object) -> None:
    with pytest.raises(images.ImageRefused):
        images.checked(value)


def test_a_path_is_for_hpc_pools_only() -> None:
    assert images.checked("/shared/images/pytorch.sif", paths=True) == "/shared/images/pytorch.sif"
    with pytest.raises(images.ImageRefused, match="HPC pools"):
        images.engine_reference("/shared/images/pytorch.sif")


@pytest.mark.django_db
@pytest.mark.parametrize("image", ["--privileged", "busybox --privileged", "x$(id)", "-v/:/host", 5])
def test_a_task_with_such_an_image_is_not_submitted(
    image: object, api: Callable[..., APIClient], world: World
) -> None:
    spec = {"command": ["true"], "image": image}
    answer = api("bob").post(
        "/api/v1/tasks/", {"compute_resource": "Research: 4 GPUs", "spec": spec}, format="json"
    )
    assert answer.status_code == 400, answer.content
    assert "image" in answer.json()["detail"].lower()
    with schema_context("acme"):
        assert not Task.objects.filter(spec__image=image).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("image", ["localhost/trainer:2.1", "/shared/images/pytorch.sif", ""])
def test_a_task_with_a_real_image_is_submitted(
    image: str, api: Callable[..., APIClient], world: World
) -> None:
    spec = {"command": ["true"], "image": image}
    answer = api("bob").post(
        "/api/v1/tasks/", {"compute_resource": "Research: 4 GPUs", "spec": spec}, format="json"
    )
    assert answer.status_code == 201, answer.content
