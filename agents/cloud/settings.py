"""`[agent.cloud]`: what one autoscaler starts, where, how many, and how each instance's agent starts.

    [agent.cloud]
    provider = "aws"                 # aws (EC2); see docs/cloud.md for adding another
    region = "eu-west-1"
    image = "ami-0123456789abcdef0"  # an image with Python 3.11 and the NVIDIA driver
    instance_type = "g5.xlarge"
    gpus_per_instance = 1            # optional where the provider describes its types' GPUs
    max_instances = 4                # never more at once, whatever is queued
    idle_timeout_seconds = 600       # an instance with no work this long is ended (at least 60)
    boot_timeout_seconds = 900       # an instance whose agent has not said hello by then is ended
    spot = false                     # spot capacity: cheaper, and the cloud may take it back
    subnet = ""                      # the subnet to start instances in (the account's default where "")
    endpoint_url = ""                # another EC2-compatible endpoint
    tags = { team = "ml" }           # added to every instance

    [agent.cloud.bootstrap]
    install = "pip install 'klique[agent]'"   # shell run first on a new instance: installs klique-agent
    agent_command = "klique-agent"
    work_dir = "/var/lib/klique-agent"   # {name} stands for the instance's name
    agent_args = []                  # e.g. ["--gpus", "8"] where the image has no NVIDIA library

Every value is checked when the agent starts (and by `klique-agent --check`), each problem named.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PROVIDERS = ("aws",)
MIN_IDLE_SECONDS = 60
_TAG = re.compile(r"^[A-Za-z0-9 _.:/=+@-]{1,128}$")


@dataclass(frozen=True)
class Bootstrap:
    install: str = "pip install 'klique[agent]'"
    agent_command: str = "klique-agent"
    work_dir: str = "/var/lib/klique-agent"
    agent_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class CloudSettings:
    provider: str
    region: str
    image: str
    instance_type: str
    max_instances: int
    gpus_per_instance: int | None = None
    idle_timeout_seconds: float = 600.0
    boot_timeout_seconds: float = 900.0
    spot: bool = False
    subnet: str = ""
    endpoint_url: str = ""
    tags: Mapping[str, str] = field(default_factory=dict)
    bootstrap: Bootstrap = field(default_factory=Bootstrap)
    tick_seconds: float = 2.0  # how often the autoscaler looks at its instances and the plane's view

    @classmethod
    def read(cls, config: Mapping[str, Any]) -> CloudSettings:
        """The settings under [agent.cloud]; ValueError naming every problem."""
        section = config.get("agent", {}).get("cloud")
        if not isinstance(section, dict):
            raise ValueError("the configuration has no [agent.cloud] section")  # noqa: TRY004
        problems: list[str] = []

        def text(key: str, *, required: bool = False, default: str = "") -> str:
            value = section.get(key, default)
            if not isinstance(value, str) or (required and not value.strip()):
                problems.append(f"[agent.cloud] {key} must be {'a non-empty' if required else 'a'} string")
                return default
            return value.strip()

        def number(key: str, default: float, low: float, high: float, what: str) -> float:
            value = section.get(key, default)
            if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
                problems.append(f"[agent.cloud] {key} must be {what} (it is {value!r})")
                return default
            return float(value)

        known = {
            "provider", "region", "image", "instance_type", "max_instances", "gpus_per_instance",
            "idle_timeout_seconds", "boot_timeout_seconds", "spot", "subnet", "endpoint_url", "tags",
            "bootstrap", "tick_seconds",
        }  # fmt: skip
        if unknown := sorted(set(section) - known):
            problems.append(f"[agent.cloud] does not take {', '.join(unknown)}")
        provider = text("provider", default="aws")
        if provider not in PROVIDERS:
            problems.append(
                f"[agent.cloud] provider must be one of {', '.join(PROVIDERS)} (it is {provider!r})"
            )
        maximum = section.get("max_instances")
        if not isinstance(maximum, int) or isinstance(maximum, bool) or not 1 <= maximum <= 10_000:
            problems.append(
                f"[agent.cloud] max_instances must be a whole number from 1 to 10000 (it is {maximum!r}): "
                "a pool of at most 0 instances could never run a task"
            )
            maximum = 1
        gpus = section.get("gpus_per_instance")
        if gpus is not None and (not isinstance(gpus, int) or isinstance(gpus, bool) or not 1 <= gpus <= 64):
            problems.append(
                f"[agent.cloud] gpus_per_instance must be a whole number from 1 to 64 (it is {gpus!r})"
            )
            gpus = None
        idle = number(
            "idle_timeout_seconds", 600.0, MIN_IDLE_SECONDS, 7 * 86400,
            f"from {MIN_IDLE_SECONDS} seconds to a week: shorter would end instances between two tasks",
        )  # fmt: skip
        boot = number("boot_timeout_seconds", 900.0, 30, 3600, "from 30 to 3600 seconds")
        tick = number("tick_seconds", 2.0, 0.2, 60, "from 0.2 to 60 seconds")
        spot = section.get("spot", False)
        if not isinstance(spot, bool):
            problems.append("[agent.cloud] spot must be true or false")
            spot = False
        tags = section.get("tags", {})
        if not isinstance(tags, dict) or not all(
            isinstance(key, str) and isinstance(value, str) and _TAG.match(key) and _TAG.match(value)
            and not key.startswith(("klique:", "aws:"))
            for key, value in tags.items()
        ):  # fmt: skip
            problems.append(
                "[agent.cloud] tags must map names to values (letters, digits, spaces and _.:/=+@-, up to 128"
                " "
                "each), none starting with klique: or aws:"
            )
            tags = {}
        bootstrap = _bootstrap(section.get("bootstrap", {}), problems)
        settings = cls(
            provider=provider,
            region=text("region", required=True),
            image=text("image", required=True),
            instance_type=text("instance_type", required=True),
            max_instances=maximum,
            gpus_per_instance=gpus,
            idle_timeout_seconds=idle,
            boot_timeout_seconds=boot,
            spot=spot,
            subnet=text("subnet"),
            endpoint_url=text("endpoint_url"),
            tags=dict(tags),
            bootstrap=bootstrap,
            tick_seconds=tick,
        )
        if problems:
            raise ValueError("; ".join(problems))
        return settings


def _bootstrap(section: object, problems: list[str]) -> Bootstrap:
    if not isinstance(section, dict):
        problems.append("[agent.cloud.bootstrap] must be a table")
        return Bootstrap()
    if unknown := sorted(set(section) - {"install", "agent_command", "work_dir", "agent_args"}):
        problems.append(f"[agent.cloud.bootstrap] does not take {', '.join(unknown)}")
    default = Bootstrap()
    values: dict[str, Any] = {}
    for key in ("install", "agent_command", "work_dir"):
        value = section.get(key, getattr(default, key))
        if not isinstance(value, str) or "\x00" in value or (key != "install" and not value.strip()):
            problems.append(f"[agent.cloud.bootstrap] {key} must be a string")
            value = getattr(default, key)
        values[key] = value
    if not values["work_dir"].startswith("/") or "{" in values["work_dir"].replace("{name}", ""):
        problems.append(
            "[agent.cloud.bootstrap] work_dir must be an absolute path ({name} is the instance's name)"
        )
    arguments = section.get("agent_args", [])
    if not isinstance(arguments, list) or not all(
        isinstance(word, str) and "\x00" not in word for word in arguments
    ):
        problems.append("[agent.cloud.bootstrap] agent_args must be a list of strings")
        arguments = []
    return Bootstrap(agent_args=tuple(arguments), **values)
