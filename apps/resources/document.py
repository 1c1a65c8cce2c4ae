"""The configuration document that administrators edit: its shape, and the report `validate` gives.

A document has three lists, each item named by a slug:

    pools:    name, environment, capacity_gpus, gpu_class, region, sharing, cost_tier,
              heartbeat_timeout_seconds
    profiles: name, display_name, sharing (whole | fraction | mig), a size, pools (ordered, each with an
              execution_priority), strict_fifo, starvation_seconds, time_limit_default_seconds,
              time_limit_max_seconds, time_limit_required (backfill). The size is one of:
              gpus ("8", "0.25"); nodes and gpus_per_node; min_gpus and max_gpus (read from the task);
              mig_profile ("1g.10gb")
    policies: name, group, reservation_gpus, limit_gpus, compute_resources (profile, name,
              queuing_priority, batch, projects)

A compute resource's `projects` gives it to those projects' work alone (none: anyone's). A project limited
to regions (data residency, set on the project) may be given a compute resource only if every pool of its
profile is in one of those regions: the report refuses it otherwise, naming the pool and its region.

A compute resource's `batch` holds its batch templates for HPC pools, by scheduler (slurm, pbs, lsf):
template (sandboxed Jinja2, protocol.batch), allowed_directives (options tasks may add, e.g. "--qos") and
defaults (partition, account, time_limit_minutes). Templates are checked when the draft is saved.

Structural mistakes (a missing field, a malformed size) are 400s from the serializers below; the rest is
the report: errors block provisioning, warnings do not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rest_framework import serializers

from apps.resources.models import (
    MAX_TIME_LIMIT_SECONDS,
    MIG_METHODS,
    MIN_TIME_LIMIT_SECONDS,
    Environment,
    SharingMethod,
    TaskSharing,
)
from apps.resources.selectors import residency_problem
from apps.scheduling.engine import UNITS_PER_GPU, SizeError, describe, mig_fraction, units
from protocol.batch import (
    SCHEDULERS,
    TemplateInvalid,
    Unsafe,
    batch_request,
    check_directives,
    check_template,
)


def gpus_to_units(value: str, *, label: str) -> int:
    try:
        count = units(value)
    except SizeError as error:
        raise serializers.ValidationError(f"{label}: {error}") from None
    if count <= 0:
        raise serializers.ValidationError(f"{label} must be more than 0 GPUs; {value!r} was given.")
    return count


class PoolDoc(serializers.Serializer[dict[str, Any]]):
    name = serializers.SlugField(max_length=100)
    environment = serializers.ChoiceField(choices=Environment.choices)
    capacity_gpus = serializers.IntegerField(min_value=1, max_value=1_000_000)
    gpu_class = serializers.CharField(max_length=50, required=False, default="", allow_blank=True)
    region = serializers.CharField(max_length=50, required=False, default="", allow_blank=True)
    sharing = serializers.ListField(
        child=serializers.ChoiceField(choices=SharingMethod.choices), required=False, default=["whole"]
    )
    cost_tier = serializers.IntegerField(min_value=0, max_value=100, required=False, default=0)
    heartbeat_timeout_seconds = serializers.IntegerField(
        min_value=5, max_value=86_400, required=False, default=90
    )


class ProfilePoolDoc(serializers.Serializer[dict[str, Any]]):
    pool = serializers.SlugField(max_length=100)
    execution_priority = serializers.IntegerField(required=False, default=0)


def _check_time_limits(attrs: dict[str, Any]) -> None:
    default, most = attrs["time_limit_default_seconds"], attrs["time_limit_max_seconds"]
    if default is not None and most is not None and default > most:
        raise serializers.ValidationError(
            f"Profile {attrs['name']}: time_limit_default_seconds ({default}) is above "
            f"time_limit_max_seconds ({most}); a task given the default would be refused."
        )


class ProfileDoc(serializers.Serializer[dict[str, Any]]):
    name = serializers.SlugField(max_length=100)
    display_name = serializers.CharField(max_length=200, required=False, default="", allow_blank=True)
    sharing = serializers.ChoiceField(choices=TaskSharing.choices, required=False, default=TaskSharing.WHOLE)
    gpus = serializers.CharField(required=False, max_length=20)
    nodes = serializers.IntegerField(required=False, min_value=1, max_value=10_000)
    gpus_per_node = serializers.IntegerField(required=False, min_value=1, max_value=64)
    min_gpus = serializers.CharField(required=False, max_length=20)
    max_gpus = serializers.CharField(required=False, max_length=20)
    mig_profile = serializers.CharField(required=False, max_length=20)
    pools = ProfilePoolDoc(many=True, allow_empty=False)
    strict_fifo = serializers.BooleanField(required=False, default=False)
    starvation_seconds = serializers.IntegerField(required=False, min_value=1, allow_null=True, default=None)
    # Time limits (backfill, docs/scheduling.md): a task's default, the most a task may ask, and whether a
    # task must have one; seconds.
    time_limit_default_seconds = serializers.IntegerField(
        required=False,
        min_value=MIN_TIME_LIMIT_SECONDS,
        max_value=MAX_TIME_LIMIT_SECONDS,
        allow_null=True,
        default=None,
    )
    time_limit_max_seconds = serializers.IntegerField(
        required=False,
        min_value=MIN_TIME_LIMIT_SECONDS,
        max_value=MAX_TIME_LIMIT_SECONDS,
        allow_null=True,
        default=None,
    )
    time_limit_required = serializers.BooleanField(required=False, default=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        _check_time_limits(attrs)
        modes = [
            mode
            for mode, keys in (
                ("gpus", ("gpus",)),
                ("nodes", ("nodes", "gpus_per_node")),
                ("range", ("min_gpus", "max_gpus")),
                ("mig", ("mig_profile",)),
            )
            if any(key in attrs for key in keys)
        ]
        name = attrs["name"]
        if len(modes) != 1:
            raise serializers.ValidationError(
                f"Profile {name}: give exactly one size: gpus, nodes with gpus_per_node, min_gpus with "
                "max_gpus, or mig_profile."
            )
        mode = modes[0]
        sharing = attrs["sharing"]
        if (mode == "mig") != (sharing == TaskSharing.MIG):
            raise serializers.ValidationError(
                f"Profile {name}: mig_profile goes with sharing 'mig', and only there."
            )
        attrs["size_from_task"] = mode == "range"
        attrs["size_units"] = attrs["min_units"] = attrs["max_units"] = 0
        attrs["node_count"] = 1
        if mode == "gpus":
            attrs["size_units"] = gpus_to_units(attrs["gpus"], label=f"Profile {name} gpus")
        elif mode == "nodes":
            if "nodes" not in attrs or "gpus_per_node" not in attrs:
                raise serializers.ValidationError(f"Profile {name}: nodes and gpus_per_node go together.")
            attrs["node_count"] = attrs["nodes"]
            attrs["size_units"] = attrs["nodes"] * attrs["gpus_per_node"] * UNITS_PER_GPU
        elif mode == "range":
            if "min_gpus" not in attrs or "max_gpus" not in attrs:
                raise serializers.ValidationError(f"Profile {name}: min_gpus and max_gpus go together.")
            attrs["min_units"] = gpus_to_units(attrs["min_gpus"], label=f"Profile {name} min_gpus")
            attrs["max_units"] = gpus_to_units(attrs["max_gpus"], label=f"Profile {name} max_gpus")
            if attrs["min_units"] > attrs["max_units"]:
                raise serializers.ValidationError(f"Profile {name}: min_gpus is above max_gpus.")
        else:
            try:
                mig_fraction(attrs["mig_profile"])
            except SizeError as error:
                raise serializers.ValidationError(f"Profile {name}: {error}") from None
        largest = attrs["size_units"] or attrs["max_units"]
        if sharing == TaskSharing.FRACTION and largest >= UNITS_PER_GPU:
            raise serializers.ValidationError(
                f"Profile {name}: a fraction profile asks for less than one GPU."
            )
        if sharing == TaskSharing.WHOLE and largest % UNITS_PER_GPU:
            raise serializers.ValidationError(
                f"Profile {name}: sizes above 1 GPU are whole GPUs; "
                "use sharing 'fraction' for parts of a GPU."
            )
        return attrs


class BatchDoc(serializers.Serializer[dict[str, Any]]):
    """One scheduler's batch settings of a compute resource."""

    template = serializers.CharField(max_length=20_000, required=False, trim_whitespace=False)
    allowed_directives = serializers.ListField(
        child=serializers.CharField(max_length=50), required=False, default=list, max_length=50
    )
    defaults = serializers.DictField(required=False, default=dict)


class ComputeResourceDoc(serializers.Serializer[dict[str, Any]]):
    profile = serializers.SlugField(max_length=100)
    name = serializers.CharField(max_length=200, required=False, default="")
    queuing_priority = serializers.IntegerField(required=False, default=0)
    batch = serializers.DictField(child=BatchDoc(), required=False, default=dict)
    projects = serializers.ListField(
        child=serializers.CharField(max_length=100), required=False, default=list, max_length=100
    )  # the projects whose work it is for; none: anyone's

    def validate_batch(self, batch: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for scheduler, settings in batch.items():
            where = f"{scheduler} batch"
            if scheduler not in SCHEDULERS:
                raise serializers.ValidationError(
                    f"Unknown scheduler {scheduler!r}: one of {', '.join(SCHEDULERS)}."
                )
            try:
                if "template" in settings:
                    check_template(settings["template"], scheduler, settings["allowed_directives"])
                else:
                    check_directives(settings["allowed_directives"])
                batch_request({}, settings["allowed_directives"], settings["defaults"])
            except (TemplateInvalid, Unsafe) as error:
                raise serializers.ValidationError(f"{where}: {error}") from None
        return batch


class PolicyDoc(serializers.Serializer[dict[str, Any]]):
    name = serializers.SlugField(max_length=100)
    group = serializers.CharField(max_length=100)
    reservation_gpus = serializers.CharField(max_length=20)
    limit_gpus = serializers.CharField(max_length=20)
    compute_resources = ComputeResourceDoc(many=True, required=False, default=list)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        name = attrs["name"]
        for key, target in (("reservation_gpus", "reservation_units"), ("limit_gpus", "limit_units")):
            try:
                attrs[target] = units(attrs[key])
            except SizeError as error:
                raise serializers.ValidationError(f"Policy {name} {key}: {error}") from None
            if attrs[target] < 0:
                raise serializers.ValidationError(f"Policy {name} {key} cannot be negative.")
        return attrs


class DocumentSerializer(serializers.Serializer[dict[str, Any]]):
    pools = PoolDoc(many=True, required=False, default=list)
    profiles = ProfileDoc(many=True, required=False, default=list)
    policies = PolicyDoc(many=True, required=False, default=list)


@dataclass
class Report:
    errors: list[dict[str, str]] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def error(self, where: str, message: str) -> None:
        self.errors.append({"where": where, "message": message})

    def warn(self, where: str, message: str) -> None:
        self.warnings.append({"where": where, "message": message})

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "errors": self.errors, "warnings": self.warnings}


def profile_size_units(profile: dict[str, Any], pools: dict[str, dict[str, Any]]) -> int:
    """The largest size a profile's task may have, in units."""
    if profile["sharing"] == TaskSharing.MIG:
        first = pools.get(profile["pools"][0]["pool"], {})
        return units(mig_fraction(profile["mig_profile"], first.get("gpu_class", "")))
    return int(profile["size_units"] or profile["max_units"])


def check(
    document: dict[str, Any],
    *,
    groups: set[str],
    online: dict[str, bool],
    busy_pools: dict[str, int],
    projects: dict[str, list[str]] | None = None,
) -> Report:
    """The validation report of a structurally valid document (DocumentSerializer's validated_data).

    `online` says which existing pools are online now; `busy_pools` counts active tasks per existing pool;
    `projects` gives each project's regions (data residency; [] for anywhere).
    """
    report = Report()
    pools = {pool["name"]: pool for pool in document["pools"]}
    for kind in ("pools", "profiles", "policies"):
        seen: set[str] = set()
        for item in document[kind]:
            if item["name"] in seen:
                report.error(
                    f"{kind}.{item['name']}", f"Two {kind} are named {item['name']}; names must differ."
                )
            seen.add(item["name"])
    for name, count in sorted(busy_pools.items()):
        if name not in pools and count:
            report.error(
                f"pools.{name}", f"Pool {name} has {count} active tasks; drain it before removing it."
            )
    used_profiles = {
        resource["profile"] for policy in document["policies"] for resource in policy["compute_resources"]
    }
    for profile in document["profiles"]:
        _check_profile(report, profile, pools, online=online, connected=profile["name"] in used_profiles)
    _check_policies(report, document, groups)
    _check_residency(report, document, projects or {})
    in_a_profile = {entry["pool"] for profile in document["profiles"] for entry in profile["pools"]}
    for pool in document["pools"]:
        if pool["name"] not in in_a_profile:
            report.warn(
                f"pools.{pool['name']}", f"Pool {pool['name']} is in no profile, so no task can use it."
            )
    return report


def _check_profile(
    report: Report,
    profile: dict[str, Any],
    pools: dict[str, dict[str, Any]],
    *,
    online: dict[str, bool],
    connected: bool,
) -> None:
    name = profile["name"]
    where = f"profiles.{name}"
    missing = [entry["pool"] for entry in profile["pools"] if entry["pool"] not in pools]
    if missing:
        report.error(where, f"Profile {name} names unknown pools: {', '.join(missing)}.")
        return
    its_pools = [pools[entry["pool"]] for entry in profile["pools"]]
    if len({pool["name"] for pool in its_pools}) != len(its_pools):
        report.error(where, f"Profile {name} lists a pool twice.")
    needs = {
        TaskSharing.MIG: (MIG_METHODS, "uses MIG"),
        TaskSharing.FRACTION: ({SharingMethod.FRACTION}, "shares GPUs"),
    }
    if profile["sharing"] in needs:
        methods, what = needs[profile["sharing"]]
        lacking = [pool["name"] for pool in its_pools if not methods & set(pool["sharing"])]
        if lacking:
            report.error(
                where, f"Profile {name} {what}, but these pools do not support it: {', '.join(lacking)}."
            )
    size = profile_size_units(profile, pools)
    largest_pool = max(pool["capacity_gpus"] for pool in its_pools) * UNITS_PER_GPU
    if size > largest_pool:
        report.error(
            where,
            f"Profile {name} asks for {describe(size)}, more than any of its pools holds "
            f"(the largest has {describe(largest_pool)}).",
        )
    if not any(online.get(pool["name"], pool["environment"] in ("cloud", "neocloud")) for pool in its_pools):
        report.warn(where, f"Every pool of profile {name} is offline now; its tasks will wait.")
    if not connected:
        report.warn(where, f"Profile {name} is connected to no policy, so nobody can use it.")


def _check_residency(report: Report, document: dict[str, Any], projects: dict[str, list[str]]) -> None:
    """A compute resource given to a project limited to regions lists only pools in those regions."""
    pools = {pool["name"]: pool for pool in document["pools"]}
    profiles = {profile["name"]: profile for profile in document["profiles"]}
    for policy in document["policies"]:
        for resource in policy["compute_resources"]:
            profile = profiles.get(resource["profile"])
            if profile is None:
                continue
            label = resource["name"] or f"{policy['name']}: {profile['display_name'] or profile['name']}"
            where = f"policies.{policy['name']}.compute_resources.{label}.projects"
            its_pools = [pools[entry["pool"]] for entry in profile["pools"] if entry["pool"] in pools]
            for project in resource.get("projects", []):
                if project not in projects:
                    report.error(
                        where, f"Compute resource {label} names project {project}, which does not exist."
                    )
                elif problem := residency_problem(project, projects[project], label, its_pools):
                    report.error(where, problem)


def _check_policies(report: Report, document: dict[str, Any], groups: set[str]) -> None:
    pools = {pool["name"]: pool for pool in document["pools"]}
    profiles = {profile["name"]: profile for profile in document["profiles"]}
    reservations = 0
    names: set[str] = set()
    for policy in document["policies"]:
        name = policy["name"]
        where = f"policies.{name}"
        if policy["group"] not in groups:
            report.error(where, f"Policy {name} names group {policy['group']}, which does not exist.")
        if policy["reservation_units"] > policy["limit_units"]:
            report.error(
                where,
                f"Policy {name} reserves {describe(policy['reservation_units'])} but is limited to "
                f"{describe(policy['limit_units'])}; a reservation cannot be above the limit.",
            )
        reservations += policy["reservation_units"]
        reachable: set[str] = set()
        for resource in policy["compute_resources"]:
            profile = profiles.get(resource["profile"])
            if profile is None:
                report.error(where, f"Policy {name} connects unknown profile {resource['profile']}.")
                continue
            reachable.update(entry["pool"] for entry in profile["pools"] if entry["pool"] in pools)
            label = resource["name"] or f"{name}: {profile['display_name'] or profile['name']}"
            if label in names:
                report.error(where, f"Two compute resources are named {label!r}.")
            names.add(label)
        capacity = sum(pools[pool]["capacity_gpus"] for pool in reachable) * UNITS_PER_GPU
        if policy["reservation_units"] > capacity:
            report.error(
                where,
                f"Policy {name} reserves {describe(policy['reservation_units'])}, "
                f"but its profiles' pools hold {describe(capacity)} in all.",
            )
    total_capacity = sum(pool["capacity_gpus"] for pool in document["pools"]) * UNITS_PER_GPU
    if reservations > total_capacity:
        report.error(
            "policies",
            f"Reservations add up to {describe(reservations)}, above the {describe(total_capacity)} of all "
            "pools; they could not all be honoured at once.",
        )
