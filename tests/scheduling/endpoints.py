"""The configuration, queue and task endpoints, declared for the battery (tests/battery.py)."""

from __future__ import annotations

from tests.battery import Endpoint, fixed
from tests.scheduling.config import acme_document

ENDPOINTS = [
    Endpoint("GET", "api/v1/configuration/", "viewer", fixed("/api/v1/configuration/")),
    Endpoint("GET", "api/v1/configuration/draft/", "admin", fixed("/api/v1/configuration/draft/")),
    Endpoint(
        "PUT",
        "api/v1/configuration/draft/",
        "admin",
        fixed("/api/v1/configuration/draft/"),
        body=lambda w: {"document": acme_document()},
        bad_body={"document": {"pools": [{"name": "no capacity", "environment": "moon"}]}},
    ),
    Endpoint(
        "POST",
        "api/v1/configuration/draft/validate/",
        "admin",
        fixed("/api/v1/configuration/draft/validate/"),
    ),
    Endpoint(
        "POST",
        "api/v1/configuration/draft/provision/",
        "admin",
        fixed("/api/v1/configuration/draft/provision/"),
    ),
    Endpoint("GET", "api/v1/pools/", "viewer", fixed("/api/v1/pools/")),
    Endpoint(
        "GET",
        "api/v1/compute-resources/",
        "viewer",
        fixed("/api/v1/compute-resources/"),
        a_ids=lambda w: [w.compute_resource_a],
    ),
    Endpoint(
        "GET",
        "api/v1/compute-resources/<uuid:resource_id>/",
        "viewer",
        lambda w: f"/api/v1/compute-resources/{w.compute_resource_a}/",
        names_object=True,
    ),
    Endpoint(
        "POST",
        "api/v1/compute-resources/<uuid:resource_id>/batch-preview/",
        "member",
        lambda w: f"/api/v1/compute-resources/{w.compute_resource_a}/batch-preview/",
        body=lambda w: {"scheduler": "slurm", "name": "train", "spec": {"command": ["python", "train.py"]}},
        bad_body={"scheduler": "slurm", "spec": {"command": ["echo", "$(touch /tmp/x)\n#SBATCH --uid=0"]}},
        names_object=True,
    ),
    Endpoint(
        "GET",
        "api/v1/pools/<uuid:pool_id>/queue/",
        "viewer",
        lambda w: f"/api/v1/pools/{w.pool_a}/queue/",
        names_object=True,
    ),
    Endpoint("GET", "api/v1/queue-wait/", "viewer", fixed("/api/v1/queue-wait/")),
    Endpoint("GET", "api/v1/tasks/", "viewer", fixed("/api/v1/tasks/"), a_ids=lambda w: [w.task_a]),
    Endpoint(
        "POST",
        "api/v1/tasks/",
        "member",
        fixed("/api/v1/tasks/"),
        body=lambda w: {"compute_resource": "Research: 4 GPUs", "name": "train"},
        bad_body={"compute_resource": "Research: 4 GPUs", "gpus": "64"},
        expect=201,
    ),
    Endpoint(
        "GET",
        "api/v1/tasks/<uuid:task_id>/",
        "viewer",
        lambda w: f"/api/v1/tasks/{w.task_a}/",
        names_object=True,
    ),
    Endpoint(
        "POST",
        "api/v1/tasks/<uuid:task_id>/cancel/",
        "member",
        lambda w: f"/api/v1/tasks/{w.task_a}/cancel/",
        names_object=True,
        owner="bob",  # another member sees the task but may not cancel it
        others=403,
    ),
    Endpoint(
        "GET",
        "api/v1/tasks/<uuid:task_id>/why/",
        "viewer",
        lambda w: f"/api/v1/tasks/{w.task_a}/why/",
        names_object=True,
    ),
    Endpoint(
        "GET",
        "api/v1/tasks/<uuid:task_id>/history/",
        "viewer",
        lambda w: f"/api/v1/tasks/{w.task_a}/history/",
        names_object=True,
    ),
]

TRACE = (
    "timestamp,duration,num_gpus,compute_resource\n"
    "2026-11-01 10:00:00,3600,4,Research: 4 GPUs\n"
    "2026-11-01 10:05:00,600,4,Research: 4 GPUs\n"
)

ENDPOINTS.append(
    Endpoint(
        "POST",
        "api/v1/configuration/draft/simulate/",
        "admin",
        fixed("/api/v1/configuration/draft/simulate/"),
        body=lambda w: {"trace": TRACE},
        bad_body={"trace": "no,columns\n1,2\n"},
    )
)

ENDPOINTS += [
    Endpoint(
        "GET",
        "api/v1/tasks/<uuid:task_id>/logs/",
        "viewer",
        lambda w: f"/api/v1/tasks/{w.task_a}/logs/",
        names_object=True,
        owner="bob",  # what a task wrote: its submitter's, its project's members', the admins'
        others=403,
    ),
    Endpoint(
        "GET",
        "api/v1/tasks/<uuid:task_id>/metrics/",
        "viewer",
        lambda w: f"/api/v1/tasks/{w.task_a}/metrics/",
        names_object=True,
        owner="bob",  # what a task wrote: its submitter's, its project's members', the admins'
        others=403,
    ),
    Endpoint(
        "GET",
        "api/v1/pools/<uuid:pool_id>/agent-tokens/",
        "admin",
        lambda w: f"/api/v1/pools/{w.pool_a}/agent-tokens/",
        names_object=True,
    ),
    Endpoint(
        "POST",
        "api/v1/pools/<uuid:pool_id>/agent-tokens/",
        "admin",
        lambda w: f"/api/v1/pools/{w.pool_a}/agent-tokens/",
        body=lambda w: {"name": "rack-7"},
        bad_body={"name": ""},
        expect=201,
        names_object=True,
    ),
    Endpoint(
        "DELETE",
        "api/v1/agent-tokens/<uuid:token_id>/",
        "admin",
        lambda w: f"/api/v1/agent-tokens/{w.agent_token_a}/",
        expect=204,
        names_object=True,
    ),
    Endpoint("GET", "api/v1/instances/", "admin", lambda w: "/api/v1/instances/"),
]

ENDPOINTS += [
    Endpoint(
        "GET",
        "api/v1/tasks/<uuid:task_id>/outputs/",
        "viewer",
        lambda w: f"/api/v1/tasks/{w.task_a}/outputs/",
        names_object=True,
        owner="bob",  # what a task wrote: its submitter's, its project's members', the admins'
        others=403,
    ),
    Endpoint(
        "GET",
        "api/v1/tasks/<uuid:task_id>/outputs/<path:name>",
        "viewer",
        lambda w: f"/api/v1/tasks/{w.task_a}/outputs/result.txt",
        names_object=True,
        owner="bob",  # what a task wrote: its submitter's, its project's members', the admins'
        others=403,
    ),
    Endpoint(
        "GET",
        "api/v1/projects/<uuid:project_id>/outputs/",
        "viewer",
        lambda w: f"/api/v1/projects/{w.project_a}/outputs/",
        names_object=True,
    ),
    Endpoint(
        "PUT",
        "api/v1/projects/<uuid:project_id>/outputs/",
        "project_admin",
        lambda w: f"/api/v1/projects/{w.project_a}/outputs/",
        body=lambda w: {"store": "plane"},
        bad_body={"store": "s3", "bucket": "Not_A_Bucket"},
        names_object=True,
    ),
    Endpoint(
        "GET",
        "api/v1/wait-objectives/",
        "viewer",
        fixed("/api/v1/wait-objectives/"),
        a_ids=lambda w: [w.objective_a],
    ),
    Endpoint(
        "POST",
        "api/v1/wait-objectives/",
        "admin",
        fixed("/api/v1/wait-objectives/"),
        body=lambda w: {
            "name": "dev-p50",
            "policy": "research",
            "percentile": 50,
            "target_seconds": 600,
            "window_seconds": 86_400,
        },
        bad_body={
            "name": "bad",
            "policy": "research",
            "percentile": 100,
            "target_seconds": 600,
            "window_seconds": 86_400,
        },
        expect=201,
    ),
    Endpoint(
        "GET",
        "api/v1/wait-objectives/<uuid:objective_id>/",
        "viewer",
        lambda w: f"/api/v1/wait-objectives/{w.objective_a}/",
        names_object=True,
    ),
    Endpoint(
        "PUT",
        "api/v1/wait-objectives/<uuid:objective_id>/",
        "admin",
        lambda w: f"/api/v1/wait-objectives/{w.objective_a}/",
        body=lambda w: {
            "name": "research-p95",
            "policy": "research",
            "percentile": 95,
            "target_seconds": 1800,
            "window_seconds": 7 * 86_400,
        },
        bad_body={
            "name": "research-p95",
            "policy": "research",
            "percentile": 95,
            "target_seconds": 1800,
            "window_seconds": 600,
        },
        names_object=True,
    ),
    Endpoint(
        "DELETE",
        "api/v1/wait-objectives/<uuid:objective_id>/",
        "admin",
        lambda w: f"/api/v1/wait-objectives/{w.objective_a}/",
        expect=204,
        names_object=True,
    ),
    Endpoint("GET", "api/v1/webhooks/", "admin", fixed("/api/v1/webhooks/"), a_ids=lambda w: [w.webhook_a]),
    Endpoint(
        "POST",
        "api/v1/webhooks/",
        "admin",
        fixed("/api/v1/webhooks/"),
        body=lambda w: {"url": "https://93.184.215.14/other", "secret_name": "SHARED_TOKEN"},
        bad_body={"url": "ftp://hooks.example.com/", "secret_name": "SHARED_TOKEN"},
        expect=201,
    ),
    Endpoint(
        "DELETE",
        "api/v1/webhooks/<uuid:webhook_id>/",
        "admin",
        lambda w: f"/api/v1/webhooks/{w.webhook_a}/",
        expect=204,
        names_object=True,
    ),
    Endpoint(
        "GET",
        "api/v1/webhooks/<uuid:webhook_id>/deliveries/",
        "admin",
        lambda w: f"/api/v1/webhooks/{w.webhook_a}/deliveries/",
        names_object=True,
    ),
]
