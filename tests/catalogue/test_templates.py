"""An app's template is checked when an entry is added: every problem at once, each named by its path, and
nothing a user sets reaches the app's command line."""

from __future__ import annotations

from typing import Any

import pytest

from apps.catalogue import shipped
from protocol.apps import AppSpec, Template, TemplateInvalid, with_port

GOOD: dict[str, Any] = {
    "name": "notebook",
    "version": "1.2.0",
    "command": ["jupyter", "lab", "--port={port}"],
    "health": {"path": "/api", "startup_seconds": 120},
    "gpus": "0.5",
    "variables": [{"name": "NOTEBOOK_DIR", "default": "/work"}, {"name": "TOKEN_NAME", "required": True}],
    "idle_timeout_seconds": 3600,
}


def problems(document: object) -> list[str]:
    with pytest.raises(TemplateInvalid) as refused:
        Template.parse(document)
    return refused.value.problems


def test_every_shipped_entry_is_a_valid_template() -> None:
    assert set(shipped.TEMPLATES) == {
        "jupyterlab",
        "agent-sandbox",
        "code-server",
        "vllm",
        "sglang",
        "llama-cpp",
        "k3k",
        "slurm",
    }
    sandbox = shipped.TEMPLATES["agent-sandbox"]
    assert sandbox.gateway_session is not None
    assert sandbox.spec({}, instance="0" * 8)["gateway_session"] == {"tokens": 2000000}
    for document in shipped.DOCUMENTS:
        assert Template.parse(Template.parse(document).as_json()) == Template.parse(document)


def test_every_problem_is_listed_by_its_path_at_once() -> None:
    found = problems(
        {
            "name": "Bad Name",
            "version": "",
            "command": ["ok", 7],
            "port": 80,
            "health": {"path": "api", "retries": 3},
            "gpus": "lots",
            "shell": "bash",
        }
    )
    assert found == [
        "shell: not a field of a template.",
        "name: lowercase letters, digits and hyphens, starting with a letter.",
        "version: a non-empty text is required.",
        'gpus: a number of GPUs, as "0", "1" or "0.5".',
        "command[1]: a non-empty text of at most 4096 characters.",
        "port: a port from 1024 to 65535, or null to let the agent pick a free one.",
        "health.retries: not a field of a health check (path, startup_seconds).",
        "health.path: a path that starts with / (letters, digits and URL punctuation).",
    ]


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"command": []}, "command:"),
        ({"command": "jupyter lab"}, "command:"),
        ({"command": ["a\x00b"]}, "command[0]:"),
        ({"port": True}, "port:"),
        ({"port": 70000}, "port:"),
        ({"health": {"startup_seconds": 0}}, "health.startup_seconds:"),
        ({"health": {"path": "/x\r\nHost: evil"}}, "health.path:"),
        ({"health": "/"}, "health:"),
        ({"kind": "daemon"}, "kind:"),
        ({"idle_timeout_seconds": 5}, "idle_timeout_seconds:"),
        ({"image": "--privileged"}, "image:"),
        ({"image": "busybox;rm -rf /"}, "image:"),
        ({"image": "/etc/passwd"}, "image:"),
        ({"environment": {"LD_PRELOAD": "/srv/x.so"}}, "environment:"),
        ({"environment": {"PORT": "80"}}, "environment.PORT:"),
        ({"variables": [{"name": "PATH"}]}, "variables[0].name:"),
        ({"variables": [{"name": "KLIQUE_TASK_ID"}]}, "variables[0].name:"),
        ({"variables": [{"name": "1BAD"}]}, "variables[0].name:"),
        ({"variables": [{"name": "PORT"}]}, "variables[0].name:"),
        ({"variables": [{"name": "A"}, {"name": "A"}]}, "variables[1].name:"),
        ({"variables": [{"name": "A", "default": 3}]}, "variables[0].default:"),
        ({"variables": [{"name": "A", "secret": True}]}, "variables[0].secret:"),
        ({"variables": "A=1"}, "variables:"),
        ({"secrets": "HF_TOKEN"}, "secrets:"),
        ({"secrets": ["LD_PRELOAD"]}, "secrets[0]:"),
        ({"secrets": ["SLURM_ACCOUNT"]}, "secrets[0]:"),
        ({"secrets": [7]}, "secrets[0]:"),
    ],
)
def test_a_template_with_a_problem_is_refused_naming_it(change: dict[str, Any], path: str) -> None:
    found = problems({**GOOD, **change})
    assert len(found) == 1, found
    assert found[0].startswith(path), found


@pytest.mark.parametrize("document", [None, [], "name: x", 3])
def test_a_template_is_an_object(document: object) -> None:
    assert problems(document) == ["(document): a template is a JSON object."]


def test_variables_reach_the_app_by_name_only_never_in_its_command() -> None:
    template = Template.parse(GOOD)
    hostile = '$(touch /tmp/owned) `id` "; rm -rf /'
    spec = template.spec(template.values({"TOKEN_NAME": hostile}), instance="0" * 8)
    assert spec["command"] == ["jupyter", "lab", "--port={port}"]
    assert spec["environment"] == {"NOTEBOOK_DIR": "/work", "TOKEN_NAME": hostile}
    placed = with_port(spec, 41234)
    assert placed["command"] == ["jupyter", "lab", "--port=41234"]
    assert placed["environment"]["PORT"] == "41234"
    assert AppSpec.parse(placed["app"]) == AppSpec("0" * 8, 41234, "/api", 120)


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ({}, "variables.TOKEN_NAME: required"),
        ({"TOKEN_NAME": "x", "LD_PRELOAD": "/x.so"}, "variables.LD_PRELOAD: not a variable of notebook"),
        ({"TOKEN_NAME": 5}, "variables.TOKEN_NAME: text"),
        ({"TOKEN_NAME": "x\x00y"}, "variables.TOKEN_NAME: text"),
    ],
)
def test_a_users_values_are_the_templates_variables(given: dict[str, Any], problem: str) -> None:
    with pytest.raises(TemplateInvalid) as refused:
        Template.parse(GOOD).values(given)
    assert refused.value.problems[0].startswith(problem), refused.value.problems


@pytest.mark.parametrize(
    "section",
    [None, {"instance": "x y"}, {"instance": "ab", "port": 22}, {"instance": "ab", "health_path": "nope"}],
)
def test_an_agent_reads_only_a_well_formed_app_section(section: object) -> None:
    with pytest.raises(TemplateInvalid):
        AppSpec.parse(section)


CLUSTER: dict[str, Any] = {
    "name": "team-cluster",
    "version": "1",
    "kind": "cluster",
    "command": ["kubectl", "proxy", "--port={port}"],
    "gpus": "4",
    "cluster": {"service": "k3k", "servers": 3, "agents": 2, "version": "v1.31.3-k3s1"},
}


def test_a_cluster_template_carries_its_cluster_to_the_agent() -> None:
    template = Template.parse(CLUSTER)
    assert template.cluster is not None
    assert (template.cluster.servers, template.cluster.agents) == (3, 2)
    app = template.spec({}, instance="0" * 8)["app"]
    assert app["cluster"] == {
        "service": "k3k", "servers": 3, "agents": 2, "version": "v1.31.3-k3s1", "persistence": "ephemeral"
    }  # fmt: skip
    assert (
        AppSpec.parse(with_port(template.spec({}, instance="0" * 8), 8001)["app"]).cluster == template.cluster
    )
    assert Template.parse(template.as_json()) == template


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"cluster": None}, 'cluster: a template of kind cluster says which service, as {"service": "k3k"}.'),
        ({"kind": "ide"}, "cluster: only a template of kind cluster makes a cluster."),
        ({"cluster": "k3k"}, 'cluster: an object {"service": "k3k", "agents": 1, ...}.'),
        ({"cluster": {"service": "pbs"}}, "cluster.service: one of k3k, slurm."),
        ({"cluster": {"service": "k3k", "mode": "shared"}}, "cluster.mode: not a field of a k3k cluster"),
        ({"cluster": {"service": "slurm", "agents": 2}}, "cluster.agents: not a field of a slurm cluster"),
        ({"cluster": {"service": "slurm", "workers": 0}}, "cluster.workers: a whole number of worker nodes"),
        ({"cluster": {"service": "slurm", "partition": "a b"}}, "cluster.partition: a Slurm partition"),
        ({"cluster": {"service": "k3k", "servers": 2}}, "cluster.servers: 1, 3 or 5"),
        ({"cluster": {"service": "k3k", "servers": True}}, "cluster.servers: 1, 3 or 5"),
        ({"cluster": {"service": "k3k", "agents": 0}}, "cluster.agents: a whole number of worker nodes"),
        ({"cluster": {"service": "k3k", "agents": "2"}}, "cluster.agents: a whole number of worker nodes"),
        ({"cluster": {"service": "k3k", "agents": 65}}, "cluster.agents: a whole number of worker nodes"),
        ({"cluster": {"service": "k3k", "version": "latest"}}, "cluster.version: a K3s version"),
        (
            {"cluster": {"service": "k3k", "version": "v1.31.3-k3s1; rm -rf /"}},
            "cluster.version: a K3s version",
        ),
        ({"cluster": {"service": "k3k", "persistence": "hostPath"}}, "cluster.persistence: one of"),
        ({"gpus": "3"}, "gpus: a cluster's GPUs are split over its 2 agents in whole GPUs; 3 is not."),
        ({"gpus": "0.5"}, "gpus: a cluster's GPUs are split over its 2 agents in whole GPUs; 0.5 is not."),
        ({"idle_timeout_seconds": 3600}, "idle_timeout_seconds: a cluster has none"),
    ],
)
def test_a_cluster_template_with_a_problem_is_refused_naming_it(change: dict[str, Any], problem: str) -> None:
    document = {**CLUSTER, **change}
    if document["cluster"] is None:
        del document["cluster"]
    found = problems(document)
    assert any(line.startswith(problem) for line in found), found


@pytest.mark.parametrize(
    "section",
    [
        {"service": "k3k", "agents": -1},
        {"service": "nomad"},
        {"service": "k3k", "servers": 4},
        "k3k",
    ],
)
def test_an_agent_reads_only_a_well_formed_cluster_in_an_app_section(section: object) -> None:
    with pytest.raises(TemplateInvalid, match=r"app\.cluster"):
        AppSpec.parse({"instance": "0a1b", "port": 8001, "cluster": section})
