"""A clustering service end to end: a K3k cluster launched through the API on a Kubernetes pool, with a
real `klique-agent --backend kubernetes` against kmock's API emulator, the one-node stand-in of
tests/e2e/kubelet.py running the app's pod as processes here, and this test standing in for the K3k
controller (a Cluster's status, its bootstrap Secret with certificate authorities made here). The app's
pod starts only once the cluster is ready and its kubeconfig minted; the app reads that kubeconfig and
serves what it found through its route; a stop takes the cluster with it."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from tests.agents.kube import NAMESPACE, Cluster, Kubelet
from tests.agents.test_kube_k3k import bootstrap, check_kubeconfig
from tests.e2e.conftest import clean_environment, start_up
from tests.e2e.kubelet import LocalNode
from tests.e2e.test_agent_crash import Demo
from tests.e2e.test_kubernetes import Plane, agent_log
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e

# The app: what a cluster's way in does with its kubeconfig, here only reading it back to its caller.
READ_KUBECONFIG = (
    "import http.server, os\n"
    "class Handler(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = open(os.environ['KUBECONFIG'], 'rb').read()\n"
    "        self.send_response(200)\n"
    "        self.send_header('Content-Length', str(len(body)))\n"
    "        self.end_headers()\n"
    "        self.wfile.write(body)\n"
    "    def log_message(self, *args):\n"
    "        pass\n"
    "http.server.ThreadingHTTPServer(('127.0.0.1', int(os.environ['PORT'])), Handler).serve_forever()\n"
)


class K3kController:
    """The K3k controller's part: each new Cluster is Provisioning, then Ready with its bootstrap Secret."""

    def __init__(self, cluster: Cluster) -> None:
        self.kubelet = Kubelet(cluster)
        self.made: dict[str, tuple[x509.Certificate, x509.Certificate]] = {}  # cluster -> server, client CA
        self.stop = threading.Event()
        self.seen_before_ready: dict[str, bool] = {}  # cluster -> whether the app's pod ran before it was

    def run(self) -> None:
        while not self.stop.wait(0.3):
            listed = self.kubelet.custom.list_namespaced_custom_object(
                "k3k.io", "v1beta1", NAMESPACE, "clusters", _preload_content=False
            )
            for item in json.loads(listed.data).get("items") or []:
                name = item["metadata"]["name"]
                if name in self.made:
                    continue
                self.kubelet.k3k_phase(name, "Provisioning")
                time.sleep(1.5)  # the servers start
                job = item["metadata"]["labels"]["klique.io/job"]
                self.seen_before_ready[name] = any(
                    (pod.get("status") or {}).get("phase") == "Running" for pod in self.kubelet.pods_of(job)
                )
                document, server, client = bootstrap()
                self.kubelet.k3k_bootstrap(name, document)
                self.kubelet.k3k_phase(name, "Ready")
                self.made[name] = (server, client)


def test_a_k3k_cluster_launched_from_the_catalogue_reaches_its_app_only_once_ready_and_goes_with_it(
    fresh_database: str, redis_url: str, tmp_path: Path
) -> None:
    from tests.e2e.test_apps import Route, wait_state

    cluster = Cluster(k3k=True).start()
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    plane = Plane(tmp_path, cluster)
    node = LocalNode(cluster, plane.volume).start()
    controller = K3kController(cluster)
    threading.Thread(target=controller.run, daemon=True).start()
    program = tmp_path / "read_kubeconfig.py"
    program.write_text(READ_KUBECONFIG)
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        token_file = plane.token_file(demo)
        plane.start_agent(demo, token_file)
        template: dict[str, Any] = {
            "name": "team-k8s", "version": "1", "kind": "cluster", "command": [sys.executable, str(program)],
            "health": {"path": "/", "startup_seconds": 120}, "gpus": "2",
            "cluster": {"service": "k3k", "agents": 2},
        }  # fmt: skip
        demo.call("POST", "/api/v1/catalogue/", json=template)
        launched = demo.call(
            "POST", "/api/v1/apps/", json={"entry": "team-k8s", "compute_resource": "K8s: 2 GPUs"}
        )
        app = wait_state(demo, launched["id"], "ready", timeout=120)
        (name, (server, client)) = next(iter(controller.made.items()))
        assert controller.seen_before_ready == {name: False}  # the pod waited for its kubeconfig

        made = Kubelet(cluster).k3k_cluster(name)
        assert made["spec"]["workerLimit"] == {"nvidia.com/gpu": "1"}  # 2 GPUs over 2 workers
        (run,) = node.running.values()
        assert run.gpus == {}  # the app's own pod holds none of them

        route = Route(running.port, app["url"], demo.token)
        answered = route.get("/")
        assert answered.status_code == 200, answered.text
        check_kubeconfig(answered.text, name, server, client)

        demo.call("POST", f"/api/v1/apps/{app['id']}/stop/")
        wait_state(demo, app["id"], "stopped", timeout=60)
        kubelet = Kubelet(cluster)
        job = made["metadata"]["labels"]["klique.io/job"]
        deadline = time.monotonic() + 30
        while not (kubelet.gone("Cluster", name) and kubelet.gone("Secret", f"{job}-kubeconfig")):
            assert time.monotonic() < deadline, agent_log(tmp_path)
            time.sleep(0.3)
        assert not node.errors, node.errors
    finally:
        controller.stop.set()
        node.stop()
        plane.stop_agent()
        assert running.interrupt() == 0
        cluster.stop()
