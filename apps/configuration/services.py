"""Writes to the resource configuration: the draft document, validation and provisioning; and the batch
script preview.

Provisioning rewrites pools, profiles, policies and compute resources from the draft in one transaction:
rows are matched by name (so a pool keeps its id and its tasks across provisions), what the draft no
longer names is deleted, and tasks still queued on a compute resource that goes away are ended with that
reason rather than dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.utils import timezone

from apps.accounts.models import Group, Project, User
from apps.configuration.simulation import Comparison, compare, jobs_from_csv, jobs_from_history
from apps.core.errors import InvalidInput, error_lines
from apps.core.events import publish_event
from apps.resources.document import DocumentSerializer, Report, check, profile_size_units
from apps.resources.models import (
    ComputeResource,
    ConfigurationDraft,
    Pool,
    ProfilePool,
    ResourcePolicy,
    ResourceProfile,
    TaskSharing,
)
from apps.scheduling import wake
from apps.scheduling.engine import UNITS_PER_GPU, SizeError, to_gpus_text, units
from apps.scheduling.lifecycle import tasks_end_for_removed_resources
from apps.scheduling.selectors import active_tasks_per_pool
from protocol.batch import TemplateInvalid, Unsafe, check_template
from protocol.scripts import Scripts, ScriptSettings, submit_command

if TYPE_CHECKING:
    from tenants.models import Tenant


@dataclass(frozen=True)
class Provisioned:
    report: Report
    created: dict[str, int]
    deleted: dict[str, int]
    ended_tasks: int


def export_active() -> dict[str, Any]:
    """The provisioned configuration as a document, in the shape the draft takes."""
    pools = [
        {
            "name": pool.name,
            "environment": pool.environment,
            "capacity_gpus": pool.capacity_gpus,
            "gpu_class": pool.gpu_class,
            "region": pool.region,
            "sharing": list(pool.sharing),
            "cost_tier": pool.cost_tier,
            "heartbeat_timeout_seconds": pool.heartbeat_timeout_seconds,
        }
        for pool in Pool.objects.all()
    ]
    profiles = []
    for profile in ResourceProfile.objects.prefetch_related("pool_order__pool"):
        item: dict[str, Any] = {
            "name": profile.name,
            "display_name": profile.display_name,
            "sharing": profile.sharing,
            "pools": [
                {"pool": entry.pool.name, "execution_priority": entry.execution_priority}
                for entry in profile.pool_order.all()
            ],
            "strict_fifo": profile.strict_fifo,
            "starvation_seconds": profile.starvation_seconds,
        }
        for key in ("time_limit_default_seconds", "time_limit_max_seconds"):
            if getattr(profile, key) is not None:
                item[key] = getattr(profile, key)
        if profile.time_limit_required:
            item["time_limit_required"] = True
        if profile.sharing == TaskSharing.MIG:
            item["mig_profile"] = profile.mig_profile
        elif profile.size_from_task:
            item["min_gpus"], item["max_gpus"] = (
                to_gpus_text(profile.min_units),
                to_gpus_text(profile.max_units),
            )
        elif profile.nodes > 1:
            item["nodes"] = profile.nodes
            item["gpus_per_node"] = profile.size_units // (profile.nodes * UNITS_PER_GPU)
        else:
            item["gpus"] = to_gpus_text(profile.size_units)
        profiles.append(item)
    policies = [
        {
            "name": policy.name,
            "group": policy.group.name,
            "reservation_gpus": to_gpus_text(policy.reservation_units),
            "limit_gpus": to_gpus_text(policy.limit_units),
            "compute_resources": [
                {
                    "profile": resource.profile.name,
                    "name": resource.name,
                    "queuing_priority": resource.queuing_priority,
                    **({"batch": resource.batch} if resource.batch else {}),
                    **(
                        {"projects": sorted(project.name for project in resource.projects.all())}
                        if resource.projects.exists()
                        else {}
                    ),
                }
                for resource in policy.compute_resources.select_related("profile")
            ],
        }
        for policy in ResourcePolicy.objects.select_related("group").prefetch_related("compute_resources")
    ]
    return {"pools": pools, "profiles": profiles, "policies": policies}


def draft_get() -> ConfigurationDraft:
    """The tenant's draft; the first time, a copy of what is provisioned."""
    draft = ConfigurationDraft.objects.first()
    if draft is None:
        draft = ConfigurationDraft.objects.create(document=export_active())
    return draft


def parse_document(document: Any) -> dict[str, Any]:
    """The document's validated form (sizes in units), or InvalidInput naming each malformed value (its
    `errors` nested as the document is)."""
    parsed = DocumentSerializer(data=document)
    if not parsed.is_valid():
        raise InvalidInput("Invalid input: " + "; ".join(error_lines(parsed.errors)), errors=parsed.errors)
    return dict(parsed.validated_data)


def _parse_draft(document: Any) -> dict[str, Any]:
    try:
        return parse_document(document)
    except InvalidInput as error:
        lines = "; ".join(error_lines(error.errors))
        raise InvalidInput(f"The draft is malformed; save a corrected one first ({lines}).") from None


@transaction.atomic
def draft_save(*, tenant: Tenant, user: User, document: Any) -> ConfigurationDraft:
    """Replace the draft with `document` once its shape is valid; the report comes from draft_validate."""
    parse_document(document)
    draft = draft_get()
    draft.document = document
    draft.updated_by = user
    draft.save()
    publish_event(tenant=tenant, kind="configuration.draft_saved", data={"by": user.username})
    return draft


def _report(document: dict[str, Any]) -> Report:
    now = timezone.now()
    online = {pool.name: pool.is_online(now) for pool in Pool.objects.all()}
    return check(
        document,
        groups=set(Group.objects.values_list("name", flat=True)),
        online=online,
        busy_pools=active_tasks_per_pool(),
        projects=dict(Project.objects.values_list("name", "regions")),
    )


def draft_simulate(
    *, days: int | None, trace: str | None, interval: float, document: Any = None
) -> Comparison:
    """Replay recent history (or a trace) against the provisioned configuration and the draft (or
    `document`, a draft not saved: what an editor shows)."""
    draft = _parse_draft(draft_get().document if document is None else document)
    jobs = jobs_from_csv(trace) if trace else jobs_from_history(days or 7)
    return compare(draft=draft, jobs=jobs, interval=interval)


def draft_validate() -> Report:
    return _report(parse_document(draft_get().document))


@transaction.atomic
def draft_provision(*, tenant: Tenant, user: User) -> Provisioned:
    """Make the draft the configuration, atomically, or refuse with the report's errors."""
    draft = ConfigurationDraft.objects.select_for_update().get(pk=draft_get().pk)
    document = _parse_draft(draft.document)
    report = _report(document)
    if not report.ok:
        raise InvalidInput(
            "Provisioning refused: " + " ".join(item["message"] for item in report.errors),
        )
    created = {"pools": 0, "profiles": 0, "policies": 0, "compute_resources": 0}
    deleted = dict.fromkeys(created, 0)

    pools: dict[str, Pool] = {}
    for item in document["pools"]:
        pool, made = Pool.objects.update_or_create(
            name=item["name"],
            defaults={
                key: item[key]
                for key in (
                    "environment",
                    "capacity_gpus",
                    "gpu_class",
                    "region",
                    "sharing",
                    "cost_tier",
                    "heartbeat_timeout_seconds",
                )
            },
        )
        pools[pool.name] = pool
        created["pools"] += made
    gpu_class = {name: pool.gpu_class for name, pool in pools.items()}

    profiles: dict[str, ResourceProfile] = {}
    for item in document["profiles"]:
        mig = item["sharing"] == TaskSharing.MIG
        profile, made = ResourceProfile.objects.update_or_create(
            name=item["name"],
            defaults={
                "display_name": item["display_name"],
                "sharing": item["sharing"],
                "size_from_task": item["size_from_task"],
                "size_units": profile_size_units(item, {n: {"gpu_class": c} for n, c in gpu_class.items()})
                if mig
                else item["size_units"],
                "min_units": item["min_units"],
                "max_units": item["max_units"],
                "nodes": item["node_count"],
                "mig_profile": item.get("mig_profile", ""),
                "strict_fifo": item["strict_fifo"],
                "starvation_seconds": item["starvation_seconds"],
                "time_limit_default_seconds": item["time_limit_default_seconds"],
                "time_limit_max_seconds": item["time_limit_max_seconds"],
                "time_limit_required": item["time_limit_required"],
            },
        )
        ProfilePool.objects.filter(profile=profile).delete()
        ProfilePool.objects.bulk_create(
            ProfilePool(
                profile=profile,
                pool=pools[entry["pool"]],
                position=position,
                execution_priority=entry["execution_priority"],
            )
            for position, entry in enumerate(item["pools"])
        )
        profiles[profile.name] = profile
        created["profiles"] += made

    groups = {group.name: group for group in Group.objects.all()}
    keep_resources: set[str] = set()
    keep_policies: set[str] = set()
    for item in document["policies"]:
        policy, made = ResourcePolicy.objects.update_or_create(
            name=item["name"],
            defaults={
                "group": groups[item["group"]],
                "reservation_units": item["reservation_units"],
                "limit_units": item["limit_units"],
            },
        )
        keep_policies.add(policy.name)
        created["policies"] += made
        for resource in item["compute_resources"]:
            profile = profiles[resource["profile"]]
            name = resource["name"] or f"{policy.group.name.title()}: {profile.display_name or profile.name}"
            compute_resource, made = ComputeResource.objects.update_or_create(
                policy=policy,
                profile=profile,
                defaults={
                    "name": name,
                    "queuing_priority": resource["queuing_priority"],
                    "batch": resource.get("batch") or {},
                },
            )
            compute_resource.projects.set(Project.objects.filter(name__in=resource.get("projects", [])))
            keep_resources.add(str(compute_resource.pk))
            created["compute_resources"] += made

    removed = ComputeResource.objects.exclude(pk__in=keep_resources)
    ended = tasks_end_for_removed_resources(resources=list(removed), actor=user)
    deleted["compute_resources"] = removed.delete()[1].get("resources.ComputeResource", 0)
    deleted["policies"] = (
        ResourcePolicy.objects.exclude(name__in=keep_policies).delete()[1].get("resources.ResourcePolicy", 0)
    )
    deleted["profiles"] = (
        ResourceProfile.objects.exclude(name__in=profiles).delete()[1].get("resources.ResourceProfile", 0)
    )
    deleted["pools"] = Pool.objects.exclude(name__in=pools).delete()[1].get("resources.Pool", 0)

    draft.provisioned_at = timezone.now()
    draft.provisioned_by = user
    draft.save(update_fields=["provisioned_at", "provisioned_by"])
    publish_event(tenant=tenant, kind="configuration.provisioned", data={"by": user.username})
    wake.request_cycle(tenant)
    return Provisioned(report=report, created=created, deleted=deleted, ended_tasks=ended)


HPC_ENVIRONMENTS = ("slurm", "pbs", "lsf")


@dataclass(frozen=True)
class BatchPreview:
    scheduler: str
    template_from: str  # "given", "compute resource" or "default"
    script: str
    submit: list[str]


def batch_preview(
    *,
    resource: ComputeResource,
    user: User,
    url: str,
    scheduler: str | None,
    template: str | None,
    gpus: str | None,
    name: str,
    spec: dict[str, Any],
) -> BatchPreview:
    """The batch script a task would get on an HPC pool of this compute resource, rendered as the agent
    would render it (placeholder folders and the signed-in user as the account), or InvalidInput with
    what is wrong: the same checks the agent applies before it submits."""
    profile = resource.profile
    if scheduler is None:
        environments = [entry.pool.environment for entry in profile.pool_order.select_related("pool")]
        scheduler = next((env for env in environments if env in HPC_ENVIRONMENTS), "slurm")
    if scheduler not in HPC_ENVIRONMENTS:
        raise InvalidInput(f"Unknown scheduler {scheduler!r}: one of {', '.join(HPC_ENVIRONMENTS)}.")
    settings_ = dict(resource.batch.get(scheduler) or {})
    template_from = "compute resource" if settings_.get("template") else "default"
    if template is not None:
        try:
            check_template(template, scheduler, settings_.get("allowed_directives") or [])
        except TemplateInvalid as error:
            raise InvalidInput(f"The template is not usable: {error}") from None
        settings_["template"], template_from = template, "given"
    size_units = profile.size_units
    if profile.size_from_task:
        try:
            size_units = units(gpus or to_gpus_text(profile.min_units))
        except SizeError as error:
            raise InvalidInput(f"gpus: {error}") from None
    folder = Path("/cluster/klique/jobs/00000000-0000-0000-0000-000000000000")
    assignment = {
        "task_id": "00000000-0000-0000-0000-000000000000",
        "name": name,
        "spec": {"command": ["<your command>"], **spec},  # a preview without a command shows where it goes
        "size_units": size_units,
        "nodes": profile.nodes,
        "mig_profile": profile.mig_profile,
        "batch": {scheduler: settings_},
    }
    scripts = Scripts(
        scheduler,
        ScriptSettings(jobs_dir=folder.parent, node_python="python3", allowed_roots=[Path("/")]),
        url,
        isolated=True,  # a member's template: rendered under time and memory limits, outside this process
    )
    account = user.username if user.username.isidentifier() else "someone"
    try:
        script, context = scripts.script(assignment, account, folder)
    except (TemplateInvalid, Unsafe) as error:
        raise InvalidInput(str(error)) from None
    submit = submit_command(scheduler, folder / "job.sh", context)
    return BatchPreview(scheduler, template_from, script, submit)
