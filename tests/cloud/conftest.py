"""moto's server mode as the EC2 (and S3) endpoint, spoken to with the real boto3 client. No cloud can be
reached from the machines the tests run on; moto validates image ids and instance types as EC2 does (its
validation switched on), and its instances run nothing: the tests start an agent per instance from the
instance's own user data where a test needs one to run work."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

REGION = "us-east-1"
KEYS = {"AWS_ACCESS_KEY_ID": "klique-test", "AWS_SECRET_ACCESS_KEY": "klique-test-secret"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_moto(**environment: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    binary = Path(sys.executable).parent / "moto_server"
    process = subprocess.Popen(
        [str(binary), "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **environment},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{endpoint}/moto-api/", timeout=1)
            return process, endpoint
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("moto_server did not start")


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    process, endpoint = start_moto(
        MOTO_EC2_ENABLE_INSTANCE_TYPE_VALIDATION="true", MOTO_ENABLE_AMI_VALIDATION="true"
    )
    yield endpoint
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def aws(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh account on the moto server: its endpoint, with the environment's credentials set."""
    httpx.post(f"{moto_endpoint}/moto-api/reset", timeout=10)
    for key, value in KEYS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    return moto_endpoint


def ec2_client(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "ec2",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"],
    )


def an_image(endpoint: str) -> str:
    return str(ec2_client(endpoint).describe_images(Owners=["amazon"])["Images"][0]["ImageId"])
