"""The EC2 provider through the real boto3 client, against moto's EC2: launches tagged with user data,
listings by tag, ends; and each kind of refusal in words an administrator can act on."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from botocore.stub import Stubber

from agents.cloud import providers
from agents.cloud.ec2 import Ec2, user_data_of
from agents.cloud.providers import Launch, ProviderError
from tests.cloud.conftest import REGION, an_image, ec2_client, start_moto


def launch(image: str = "", **changes: Any) -> Launch:
    values: dict[str, Any] = {
        "name": "scaler-1a2b3c4d",
        "instance_type": "g5.xlarge",
        "image": image,
        "user_data": "#!/bin/sh\necho hello\n",
        "tags": {"klique:autoscaler": "scaler", "team": "ml"},
    }
    values.update(changes)
    return Launch(**values)


def test_an_instance_is_launched_tagged_listed_by_its_tags_and_ended(aws: str) -> None:
    provider = Ec2(REGION, aws)
    image = an_image(aws)
    first = provider.launch(launch(image))
    second = provider.launch(launch(image, name="scaler-5e6f7a8b", spot=True))
    provider.launch(launch(image, name="other-00000000", tags={"klique:autoscaler": "another"}))
    seen = {instance.name: instance for instance in provider.instances({"klique:autoscaler": "scaler"})}
    assert set(seen) == {"scaler-1a2b3c4d", "scaler-5e6f7a8b"}  # not the other autoscaler's
    assert seen["scaler-1a2b3c4d"].provider_id == first
    assert seen["scaler-1a2b3c4d"].state in (providers.PENDING, providers.RUNNING)
    assert seen["scaler-5e6f7a8b"].spot is True
    assert seen["scaler-1a2b3c4d"].spot is False
    assert user_data_of(ec2_client(aws), first) == "#!/bin/sh\necho hello\n"
    provider.terminate([first])
    provider.terminate([first])  # ending one already ended is what was asked, not an error
    states = {
        instance.name: instance.state for instance in provider.instances({"klique:autoscaler": "scaler"})
    }
    assert states == {"scaler-1a2b3c4d": providers.GONE, "scaler-5e6f7a8b": states["scaler-5e6f7a8b"]}
    assert states["scaler-5e6f7a8b"] != providers.GONE
    assert second


def test_the_gpus_of_an_instance_type_come_from_its_description(aws: str) -> None:
    provider = Ec2(REGION, aws)
    assert provider.gpus_of("g5.xlarge") == 1
    assert provider.gpus_of("p4d.24xlarge") == 8
    assert provider.gpus_of("m5.large") is None


@pytest.mark.parametrize(
    ("change", "kind", "said"),
    [
        ({"image": "ami-0000dead"}, providers.IMAGE, "set [agent.cloud] image to an AMI that exists"),
        ({"instance_type": "g9.huge"}, providers.INSTANCE_TYPE, "instance_type to a type this region offers"),
        ({"subnet": "subnet-0000dead"}, providers.NETWORK, "subnet to a subnet that exists"),
    ],
)
def test_a_launch_refused_says_which_setting_is_wrong(
    aws: str, change: dict[str, str], kind: str, said: str
) -> None:
    provider = Ec2(REGION, aws)
    with pytest.raises(ProviderError) as refused:
        provider.launch(launch(**{"image": an_image(aws), **change}))
    assert refused.value.kind == kind, refused.value
    assert said in str(refused.value)
    with pytest.raises(ProviderError) as checked:  # the check finds the same without starting anything
        provider.check(
            change.get("instance_type", "g5.xlarge"),
            change.get("image", an_image(aws)),
            change.get("subnet", ""),
        )
    assert checked.value.kind == kind
    assert provider.instances({"klique:autoscaler": "scaler"}) == []


def test_credentials_the_cloud_refuses_are_named() -> None:
    process, endpoint = start_moto(
        INITIAL_NO_AUTH_ACTION_COUNT="0"
    )  # every request must be signed by a known key
    try:
        provider = Ec2(REGION, endpoint)
        for attempt in (
            lambda: provider.instances({"a": "b"}),
            lambda: provider.check("g5.xlarge", "ami-1", ""),
        ):
            with pytest.raises(ProviderError) as refused:
                attempt()
            assert refused.value.kind == providers.CREDENTIALS
            assert "AuthFailure" in str(refused.value)
            assert "AWS credentials" in str(refused.value)
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.parametrize(
    ("code", "kind", "said"),
    [
        ("InstanceLimitExceeded", providers.QUOTA, "raise the account's EC2 quota"),
        ("VcpuLimitExceeded", providers.QUOTA, "raise the account's EC2 quota"),
        ("MaxSpotInstanceCountExceeded", providers.QUOTA, "raise the account's EC2 quota"),
        ("InsufficientInstanceCapacity", providers.CAPACITY, "no capacity of this type now"),
        ("UnauthorizedOperation", providers.CREDENTIALS, "ec2:RunInstances"),
        ("RequestLimitExceeded", providers.UNAVAILABLE, "tried again"),
        ("SomethingNew", providers.OTHER, "see EC2's message"),
    ],
)
def test_refusals_moto_cannot_make_are_read_the_same_way(code: str, kind: str, said: str) -> None:
    """moto keeps no quotas or capacity: these answers are stubbed on the real boto3 client (botocore's
    Stubber), so the provider reads EC2's own error shapes."""
    client = ec2_client("http://127.0.0.1:9")  # never reached: the stub answers
    stub = Stubber(client)
    stub.add_client_error("run_instances", service_error_code=code, service_message="the cloud said no")
    with stub, pytest.raises(ProviderError) as refused:
        Ec2(REGION, client=client).launch(launch("ami-1"))
    assert refused.value.kind == kind
    assert said in str(refused.value)
    assert code in str(refused.value)


def _check(aws: str, tmp_path: Any, **cloud: Any) -> subprocess.CompletedProcess[str]:
    section = {"region": REGION, "endpoint_url": aws, "image": an_image(aws), "instance_type": "g5.12xlarge",
               "max_instances": 2, **cloud}  # fmt: skip
    lines = ["[agent.cloud]"] + [f"{key} = {json.dumps(value)}" for key, value in section.items()]
    config = tmp_path / "cloud.toml"
    config.write_text("\n".join(lines) + "\n")
    return subprocess.run(
        [sys.executable, "-m", "agents.main", "--url", "http://x.localhost", "--backend", "cloud",
         "--config", str(config), "--check", "--work-dir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_the_agents_check_asks_the_provider_and_names_what_is_wrong(aws: str, tmp_path: Any) -> None:
    done = _check(aws, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "up to 2 g5.12xlarge instances of 4 GPU(s) in us-east-1" in done.stdout
    refused = _check(aws, tmp_path, image="ami-0000dead")
    assert refused.returncode == 2
    assert "InvalidAMIID.NotFound" in refused.stdout
    invalid = _check(aws, tmp_path, max_instances=0, idle_timeout_seconds=30)
    assert invalid.returncode == 2
    assert "max_instances must be a whole number from 1" in invalid.stdout
    assert "idle_timeout_seconds must be from 60 seconds" in invalid.stdout


def _listed(instance_id: str, name: str, spot: bool) -> dict[str, Any]:
    return {
        "InstanceId": instance_id,
        "InstanceType": "g5.12xlarge",
        "State": {"Name": "running", "Code": 16},
        "Tags": [{"Key": "klique:instance", "Value": name}, {"Key": "klique:autoscaler", "Value": "s"}],
        **({"InstanceLifecycle": "spot"} if spot else {}),
    }


def _stub_listing(stub: Stubber) -> None:
    instances = [
        _listed("i-1", "s-one", True),
        _listed("i-2", "s-two", True),
        _listed("i-3", "s-three", False),
    ]
    stub.add_response("describe_instances", {"Reservations": [{"Instances": instances}]})


def test_a_spot_instance_given_its_two_minute_notice_is_seen_as_interrupted_while_it_still_runs() -> None:
    """EC2 marks the spot request when it gives the instance its notice; moto cannot, so the answers are
    stubbed on the real client."""
    client = ec2_client("http://127.0.0.1:9")
    stub = Stubber(client)
    _stub_listing(stub)
    notice = {"Code": "marked-for-termination", "Message": "Spot Instance is marked for termination."}
    stub.add_response(
        "describe_spot_instance_requests",
        {
            "SpotInstanceRequests": [
                {"InstanceId": "i-1", "Status": notice},
                {
                    "InstanceId": "i-2",
                    "Status": {"Code": "fulfilled", "Message": "Your spot request is fulfilled."},
                },
            ]
        },
        {"Filters": [{"Name": "instance-id", "Values": ["i-1", "i-2"]}]},  # spot ones only
    )
    with stub:
        seen = {item.name: item for item in Ec2(REGION, client=client).instances({"klique:autoscaler": "s"})}
    assert seen["s-one"].state == providers.RUNNING
    assert seen["s-one"].interruption == (
        "the cloud announced it will reclaim it "
        "(marked-for-termination: Spot Instance is marked for termination.)"
    )
    assert seen["s-two"].interruption == ""
    assert seen["s-three"].interruption == ""


def test_without_leave_to_read_spot_requests_instances_are_judged_by_state_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = ec2_client("http://127.0.0.1:9")
    stub = Stubber(client)
    provider = Ec2(REGION, client=client)
    for _ in range(2):
        _stub_listing(stub)
        stub.add_client_error("describe_spot_instance_requests", service_error_code="UnauthorizedOperation")
    with stub:
        first = provider.instances({"klique:autoscaler": "s"})
        second = provider.instances({"klique:autoscaler": "s"})
    assert [item.interruption for item in first + second] == [""] * 6
    assert sum("notices cannot be read" in record.message for record in caplog.records) == 1  # said once


def test_spot_requests_are_read_from_moto_without_a_notice(aws: str) -> None:
    provider = Ec2(REGION, endpoint_url=aws)
    provider.launch(launch(an_image(aws), name="scaler-5e6f7a8b", spot=True))
    [seen] = provider.instances({"klique:autoscaler": "scaler"})
    assert seen.spot is True
    assert seen.interruption == ""
