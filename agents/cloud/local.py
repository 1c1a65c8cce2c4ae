"""Instances on this host: a stand-in for a cloud's machines where the "cloud" is moto's EC2 (the demo, the
tests), whose instances run nothing by themselves.

It watches the endpoint for instances carrying a tag; each one that runs gets its user data run here, as
the instance's first boot would (`sh`, in a session of its own, its output in <root>/<name>.log); each one
that ends (terminated by its autoscaler, or taken back by the "cloud") has its processes killed at once, as
a machine that is switched off. Nothing else is simulated: the agent the user data starts is the real one,
connecting to the real plane.

    python -m agents.cloud.local --endpoint http://127.0.0.1:5000 --region eu-west-1 \
        --tag klique:autoscaler=demo-cloud --root .klique/cloud
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agents.cloud.ec2 import NAME_TAG

logger = logging.getLogger("klique.cloud.local")


class LocalMachines:
    def __init__(self, client: Any, tags: dict[str, str], root: Path) -> None:
        self.client, self.tags, self.root = client, tags, root
        self.running: dict[str, subprocess.Popen[bytes]] = {}  # provider id -> its boot script's process

    def instances(self) -> dict[str, tuple[str, str]]:
        """Provider id -> (name, state) of the tagged instances."""
        filters = [{"Name": f"tag:{key}", "Values": [value]} for key, value in self.tags.items()]
        found = {}
        for reservation in self.client.describe_instances(Filters=filters).get("Reservations", []):
            for instance in reservation.get("Instances", []):
                tags = {tag["Key"]: tag["Value"] for tag in instance.get("Tags", [])}
                found[instance["InstanceId"]] = (tags.get(NAME_TAG, ""), instance["State"]["Name"])
        return found

    def boot(self, provider_id: str, name: str) -> None:
        answer = self.client.describe_instance_attribute(InstanceId=provider_id, Attribute="userData")
        script = base64.b64decode(answer.get("UserData", {}).get("Value", "") or b"").decode()
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / f"{name or provider_id}.log", "ab")  # noqa: SIM115 -- the child keeps it
        self.running[provider_id] = subprocess.Popen(
            ["sh", "-c", script], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        logger.info("instance %s (%s) booted", name, provider_id)

    def switch_off(self, provider_id: str) -> None:
        process = self.running.pop(provider_id)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        logger.info("instance %s switched off", provider_id)

    def step(self) -> None:
        seen = self.instances()
        for provider_id, (name, state) in seen.items():
            if state == "running" and provider_id not in self.running:
                self.boot(provider_id, name)
        for provider_id in list(self.running):
            if seen.get(provider_id, ("", "gone"))[1] != "running":
                self.switch_off(provider_id)

    def stop(self) -> None:
        for provider_id in list(self.running):
            self.switch_off(provider_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents.cloud.local", description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--region", required=True)
    parser.add_argument("--tag", action="append", default=[], help="KEY=VALUE an instance must carry")
    parser.add_argument("--root", type=Path, required=True, help="where each instance's output goes")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between looks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    import boto3  # noqa: PLC0415 -- the cloud extra

    client = boto3.client("ec2", region_name=args.region, endpoint_url=args.endpoint)
    machines = LocalMachines(client, dict(tag.split("=", 1) for tag in args.tag), args.root)
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while not stopping:
            try:
                machines.step()
            except Exception:  # the endpoint away a moment: look again
                logger.exception("looking at the instances failed")
            time.sleep(args.every)
    finally:
        machines.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
