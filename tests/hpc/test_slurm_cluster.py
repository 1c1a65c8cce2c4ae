"""A Slurm cluster's configuration and programs (protocol.clusters) run by a real Slurm (Debian's 22.05):
slurmctld reads the slurm.conf Klique writes, wakes a CLOUD node for a waiting job by running Klique's
resume program, the node's slurmd joins configless and runs the job, and once the node has been idle
slurmctld gives it back through the suspend program.

What stands in: the plane is a small HTTP server here that checks the controller's token and, as the plane
would make a worker task whose pod runs `slurmd`, starts `slurmd` for the node on this machine. On one
machine the controller's host name, ports and folders are this machine's and a test folder's (a line each,
replaced); every other line is as Klique writes it, and the programs are Klique's, run by slurmctld."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from protocol import clusters, pods
from tests.containers import Podman

pytestmark = pytest.mark.timeout(300)

TASK = "0f0e0d0c-0b0a-4999-8888-777766665555"
JOB = pods.job_name(TASK, "abcdef12-3456-4789-8abc-def012345678")
NODE = f"{clusters.cluster_name(JOB)}-w0"
TOKEN = "kqt_0f0e0d0c0b0a49998888777766665555_signature"
IDLE_SECONDS = 15  # as the test's idle time; the section's shortest is a minute


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Plane(ThreadingHTTPServer):
    """The plane as the programs see it: the controller's token checked, a node woken by starting its
    slurmd, a node given back by stopping it."""

    def __init__(self, folder: Path, host: str = "127.0.0.1") -> None:
        super().__init__((host, 0), Asked)
        self.folder = folder
        self.asked: list[tuple[str, dict[str, Any]]] = []
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.waiting: set[str] = set()  # woken, their worker task still queued (when it does not start them)
        self.starts = True
        self.controller_port = 0

    def wake(self, node: str) -> None:
        if not self.starts:
            self.waiting.add(node)
            return
        log = open(self.folder / f"{node}.log", "wb")  # noqa: SIM115 -- the worker's, closed with it
        self.workers[node] = subprocess.Popen(  # as the worker's start runs it (clusters.START)
            ["slurmd", "-D", "-b", "-N", node, "--conf-server", f"127.0.0.1:{self.controller_port}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={"PATH": os.environ["PATH"]},
        )

    def give_back(self, node: str) -> None:
        self.waiting.discard(node)
        worker = self.workers.pop(node, None)
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=30)

    def live(self) -> list[str]:
        """The nodes with a worker task, as the plane answers the reconciler."""
        return sorted({*self.workers, *self.waiting})


class Asked(BaseHTTPRequestHandler):
    server: Plane

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.send_response(403)
            self.end_headers()
            return
        said = " ".join(self.server.live()).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(said)))
        self.end_headers()
        self.wfile.write(said)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.asked.append((self.path, {**body, "token": self.headers.get("Authorization")}))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.send_response(403)
        else:
            if "resume" in body:
                for node in clusters.expand_hostlist(body["resume"]):
                    self.server.wake(node)
            if "suspend" in body:
                for node in clusters.expand_hostlist(body["suspend"]):
                    self.server.give_back(node)
            self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *_: Any) -> None:
        return


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    server = Plane(tmp_path)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    for node in list(server.workers):
        server.give_back(node)
    server.shutdown()


def on_this_machine(text: str, folder: Path, port: int, spool: Path, **more: str) -> str:
    """Klique's slurm.conf with this machine as the controller's host, the test's ports and folders."""
    replaced = {
        "SlurmctldHost": f"{socket.gethostname()}(127.0.0.1)",
        "SlurmctldPort": str(port),
        "StateSaveLocation": str(folder / "state"),
        "SlurmdSpoolDir": str(spool / "%n"),  # short: a step's socket path has at most 108 characters
        "SuspendProgram": str(folder / "suspend"),
        "ResumeProgram": str(folder / "resume"),
        "ResumeFailProgram": str(folder / "suspend"),
        "SuspendTime": str(IDLE_SECONDS),
        "SuspendTimeout": "5",
        **more,
    }
    lines = []
    for line in text.splitlines():
        key = line.partition("=")[0]
        lines.append(f"{key}={replaced.pop(key)}" if key in replaced else line)
    assert not replaced, f"Klique's slurm.conf no longer has {', '.join(replaced)}"
    lines += [
        f"SlurmdPort={free_port()}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd-%n.log'}",
        "AccountingStorageType=accounting_storage/none",
        "SlurmctldDebug=verbose",
        "SlurmdDebug=verbose",
    ]
    return "\n".join(lines) + "\n"


def until(check: Any, what: str, timeout: float, log: Path, state: Any = None) -> Any:
    """Wait for `check` to hold; past `timeout`, fail saying what the logs (and `state`, the cluster's
    state as Slurm tells it, where given) said."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.5)
    seen = f"--- what Slurm says:\n{state()}\n" if state is not None else ""
    raise AssertionError(f"{what}: not seen in {timeout:.0f} s\n{seen}{logs(log.parent)}")


def logs(folder: Path) -> str:
    """The ends of slurmctld's log and of each worker's (its slurmd's own and its output), to say why."""
    said = []
    for path in sorted(folder.glob("*.log")):
        said.append(f"--- {path.name} ends:\n{path.read_text(errors='replace')[-3000:]}")
    return "\n".join(said) or "(no log)"


@dataclass
class Controller:
    """slurmctld on this machine with Klique's files, and what the test reads of it."""

    folder: Path
    environment: dict[str, str]
    log: Path
    reconciler: subprocess.Popen[bytes] | None = None

    def scontrol(self, *words: str) -> str:
        done = subprocess.run(
            ["scontrol", *words],
            env=self.environment,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        return done.stdout + done.stderr

    def state(self) -> str:
        """The nodes and jobs as slurmctld has them."""
        return self.scontrol("show", "nodes") + self.scontrol("show", "jobs")

    def reconcile(self) -> None:
        self.reconciler = subprocess.Popen(
            ["sh", str(self.folder / "reconcile")],
            env=self.environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def reconciled(self) -> str:
        """What the reconciler said, once stopped."""
        assert self.reconciler is not None
        self.reconciler.terminate()
        return self.reconciler.communicate(timeout=30)[0].decode()


@contextlib.contextmanager
def controller_here(folder: Path, plane: Plane, **replaced: str) -> Iterator[Controller]:
    """Klique's files for a cluster of two one-GPU workers in partition `team`, and slurmctld running them
    (with `replaced` lines of slurm.conf besides this machine's), answering."""
    service = clusters.ClusterService.parse(
        {"service": "slurm", "workers": 2, "worker_gpus": 1, "worker_cpus": 1, "partition": "team"}
    )
    files = clusters.slurm_files(
        service, job=JOB, plane=f"http://127.0.0.1:{plane.server_port}", task_id=TASK, token=TOKEN
    )
    plane.controller_port = free_port()
    (folder / "state").mkdir()
    spool = Path(tempfile.mkdtemp(prefix="kq-", dir="/tmp"))
    conf = folder / "slurm.conf"
    conf.write_text(on_this_machine(files["slurm.conf"], folder, plane.controller_port, spool, **replaced))
    # The GPU links a worker's start makes, here to stand-in devices (as deploy/slurm/single-node.sh's).
    devices = folder / "dev"
    devices.mkdir()
    os.mknod(devices / "klique-gpu0", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    (folder / "gres.conf").write_text(
        files["gres.conf"].replace(clusters.GPU_LINKS, str(devices / "klique-gpu"))
    )
    (folder / "token").write_text(files["token"])
    for program in ("resume", "suspend", "reconcile"):  # Klique's, reading the token where the test keeps it
        (folder / program).write_text(
            files[program]
            .replace(f"{clusters.SLURM_PATH}/token", str(folder / "token"))
            .replace(f"sleep {clusters.RECONCILE_SECONDS}", "sleep 2")
        )
        (folder / program).chmod(0o700)
    here = Controller(folder, {"PATH": os.environ["PATH"], "SLURM_CONF": str(conf)}, folder / "slurmctld.log")
    daemon = subprocess.Popen(
        ["slurmctld", "-D", "-i", "-f", str(conf)],
        env=here.environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        until(lambda: "UP" in here.scontrol("ping"), "slurmctld answering", 60, here.log)
        yield here
    finally:
        if here.reconciler is not None and here.reconciler.poll() is None:
            here.reconciler.kill()
            here.reconciler.wait(timeout=30)
        daemon.terminate()
        daemon.wait(timeout=30)
        shutil.rmtree(spool, ignore_errors=True)


def test_slurm_wakes_a_node_through_klique_runs_a_job_on_it_and_gives_it_back(
    slurm: Path, tmp_path: Path, plane: Plane
) -> None:
    with controller_here(tmp_path, plane) as here:
        environment, log, scontrol = here.environment, here.log, here.scontrol
        nodes = scontrol("show", "nodes")
        assert f"NodeName={NODE}" in nodes
        assert "CLOUD" in nodes  # powered down until a job wants it

        output = tmp_path / "job.out"
        script = "echo ran on $SLURMD_NODENAME with GPUs $CUDA_VISIBLE_DEVICES"
        submitted = subprocess.run(
            ["sbatch", "--parsable", "-p", "team", "--gres=gpu:1", "-o", str(output), "--wrap", script],
            env=environment, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr

        # Slurm runs Klique's resume program for the node; the plane starts its slurmd; the job runs there.
        until(
            lambda: any("resume" in body for _, body in plane.asked),
            "the resume program",
            90,
            log,
            here.state,
        )
        path, body = next((path, body) for path, body in plane.asked if "resume" in body)
        assert path == f"/agents/v1/tasks/{TASK}/slurm/"
        assert body == {"resume": NODE, "token": f"Bearer {TOKEN}"}
        until(
            lambda: output.exists() and "ran on" in output.read_text(),
            "the job's output",
            120,
            log,
            here.state,
        )
        assert output.read_text().split() == ["ran", "on", NODE, "with", "GPUs", "0"]  # its one GPU, bound
        assert submitted.stdout.strip().isdigit()

        # Its worker task ends outside Slurm (preempted: its pod goes). The reconciler, finding no task
        # for the node, has Slurm power it down; the next job wakes it again, as a new worker.
        here.reconcile()
        plane.give_back(NODE)

        def asked(action: str) -> list[dict[str, Any]]:
            return [body for _, body in plane.asked if action in body]

        until(lambda: asked("suspend"), "the reconciler powering the node down", 90, log, here.state)
        assert asked("suspend")[0] == {"suspend": NODE, "token": f"Bearer {TOKEN}"}
        second = tmp_path / "second.out"
        script = "echo again on $SLURMD_NODENAME"
        again = subprocess.run(
            ["sbatch", "--parsable", "-p", "team", "-o", str(second), "--wrap", script],
            env=environment, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert again.returncode == 0, again.stderr
        until(
            lambda: second.exists() and "again on" in second.read_text(),
            "the second job's output",
            120,
            log,
            here.state,
        )
        assert len(asked("resume")) == 2
        woken = asked("resume")[1]["resume"]  # w0 again, or w1 while w0 powers down: woken by Klique
        assert second.read_text().split() == ["again", "on", woken]

        # Idle for its SuspendTime, the node is given back through the suspend program.
        until(lambda: len(asked("suspend")) == 2, "the suspend program", 120, log, here.state)
        assert asked("suspend")[1]["suspend"] == woken
        assert plane.workers == {}
        said = here.reconciled()
        assert said.count(f"klique: the worker task of {NODE} ended outside Slurm") == 1, said


def test_a_node_not_up_within_slurms_resume_timeout_is_given_back_and_put_back_in_service(
    slurm: Path, tmp_path: Path, plane: Plane
) -> None:
    """Its worker task waited in Klique's queue past ResumeTimeout: Slurm gives the node back (the task is
    cancelled) and sets it down; the reconciler returns it to service, for the requeued job to wake."""
    plane.starts = False  # the worker task waits in Klique's queue: no slurmd comes
    with controller_here(tmp_path, plane, ResumeTimeout="10") as here:
        here.reconcile()
        submitted = subprocess.run(
            ["sbatch", "-p", "team", "-o", "/dev/null", "--wrap", "true"],
            env=here.environment, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr

        def states() -> dict[str, str]:
            said = subprocess.run(
                ["sinfo", "--noheader", "--Node", "--format", "%N %t"],
                env=here.environment, capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            return dict(line.split() for line in said.stdout.splitlines())

        until(
            lambda: any("suspend" in body for _, body in plane.asked), "the resume fail program", 60, here.log
        )
        until(lambda: states().get(NODE) == "idle~", "the node back in service", 60, here.log)
        said = here.reconciled()
        assert f"klique: {NODE} was not up within Slurm's resume timeout" in said, said


# The image and its start script, in containers -------------------------------------------------------


class Pods(Plane):
    """The plane for a cluster in containers: a woken node is a container of the image running the
    worker's start, as the pod of its worker task would; given back, it is removed."""

    def __init__(self, folder: Path, podman: Podman, controller: str) -> None:
        # Every address: the pods' network reaches this host at its gateway, which podman gives its bridge
        # only once a container is on it.
        super().__init__(folder, "0.0.0.0")  # noqa: S104
        self.podman, self.controller, self.address = podman, controller, ""
        self.containers: set[str] = set()

    def wake(self, node: str) -> None:
        name = f"kq-{node}"
        self.podman.run("rm", "--force", name)
        started = self.podman.run(
            "run", "--detach", "--name", name, "--hostname", node,
            "--add-host", f"{self.controller}:{self.address}",  # the Service's name, as cluster DNS gives it
            "--device", f"{self.folder / 'nvidia0'}:/dev/nvidia0",  # the pod's one GPU
            "--volume", f"{self.folder / 'files'}:{clusters.SLURM_PATH}:ro",
            "--volume", f"{self.folder / 'work'}:{WORK}",  # the controller's folder, from the work volume
            SLURM_IMAGE, *clusters.worker_command(node, self.controller),
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        self.containers.add(node)

    def live(self) -> list[str]:
        return sorted(self.containers)

    def give_back(self, node: str) -> None:
        if node in self.containers:
            self.containers.discard(node)
            self.podman.run("rm", "--force", "--time", "5", f"kq-{node}")


SLURM_IMAGE = "localhost/klique-slurm:22.05"
WORK = f"/klique/{TASK}"  # the controller's task folder on the work volume (protocol.pods)


def test_the_slurm_image_starts_a_controller_and_a_worker_as_their_pods_would(
    shipped_images: Podman, tmp_path: Path
) -> None:
    """The shipped entry's image (deploy/apps/images.sh) with Klique's files and start script, unchanged
    but for SuspendTime: the controller's container starts munge and slurmctld, a job waits, the resume
    program asks the plane, the worker's container joins and runs it on its one GPU, and the idle node is
    given back. The pods' network is podman's; the Service's name is the controller's address."""
    podman = shipped_images
    gateway = json.loads(podman.run("network", "inspect", "podman").stdout)[0]["subnets"][0]["gateway"]
    service = clusters.ClusterService.parse(
        {"service": "slurm", "workers": 2, "worker_gpus": 1, "worker_cpus": 1}
    )
    controller = clusters.slurm_controller(JOB)
    node = f"{clusters.cluster_name(JOB)}-w0"
    name = f"kq-{controller}"
    files = tmp_path / "files"  # the controller run's Secret, as its pods mount it
    files.mkdir()
    os.mknod(tmp_path / "nvidia0", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    (tmp_path / "work").mkdir()
    plane = Pods(tmp_path, podman, controller)
    threading.Thread(target=plane.serve_forever, daemon=True).start()
    written = clusters.slurm_files(
        service, job=JOB, plane=f"http://{gateway}:{plane.server_port}", task_id=TASK, token=TOKEN
    )
    for file, text in written.items():  # idle for IDLE_SECONDS, reconciled every 3 s: a line each changed
        changed = text.replace("SuspendTime=300", f"SuspendTime={IDLE_SECONDS}")
        (files / file).write_text(changed.replace(f"sleep {clusters.RECONCILE_SECONDS}", "sleep 3"))
    (files / "munge.key").write_bytes(os.urandom(clusters.MUNGE_KEY_BYTES))
    for made in files.iterdir():  # as the Secret volume gives them (protocol.pods: defaultMode 0500)
        made.chmod(0o500)
    log = tmp_path / "controller.log"

    def login(*words: str) -> str:  # what a user types in the login's terminal, in the app's folder
        conf = f"SLURM_CONF={clusters.SLURM_PATH}/slurm.conf"
        done = podman.run("exec", "--env", conf, "--workdir", WORK, name, *words)
        return done.stdout + done.stderr

    def seen(check: Any) -> Any:  # with the controller's log kept for a failure's message
        said = podman.run("logs", name)
        log.write_text(said.stdout + said.stderr)
        return check()

    def output() -> str:  # where sbatch writes it by default: the folder it was submitted from
        found = list((tmp_path / "work").glob("slurm-*.out"))
        return found[0].read_text() if found else ""

    podman.run("rm", "--force", name)
    try:
        started = podman.run(
            "run", "--detach", "--name", name, "--hostname", controller,
            "--volume", f"{files}:{clusters.SLURM_PATH}:ro", "--volume", f"{tmp_path / 'work'}:{WORK}",
            SLURM_IMAGE, "sh", f"{clusters.SLURM_PATH}/start", "controller", "--", "sleep", "infinity",
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        plane.address = podman.run(
            "inspect", "--format", "{{.NetworkSettings.IPAddress}}", name
        ).stdout.strip()
        until(lambda: seen(lambda: "UP" in login("scontrol", "ping")), "slurmctld in its container", 90, log)
        assert "reconcile" in login("ps", "-eo", "args")  # the reconciler beside it, leaving live nodes be
        assert f"{clusters.cluster_name(JOB)}-w[0-1]" in login("sinfo", "--noheader")  # powered down, listed

        script = "echo ran on $SLURMD_NODENAME with GPUs $CUDA_VISIBLE_DEVICES"
        assert login("sbatch", "--gres=gpu:1", "--wrap", script).startswith("Submitted")

        def resumed() -> bool:
            return any("resume" in body for _, body in plane.asked)

        until(lambda: seen(resumed), "the resume program", 90, log)
        # The plane's answer is in the controller's output, which is the app's log.
        until(
            lambda: seen(lambda: f"klique: resume {node}: {{}}" in log.read_text()),
            "the answer logged",
            30,
            log,
        )
        until(lambda: seen(lambda: "ran on" in output()), "the job in the worker's container", 150, log)
        assert output().split() == ["ran", "on", node, "with", "GPUs", "0"]
        until(lambda: seen(lambda: node not in plane.containers), "the suspend program", 150, log)
        given = next(body for _, body in plane.asked if "suspend" in body)
        assert given == {"suspend": node, "token": f"Bearer {TOKEN}"}
    finally:
        plane.shutdown()
        podman.run("rm", "--force", name)
        for worker in ("w0", "w1"):
            podman.run("rm", "--force", f"kq-{clusters.cluster_name(JOB)}-{worker}")
