"""Apps on a Kubernetes pool (agents.kubernetes, protocol.pods.Relay) against kmock's API emulator: the
app's pod carries its relay as a confined native sidecar whose key is in a Secret of its own, the agent
reaches the app at the pod's address through that relay with the key, a restarted agent finds the app
again from its state, an app stopped from outside says why with its log's last lines, and what cannot run
as an app is refused saying so."""

from __future__ import annotations

import asyncio
import http.server
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents import node
from agents.backend import Refused, free_port
from agents.kubernetes import Kubernetes
from agents.state import State
from protocol import pods
from tests.agents.kube import Cluster, Kubelet
from tests.agents.test_kubernetes import Recorder, assignment, backend, begin, refusal, until

pytestmark = pytest.mark.timeout(120)

IMAGE = "ghcr.io/klique/klique:1.0"


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    running = Cluster().start()
    yield running
    running.stop()


def app_task(task_id: str, port: int, **extra: Any) -> dict[str, Any]:
    task = assignment(task_id, **extra)
    task["spec"] = {
        "command": ["jupyter", "lab", "--ip=127.0.0.1", f"--port={port}"],
        "environment": {"PORT": str(port)},
        "app": {"instance": "0a1b2c", "port": port, "health_path": "/", "startup_seconds": 30},
    }
    return task


@pytest.fixture
def app_server() -> Iterator[int]:
    """The app as its pod would serve it: HTTP on this host's loopback."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"app at {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()


def test_an_apps_pod_has_a_confined_relay_beside_it_with_a_key_the_app_never_sees(
    cluster: Cluster, tmp_path: Path, app_server: int
) -> None:
    kube, kubelet = backend(cluster, tmp_path, relay_image=IMAGE), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = app_task("app1", app_server)

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        name = pods.job_name("app1", "lease-app1")
        job = await asyncio.to_thread(kubelet.job, name)
        pods.validate_workload(job)  # the Kubernetes schema takes the sidecar as rendered
        spec = job["spec"]["template"]["spec"]
        (relay,) = spec["initContainers"]
        assert relay["name"] == pods.RELAY_CONTAINER
        assert relay["restartPolicy"] == "Always"  # a native sidecar: up before the app, stopped after it
        assert relay["image"] == IMAGE
        relay_port = relay["ports"][0]["containerPort"]
        assert relay_port != app_server
        assert relay["command"] == [
            "klique-node", "relay", "--port", str(relay_port), "--app-port", str(app_server)
        ]  # fmt: skip
        assert relay["startupProbe"]["tcpSocket"]["port"] == relay_port
        confined = relay["securityContext"]
        assert confined["capabilities"] == {"drop": ["ALL"]}
        assert confined["runAsNonRoot"] is True
        assert confined["runAsUser"] != 0
        assert confined["allowPrivilegeEscalation"] is False
        assert confined["readOnlyRootFilesystem"] is True
        # The key: in a Secret of its own, named only in the relay's environment.
        assert relay["env"] == [
            {"name": "KLIQUE_APP_KEY", "valueFrom": {"secretKeyRef": {"name": f"{name}-app", "key": "key"}}}
        ]
        key = (await asyncio.to_thread(kubelet.secret, f"{name}-app"))["stringData"]["key"]
        assert re.fullmatch(r"[0-9a-f]{64}", key)
        (main,) = spec["containers"]
        assert f"{name}-app" not in str(main)
        run_secret = await asyncio.to_thread(kubelet.secret, name)
        assert key not in str(run_secret)
        assert key not in str(job)
        # Its pod admits connections to the relay's port and nothing else.
        policy = await asyncio.to_thread(kubelet.network_policy, f"{name}-app")
        pods.validate_workload(policy)
        assert policy["spec"]["podSelector"]["matchLabels"] == {
            key: job["spec"]["template"]["metadata"]["labels"][key]
            for key in ("klique.io/agent", "klique.io/task", "klique.io/lease")
        }
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": relay_port}]}]
        assert policy["metadata"]["ownerReferences"][0]["name"] == name

        # The relay as the sidecar runs it; the pod runs at an address the cluster gives.
        relay_server = node.AppRelay(key, app_server, port=relay_port)
        threading.Thread(target=relay_server.serve_forever, daemon=True).start()
        (pod,) = await asyncio.to_thread(kubelet.make_pods, name, terminating=True)
        await asyncio.to_thread(kubelet.run, pod, ip="127.0.0.1")
        app = kube.spec_of("app1")["app"]
        upstream = await asyncio.wait_for(kube.app_upstream("app1", _spec(app)), 10)
        assert upstream is not None
        assert upstream.describe() == f"port {app_server} of pod {pod}"
        async with httpx.AsyncClient(transport=upstream.transport()) as client:
            answered = await client.get(f"http://127.0.0.1:{app_server}/lab?x=1")
        assert answered.text == "app at /lab?x=1"
        await upstream.aclose()

        # Someone else in the cluster who finds the relay's port reaches nothing without the key.
        reader, writer = await asyncio.open_connection("127.0.0.1", relay_port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 64 + b"\n")
        await writer.drain()
        try:
            answered_stranger = await asyncio.wait_for(reader.read(), 15)
        except ConnectionResetError:  # closed with what it sent unread
            answered_stranger = b""
        assert answered_stranger == b""
        writer.close()

        # A restarted agent takes the app's section, port and key from its state.
        again = Kubernetes(kube.settings, State(tmp_path / "agent.sqlite"), kube.api)
        again.adopt(Recorder(again.state))
        assert again.spec_of("app1") == {"app": task["spec"]["app"]}
        found = await asyncio.wait_for(again.app_upstream("app1", _spec(app)), 10)
        assert found is not None
        assert (found.relay_port, found.key) == (relay_port, key)
        await found.aclose()
        await again.stop_all(0)

        # The run ends: both of its Secrets go with it.
        await asyncio.to_thread(kubelet.end, pod, 0)
        await asyncio.to_thread(kubelet.job_ended, name, True)
        (result,) = await until(lambda: recorder.of("result"))
        assert "reason" not in result
        made = (("Secret", f"{name}-app"), ("Secret", name), ("NetworkPolicy", f"{name}-app"))
        await until(lambda: all(kubelet.gone(kind, item) for kind, item in made))
        assert await kube.app_upstream("app1", _spec(app)) is None  # the run is over
        relay_server.server.close()
        await kube.stop_all(0)

    asyncio.run(scenario())


def _spec(section: dict[str, Any]) -> Any:
    from protocol.apps import AppSpec

    return AppSpec.parse(section)


def test_an_app_stopped_from_outside_says_why_with_its_logs_last_lines(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path, relay_image=IMAGE), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = app_task("app2", free_port())

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        name = pods.job_name("app2", "lease-app2")
        (pod,) = await asyncio.to_thread(kubelet.make_pods, name, terminating=True)
        await asyncio.to_thread(kubelet.run, pod, ip="127.0.0.1")
        await asyncio.to_thread(kubelet.write, pod, "loading the model", "still loading", "ImportError: vllm")
        await until(lambda: "ImportError: vllm" in recorder.lines())
        await kube.fail("app2", "it did not answer its health check within 30 s", grace_seconds=5)
        await asyncio.to_thread(kubelet.terminated, pod)
        (result,) = await until(lambda: recorder.of("result"))
        assert result["stopped"] is True
        assert result["reason"] == (
            "it did not answer its health check within 30 s; its log ends: "
            "loading the model | still loading | ImportError: vllm"
        )
        await until(lambda: kubelet.gone("Secret", f"{name}-app"))
        await kube.stop_all(0)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("overrides", "extra", "words"),
    [
        ({}, {}, "its agent has no relay_image in [agent.kubernetes]"),
        ({"relay_image": IMAGE}, {"nodes": 2, "gpus": 8}, "an app runs on one node"),
    ],
)
def test_what_cannot_run_as_an_app_is_refused_for_good_saying_why(
    cluster: Cluster, tmp_path: Path, overrides: dict[str, Any], extra: dict[str, Any], words: str
) -> None:
    kube = backend(cluster, tmp_path, **overrides)
    task = app_task("app3", free_port(), **extra)

    async def scenario() -> None:
        begin(kube, task)
        with pytest.raises(Refused) as refused:
            await kube.start(task, Recorder(kube.state))
        assert refused.value.permanent
        assert words in str(refused.value)
        assert kube.running() == []
        assert await asyncio.to_thread(Kubelet(cluster).jobs) == []
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_without_network_policies_the_app_runs_behind_its_relay_alone(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path, relay_image=IMAGE, app_network_policy=False), Kubelet(cluster)
    task = app_task("app4", free_port())

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, Recorder(kube.state))
        name = pods.job_name("app4", "lease-app4")
        assert (await asyncio.to_thread(kubelet.job, name))["spec"]["template"]["spec"]["initContainers"]
        assert await asyncio.to_thread(kubelet.gone, "NetworkPolicy", f"{name}-app")
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_a_role_that_may_not_make_network_policies_keeps_the_app_queued_saying_what_to_do(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path, relay_image=IMAGE), Kubelet(cluster)
    assert cluster.emulator is not None
    policies = re.compile(r"/apis/networking.k8s.io/v1/namespaces/[^/]+/networkpolicies")
    cluster.emulator.refused.append(("POST", policies))
    task = app_task("app5", free_port())

    refused = refusal(kube, task)
    assert "may not create networkpolicies.networking.k8s.io in namespace ml" in str(refused)
    assert refused.permanent is False  # it waits in the queue while an administrator fixes the Role
    name = pods.job_name("app5", "lease-app5")
    assert kubelet.jobs() == []  # no pod the policy does not guard
    assert kubelet.gone("Secret", name)
    assert kubelet.gone("Secret", f"{name}-app")


def test_a_pod_template_that_takes_the_relays_name_is_refused_when_read(
    cluster: Cluster, tmp_path: Path
) -> None:
    template = "spec:\n  initContainers:\n    - name: klique-relay\n      image: x\n"
    words = "line 3: no init container may be named 'klique-relay'"
    with pytest.raises(pods.PodTemplateInvalid, match=words):
        backend(cluster, tmp_path, relay_image=IMAGE, templates={"Research: GPUs": template})


@pytest.mark.parametrize("how", ["adopted", "assigned again"])
def test_an_agent_killed_before_it_recorded_an_apps_job_reaches_the_same_relay(
    cluster: Cluster, tmp_path: Path, app_server: int, how: str
) -> None:
    """The agent made the app's Job and died before its state said so. The next one finds the Job it
    labelled (or is handed the run again, with another port picked for it): either way it reaches the
    relay the pod runs, with the ports the pod was given and the key in the run's Secret, never a new one."""
    kube, kubelet = backend(cluster, tmp_path, relay_image=IMAGE), Kubelet(cluster)
    task = app_task("app6", app_server)

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, Recorder(kube.state))
        name = pods.job_name("app6", "lease-app6")
        (relay_port, app_port) = pods.relay_ports(
            (await asyncio.to_thread(kubelet.job, name))["spec"]["template"]["spec"]
        ) or (0, 0)
        key = (await asyncio.to_thread(kubelet.secret, f"{name}-app"))["stringData"]["key"]
        await kube.stop_all(0)
        kube.state.remove_job("app6")  # what the killed agent never wrote
        relay_server = node.AppRelay(key, app_server, port=relay_port)
        threading.Thread(target=relay_server.serve_forever, daemon=True).start()
        (pod,) = await asyncio.to_thread(kubelet.make_pods, name, terminating=True)
        await asyncio.to_thread(kubelet.run, pod, ip="127.0.0.1")

        again = Kubernetes(kube.settings, State(tmp_path / "agent.sqlite"), kube.api)
        if how == "adopted":
            again.adopt(Recorder(again.state))
            await until(lambda: again.running() == ["app6"])
        else:
            other = app_task("app6", free_port())  # the agent loop picks a port for each assignment
            await again.start(other, Recorder(again.state))
            assert (await asyncio.to_thread(kubelet.secret, f"{name}-app"))["stringData"]["key"] == key
        assert again.spec_of("app6")["app"]["instance"] == task["spec"]["app"]["instance"]
        upstream = await asyncio.wait_for(again.app_upstream("app6", _spec(again.spec_of("app6")["app"])), 10)
        assert upstream is not None
        assert (upstream.relay_port, upstream.port, upstream.key) == (relay_port, app_port, key)
        async with httpx.AsyncClient(transport=upstream.transport()) as client:
            assert (await client.get(upstream.local + "/again")).text == "app at /again"
        await upstream.aclose()
        relay_server.server.close()
        await again.stop_all(0)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "container",
    [
        {"name": "other", "command": ["klique-node", "relay", "--port", "7070", "--app-port", "8888"]},
        {"name": "klique-relay", "command": ["klique-node", "relay", "--port", "7070"]},
        {"name": "klique-relay", "command": ["klique-node", "relay", "--port", "x", "--app-port", "8888"]},
        {"name": "klique-relay", "command": ["klique-node", "relay", "--port", "0", "--app-port", "8888"]},
        {"name": "klique-relay", "command": ["klique-node", "relay", "--port", "70000", "--app-port", "1"]},
        {"name": "klique-relay", "command": ["sh", "-c", "--port", "7070", "--app-port", "8888"]},
        {"name": "klique-relay", "command": ["klique-node", "relay", "--app-port", "8888", "--port", "7070"]},
        {"name": "klique-relay"},
        "klique-relay",
    ],
)
def test_a_pod_whose_relay_is_not_as_klique_renders_it_has_no_relay_ports(container: object) -> None:
    assert pods.relay_ports({"initContainers": [container]}) is None
    rendered = pods.SAMPLE_RELAY
    made = pods.render(
        pods.Template.parse("default", pods.DEFAULT_TEMPLATE),
        {**pods.SAMPLE_ASSIGNMENT, "spec": {"command": ["x"], "app": {"instance": "ab", "port": 8888}}},
        pods.ClusterSettings(),
        relay=rendered,
    )
    spec = made.job["spec"]["template"]["spec"]
    assert pods.relay_ports(spec) == (rendered.port, rendered.app_port)
