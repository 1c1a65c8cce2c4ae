"""Declared volumes: a task names volumes out of those its pool's agent offers, never says what to mount.
The form is checked when the task is submitted, the offer by the agent before it starts the task; a
pool's read-only volume stays read-only; backends that mount none refuse a task that declares some."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from rest_framework.test import APIClient

from agents.backend import Refused
from agents.baremetal import BareMetal
from agents.hpc.backend import DIALECTS, Batch
from agents.hpc.cluster import Completed, Settings
from agents.state import Position, State
from protocol import pods
from protocol import volumes as rule
from protocol.units import UNITS_PER_GPU
from tests.world import World

DATASETS = {"path": "/datasets", "source": {"persistentVolumeClaim": {"claimName": "imagenet"}}}
MODELS = {"path": "/models", "read_only": False, "source": {"nfs": {"server": "nfs.lab", "path": "/models"}}}
OFFERS = rule.offered({"datasets": DATASETS, "models": MODELS})


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("datasets", "must be a list"),
        ({"datasets": True}, "must be a list"),
        ([["datasets"]], "each entry is a name"),
        ([{"name": "datasets", "path": "/etc"}], "each entry is a name"),  # a task never says where
        ([{"name": "datasets", "source": {"hostPath": {"path": "/"}}}], "each entry is a name"),
        ([{"read_only": True}], "each entry is a name"),
        ([{"name": "datasets", "read_only": "yes"}], "must be true or false"),
        (["../etc"], "is not a volume name"),
        (["Datasets"], "is not a volume name"),
        (["data sets"], "is not a volume name"),
        (["-data"], "is not a volume name"),
        (["a" * 41], "is not a volume name"),
        ([""], "is not a volume name"),
        ([7], "each entry is a name"),
        (["datasets", {"name": "datasets"}], "twice"),
        ([f"v{i}" for i in range(17)], "at most 16"),
    ],
)
def test_a_declaration_out_of_form_is_refused(value: object, says: str) -> None:
    with pytest.raises(rule.VolumeRefused, match=says):
        rule.wanted(value)


def test_a_declaration_in_form() -> None:
    assert rule.wanted(None) == rule.wanted([]) == []
    assert rule.wanted(["datasets", {"name": "models", "read_only": True}]) == [
        rule.Wanted("datasets"),
        rule.Wanted("models", read_only=True),
    ]


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ({"Data": DATASETS}, "not a volume name"),
        ({"data": {**DATASETS, "path": "datasets"}}, "absolute path"),
        ({"data": {**DATASETS, "path": "/data/../etc"}}, "absolute path"),
        ({"data": {**DATASETS, "path": "/"}}, "absolute path"),
        ({"data": {**DATASETS, "path": "/data:rw"}}, "absolute path"),
        ({"data": {**DATASETS, "path": "/klique-work"}}, "the task's own folders"),
        ({"data": {**DATASETS, "path": "/scratch/x"}}, "the task's own folders"),
        ({"a": DATASETS, "b": DATASETS}, "another volume is mounted at /datasets"),
        ({"data": {**DATASETS, "source": {}}}, "one volume source"),
        ({"data": {**DATASETS, "source": {"nfs": {}, "hostPath": {}}}}, "one volume source"),
        ({"data": {**DATASETS, "mode": "rw"}}, "takes path, read_only and source"),
    ],
)
def test_an_offer_out_of_form_is_refused(table: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        rule.offered(table)


def test_a_volume_the_pool_does_not_offer_is_named_with_what_it_offers() -> None:
    with pytest.raises(rule.VolumeRefused, match=r"volume 'secrets'.*it offers: datasets, models"):
        rule.chosen(rule.wanted(["datasets", "secrets"]), OFFERS)


def settings(**extra: Any) -> pods.ClusterSettings:
    return pods.ClusterSettings(namespace="ml", agent="agent-1", volumes=OFFERS, **extra)


def assignment(volumes: list[Any]) -> dict[str, Any]:
    return {
        "task_id": "6c1f0d9e-0d55-4a5e-9a56-1d0f6f1e2a10",
        "lease_id": "2b7e4c1a-aaaa-bbbb-cccc-000000000000",
        "size_units": UNITS_PER_GPU,
        "nodes": 1,
        "user": "ada",
        "spec": {"command": ["python", "train.py"], "volumes": volumes},
    }


def mounts_of(job: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    pod = job["spec"]["template"]["spec"]
    sources = {volume["name"]: volume for volume in pod["volumes"]}
    found = {}
    for mount in pod["containers"][0]["volumeMounts"]:
        if mount["name"].startswith("klique-v-"):
            source = sources[mount["name"]]
            assert set(source) - {"name"} <= {"persistentVolumeClaim", "nfs"}
            found[mount["mountPath"]] = (mount["name"], mount["readOnly"])
    return found


@pytest.mark.parametrize(
    ("declared", "mounted"),
    [
        ([], {}),
        (["datasets"], {"/datasets": ("klique-v-datasets", True)}),  # the pool's read-only stays so
        ([{"name": "datasets", "read_only": False}], {"/datasets": ("klique-v-datasets", True)}),
        (["models"], {"/models": ("klique-v-models", False)}),
        ([{"name": "models", "read_only": True}], {"/models": ("klique-v-models", True)}),
        (
            ["models", "datasets"],
            {"/models": ("klique-v-models", False), "/datasets": ("klique-v-datasets", True)},
        ),
    ],
)
def test_declared_volumes_are_mounted_as_the_pool_offers_them(
    declared: list[Any], mounted: dict[str, tuple[str, bool]]
) -> None:
    template = pods.check("default", pods.DEFAULT_TEMPLATE, settings())
    manifests = pods.render(template, assignment(declared), settings())
    pods.validate(manifests.job)
    assert mounts_of(manifests.job) == mounted


def test_an_offered_source_the_schema_refuses_is_refused_when_the_configuration_is_read() -> None:
    bad = rule.offered({"data": {**DATASETS, "source": {"persistentVolumeClaim": {"claimNam": "x"}}}})
    with pytest.raises(pods.PodTemplateInvalid, match="refused by Kubernetes"):
        pods.check("default", pods.DEFAULT_TEMPLATE, pods.ClusterSettings(volumes=bad))


# The plane and the backends ---------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("volumes", "says"),
    [
        ("datasets", "must be a list"),
        (["../etc"], "is not a volume name"),
        ([{"name": "x", "path": "/"}], "each"),
    ],
)
def test_a_task_cannot_be_submitted_with_volumes_out_of_form(
    volumes: object, says: str, api: Callable[..., APIClient], world: World
) -> None:
    spec = {"command": ["true"], "volumes": volumes}
    answer = api("bob").post(
        "/api/v1/tasks/", {"compute_resource": "Research: 4 GPUs", "spec": spec}, format="json"
    )
    assert answer.status_code == 400, answer.content
    assert says in answer.json()["detail"]


@pytest.mark.django_db
def test_a_task_with_volumes_in_form_is_queued(api: Callable[..., APIClient], world: World) -> None:
    spec = {"command": ["true"], "volumes": ["datasets", {"name": "models", "read_only": True}]}
    answer = api("bob").post(
        "/api/v1/tasks/", {"compute_resource": "Research: 4 GPUs", "spec": spec}, format="json"
    )
    assert answer.status_code == 201, answer.content
    assert answer.json()["spec"]["volumes"] == spec["volumes"]


def test_the_bare_metal_agent_refuses_a_task_that_declares_volumes(tmp_path: Path) -> None:
    bare = BareMetal(1, tmp_path / "work", State(tmp_path / "agent.sqlite"))

    async def report(task_id: str, kind: str, body: dict[str, Any], offset: Position | None) -> None:
        raise AssertionError("nothing starts")

    given = {"task_id": "t", "lease_id": "l", "size_units": UNITS_PER_GPU}
    given["spec"] = {"command": ["true"], "volumes": ["datasets"]}
    with pytest.raises(Refused, match="a bare-metal pool does not mount") as refused:
        asyncio.run(bare.start(given, report))
    assert refused.value.permanent
    assert bare.running() == []


@pytest.mark.parametrize("scheduler", sorted(DIALECTS))
@pytest.mark.parametrize(
    "declared",
    [["datasets"], [{"name": "models", "read_only": True}], ["datasets", "models"], [{"name": "scratch"}]],
)
def test_a_batch_agent_refuses_a_task_that_declares_volumes_before_it_submits_anything(
    tmp_path: Path, scheduler: str, declared: list[Any]
) -> None:
    """Slurm, PBS and LSF jobs see the cluster's own file systems: a task that counts on declared volumes is
    refused for good, naming the scheduler, and no command reaches the cluster."""
    commands: list[list[str]] = []

    async def cluster(
        argv: Sequence[str],
        stdin: bytes | None,
        environment: Mapping[str, str] | None,
        account: str | None = None,
        output: BinaryIO | None = None,
        /,
    ) -> Completed:
        commands.append(list(argv))
        return Completed(0, "", "")

    settings = Settings(jobs_dir=tmp_path / "jobs", poll_seconds=3600)
    batch = Batch(
        DIALECTS[scheduler](), settings, State(tmp_path / "agent.sqlite"), "https://acme.example", run=cluster
    )

    async def report(task_id: str, kind: str, body: dict[str, Any], offset: Position | None) -> None:
        raise AssertionError("nothing starts")

    given = {
        "task_id": "t",
        "lease_id": "l",
        "size_units": UNITS_PER_GPU,
        "user": "alice",
        "task_token": "kqt_x_y",
        "spec": {"command": ["true"], "volumes": declared},
    }

    async def start() -> None:
        try:
            await batch.start(given, report)
        finally:
            if batch.poller is not None:
                batch.poller.cancel()

    with pytest.raises(Refused, match=f"a {scheduler.upper()} pool does not mount") as refused:
        asyncio.run(start())
    assert refused.value.permanent
    assert batch.running() == []
    assert not [argv for argv in commands if argv[0] in ("sbatch", "qsub", "bsub")]
    assert not (tmp_path / "jobs" / "t").exists()
