"""The bare-metal backend's container mode, on a real podman (tests/containers.py): a task with an `image`
runs in a container with its folder, its variables by name, its output streamed and its exit code kept;
a missing image fails at once with the image named in the task's reason; a stopped or killed task leaves
no container behind; GPUs go to each engine the way it takes them."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import tarfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from agents import containers
from agents.backend import Refused
from agents.baremetal import BareMetal
from agents.environment import BUILD_FAILED
from agents.state import State
from protocol.units import UNITS_PER_GPU
from tests.agents.test_baremetal import Recorder
from tests.containers import Podman

TIMEOUT = 120


def bare_metal(tmp_path: Path, *, source: str = "configured", shared_path: str = "") -> BareMetal:
    return BareMetal(
        4, tmp_path / "work", State(tmp_path / "work" / "agent.sqlite"), source, shared_path=shared_path
    )


def assignment(task_id: str, spec: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"task_id": task_id, "lease_id": "l", "size_units": UNITS_PER_GPU, "spec": spec, **extra}


def run(bare: BareMetal, given: dict[str, Any]) -> Recorder:
    async def scenario() -> Recorder:
        recorder = Recorder(bare.state)
        await bare.start(given, recorder)
        await asyncio.wait_for(recorder.finished.wait(), timeout=TIMEOUT)
        return recorder

    return asyncio.run(scenario())


def result(recorder: Recorder) -> dict[str, Any]:
    kind, body = recorder.reports[-1]
    assert kind == "result", recorder.reports
    return body


def containers_named(podman: Podman, task_id: str) -> list[str]:
    listed = podman.run("ps", "--all", "--format", "{{.Names}}")
    assert listed.returncode == 0, listed.stderr
    return [name for name in listed.stdout.split() if name == containers.container_name(task_id)]


def test_a_task_runs_in_its_image_with_its_folder_output_and_exit_code(
    podman: Podman, tmp_path: Path
) -> None:
    script = (
        "echo line one; echo line two >&2; "
        "if [ -d /usr/lib ]; then echo on-the-host; else echo in-the-image; fi; "
        'echo "task $KLIQUE_TASK_ID in $(pwd)"; echo kept > /work/made-inside.txt; exit 3'
    )
    bare = bare_metal(tmp_path)
    recorder = run(bare, assignment("t-image", {"command": ["sh", "-c", script], "image": podman.image}))

    lines = recorder.lines()
    assert {"line one", "line two", "in-the-image", "task t-image in /work"} <= set(lines), lines
    assert "on-the-host" not in lines
    assert result(recorder)["exit_code"] == 3
    assert "reason" not in result(recorder)  # the command's own failure: its exit code says it
    assert (tmp_path / "work" / "t-image" / "made-inside.txt").read_text() == "kept\n"
    assert any(line.startswith("klique: container: ") and "podman run --rm" in line for line in lines)
    assert containers_named(podman, "t-image") == []  # --rm: gone with its end


def test_the_tasks_variables_and_secrets_reach_the_container_by_name_only(
    podman: Podman, tmp_path: Path
) -> None:
    secret = "s3cr3t-value-that-must-not-show"
    spec = {
        "command": ["sh", "-c", 'echo "epochs=$EPOCHS"; echo "key=$API_KEY"'],
        "image": podman.image,
        "environment": {"EPOCHS": "7"},
    }
    recorder = run(bare_metal(tmp_path), assignment("t-vars", spec, secrets={"API_KEY": secret}))

    lines = recorder.lines()
    assert "epochs=7" in lines, lines
    assert f"key={secret}" in lines, lines
    engine_line = next(line for line in lines if line.startswith("klique: container:"))
    assert "-e API_KEY" in engine_line
    assert "-e EPOCHS" in engine_line
    assert secret not in engine_line  # values never on its command line
    assert "=7" not in engine_line
    assert secret not in (tmp_path / "work" / "t-vars" / "spec.json").read_text()


@pytest.mark.parametrize("image", ["localhost/klique-no-such-image:9", "nvcr.io/nvidia/pytorch:24.05-py3"])
def test_a_missing_image_fails_at_once_naming_it(podman: Podman, tmp_path: Path, image: str) -> None:
    started = time.monotonic()
    recorder = run(bare_metal(tmp_path), assignment("t-missing", {"command": ["true"], "image": image}))

    assert time.monotonic() - started < 30  # no registry is tried: the agent does not pull by default
    body = result(recorder)
    assert body["exit_code"] == BUILD_FAILED
    assert f"the image {image} is not on this host" in body["reason"], body
    assert any("podman load -i ARCHIVE" in line for line in recorder.lines()), recorder.lines()


def test_an_engine_that_cannot_run_the_image_says_so(podman: Podman, tmp_path: Path) -> None:
    # As if NVML had found GPUs: podman is asked for CDI devices this machine has no specification for.
    bare = bare_metal(tmp_path, source="nvml")
    recorder = run(bare, assignment("t-cdi", {"command": ["true"], "image": podman.image}))

    body = result(recorder)
    assert body["exit_code"] == containers.CANNOT_START
    assert "container could not be started" in body["reason"]
    assert any("unresolvable CDI devices nvidia.com/gpu=0" in line for line in recorder.lines())


def test_a_container_left_by_an_earlier_run_is_removed_before_the_next(
    podman: Podman, tmp_path: Path
) -> None:
    bare = bare_metal(tmp_path)
    busy = podman.run("run", "-d", "--name", containers.container_name("t-125"), podman.image, "sleep", "600")
    assert busy.returncode == 0, busy.stderr
    try:
        recorder = run(bare, assignment("t-125", {"command": ["true"], "image": podman.image}))
    finally:
        podman.run("rm", "--force", "--time", "0", containers.container_name("t-125"))
    body = result(recorder)
    assert body["exit_code"] == 0, recorder.lines()  # an earlier run's container is removed first


def _wait_for_container(podman: Podman, task_id: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not containers_named(podman, task_id):
        assert time.monotonic() < deadline, "the container never started"
        time.sleep(0.2)


def interrupted(
    bare: BareMetal, podman: Podman, task_id: str, spec: dict[str, Any], then: Callable[[], Awaitable[None]]
) -> Recorder:
    """Start the task, wait until its container runs, do `then`, and wait for the task's result."""

    async def scenario() -> Recorder:
        recorder = Recorder(bare.state)
        await bare.start(assignment(task_id, spec), recorder)
        await asyncio.to_thread(_wait_for_container, podman, task_id)
        await then()
        await asyncio.wait_for(recorder.finished.wait(), timeout=TIMEOUT)
        return recorder

    return asyncio.run(scenario())


def test_a_stopped_task_stops_its_container(podman: Podman, tmp_path: Path) -> None:
    bare = bare_metal(tmp_path)
    spec = {"command": ["sh", "-c", "echo started; sleep 600"], "image": podman.image}
    recorder = interrupted(bare, podman, "t-stop", spec, lambda: bare.stop("t-stop", grace_seconds=20))
    body = result(recorder)
    assert body["stopped"] is True
    assert body["exit_code"] == 128 + signal.SIGTERM  # the command got SIGTERM inside (an init forwards it)
    assert containers_named(podman, "t-stop") == []


def test_a_task_that_ignores_sigterm_is_killed_and_leaves_no_container(
    podman: Podman, tmp_path: Path
) -> None:
    bare = bare_metal(tmp_path)
    spec = {"command": ["sh", "-c", "trap '' TERM; while true; do sleep 1; done"], "image": podman.image}
    recorder = interrupted(bare, podman, "t-deaf", spec, lambda: bare.stop("t-deaf", grace_seconds=1))
    body = result(recorder)
    assert body["stopped"] is True
    assert body["exit_code"] == -signal.SIGKILL  # the grace period ran out: SIGKILL to the runner's group
    assert containers_named(podman, "t-deaf") == []


def test_a_runner_killed_outright_leaves_no_container(podman: Podman, tmp_path: Path) -> None:
    """SIGKILL to the runner's whole process group (the out-of-memory killer, a kill -9) takes the engine's
    client with it, while the engine keeps the container running: the agent removes it."""
    bare = bare_metal(tmp_path)
    spec = {"command": ["sh", "-c", "sleep 600"], "image": podman.image}

    async def kill() -> None:
        (run,) = bare.state.runs()
        os.killpg(run.pid, signal.SIGKILL)

    recorder = interrupted(bare, podman, "t-killed", spec, kill)
    assert result(recorder)["exit_code"] == -signal.SIGKILL
    assert containers_named(podman, "t-killed") == []


def test_an_image_the_agent_must_not_pass_to_an_engine_is_refused_before_anything_starts(
    podman: Podman, tmp_path: Path
) -> None:
    bare = bare_metal(tmp_path)
    for image in ["--privileged", "-v/:/host", "busybox --privileged", "/etc/shadow.sif", "x;id", 7]:

        async def report(*_: Any) -> None:
            raise AssertionError("nothing starts")

        with pytest.raises(Refused) as refused:
            asyncio.run(bare.start(assignment("t-bad", {"command": ["true"], "image": image}), report))
        assert refused.value.permanent
        assert "image" in str(refused.value)
    assert bare.state.runs() == []
    assert containers_named(podman, "t-bad") == []


# How each engine is given GPUs: rendered here, as no GPU is on these machines.


def _argv(engine: str, environment: dict[str, str], **overrides: Any) -> tuple[list[str], list[str]]:
    given: dict[str, Any] = {
        "image": "localhost/trainer:2.1",
        "task_id": "t1",
        "workdir": Path("/srv/klique/t1"),
        "passed": {"EPOCHS": "3"},
        "runner_environment": environment,
    }
    return containers.run_argv(engine, **(given | overrides))


def test_podman_gets_cdi_device_names_and_the_container_counts_its_gpus_from_zero() -> None:
    argv, notes = _argv("/usr/bin/podman", {"CUDA_VISIBLE_DEVICES": "1,3", "KLIQUE_GPU_SOURCE": "nvml"})
    assert argv[argv.index("--device") : argv.index("--device") + 4] == [
        "--device", "nvidia.com/gpu=1", "--device", "nvidia.com/gpu=3",
    ]  # fmt: skip
    assert "CUDA_VISIBLE_DEVICES=0,1" in argv
    assert argv[-2:] == ["--", "localhost/trainer:2.1"]
    assert notes == []


def test_a_mig_slice_goes_to_podman_by_its_uuid() -> None:
    uuid = "MIG-5c89852c-d268-c3f3-1b07-005d5ae1dc3f"
    argv, _ = _argv("podman", {"CUDA_VISIBLE_DEVICES": uuid, "KLIQUE_GPU_SOURCE": "nvml"})
    assert ["--device", f"nvidia.com/gpu={uuid}"] == argv[argv.index("--device") : argv.index("--device") + 2]
    assert "CUDA_VISIBLE_DEVICES=0" in argv


def test_docker_gets_its_gpus_flag() -> None:
    argv, _ = _argv("/usr/bin/docker", {"CUDA_VISIBLE_DEVICES": "0,2", "KLIQUE_GPU_SOURCE": "nvml"})
    assert argv[argv.index("--gpus") + 1] == "device=0,2"
    assert "--device" not in argv
    assert "CUDA_VISIBLE_DEVICES=0,1" in argv


def test_a_configured_inventory_passes_no_devices_and_says_so() -> None:
    argv, notes = _argv("podman", {"CUDA_VISIBLE_DEVICES": "0", "KLIQUE_GPU_SOURCE": "configured"})
    assert "--device" not in argv
    assert "--gpus" not in argv
    at = argv.index("CUDA_VISIBLE_DEVICES")  # by name: the host's value, which has no devices behind it
    assert argv[at - 1 : at + 1] == ["-e", "CUDA_VISIBLE_DEVICES"]
    assert any("configured inventory" in note for note in notes)


@pytest.mark.parametrize(
    ("address", "hosts"),
    [
        ("http://demo.localhost:8000/v1", ["demo.localhost"]),
        ("http://Acme-1.Demo.LOCALHOST/v1", ["acme-1.demo.localhost"]),
        ("https://acme.klique.example/v1", []),  # a real name: the resolver's
        ("http://localhost:8000/v1", []),  # every image knows it
        ("http://demo.localhost:80@evil.example/v1", []),  # the host is evil.example
        ("http://demo.localhost.evil.example/v1", []),
        ("http://a_b.localhost/v1", []),
        ("http://-x.localhost/v1", []),
        ("http://127.0.0.1:8000/v1", []),
        ("not a url", []),
    ],
)
def test_a_gateway_under_localhost_is_on_the_containers_loopback(address: str, hosts: list[str]) -> None:
    argv, _ = _argv("podman", {}, passed={"OPENAI_BASE_URL": address, "OPENAI_API_KEY": "kqs_x"})
    assert [word for word in argv if word.startswith("--add-host")] == [
        f"--add-host={host}:127.0.0.1" for host in hosts
    ]
    assert argv.index("--") > max((argv.index(word) for word in argv if word.startswith("--add")), default=0)
    assert address not in str(argv)  # names only on its command line
    unpassed, _ = _argv("podman", {"OPENAI_BASE_URL": address})  # the runner's own: not the container's
    assert not any(word.startswith("--add-host") for word in unpassed)


def test_the_shared_file_system_is_mounted_at_its_own_path(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    argv, notes = _argv("podman", {"KLIQUE_SHARED_PATH": str(shared)})
    assert f"{shared}:{shared}" in argv
    assert notes == []
    argv, notes = _argv("podman", {"KLIQUE_SHARED_PATH": str(tmp_path / "absent")})
    assert not any(str(tmp_path / "absent") in word for word in argv)
    assert any("not on this host" in note for note in notes)
    odd = tmp_path / "a:b,c"
    odd.mkdir()
    argv, notes = _argv("podman", {"KLIQUE_SHARED_PATH": str(odd)})
    assert not any(str(odd) in word for word in argv)  # a colon would split the engine's volume option
    assert any("cannot be mounted" in note for note in notes)


def test_the_container_sees_the_shared_file_system(podman: Podman, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "dataset.txt").write_text("from the shared file system\n")
    bare = bare_metal(tmp_path, shared_path=str(shared))
    spec = {"command": ["cat", f"{shared}/dataset.txt"], "image": podman.image}
    recorder = run(bare, assignment("t-shared", spec))
    assert "from the shared file system" in recorder.lines()
    assert result(recorder)["exit_code"] == 0


def test_the_engine_is_the_operators_choice(monkeypatch: pytest.MonkeyPatch, podman: Podman) -> None:
    monkeypatch.setenv("KLIQUE_CONTAINER_ENGINE", "no-such-engine")
    assert containers.engine() is None
    monkeypatch.setenv("KLIQUE_CONTAINER_ENGINE", "podman")
    chosen = containers.engine()
    assert chosen is not None
    assert chosen.endswith("podman")
    monkeypatch.setenv("KLIQUE_IMAGE_PULL", "always-from-anywhere")
    with pytest.raises(ValueError, match="KLIQUE_IMAGE_PULL"):
        containers.pull_policy()


def test_a_missing_image_is_loaded_from_the_administrators_archives(podman: Podman, tmp_path: Path) -> None:
    archives = tmp_path / "archives"
    archives.mkdir()
    (archives / "README.txt").write_text("not an archive\n")
    wanted = "localhost/klique-archived:1"
    for image, file in ((wanted, "b-archived.tar"), ("localhost/klique-other:1", "a-other.tar")):
        assert podman.run("tag", podman.image, image).returncode == 0
        saved = podman.run("save", "--output", str(archives / file), image)
        assert saved.returncode == 0, saved.stderr
        assert podman.run("rmi", image).returncode == 0
    try:
        bare = BareMetal(
            4, tmp_path / "work", State(tmp_path / "work" / "agent.sqlite"), image_archives=str(archives)
        )
        recorder = run(
            bare, assignment("t-archived", {"command": ["echo", "loaded and ran"], "image": wanted})
        )
        assert result(recorder)["exit_code"] == 0, recorder.lines()
        assert "loaded and ran" in recorder.lines()
        assert any(
            line.startswith("klique: load: ") and "b-archived.tar" in line for line in recorder.lines()
        )
        assert podman.run("image", "exists", wanted).returncode == 0
        assert (
            podman.run("image", "exists", "localhost/klique-other:1").returncode != 0
        )  # only what was asked

        missing = run(
            bare, assignment("t-nowhere", {"command": ["true"], "image": "localhost/klique-nowhere:1"})
        )
        assert result(missing)["exit_code"] == BUILD_FAILED
        assert any(f"nor in an archive in {archives}" in line for line in missing.lines())
    finally:
        podman.run("rmi", "--force", wanted)


def test_an_archive_is_known_by_the_names_in_its_manifest(tmp_path: Path) -> None:
    def archive(name: str, members: dict[str, bytes], *, gzip: bool = False) -> Path:
        path = tmp_path / name
        with tarfile.open(path, "w:gz" if gzip else "w") as bundle:
            for member, content in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(content)
                bundle.addfile(info, io.BytesIO(content))
        return path

    hub = archive(
        "hub.tar.gz", {"manifest.json": b'[{"RepoTags": ["docker.io/library/busybox:latest"]}]'}, gzip=True
    )
    assert containers.archive_names(hub) == ["docker.io/library/busybox:latest"]
    assert containers.archive_holding(tmp_path, "busybox") == hub  # the same image, as docker names it
    assert containers.archive_holding(tmp_path, "docker.io/library/busybox:latest") == hub
    assert containers.archive_holding(tmp_path, "busybox:1.36") is None
    for name, members in {
        "no-manifest.tar": {"layer.tar": b"x"},
        "not-a-list.tar": {"manifest.json": b'{"RepoTags": ["x:1"]}'},
        "not-json.tar": {"manifest.json": b"[{"},
        "huge.tar": {"manifest.json": b"[" + b" " * (containers.MAX_MANIFEST + 1) + b"]"},
    }.items():
        assert containers.archive_names(archive(name, members)) == [], name
    (tmp_path / "plain.tar").write_bytes(b"not a tar at all")
    assert containers.archive_names(tmp_path / "plain.tar") == []
    assert containers.archive_holding(tmp_path / "absent", "busybox") is None


def test_a_container_holds_no_capability_and_cannot_gain_one(podman: Podman, tmp_path: Path) -> None:
    """Root in the container in name only: no capabilities, no setuid, and the shared file system's
    permissions hold for it (another user's folder stays closed to it)."""
    shared = tmp_path / "shared"
    (shared / "someone-else").mkdir(parents=True)
    (shared / "someone-else" / "notes.txt").write_text("theirs\n")
    os.chown(shared / "someone-else", 54321, 54321)
    os.chown(shared / "someone-else" / "notes.txt", 54321, 54321)
    (shared / "someone-else").chmod(0o755)
    (shared / "someone-else" / "notes.txt").chmod(0o644)
    tmp_path.chmod(0o755)
    script = (
        "grep -E '^(CapEff|CapBnd|NoNewPrivs):' /proc/self/status; "
        f"echo mine > {shared}/someone-else/notes.txt && echo overwrote; "
        f"touch {shared}/someone-else/planted && echo planted; "
        f"cat {shared}/someone-else/notes.txt"
    )
    bare = bare_metal(tmp_path, shared_path=str(shared))
    recorder = run(bare, assignment("t-caps", {"command": ["sh", "-c", script], "image": podman.image}))
    lines = recorder.lines()
    assert "CapEff:\t0000000000000000" in lines, lines
    assert "CapBnd:\t0000000000000000" in lines, lines
    assert "NoNewPrivs:\t1" in lines, lines
    assert "overwrote" not in lines
    assert "planted" not in lines
    assert "theirs" in lines
    assert (shared / "someone-else" / "notes.txt").read_text() == "theirs\n"


def test_an_operator_grants_back_only_capabilities_of_the_allow_list(
    monkeypatch: pytest.MonkeyPatch, podman: Podman, tmp_path: Path
) -> None:
    monkeypatch.setenv("KLIQUE_CONTAINER_CAPABILITIES", "ipc_lock, CAP_SYS_ADMIN")
    bare = bare_metal(tmp_path)
    script = "grep -E '^CapEff:' /proc/self/status"
    recorder = run(bare, assignment("t-grant", {"command": ["sh", "-c", script], "image": podman.image}))
    lines = recorder.lines()
    assert "CapEff:\t0000000000004000" in lines, lines  # IPC_LOCK (14) alone
    assert any("names what is not a capability, left out: CAP_SYS_ADMIN" in line for line in lines), lines


@pytest.mark.parametrize(
    ("value", "granted", "refused"),
    [
        ("", [], ""),
        ("IPC_LOCK", ["IPC_LOCK"], ""),
        ("cap_sys_ptrace, SYS_NICE,SYS_NICE", ["SYS_NICE", "SYS_PTRACE"], ""),
        ("SYS_ADMIN", [], "SYS_ADMIN"),
        ("ALL", [], "ALL"),
        ("DAC_OVERRIDE,CHOWN,SETUID,NET_BIND_SERVICE", [], "DAC_OVERRIDE, CHOWN, SETUID, NET_BIND_SERVICE"),
        ("IPC_LOCK --privileged", [], "IPC_LOCK --PRIVILEGED"),
        ("IPC_LOCK;id", [], "IPC_LOCK;ID"),
        ("-v/:/host", [], "-V/:/HOST"),
    ],
)
def test_only_named_capabilities_of_the_allow_list_reach_the_engine(
    value: str, granted: list[str], refused: str
) -> None:
    assert containers.capabilities(value) == (granted, refused)
    argv, _ = _argv("podman", {"KLIQUE_CONTAINER_CAPABILITIES": value})
    assert "--cap-drop=ALL" in argv
    assert "--security-opt=no-new-privileges" in argv
    assert [word for word in argv if word.startswith("--cap-add")] == [
        f"--cap-add={name}" for name in granted
    ]
