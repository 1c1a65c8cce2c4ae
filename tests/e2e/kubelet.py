"""A one-node cluster for the end-to-end tests: kmock's API emulator (tests/agents/kube.py) and, beside it,
what its controllers and kubelet would do, done on this host.

`LocalNode` watches the emulator's Jobs like the Job controller (one pod per completion index, a
suspended Job left alone), schedules pods against the node's GPU resources like kube-scheduler (a pod
that does not fit waits `Unschedulable` with the scheduler's message), and runs each pod's main
container like a kubelet, except that there is no container runtime here: its command runs as a process
of this host, with the pod's environment (its `env`, field references and the `envFrom` Secret), its
task folder on the work volume mapped to a folder here, its output written to the pod's log with
timestamps, and its exit code put in the pod's status. Deleting a pod sends SIGTERM and, after its grace
period, SIGKILL; the Job's condition follows its pods. A native sidecar (an init container with
`restartPolicy: Always`, as an app's relay) runs as a process too, started before the main container once
its startup probe's port answers and stopped when it ends; Klique's `klique-node` is this checkout's. Every
pod's address is this host's loopback. A Secret volume of the main container is written to a folder here
(its mount path, in the container's variables, mapped to it); the pod waits `ContainerCreating`, as a
kubelet retries the mount, until the Secret exists. On a cluster with JobSet (`Cluster(jobset=True)`) it is
the JobSet controller too: each JobSet that is not suspended gets its Job (`Kubelet.make_jobset_job`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from tests.agents.kube import IMAGE, NAMESPACE, Cluster, Kubelet

NODE_GPUS = {"nvidia.com/gpu": 8, "nvidia.com/gpu.shared": 4, "nvidia.com/mig-1g.10gb": 7}
NODE = "gpu-node-1"


def stamp() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f000Z")


@dataclass
class Running:
    process: subprocess.Popen[bytes]
    pod: str
    job: str
    gpus: dict[str, int]
    reader: threading.Thread
    stopping_since: float = 0.0
    sidecars: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def stop_sidecars(self, signum: int = signal.SIGTERM) -> None:
        for sidecar in self.sidecars:
            if sidecar.poll() is None:
                os.killpg(sidecar.pid, signum)


@dataclass
class LocalNode:
    cluster: Cluster
    work_root: Path  # the work volume, as this host sees it (the agent's outputs_dir)
    gpus: dict[str, int] = field(default_factory=lambda: dict(NODE_GPUS))
    running: dict[str, Running] = field(default_factory=dict)
    jobs_seen: set[str] = field(default_factory=set)
    stop_event: threading.Event = field(default_factory=threading.Event)
    grace_seconds: float = 30.0
    created_jobs: list[str] = field(default_factory=list)
    jobsets_made: set[str] = field(default_factory=set)
    created_jobsets: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        api = self.cluster.api()
        self.batch, self.core = client.BatchV1Api(api), client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def start(self) -> LocalNode:
        threading.Thread(target=self._loop, daemon=True, name="local-node").start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for run in list(self.running.values()):
            if run.process.poll() is None:
                os.killpg(run.process.pid, signal.SIGKILL)
            run.stop_sidecars(signal.SIGKILL)

    def _list(self, call: Any) -> list[dict[str, Any]]:
        return list(json.loads(call(NAMESPACE, _preload_content=False).data).get("items") or [])

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                self._pass()
            except client.exceptions.ApiException:
                pass  # a 404 of an object deleted meanwhile: the next pass sees the new state
            except Exception as error:  # kept for the test to show; the node goes on
                self.errors.append(f"{type(error).__name__}: {error}")
            time.sleep(0.2)

    def _jobsets(self, jobs: dict[str, dict[str, Any]]) -> None:
        """The JobSet controller's part: a JobSet admitted (not suspended) gets its one Job."""
        listed = json.loads(
            self.custom.list_namespaced_custom_object(
                "jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets", _preload_content=False
            ).data
        )
        jobsets = {item["metadata"]["name"]: item for item in listed.get("items") or []}
        for name, jobset in jobsets.items():
            made = f"{name}-{jobset['spec']['replicatedJobs'][0]['name']}-0"
            if made not in jobs and name not in self.jobsets_made and not jobset["spec"].get("suspend"):
                self.jobsets_made.add(name)
                self.created_jobsets.append(name)
                Kubelet(self.cluster).make_jobset_job(name)

    def _pass(self) -> None:
        jobs = {job["metadata"]["name"]: job for job in self._list(self.batch.list_namespaced_job)}
        if self.cluster.jobset:
            self._jobsets(jobs)
            jobs = {job["metadata"]["name"]: job for job in self._list(self.batch.list_namespaced_job)}
        pods = {pod["metadata"]["name"]: pod for pod in self._list(self.core.list_namespaced_pod)}
        for name, job in jobs.items():
            if name not in self.jobs_seen and not job["spec"].get("suspend"):
                self.jobs_seen.add(name)
                self.created_jobs.append(name)
                self._make_pods(job)
        for name, pod in pods.items():
            phase = (pod.get("status") or {}).get("phase")
            try:
                if pod["metadata"].get("deletionTimestamp"):
                    self._terminate(name, pod)
                elif (
                    phase == "Pending"
                    and name not in self.running
                    and not self._waiting(pod)
                    and self._volumes_ready(name, pod)
                ):
                    self._schedule(name, pod)
            except client.exceptions.ApiException as error:  # its Secret gone: the kubelet says so, goes on
                if error.status == 404 and name not in self.running:
                    self._patch(
                        name,
                        {
                            "status": {
                                "phase": "Pending",
                                "containerStatuses": [
                                    {
                                        "name": "main",
                                        "state": {
                                            "waiting": {
                                                "reason": "CreateContainerConfigError",
                                                "message": "secret not found",
                                            }
                                        },
                                        **IMAGE,
                                    }
                                ],
                            }
                        },
                    )
        for name, run in list(self.running.items()):
            code = run.process.poll()
            if code is not None:
                run.reader.join(5)
                self._ended(name, run, code)
        for name, job in jobs.items():
            self._job_verdict(
                name, job, [pod for pod in pods.values() if pod["metadata"]["labels"].get("job-name") == name]
            )

    def _waiting(self, pod: dict[str, Any]) -> bool:
        """The pod's container waits for something this node cannot give it (its Secret is gone)."""
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        return any(
            "waiting" in (status.get("state") or {})
            and status["state"]["waiting"].get("reason") != "ContainerCreating"  # a mount retried
            for status in statuses
        )

    def _secret_volumes(self, pod: dict[str, Any]) -> dict[str, str]:
        """The main container's Secret volumes: mount path -> Secret name."""
        secrets = {
            volume["name"]: volume["secret"]["secretName"]
            for volume in pod["spec"].get("volumes") or []
            if volume.get("secret")
        }
        mounts = pod["spec"]["containers"][0].get("volumeMounts") or []
        return {mount["mountPath"]: secrets[mount["name"]] for mount in mounts if mount["name"] in secrets}

    def _volumes_ready(self, name: str, pod: dict[str, Any]) -> bool:
        """Whether every Secret the pod mounts exists; else it waits ContainerCreating, as a kubelet
        whose mount fails tries again."""
        for secret in self._secret_volumes(pod).values():
            try:
                self._secret(secret)
            except client.exceptions.ApiException as error:
                if error.status != 404:
                    raise
                waiting = {"reason": "ContainerCreating", "message": f'secret "{secret}" not found'}
                statuses = (pod.get("status") or {}).get("containerStatuses") or []
                if not statuses:
                    status = {"name": "main", "state": {"waiting": waiting}, **IMAGE}
                    self._patch(name, {"status": {"phase": "Pending", "containerStatuses": [status]}})
                return False
        return True

    def _mounted(self, name: str, pod: dict[str, Any]) -> dict[str, str]:
        """The pod's Secret volumes written to folders here: mount path -> folder."""
        mapped = {}
        for index, (path, secret) in enumerate(sorted(self._secret_volumes(pod).items())):
            folder = self.work_root.parent / f"{name}-volumes" / str(index)
            folder.mkdir(parents=True, exist_ok=True)
            for key, value in self._secret(secret).items():
                (folder / key).write_text(value)
                (folder / key).chmod(0o400)
            mapped[path] = str(folder)
        return mapped

    def _make_pods(self, job: dict[str, Any]) -> None:
        """The Job controller's part, as the unit tests' Kubelet does it; pods stay while they stop."""
        Kubelet(self.cluster).make_pods(job["metadata"]["name"], terminating=True)

    def _asks(self, pod: dict[str, Any]) -> dict[str, int]:
        main = pod["spec"]["containers"][0]
        limits = (main.get("resources") or {}).get("limits") or {}
        return {key: int(value) for key, value in limits.items() if key in NODE_GPUS}

    def _schedule(self, name: str, pod: dict[str, Any]) -> None:
        asks = self._asks(pod)
        used: dict[str, int] = {}
        for run in self.running.values():
            for key, value in run.gpus.items():
                used[key] = used.get(key, 0) + value
        short = [key for key, value in asks.items() if used.get(key, 0) + value > self.gpus.get(key, 0)]
        if short:
            message = (
                f"0/1 nodes are available: 1 Insufficient {short[0]}. preemption: 0/1 nodes are available."
            )
            condition = {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": message,
            }
            if (pod.get("status") or {}).get("conditions") != [condition]:
                self._patch(name, {"status": {"phase": "Pending", "conditions": [condition]}})
            return
        self._run(name, pod, asks)

    def _secret(self, name: str) -> dict[str, str]:
        found = json.loads(self.core.read_namespaced_secret(name, NAMESPACE, _preload_content=False).data)
        return dict(found.get("stringData") or {})

    def _environment(
        self,
        pod: dict[str, Any],
        folder: Path,
        container: dict[str, Any] | None = None,
        mounted: dict[str, str] | None = None,
    ) -> dict[str, str]:
        main = container or pod["spec"]["containers"][0]
        klique_node = str(Path(sys.executable).parent)  # where this checkout's klique-node is
        environment = {
            "PATH": f"{klique_node}:{os.environ['PATH']}",
            "PYTHONUNBUFFERED": "1",
            "HOME": str(folder),
        }
        for source in main.get("envFrom") or []:
            environment.update(self._secret(source["secretRef"]["name"]))
        annotations = pod["metadata"].get("annotations") or {}
        for item in main.get("env") or []:
            if "value" in item:
                environment[item["name"]] = str(item["value"])
            elif "secretKeyRef" in item["valueFrom"]:
                reference = item["valueFrom"]["secretKeyRef"]
                environment[item["name"]] = self._secret(reference["name"])[reference["key"]]
            else:  # metadata.annotations['...']
                path = item["valueFrom"]["fieldRef"]["fieldPath"]
                environment[item["name"]] = str(annotations.get(path.split("'")[1], ""))
        environment["KLIQUE_WORK_DIR"] = str(folder)  # the work volume's mount, as this host has it
        for path, here in (mounted or {}).items():  # a Secret volume's mount, as this host has it
            environment = {
                key: here + value[len(path) :] if value.startswith(path + "/") or value == path else value
                for key, value in environment.items()
            }
        return environment

    def _run(self, name: str, pod: dict[str, Any], asks: dict[str, int]) -> None:
        task = pod["metadata"]["labels"]["klique.io/task"]
        folder = self.work_root / task
        folder.mkdir(parents=True, exist_ok=True)
        sidecars = self._sidecars(name, pod, folder)
        main = pod["spec"]["containers"][0]
        process = subprocess.Popen(
            main["command"],
            cwd=folder,
            env=self._environment(pod, folder, mounted=self._mounted(name, pod)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        reader = threading.Thread(target=self._read, args=(name, process), daemon=True)
        assert self.cluster.emulator is not None
        emulator = self.cluster.emulator
        self.cluster.call(lambda: emulator.logs.setdefault(name, []))
        self.running[name] = Running(
            process, name, pod["metadata"]["labels"]["job-name"], asks, reader, sidecars=sidecars
        )
        reader.start()
        self._patch(
            name,
            {
                "spec": {"nodeName": NODE},
                "status": {
                    "phase": "Running",
                    "podIP": "127.0.0.1",
                    "conditions": [{"type": "PodScheduled", "status": "True"}],
                    "containerStatuses": [
                        {"name": "main", "state": {"running": {"startedAt": stamp()}}, **IMAGE}
                    ],
                },
            },
        )

    def _sidecars(self, name: str, pod: dict[str, Any], folder: Path) -> list[subprocess.Popen[bytes]]:
        """The pod's native sidecars, each started once its startup probe's port takes connections."""
        started = []
        for container in pod["spec"].get("initContainers") or []:
            if container.get("restartPolicy") != "Always":
                continue
            log = (self.work_root.parent / f"{name}-{container['name']}.log").open("ab")
            started.append(
                subprocess.Popen(
                    container["command"],
                    env=self._environment(pod, folder, container),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            port = ((container.get("startupProbe") or {}).get("tcpSocket") or {}).get("port")
            deadline = time.monotonic() + 10
            while port and time.monotonic() < deadline and started[-1].poll() is None:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                time.sleep(0.05)
        return started

    def _read(self, pod: str, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        assert self.cluster.emulator is not None
        emulator = self.cluster.emulator
        for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.cluster.call(lambda line=line: emulator.logs.setdefault(pod, []).append((stamp(), line)))

    def _ended(self, name: str, run: Running, code: int) -> None:
        del self.running[name]
        run.stop_sidecars()  # they end after the main container
        exit_code = 128 - code if code < 0 else code  # killed by a signal: 128 + its number
        terminated = {
            "exitCode": exit_code,
            "finishedAt": stamp(),
            "reason": "Completed" if code == 0 else "Error",
        }
        status = {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "containerStatuses": [{"name": "main", "state": {"terminated": terminated}, **IMAGE}],
        }
        try:
            self._patch(name, {"status": status})
            if run.stopping_since:
                self._patch(name, {"metadata": {"finalizers": []}})  # deleted: it goes once stopped
        except client.exceptions.ApiException:
            pass

    def _terminate(self, name: str, pod: dict[str, Any]) -> None:
        run = self.running.get(name)
        if run is None:
            self._patch(name, {"metadata": {"finalizers": []}})
            return
        if not run.stopping_since:
            run.stopping_since = time.monotonic()
            os.killpg(run.process.pid, signal.SIGTERM)
        elif time.monotonic() - run.stopping_since > self.grace_seconds:
            os.killpg(run.process.pid, signal.SIGKILL)
            run.stop_sidecars(signal.SIGKILL)

    def _job_verdict(self, name: str, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        if (job.get("status") or {}).get("conditions") or not pods:
            return
        phases = [(pod.get("status") or {}).get("phase") for pod in pods]
        wanted = int(job["spec"].get("completions") or 1)
        if "Failed" in phases:
            condition = {
                "type": "Failed",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "Job has reached the specified backoff limit",
            }
            for pod in pods:  # the Job controller stops what is left of a failed Job
                if (pod.get("status") or {}).get("phase") == "Running" and pod["metadata"][
                    "name"
                ] in self.running:
                    os.killpg(self.running[pod["metadata"]["name"]].process.pid, signal.SIGTERM)
        elif phases.count("Succeeded") >= wanted:
            condition = {"type": "Complete", "status": "True"}
        else:
            return
        self.batch.patch_namespaced_job(
            name, NAMESPACE, {"status": {"conditions": [condition]}}, _preload_content=False
        )

    def _patch(self, name: str, body: dict[str, Any]) -> None:
        self.core.patch_namespaced_pod(name, NAMESPACE, body, _preload_content=False)
