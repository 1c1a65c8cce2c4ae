"""A Slurm cluster's section, files and programs (protocol.clusters): what a template may say, what the
controller is given, and that Slurm's host lists are read as Slurm reads them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from protocol import clusters, pods

TASK = "0f0e0d0c-0b0a-4999-8888-777766665555"
LEASE = "abcdef12-3456-4789-8abc-def012345678"
JOB = pods.job_name(TASK, LEASE)
CLUSTER = clusters.cluster_name(JOB)


def slurm(**fields: Any) -> clusters.ClusterService:
    return clusters.ClusterService.parse({"service": "slurm", **fields})


def test_a_slurm_section_with_its_defaults_and_as_written() -> None:
    assert slurm().as_json() == {
        "service": "slurm",
        "workers": 1,
        "worker_gpus": 1,
        "worker_cpus": 4,
        "worker_compute_resource": "",
        "partition": "gpu",
        "idle_seconds": 300,
    }
    written = {"service": "slurm", "workers": 8, "worker_gpus": 2, "worker_cpus": 16,
               "worker_compute_resource": "Training", "partition": "batch", "idle_seconds": 600}  # fmt: skip
    assert clusters.ClusterService.parse(written).as_json() == written
    assert slurm(worker_gpus=0).worker_gpus == 0  # a CPU cluster


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"workers": 0}, "cluster.workers"),
        ({"workers": 65}, "cluster.workers"),
        ({"workers": True}, "cluster.workers"),
        ({"workers": "4"}, "cluster.workers"),
        ({"worker_gpus": 17}, "cluster.worker_gpus"),
        ({"worker_gpus": 0.5}, "cluster.worker_gpus"),
        ({"worker_cpus": 0}, "cluster.worker_cpus"),
        ({"idle_seconds": 10}, "cluster.idle_seconds"),
        ({"partition": "gpu; rm -rf /"}, "cluster.partition"),
        ({"partition": "a\nNodeName=x"}, "cluster.partition"),
        ({"partition": ""}, "cluster.partition"),
        ({"worker_compute_resource": 3}, "cluster.worker_compute_resource"),
        ({"agents": 2}, "cluster.agents: not a field of a slurm cluster"),
        ({"servers": 3}, "cluster.servers: not a field of a slurm cluster"),
    ],
)
def test_a_wrong_slurm_section_is_refused_by_its_path(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(clusters.ServiceInvalid) as refused:
        slurm(**fields)
    assert any(said.startswith(problem) for said in refused.value.problems), refused.value.problems


def test_every_problem_of_a_section_is_listed() -> None:
    with pytest.raises(clusters.ServiceInvalid) as refused:
        slurm(workers=0, worker_gpus=-1, partition="", colour="red")
    assert len(refused.value.problems) == 4
    with pytest.raises(clusters.ServiceInvalid) as refused:
        clusters.ClusterService.parse({"service": "slurmish", "colour": "red"})
    assert refused.value.problems == [
        "cluster.service: one of k3k, slurm.",
        "cluster.colour: not a field of a cluster.",
    ]


def test_the_slurm_conf_has_cloud_nodes_woken_and_given_back_by_klique() -> None:
    service = slurm(workers=4, worker_gpus=2, worker_cpus=8, partition="train", idle_seconds=900)
    lines = clusters.slurm_conf(service, job=JOB).splitlines()
    assert f"SlurmctldHost={CLUSTER}-ctld" in lines
    assert f"NodeName={CLUSTER}-w[0-3] State=CLOUD CPUs=8 Gres=gpu:2" in lines
    assert f"PartitionName=train Nodes={CLUSTER}-w[0-3] Default=YES MaxTime=INFINITE State=UP" in lines
    assert "SuspendTime=900" in lines
    assert f"ResumeProgram={clusters.SLURM_PATH}/resume" in lines
    assert f"SuspendProgram={clusters.SLURM_PATH}/suspend" in lines
    assert f"ResumeFailProgram={clusters.SLURM_PATH}/suspend" in lines
    parameters = next(line for line in lines if line.startswith("SlurmctldParameters="))
    assert {"enable_configless", "cloud_reg_addrs"} <= set(parameters.split("=", 1)[1].split(","))
    gres = clusters.gres_conf(service, job=JOB)
    assert f"NodeName={CLUSTER}-w[0-3] Name=gpu File=/dev/klique-gpu[0-1]" in gres.splitlines()
    assert "File=/dev/klique-gpu0\n" in clusters.gres_conf(slurm(workers=2, worker_gpus=1), job=JOB)
    assert "Name=gpu" not in clusters.gres_conf(slurm(worker_gpus=0), job=JOB)
    assert 'exec slurmd -D -b -N "$1" --conf-server "$2:6817"' in clusters.START
    one = clusters.slurm_conf(slurm(workers=1, worker_gpus=0), job=JOB)
    assert f"NodeName={CLUSTER}-w0 State=CLOUD CPUs=4" in one.splitlines()  # no GPUs: no Gres
    assert clusters.slurm_nodes(JOB, service) == [f"{CLUSTER}-w{index}" for index in range(4)]


@pytest.mark.parametrize(
    ("hostlist", "names"),
    [
        ("vc-a-w3", ["vc-a-w3"]),
        ("vc-a-w[0-3]", ["vc-a-w0", "vc-a-w1", "vc-a-w2", "vc-a-w3"]),
        ("vc-a-w[1,3-4,9]", ["vc-a-w1", "vc-a-w3", "vc-a-w4", "vc-a-w9"]),
        ("vc-a-w[0-1],vc-b-w7", ["vc-a-w0", "vc-a-w1", "vc-b-w7"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[0-63]", [f"n{number}" for number in range(64)]),
    ],
)
def test_host_lists_are_expanded_as_slurm_expands_them(
    tmp_path: Path, hostlist: str, names: list[str]
) -> None:
    assert clusters.expand_hostlist(hostlist) == names
    scontrol = shutil.which("scontrol")
    if scontrol is not None:  # Slurm's own reading, where Slurm is installed (the HPC tests install it)
        conf = tmp_path / "slurm.conf"
        conf.write_text(
            "ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost\nPartitionName=p Nodes=ALL\n"
        )
        said = subprocess.run(
            [scontrol, "show", "hostnames", hostlist],
            capture_output=True,
            text=True,
            env={**os.environ, "SLURM_CONF": str(conf)},
            check=False,
        )
        assert said.returncode == 0, said.stderr
        assert said.stdout.split() == names


@pytest.mark.parametrize(
    "hostlist",
    [
        "",
        "a[",
        "a[3-1]",
        "a[x-y]",
        "a]b",
        "a b",
        "a;b",
        "a[0-100000]",
        "n[0-63],m[0-10]",
        "$(id)",
        "n[1-2]x",
        "[1-2]",
    ],
)
def test_what_is_not_a_host_list_or_is_too_long_is_refused(hostlist: str) -> None:
    with pytest.raises(ValueError, match=r"host list|hosts in"):
        clusters.expand_hostlist(hostlist)


def program(tmp_path: Path, action: str) -> Path:
    """The controller's resume or suspend program, with `curl` standing in to print what it was given."""
    files = clusters.slurm_files(
        slurm(workers=4), job=JOB, plane="https://acme.klique.example", task_id=TASK, token="kqt_x_y"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "curl").write_text('#!/bin/sh\nfor word in "$@"; do printf "%s\\n" "$word"; done\n')
    (bin_dir / "curl").chmod(0o755)
    path = tmp_path / action
    path.write_text(files[action])
    return path


@pytest.mark.parametrize("action", ["resume", "suspend"])
@pytest.mark.parametrize(
    "hostlist",
    [
        f"{CLUSTER}-w[0-3]",
        '"; curl evil; "',
        "$(touch /tmp/klique-pwned)",
        "`touch /tmp/klique-pwned`",
        'a\\", "resume": "b',
        "x' && touch /tmp/klique-pwned && echo '",
    ],
)
def test_slurms_argument_reaches_the_plane_as_data_only(tmp_path: Path, action: str, hostlist: str) -> None:
    path = program(tmp_path, action)
    environment = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    said = subprocess.run(
        ["sh", str(path), hostlist], capture_output=True, text=True, env=environment, check=False
    )
    words = said.stdout.splitlines()
    assert words[-1] == f"https://acme.klique.example/agents/v1/tasks/{TASK}/slurm/"
    body = words[words.index("--data") + 1]
    kept = "".join(character for character in hostlist if character.isalnum() or character in "_.,[]-")
    assert body == f'{{"{action}": "{kept}"}}'
    assert not Path("/tmp/klique-pwned").exists()  # noqa: S108


@pytest.mark.parametrize(
    ("plane", "task"),
    [
        ("https://acme.example/$(id)", TASK),
        ('https://acme.example/"; id; "', TASK),
        ("file:///etc/passwd", TASK),
        ("https://acme.example", "x; id"),
    ],
)
def test_the_programs_are_not_made_from_values_that_are_not_klique_s(plane: str, task: str) -> None:
    with pytest.raises(ValueError, match=r"cannot be written|not a task id"):
        clusters.slurm_files(slurm(), job=JOB, plane=plane, task_id=task, token="kqt_x_y")


GOOD_WORKER = {
    "controller": TASK,
    "lease": LEASE,
    "node": f"{CLUSTER}-w0",
    "secret": f"{JOB}-slurm",
    "cpus": 4,
}


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        ({**GOOD_WORKER, "node": "x; id"}, "slurm_worker.node"),
        ({**GOOD_WORKER, "secret": "other-secret"}, "slurm_worker.secret"),
        ({**GOOD_WORKER, "cpus": 0}, "slurm_worker.cpus"),
        ({**GOOD_WORKER, "controller": "../../etc"}, "slurm_worker.controller"),  # a folder's name
        ({**GOOD_WORKER, "controller": None}, "slurm_worker.controller"),
        ("node", "slurm_worker: an object"),
    ],
)
def test_a_worker_section_that_klique_did_not_make_is_refused(section: Any, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        clusters.SlurmWorker.parse(section)
    assert clusters.SlurmWorker.parse(GOOD_WORKER).node == f"{CLUSTER}-w0"
