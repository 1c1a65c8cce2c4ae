"""Batch templates on compute resources: checked when the draft is saved, provisioned, and previewed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from tests.scheduling.config import acme_document
from tests.world import World

TEMPLATE = """#!/bin/bash
#SBATCH --job-name={{ job_name }}
#SBATCH --nodes={{ nodes }}
#SBATCH --gpus-per-node={{ gpus_per_node }}
#SBATCH --output={{ output }}
{% if partition %}#SBATCH --partition={{ partition }}
{% endif %}{% for directive in directives %}#SBATCH {{ directive }}
{% endfor %}module load cuda/12.4
{{ environment }}
{{ run }}
"""


def with_batch(batch: dict[str, Any]) -> dict[str, Any]:
    document = acme_document()
    document["policies"][0]["compute_resources"][0]["batch"] = batch
    return document


def resource_id(client: APIClient, name: str) -> str:
    rows = client.get("/api/v1/compute-resources/", {"limit": 100}).json()["results"]
    return str(next(row["id"] for row in rows if row["name"] == name))


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (
            {"slurm": {"template": "#!/bin/bash\n{{ nodes }}{{ gpus }}\n{% for %}\n{{ run }}"}},
            "slurm batch: line 3",
        ),
        (
            {"slurm": {"template": "#!/bin/bash\n#SBATCH --nodes={{ nodes }}\n"}},
            "must use run, gpus_per_node",
        ),
        ({"slurm": {"allowed_directives": ["--uid"]}}, "cannot be left to tasks"),
        ({"slurm": {"defaults": {"partition": "gpu; id"}}}, "cannot go into a batch script"),
        ({"condor": {}}, "Unknown scheduler 'condor'"),
    ],
)
def test_a_batch_template_that_cannot_work_is_refused_when_saved(
    api: Callable[..., APIClient], batch: dict[str, Any], message: str
) -> None:
    saved = api("alice").put("/api/v1/configuration/draft/", {"document": with_batch(batch)}, format="json")
    assert saved.status_code == 400, saved.content
    assert message in str(saved.json()), saved.json()


def test_templates_are_provisioned_exported_and_previewed_as_the_agent_renders_them(
    api: Callable[..., APIClient], world: World
) -> None:
    admin = api("alice")
    batch = {
        "slurm": {
            "template": TEMPLATE,
            "allowed_directives": ["--qos"],
            "defaults": {"partition": "gpu", "time_limit_minutes": 120},
        }
    }
    assert (
        admin.put("/api/v1/configuration/draft/", {"document": with_batch(batch)}, format="json").status_code
        == 200
    )
    assert admin.post("/api/v1/configuration/draft/provision/").status_code == 200
    active = admin.get("/api/v1/configuration/").json()
    research = next(policy for policy in active["policies"] if policy["name"] == "research")
    assert research["compute_resources"][0]["batch"] == batch

    member = api("bob")
    queue = resource_id(member, "Research: 4 GPUs")
    spec = {"command": ["python", "train.py", "--lr", "3e-4"], "batch": {"directives": {"--qos": "high"}}}
    preview = member.post(
        f"/api/v1/compute-resources/{queue}/batch-preview/", {"name": "resnet", "spec": spec}, format="json"
    )
    assert preview.status_code == 200, preview.content
    shown = preview.json()
    assert (shown["scheduler"], shown["template_from"]) == ("slurm", "compute resource")
    lines = shown["script"].splitlines()
    assert "#SBATCH --gpus-per-node=4" in lines
    assert "#SBATCH --partition=gpu" in lines  # the compute resource's default
    assert "#SBATCH --qos=high" in lines  # allowed, asked for by the task
    assert "module load cuda/12.4" in lines
    assert lines[-1].endswith("-- python train.py --lr 3e-4")
    assert shown["submit"] == [
        "sbatch",
        "--parsable",
        "/cluster/klique/jobs/00000000-0000-0000-0000-000000000000/job.sh",
    ]

    pbs = member.post(
        f"/api/v1/compute-resources/{queue}/batch-preview/", {"scheduler": "pbs"}, format="json"
    )
    assert pbs.json()["template_from"] == "default"
    assert pbs.json()["submit"][:5] == ["qsub", "-N", "klique-00000000", "-l", "nodes=1:gpus=4"]

    cases: list[tuple[dict[str, Any], str]] = [
        ({"command": ["echo", "fine\n#SBATCH --uid=0"]}, "newline"),
        ({"command": ["true"], "batch": {"directives": {"--exclusive": "user"}}}, "not allowed"),
    ]
    for spec, why in cases:
        refused = member.post(
            f"/api/v1/compute-resources/{queue}/batch-preview/", {"spec": spec}, format="json"
        )
        assert refused.status_code == 400
        assert why in refused.json()["detail"]
    broken = member.post(
        f"/api/v1/compute-resources/{queue}/batch-preview/", {"template": "{{ run }"}, format="json"
    )
    assert broken.status_code == 400
    assert "The template is not usable: line 1" in broken.json()["detail"]
