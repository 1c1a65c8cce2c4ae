"""A cloud pool for real: `klique up`, the pool's autoscaler (`klique-agent --backend cloud`) against
moto's EC2 through boto3, and, for every instance it starts, a real bare-metal agent started by running
the instance's own user data on this host (agents.cloud.local). Work queued on the empty pool starts
instances (never more than the maximum), runs on their agents, survives the cloud taking an instance back,
and the idle instances end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest

from tests.cloud.conftest import KEYS, REGION, an_image, ec2_client, start_moto
from tests.e2e.conftest import clean_environment, start_up
from tests.e2e.test_agent_crash import Demo

pytestmark = pytest.mark.e2e

STEPS = "import time\nfor i in range({n}):\n    print(f'step {{i}}', flush=True)\n    time.sleep({pause})\n"
SCALER = "burst-scaler"


def submit(demo: Demo, steps: int, pause: float) -> str:
    task = demo.call(
        "POST",
        "/api/v1/tasks/",
        json={
            "compute_resource": "Research: burst",
            "spec": {"command": [sys.executable, "-c", STEPS.format(n=steps, pause=pause)]},
        },
    )
    return str(task["id"])


def instances(client: Any) -> dict[str, tuple[str, str]]:
    """name -> (provider id, state) of the autoscaler's instances."""
    found = {}
    reservations = client.describe_instances(Filters=[{"Name": "tag:klique:autoscaler", "Values": [SCALER]}])
    for reservation in reservations["Reservations"]:
        for instance in reservation["Instances"]:
            tags = {tag["Key"]: tag["Value"] for tag in instance["Tags"]}
            found[tags["klique:instance"]] = (instance["InstanceId"], instance["State"]["Name"])
    return found


def alive(client: Any) -> set[str]:
    return {name for name, (_, state) in instances(client).items() if state in ("pending", "running")}


def wait_for(what: str, check: Any, timeout: float, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


WRITE = "import json, os\nos.makedirs('out')\njson.dump({'loss': 0.25}, open('out/metrics.json', 'w'))\n"


def check_outputs_in_the_project_s_bucket(demo: Demo, endpoint: str, port: int) -> None:
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"],
    )
    s3.create_bucket(Bucket="vision-outputs")
    project = demo.call("POST", "/api/v1/projects/", json={"name": "orbit", "regions": [REGION]})
    for name, value in (
        ("S3_KEY_ID", KEYS["AWS_ACCESS_KEY_ID"]),
        ("S3_SECRET", KEYS["AWS_SECRET_ACCESS_KEY"]),
    ):
        secret = {"scope": "project", "project": "orbit", "name": name, "value": value}
        demo.call("POST", "/api/v1/secrets/", json=secret)
    bucket = {
        "store": "s3", "bucket": "vision-outputs", "prefix": "klique/", "region": REGION,
        "endpoint": endpoint, "access_key_secret": "S3_KEY_ID", "secret_key_secret": "S3_SECRET",
    }  # fmt: skip
    demo.call("PUT", f"/api/v1/projects/{project['id']}/outputs/", json=bucket)
    spec = {"command": [sys.executable, "-c", WRITE], "outputs": ["out/*.json"]}
    task = demo.call(
        "POST",
        "/api/v1/tasks/",
        json={"compute_resource": "Research: burst", "project": "orbit", "spec": spec},
    )["id"]
    wait_for(
        "the task with outputs completed",
        lambda: demo.call("GET", f"/api/v1/tasks/{task}/")["state"] == "completed",
        120,
    )
    [output] = demo.call("GET", f"/api/v1/tasks/{task}/outputs/")
    assert output["name"] == "out/metrics.json"
    assert output["location"].startswith(f"s3://vision-outputs/klique/{task}/")
    stored = s3.get_object(
        Bucket="vision-outputs", Key=output["location"].removeprefix("s3://vision-outputs/")
    )
    assert json.loads(stored["Body"].read()) == {"loss": 0.25}
    download = httpx.get(
        f"http://127.0.0.1:{port}/api/v1/tasks/{task}/outputs/out/metrics.json",
        headers=demo.headers,
        timeout=30,
    )
    assert download.status_code == 302
    assert json.loads(httpx.get(download.headers["location"], timeout=30).content) == {"loss": 0.25}


def test_a_cloud_pool_scales_from_zero_runs_work_on_its_instances_and_survives_an_interruption(
    fresh_database: str, redis_url: str, tmp_path: Path
) -> None:
    moto, endpoint = start_moto(
        MOTO_EC2_ENABLE_INSTANCE_TYPE_VALIDATION="true", MOTO_ENABLE_AMI_VALIDATION="true"
    )
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url, **KEYS)
    environment["AWS_DEFAULT_REGION"] = REGION
    running = start_up(environment, tmp_path / "data")
    helpers: list[subprocess.Popen[bytes]] = []
    try:
        token = running.wait_for(r"Admin token: +(klq_\S+)")[1]
        demo = Demo(running.port, token)
        scaler_token = demo.pool_token(
            {"name": "burst", "environment": "cloud", "capacity_gpus": 8, "gpu_class": "A10G",
             "region": REGION, "heartbeat_timeout_seconds": 30},
            {"name": "burst-two", "gpus": "2", "pools": [{"pool": "burst"}]},
            {"profile": "burst-two", "name": "Research: burst"},
        )  # fmt: skip
        token_file = tmp_path / "scaler.token"
        token_file.write_text(scaler_token)
        token_file.chmod(0o600)
        config = tmp_path / "cloud.toml"
        config.write_text(
            "[agent.cloud]\n"
            f'region = "{REGION}"\nendpoint_url = "{endpoint}"\nimage = "{an_image(endpoint)}"\n'
            'instance_type = "g5.12xlarge"\nmax_instances = 2\nidle_timeout_seconds = 60\n'
            "boot_timeout_seconds = 120\ntick_seconds = 0.5\n"
            "[agent.cloud.bootstrap]\n"
            f'install = ""\nagent_command = "{sys.executable} -m agents.main"\n'
            f'work_dir = "{tmp_path}/instances/{{name}}"\n'
            'agent_args = ["--gpus", "4", "--grace-seconds", "3"]\n'
        )
        url = f"http://demo.localhost:{running.port}"
        helpers.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "agents.cloud.local",
                    "--endpoint",
                    endpoint,
                    "--region",
                    REGION,
                    "--tag",
                    f"klique:autoscaler={SCALER}",
                    "--root",
                    str(tmp_path / "machines"),
                    "--every",
                    "0.3",
                ],
                env=environment,
            )
        )
        helpers.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "agents.main",
                    "--url",
                    url,
                    "--token-file",
                    str(token_file),
                    "--backend",
                    "cloud",
                    "--config",
                    str(config),
                    "--agent-id",
                    SCALER,
                    "--work-dir",
                    str(tmp_path / "scaler"),
                ],
                env=environment,
            )
        )
        ec2 = ec2_client(endpoint)

        def pool_online() -> bool:
            pools = demo.call("GET", "/api/v1/pools/")["results"]
            return any(pool["name"] == "burst" and pool["online"] for pool in pools)

        # The pool is online with no instance at all: its autoscaler is its listener.
        wait_for("pool burst online", pool_online, 60)
        assert alive(ec2) == set()

        # Five 2-GPU tasks on an empty pool of at most two 4-GPU instances.
        tasks = [submit(demo, steps=6, pause=0.3) for _ in range(5)]
        most = 0

        def all_completed() -> bool:
            nonlocal most
            most = max(most, len(alive(ec2)))
            states = [demo.call("GET", f"/api/v1/tasks/{task}/")["state"] for task in tasks]
            assert "failed" not in states, states
            return states == ["completed"] * 5

        wait_for("the burst to complete", all_completed, 180)
        assert most == 2, most  # it scaled out to its maximum, and no further
        assert len(instances(ec2)) == 2  # none started twice
        for task in tasks:
            assert demo.logged(task)[-1] == "step 5"
            assert demo.call("GET", f"/api/v1/tasks/{task}/")["pool"] == "burst"

        # The cloud takes back the instance a long task runs on: the task goes back to the front of its queue
        # as preempted, then runs to the end on an instance.
        long = submit(demo, steps=60, pause=0.25)
        wait_for(
            "the long task running",
            lambda: demo.call("GET", f"/api/v1/tasks/{long}/")["state"] == "running",
            60,
        )
        wait_for("its first lines", lambda: len(demo.logged(long)) >= 3, 30)
        history = demo.call("GET", f"/api/v1/tasks/{long}/history/")
        name = next(
            match[1] for event in history if (match := re.search(r"handed on to (\S+):", event["message"]))
        )
        ec2.terminate_instances(InstanceIds=[instances(ec2)[name][0]])

        def preempted() -> bool:
            events = demo.call("GET", f"/api/v1/tasks/{long}/history/")
            return any(event["to_state"] == "preempted" for event in events)

        wait_for("the interruption to preempt it", preempted, 30)
        events = demo.call("GET", f"/api/v1/tasks/{long}/history/")
        interruption = next(event for event in events if event["to_state"] == "preempted")
        assert f"the cloud took back instance {name}" in interruption["message"]
        wait_for(
            "the long task completed",
            lambda: demo.call("GET", f"/api/v1/tasks/{long}/")["state"] == "completed",
            120,
        )
        assert demo.logged(long)[-1] == "step 59"

        # A project limited to the pool's region keeps its outputs in its own bucket there (moto's S3): the
        # instance's agent stores them in the bucket itself, and the API serves them from there.
        check_outputs_in_the_project_s_bucket(demo, endpoint, running.port)

        # Idle instances end after their timeout (60 s); none is left running.
        wait_for("the idle instances to end", lambda: alive(ec2) == set(), 120, every=2)
        assert demo.call("GET", f"/api/v1/tasks/{long}/")["state"] == "completed"
    finally:
        for helper in reversed(helpers):
            helper.terminate()
            try:
                helper.wait(timeout=20)
            except subprocess.TimeoutExpired:
                helper.kill()
        running.interrupt()
        moto.terminate()
        moto.wait(timeout=10)
