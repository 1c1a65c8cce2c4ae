"""The compute nodes' reporter (agents/node.py), run as the batch script runs it: a plain script under the
system's Python, posting to a stand-in for the plane's endpoints."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import time
from pathlib import Path

from agents import node
from tests.hpc.conftest import PlaneStandIn

TASK = "3d0f6a1e-0000-4000-8000-000000000042"
WORK = (
    'echo step 1; echo \'{"loss": 0.9, "step": 1}\' >> "$KLIQUE_METRICS_FILE"; '
    'echo "not json" >> "$KLIQUE_METRICS_FILE"; '
    'echo step 2; echo \'{"loss": 0.5, "step": 2}\' >> "$KLIQUE_METRICS_FILE"; '
    "echo done > result.txt; exit 4"
)


def reporter(plane: PlaneStandIn, folder: Path, *command: str, **environment: str) -> subprocess.Popen[str]:
    (folder / "token").write_text(f"kqt_{TASK}_signature\n")
    return subprocess.Popen(
        [
            "/usr/bin/python3",
            node.__file__,
            "--url",
            plane.url,
            "--task",
            TASK,
            "--token-file",
            str(folder / "token"),
            "--workdir",
            str(folder),
            "--output",
            "*.txt",
            "--metrics-seconds",
            "0.2",
            "--",
            *command,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment,
    )


def test_output_metrics_outputs_and_the_exit_code_reach_the_plane_through_its_refusals(
    plane: PlaneStandIn, tmp_path: Path
) -> None:
    fake_smi = tmp_path / "bin" / "nvidia-smi"  # a node with a GPU, as nvidia-smi answers on one
    fake_smi.parent.mkdir()
    fake_smi.write_text("#!/bin/sh\necho '0, 87, 40000, 81559'\n")
    fake_smi.chmod(0o755)
    plane.refuse = 3  # the plane restarts while the task runs: nothing may be lost or doubled
    plane.full = 2  # and its file store is full for the first two tries of the output
    process = reporter(plane, tmp_path, "bash", "-c", WORK, PATH=f"{fake_smi.parent}:/usr/bin:/bin")
    printed, _ = process.communicate(timeout=60)
    assert process.returncode == 4
    assert printed.splitlines()[:2] == ["step 1", "step 2"]  # for the batch system's output file too
    assert plane.lines(TASK) == ["step 1", "step 2"]
    task_values = [m["values"] for m in plane.metrics(TASK) if "gpus" not in m["values"]]
    assert task_values == [{"loss": 0.9, "step": 1}, {"loss": 0.5, "step": 2}]
    gpus = [m["values"]["gpus"] for m in plane.metrics(TASK) if "gpus" in m["values"]]
    assert gpus[0] == [
        {"index": 0, "utilization_percent": 87.0, "memory_used_mib": 40000.0, "memory_total_mib": 81559.0}
    ]
    said = [
        line for r in plane.reports if r["type"] == "log" and r["stream"] == "klique" for line in r["lines"]
    ]
    assert said == ["klique: not a JSON object in metrics-node0.jsonl, skipped: not json"]
    numbers = [report["seq"] for report in plane.reports]
    assert numbers == sorted(set(numbers))  # each report once, in order
    assert {report["source"] for report in plane.reports} == {"node-0"}
    assert plane.outputs == {f"{TASK}/result.txt": b"done\n"}  # stored on the third try
    assert plane.digests == [hashlib.sha256(b"done\n").hexdigest()] * 3
    assert (tmp_path / "exit-code").read_text() == "4"


def test_outputs_of_a_project_with_a_bucket_go_to_the_bucket_then_a_receipt_to_the_plane(
    plane: PlaneStandIn, tmp_path: Path
) -> None:
    plane.store, plane.bucket_refuse = "s3", 1  # the first URL has expired by the time the PUT arrives
    process = reporter(plane, tmp_path, "bash", "-c", WORK, PATH="/usr/bin:/bin")
    process.communicate(timeout=60)
    assert process.returncode == 4
    assert plane.outputs == {}  # nothing of the file went through the plane
    assert plane.bucket == {f"{TASK}/result.txt": b"done\n"}
    digest = hashlib.sha256(b"done\n").hexdigest()
    assert [headers.get("x-amz-meta-klique-sha256") for headers in plane.bucket_headers] == [digest, digest]
    assert all(
        "Authorization" not in headers for headers in plane.bucket_headers
    )  # the task token stays home
    assert plane.receipts == [
        {"name": "result.txt", "sha256": digest, "size": 5}
    ]  # once, after it was stored
    said = [
        line for r in plane.reports if r["type"] == "log" and r["stream"] == "klique" for line in r["lines"]
    ]
    assert not any("not stored" in line for line in said)


def test_sigterm_reaches_the_command_which_may_stop_cleanly(plane: PlaneStandIn, tmp_path: Path) -> None:
    # The signal reaches the whole group: a single `sleep 60 & wait` could end on the killed sleep and
    # the script with it, before the shell's own trap ran; the loop waits on until the trap runs.
    script = "trap 'echo stopping; exit 0' TERM; echo ready; while :; do sleep 0.2 & wait; done"
    process = reporter(plane, tmp_path, "bash", "-c", script, PATH="/usr/bin:/bin")
    deadline = time.monotonic() + 20
    while "ready" not in plane.lines(TASK) and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=30)
    assert process.returncode == 0
    assert plane.lines(TASK) == ["ready", "stopping"]
