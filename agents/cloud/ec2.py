"""AWS EC2 as an autoscaler's provider, through the real boto3 client.

Credentials come from boto3's own chain (the environment, a profile, the instance role of the host the
autoscaler runs on); `endpoint_url` points it at another EC2-compatible endpoint. Instances are tagged at
launch (TagSpecifications), so an instance exists with its tags or not at all: an autoscaler that dies
between the launch and its own note of it finds the instance by its tags when it comes back.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from agents.cloud.providers import (
    CAPACITY,
    CREDENTIALS,
    ENDING,
    GONE,
    IMAGE,
    INSTANCE_TYPE,
    NETWORK,
    OTHER,
    PENDING,
    QUOTA,
    RUNNING,
    UNAVAILABLE,
    Launch,
    ProviderError,
    Seen,
)

NAME_TAG = "klique:instance"
# A spot request's status once EC2 has given its instance the two-minute interruption notice.
NOTICES = frozenset({"marked-for-termination", "marked-for-stop", "marked-for-hibernation"})
logger = logging.getLogger(__name__)

# EC2's error codes, by what an administrator has to do about them.
_KINDS = {
    CREDENTIALS: (
        "AuthFailure", "InvalidClientTokenId", "SignatureDoesNotMatch", "UnauthorizedOperation",
        "AccessDenied", "AccessDeniedException", "ExpiredToken", "RequestExpired", "OptInRequired",
    ),
    QUOTA: (
        "InstanceLimitExceeded", "VcpuLimitExceeded", "MaxSpotInstanceCountExceeded",
        "InsufficientFreeAddressesInSubnet", "ResourceLimitExceeded",
    ),
    CAPACITY: ("InsufficientInstanceCapacity", "InsufficientHostCapacity", "SpotMaxPriceTooLow"),
    IMAGE: ("InvalidAMIID.NotFound", "InvalidAMIID.Malformed", "InvalidAMIID.Unavailable"),
    INSTANCE_TYPE: ("InvalidInstanceType.NotFound", "InvalidInstanceType", "Unsupported"),
    NETWORK: ("InvalidSubnetID.NotFound", "InvalidSubnet", "InvalidGroup.NotFound"),
    UNAVAILABLE: ("RequestLimitExceeded", "ServiceUnavailable", "InternalError", "Unavailable"),
}  # fmt: skip
_KIND_OF = {code: kind for kind, codes in _KINDS.items() for code in codes}
_ADVICE = {
    CREDENTIALS: "check the autoscaler's AWS credentials and that their policy allows ec2:RunInstances, "
    "ec2:DescribeInstances, ec2:DescribeSpotInstanceRequests, ec2:TerminateInstances and ec2:CreateTags",
    QUOTA: "raise the account's EC2 quota for this instance type (Service Quotas) or lower max_instances",
    CAPACITY: "the region has no capacity of this type now; it is tried again, or use another type or region",
    IMAGE: "set [agent.cloud] image to an AMI that exists in this region",
    INSTANCE_TYPE: "set [agent.cloud] instance_type to a type this region offers",
    NETWORK: "set [agent.cloud] subnet to a subnet that exists in this region",
    UNAVAILABLE: "EC2 is not answering now; it is tried again",
    OTHER: "see EC2's message",
}
_STATES = {
    "pending": PENDING,
    "running": RUNNING,
    "stopping": ENDING,
    "shutting-down": ENDING,
    "stopped": GONE,
    "terminated": GONE,
}


def _refusal(error: Exception, doing: str) -> ProviderError:
    """A boto3 error as a ProviderError saying what was refused and what to do."""
    from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415 -- the cloud extra

    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        message = str(error.response.get("Error", {}).get("Message", ""))[:300]
        kind = _KIND_OF.get(code, OTHER)
        return ProviderError(kind, f"EC2 refused to {doing}: {code}: {message} ({_ADVICE[kind]}).")
    if isinstance(error, BotoCoreError):
        kind = CREDENTIALS if "credential" in str(error).lower() else UNAVAILABLE
        return ProviderError(kind, f"EC2 could not be asked to {doing}: {error} ({_ADVICE[kind]}).")
    return ProviderError(OTHER, f"EC2 could not be asked to {doing}: {error}.")


class Ec2:
    """The Provider for AWS EC2 (and EC2-compatible endpoints)."""

    def __init__(self, region: str, endpoint_url: str = "", client: Any = None) -> None:
        self.region = region
        if client is None:
            import boto3  # noqa: PLC0415 -- the cloud extra: only an autoscaler needs it

            client = boto3.client("ec2", region_name=region, endpoint_url=endpoint_url or None)
        self.client = client
        self._notices_unread = False  # said once that spot requests cannot be read

    def _call(self, doing: str, operation: str, **arguments: Any) -> Any:
        try:
            return getattr(self.client, operation)(**arguments)
        except Exception as error:
            raise _refusal(error, doing) from None

    def launch(self, launch: Launch) -> str:
        tags = [{"Key": key, "Value": value} for key, value in {**launch.tags, NAME_TAG: launch.name}.items()]
        tags.append({"Key": "Name", "Value": f"klique-{launch.name}"})
        arguments: dict[str, Any] = {
            "ImageId": launch.image,
            "InstanceType": launch.instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "UserData": launch.user_data,
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": tags},
                {"ResourceType": "volume", "Tags": tags},
            ],
            "InstanceInitiatedShutdownBehavior": "terminate",
            "MetadataOptions": {"HttpTokens": "required"},  # IMDSv2 only: the user data holds a token
        }
        if launch.subnet:
            arguments["SubnetId"] = launch.subnet
        if launch.spot:
            arguments["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
            }
        answer = self._call(f"start a {launch.instance_type} instance", "run_instances", **arguments)
        return str(answer["Instances"][0]["InstanceId"])

    def instances(self, tags: Mapping[str, str]) -> list[Seen]:
        filters = [{"Name": f"tag:{key}", "Values": [value]} for key, value in tags.items()]
        seen: list[Seen] = []
        paginator = self.client.get_paginator("describe_instances")
        try:
            for page in paginator.paginate(Filters=filters):
                for reservation in page.get("Reservations", []):
                    seen += [self._seen(instance) for instance in reservation.get("Instances", [])]
        except Exception as error:
            raise _refusal(error, "list the autoscaler's instances") from None
        return self._with_notices(seen)

    def _with_notices(self, seen: list[Seen]) -> list[Seen]:
        """Spot instances the cloud has announced it will reclaim, two minutes ahead: EC2 marks their spot
        request (marked-for-termination) when it puts the notice in the instance's metadata. Their tasks
        are preempted while the instance is still there to stop them with their grace period. Without
        leave to read spot requests, instances are judged by their state alone, once said in the log."""
        live = [item.provider_id for item in seen if item.spot and item.state in (PENDING, RUNNING)]
        if not live:
            return seen
        try:
            answer = self.client.describe_spot_instance_requests(
                Filters=[{"Name": "instance-id", "Values": live}]
            )
        except Exception as error:
            if not self._notices_unread:
                logger.warning(
                    "spot interruption notices cannot be read (%s); instances are judged by state", error
                )
            self._notices_unread = True
            return seen
        noticed = {
            str(request.get("InstanceId")): "{Code}: {Message}".format_map(
                {"Message": "", **request["Status"]}
            )
            for request in answer.get("SpotInstanceRequests", [])
            if request.get("Status", {}).get("Code") in NOTICES
        }
        return [
            replace(
                item, interruption=f"the cloud announced it will reclaim it ({noticed[item.provider_id]})"
            )
            if item.provider_id in noticed and not item.interruption
            else item
            for item in seen
        ]

    @staticmethod
    def _seen(instance: Mapping[str, Any]) -> Seen:
        tags = {tag.get("Key"): tag.get("Value") for tag in instance.get("Tags", [])}
        state = _STATES.get(str(instance.get("State", {}).get("Name", "")), GONE)
        reason = str(instance.get("StateReason", {}).get("Message", ""))
        spot = instance.get("InstanceLifecycle") == "spot"
        interruption = ""
        if spot and state in (ENDING, GONE) and "Spot" in reason:
            interruption = reason
        return Seen(
            provider_id=str(instance.get("InstanceId", "")),
            name=str(tags.get(NAME_TAG, "")),
            state=state,
            instance_type=str(instance.get("InstanceType", "")),
            spot=spot,
            interruption=interruption,
        )

    def terminate(self, provider_ids: list[str]) -> None:
        if provider_ids:
            try:
                self.client.terminate_instances(InstanceIds=provider_ids)
            except Exception as error:
                refusal = _refusal(error, f"end {', '.join(provider_ids)}")
                if "InvalidInstanceID.NotFound" not in str(refusal):  # already gone: what was asked
                    raise refusal from None

    def gpus_of(self, instance_type: str) -> int | None:
        answer = self._call(
            f"describe instance type {instance_type}",
            "describe_instance_types",
            InstanceTypes=[instance_type],
        )
        for described in answer.get("InstanceTypes", []):
            gpus = described.get("GpuInfo", {}).get("Gpus", [])
            return sum(int(gpu.get("Count", 0)) for gpu in gpus) or None
        return None

    def check(self, instance_type: str, image: str, subnet: str) -> None:
        self._call(f"describe image {image}", "describe_images", ImageIds=[image])
        self._call(
            f"describe instance type {instance_type}",
            "describe_instance_types",
            InstanceTypes=[instance_type],
        )
        if subnet:
            self._call(f"describe subnet {subnet}", "describe_subnets", SubnetIds=[subnet])


def user_data_of(client: Any, provider_id: str) -> str:
    """An instance's user data, decoded (for tests and for an administrator looking at one)."""
    answer = client.describe_instance_attribute(InstanceId=provider_id, Attribute="userData")
    encoded = answer.get("UserData", {}).get("Value", "")
    return base64.b64decode(encoded).decode() if encoded else ""
