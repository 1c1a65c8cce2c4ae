"""Pod templates (protocol.pods): what renders, validated against the Kubernetes schema, and what is refused,
each refusal naming the template and the line."""

from __future__ import annotations

from typing import Any

import pytest

from protocol import pods
from protocol.units import UNITS_PER_GPU

SETTINGS = pods.ClusterSettings(
    namespace="ml",
    agent="agent-1",
    work_volume={"persistentVolumeClaim": {"claimName": "klique-work"}},
    shared_path="/shared",
    shared_volume={"persistentVolumeClaim": {"claimName": "shared"}},
    local_queue="team-a",
)


def task(**extra: Any) -> dict[str, Any]:
    return {
        "task_id": "6c1f0d9e-0d55-4a5e-9a56-1d0f6f1e2a10",
        "lease_id": "2b7e4c1a-aaaa-bbbb-cccc-000000000000",
        "name": "fine-tune",
        "size_units": 2 * UNITS_PER_GPU,
        "nodes": 1,
        "user": "Grace Hopper <grace@example.com>",
        "spec": {
            "command": ["torchrun", "train.py"],
            "image": "ghcr.io/acme/train:1.2",
            "outputs": ["ckpt/*"],
        },
        **extra,
    }


LIMITS = "spec:\n  containers:\n    - name: main\n      resources:\n        limits:\n"

RICH = """\
metadata:
  labels:
    team: vision
  annotations:
    scheduling.k8s.io/group-name: ${job_name}
spec:
  schedulerName: volcano
  priorityClassName: research
  serviceAccountName: trainer
  nodeSelector:
    nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3
  tolerations:
    - key: nvidia.com/gpu
      operator: Exists
      effect: NoSchedule
  containers:
    - name: main
      image: ${image}
      env:
        - name: RUN_NAME
          value: "${task_name} for ${user}"
      resources:
        limits:
          memory: 64Gi
    - name: sidecar
      image: busybox
"""


def test_a_rich_template_renders_a_job_kubernetes_accepts() -> None:
    template = pods.check("vision", RICH, SETTINGS)
    made = pods.render(template, task(), SETTINGS, tenant="acme", environment={"WANDB_KEY": "k"})
    for manifest in (made.job, made.secret):
        pods.validate(manifest)
    job = made.job
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["spec"]["suspend"] is True
    spec = job["spec"]["template"]["spec"]
    assert spec["schedulerName"] == "volcano"
    assert spec["restartPolicy"] == "Never"
    assert (
        job["spec"]["template"]["metadata"]["annotations"]["scheduling.k8s.io/group-name"]
        == job["metadata"]["name"]
    )
    main, sidecar = spec["containers"]
    assert sidecar == {"name": "sidecar", "image": "busybox"}  # only the task's container is Klique's
    assert main["image"] == "ghcr.io/acme/train:1.2"
    assert main["command"] == ["torchrun", "train.py"]
    assert main["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": "2"}
    env = {item["name"]: item.get("value") for item in main["env"]}
    assert env["RUN_NAME"] == "fine-tune for Grace Hopper <grace@example.com>"
    assert env["KLIQUE_TASK_ID"] == task()["task_id"]
    mounts = {mount["mountPath"] for mount in main["volumeMounts"]}
    assert {"/scratch", "/shared", f"/klique/{task()['task_id']}"} <= mounts
    labels = job["metadata"]["labels"]
    assert labels["klique.io/submitter"] == "Grace-Hopper-grace-example.com"  # a label value
    assert job["metadata"]["annotations"]["klique.io/submitter"] == "Grace Hopper <grace@example.com>"
    assert "WANDB_KEY" not in str(job)
    assert made.secret["stringData"] == {"WANDB_KEY": "k"}


@pytest.mark.parametrize(
    "value",
    [
        "x\n  hostNetwork: true",
        "}: {hostPID: true",
        "'; privileged: true; '",
        "${image}",
        "*alias",
        "&anchor value",
    ],
)
def test_a_value_never_changes_the_documents_structure(value: str) -> None:
    """Values are put in after the YAML is parsed, into string scalars only: whatever a task's name holds,
    it stays one string."""
    template = pods.check("default", pods.DEFAULT_TEMPLATE.replace("${image}", '"${task_name}"'), SETTINGS)
    job = pods.render(template, task(name=value), SETTINGS).job
    spec = job["spec"]["template"]["spec"]
    assert spec["containers"][0]["image"] == value
    assert set(spec) == {"containers", "restartPolicy", "volumes"}
    pods.validate(job)


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("spec:\n  containers: [\n", 3, "not valid YAML"),
        ("a: &x [1, 2]\nb: *x\n", 1, "anchors and aliases"),
        ("spec:\n  containers:\n    - name: main\n      image: ${imagee}\n", 4, "unknown variable ${imagee}"),
        ("spec:\n  nodeSelector: 3\n", 2, "refused by Kubernetes"),
        (
            "spec:\n  containers:\n    - name: main\n      image: x\n      privilegd: true\n",
            3,
            "'privilegd' was unexpected",
        ),
        (
            LIMITS + "          amd.com/gpu: 1\n",
            6,
            "asks for 1 amd.com/gpu",
        ),
        (
            LIMITS + "          nvidia.com/gpu: 8\n",
            6,
            "asks for 8 nvidia.com/gpu",
        ),
        ("kind: Job\n", 1, "not part of a pod template"),
        ("spec: {}\nspec: {}\n", 2, "given twice"),
        ("base: {}\nspec:\n  <<: {}\n", 3, "merge keys"),
        ("- a\n- b\n", 1, "must be a mapping"),
    ],
    ids=[
        "yaml",
        "aliases",
        "unknown-variable",
        "schema-type",
        "schema-field",
        "amd-gpus",
        "more-gpus",
        "kind",
        "duplicate",
        "merge-key",
        "not-a-mapping",
    ],
)
def test_a_template_that_cannot_be_used_is_refused_naming_its_line(text: str, line: int, words: str) -> None:
    with pytest.raises(pods.PodTemplateInvalid) as refused:
        pods.check("train", text, SETTINGS)
    assert refused.value.line == line
    assert str(refused.value).startswith(f"Pod template 'train', line {line}: ")
    assert words in str(refused.value)


def test_a_billion_laughs_is_refused_before_it_expands() -> None:
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(9)
    )
    with pytest.raises(pods.PodTemplateInvalid, match="anchors and aliases"):
        pods.Template.parse("bomb", bomb)


def test_an_oversize_template_is_refused() -> None:
    with pytest.raises(pods.PodTemplateInvalid, match="over 64 KiB"):
        pods.Template.parse("big", "metadata: {}\n" + "# padding\n" * 8000)


def test_a_size_that_does_not_split_over_its_nodes_is_refused() -> None:
    template = pods.Template.parse("default", pods.DEFAULT_TEMPLATE)
    with pytest.raises(pods.PodTemplateInvalid, match="do not split evenly over 2 nodes"):
        pods.render(template, task(size_units=3 * UNITS_PER_GPU, nodes=2), SETTINGS)


def test_job_names_are_dns_labels_one_per_run() -> None:
    first = pods.job_name(task()["task_id"], task()["lease_id"])
    again = pods.job_name(task()["task_id"], "9f00aaaa-0000-0000-0000-000000000000")
    assert first != again
    assert len(first) <= 52
    assert first.startswith("k-")
    assert pods.job_name("Task_With.Odd/Chars", "L") == "k-taskwithoddchars-l"


JOBSET = pods.ClusterSettings(**{**SETTINGS.__dict__, "multi_node": "jobset"})


def test_a_multi_node_task_on_jobset_is_one_workload_whose_job_kubernetes_accepts() -> None:
    template = pods.check("vision", RICH, JOBSET)
    made = pods.render(template, task(size_units=8 * UNITS_PER_GPU, nodes=2), JOBSET, tenant="acme")
    pods.validate_jobset(made.job)
    pods.validate(pods.jobset_job(made.job))
    name = made.job["metadata"]["name"]
    assert (made.kind, made.followed, made.service) == ("JobSet", f"{name}-node-0", None)
    assert made.job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert made.job["spec"]["suspend"] is True
    inner = made.job["spec"]["replicatedJobs"][0]["template"]
    assert "kueue.x-k8s.io/queue-name" not in inner["metadata"]["labels"]
    assert inner["metadata"]["labels"]["klique.io/task"] == task()["task_id"]
    assert "suspend" not in inner["spec"]
    assert "ttlSecondsAfterFinished" not in inner["spec"]
    assert made.job["spec"]["ttlSecondsAfterFinished"] == JOBSET.ttl_seconds_after_finished
    pod = inner["spec"]["template"]
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == name
    env = {item["name"]: item.get("value") for item in pod["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == f"{name}-node-0-0.{name}.ml.svc"
    # The same task as an Indexed Job: rank 0 is the Job's pod 0 behind Klique's own Service.
    indexed = pods.render(template, task(size_units=8 * UNITS_PER_GPU, nodes=2), SETTINGS, tenant="acme")
    assert indexed.kind == "Job"
    assert indexed.service is not None
    main = indexed.job["spec"]["template"]["spec"]["containers"][0]
    assert {item["name"]: item.get("value") for item in main["env"]}[
        "MASTER_ADDR"
    ] == f"{name}-0.{name}.ml.svc"


def jobset_of(**changes: Any) -> dict[str, Any]:
    made = pods.render(pods.check("default", "", JOBSET), task(nodes=2), JOBSET, tenant="acme").job
    for key, value in changes.items():
        made["spec"][key] = value
    return made


@pytest.mark.parametrize(
    ("made", "words"),
    [
        (jobset_of(startupPolicy={"startupPolicyOrder": "InOrder"}), "unknown fields startupPolicy"),
        (jobset_of(replicatedJobs=[]), "one replicated Job named 'node'"),
        ({**jobset_of(), "apiVersion": "jobset.x-k8s.io/v1alpha1"}, "not a jobset.x-k8s.io/v1alpha2 JobSet"),
        ({**jobset_of(), "metadata": {"name": "k-" + "x" * 60}}, "is over 63 characters"),
    ],
)
def test_a_jobset_klique_would_not_make_is_refused(made: dict[str, Any], words: str) -> None:
    with pytest.raises(pods.ManifestRefused, match=words):
        pods.validate_jobset(made)


def test_a_jobset_whose_job_the_schema_refuses_names_the_path_inside_the_jobset() -> None:
    made = jobset_of()
    made["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["hostPID"] = "yes"
    with pytest.raises(pods.ManifestRefused) as refused:
        pods.validate_jobset(made)
    assert refused.value.path == (
        "spec",
        "replicatedJobs",
        0,
        "template",
        "spec",
        "template",
        "spec",
        "hostPID",
    )


def test_a_template_checked_for_both_multi_node_workloads_names_its_line() -> None:
    text = "spec:\n  containers:\n    - name: main\n      image: x\n  hostPID: 'yes'\n"
    with pytest.raises(pods.PodTemplateInvalid) as refused:
        pods.check("bad", text, JOBSET)
    assert refused.value.line == 5


PYTORCHJOB = pods.ClusterSettings(**{**SETTINGS.__dict__, "multi_node": "pytorchjob"})


def test_a_multi_node_task_for_the_training_operator_is_a_pytorchjob_of_a_master_and_workers() -> None:
    template = pods.check("vision", RICH, PYTORCHJOB)
    made = pods.render(template, task(size_units=8 * UNITS_PER_GPU, nodes=4), PYTORCHJOB, tenant="acme")
    pods.validate_workload(made.job)
    name = made.job["metadata"]["name"]
    assert (made.kind, made.followed, made.service) == ("PyTorchJob", name, None)
    assert made.job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert made.job["spec"]["runPolicy"]["suspend"] is True
    replicas = made.job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)
    main, sidecar = replicas["Worker"]["template"]["spec"]["containers"]
    assert (main["name"], sidecar["name"]) == ("pytorch", "sidecar")  # the operator's container name
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "subdomain" not in replicas["Master"]["template"]["spec"]


def pytorchjob_of() -> dict[str, Any]:
    template = pods.check("default", "", PYTORCHJOB)
    return pods.render(template, task(nodes=2), PYTORCHJOB, tenant="acme").job


def renamed(job: dict[str, Any], container: str) -> dict[str, Any]:
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = container
    return job


@pytest.mark.parametrize(
    ("made", "words"),
    [
        ({**pytorchjob_of(), "apiVersion": "kubeflow.org/v2"}, "not a kubeflow.org/v1 PyTorchJob"),
        ({**pytorchjob_of(), "spec": {**pytorchjob_of()["spec"], "elasticPolicy": {}}}, "unknown fields"),
        (
            {**pytorchjob_of(), "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 2}}}},
            "one Master and the Workers",
        ),
        (renamed(pytorchjob_of(), "main"), "the task's container is named 'pytorch'"),
        ({**pytorchjob_of(), "metadata": {"name": "k-" + "x" * 60}}, "is over 63 characters"),
    ],
)
def test_a_pytorchjob_klique_would_not_make_is_refused(made: dict[str, Any], words: str) -> None:
    with pytest.raises(pods.ManifestRefused, match=words):
        pods.validate_workload(made)


def test_a_pytorchjob_whose_pod_the_schema_refuses_names_the_path_inside_it() -> None:
    made = pytorchjob_of()
    made["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["hostPID"] = "yes"
    with pytest.raises(pods.ManifestRefused) as refused:
        pods.validate_workload(made)
    assert refused.value.path == ("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "hostPID")
