"""What users do to tasks: submit and cancel. The state changes themselves are lifecycle.py's.

A task that could never run (larger than every pool of its profile, above its policy's limit or the
tenant's share, a size its profile does not take) is refused at submit with the field and the limit
named, never left queued forever.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction
from django.db.models import prefetch_related_objects
from django.utils import timezone

from apps.accounts.models import ApiToken, Project, Role, User
from apps.core.errors import Forbidden, InvalidInput
from apps.core.events import publish_event
from apps.core.ids import as_uuid
from apps.resources.models import MAX_TIME_LIMIT_SECONDS, MIN_TIME_LIMIT_SECONDS, ComputeResource, TaskSharing
from apps.resources.selectors import residency_problem
from apps.scheduling import wake
from apps.scheduling.engine import UNITS_PER_GPU, SizeError, describe, describe_seconds, units
from apps.scheduling.lifecycle import transition
from apps.scheduling.models import ENDED_STATES, Task, TaskEvent, TaskState
from apps.scheduling.runs import run_request_stop
from apps.scheduling.selectors import compute_resources_for
from apps.vault.services import secrets_check
from protocol import environment as task_environment
from protocol import images as task_images
from protocol import sessions as task_sessions
from protocol import volumes as task_volumes

if TYPE_CHECKING:
    from tenants.models import Tenant

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskRequest:
    """What a user asks for; sizes are GPUs as text ("4", "0.25") or numbers."""

    compute_resource: str  # id or name
    gpus: str | None = None
    name: str = ""
    project: str | None = None  # id or name
    priority: int = 0
    max_attempts: int = 3
    spec: dict[str, Any] | None = None
    idempotency_key: str = ""  # the same key again (by the same submitter) returns the task it made
    time_limit_seconds: int | None = None  # None: the profile's default, if it has one


def compute_resource_open_to(user: User, reference: str) -> ComputeResource:
    """A compute resource `user` may submit to, by id or name; InvalidInput naming where to look."""
    resources = compute_resources_for(user)
    identifier = as_uuid(reference)
    match = (
        resources.filter(pk=identifier).first() if identifier else resources.filter(name=reference).first()
    )
    if match is None:
        raise InvalidInput(
            f"No compute resource {reference!r} is open to {user.username}. `klique queues` (or GET "
            "/api/v1/compute-resources/) lists the ones your groups' policies allow.",
            field="compute_resource",
        )
    return match


def task_size(*, tenant: Tenant, resource: ComputeResource, gpus: str | None) -> int:
    """The size in units a task asking for `gpus` would have on `resource`, or InvalidInput saying why
    such a task could never run there: what submitting it would check, without submitting it."""
    return _size(resource, gpus, tenant)


def _size(resource: ComputeResource, gpus: str | None, tenant: Tenant) -> int:
    """The task's size in units, or InvalidInput naming the field and the limit it breaks."""
    profile = resource.profile
    if profile.size_from_task:
        if gpus is None:
            raise InvalidInput(
                f"{resource.name} takes the size from the task: give gpus between "
                f"{describe(profile.min_units)} "
                f"and {describe(profile.max_units)}.",
                field="gpus",
            )
        try:
            size = units(gpus)
        except SizeError as error:
            raise InvalidInput(str(error), field="gpus") from None
        if size <= 0:
            raise InvalidInput(f"gpus must be more than 0; {gpus} was asked for.", field="gpus")
        if not profile.min_units <= size <= profile.max_units:
            raise InvalidInput(
                f"{resource.name} runs tasks of {describe(profile.min_units)} to "
                f"{describe(profile.max_units)}; "
                f"{describe(size)} was asked for.",
                field="gpus",
            )
        if profile.sharing == TaskSharing.WHOLE and size % UNITS_PER_GPU:
            raise InvalidInput(
                f"{resource.name} runs whole GPUs; {gpus} is not a whole number.", field="gpus"
            )
    else:
        size = profile.size_units
        if gpus is not None:
            try:
                asked = units(gpus)
            except SizeError as error:
                raise InvalidInput(str(error), field="gpus") from None
            if asked != size:
                raise InvalidInput(
                    f"{resource.name} runs tasks of exactly {describe(size)}; "
                    "leave gpus out or ask for that.",
                    field="gpus",
                )
    _check_it_can_ever_run(resource, size, tenant)
    return size


def _check_it_can_ever_run(resource: ComputeResource, size: int, tenant: Tenant) -> None:
    policy = resource.policy
    largest = max((pool.capacity_gpus for pool in resource.profile.pools.all()), default=0) * UNITS_PER_GPU
    if size > largest:
        raise InvalidInput(
            f"{describe(size)} is more than any pool of {resource.name} holds (the largest has "
            f"{describe(largest)}).",
            field="gpus",
        )
    if size > policy.limit_units:
        raise InvalidInput(
            f"{describe(size)} is above the limit of policy {policy.name}, {describe(policy.limit_units)}.",
            field="gpus",
        )
    if tenant.gpu_share is not None and size > tenant.gpu_share * UNITS_PER_GPU:
        raise InvalidInput(
            f"{describe(size)} is above the tenant's GPU share of {tenant.gpu_share}; ask your provider.",
            field="gpus",
        )


def _project(user: User, reference: str | None) -> Project | None:
    if reference is None:
        return None
    identifier = as_uuid(reference)
    project = (
        Project.objects.filter(pk=identifier) if identifier else Project.objects.filter(name=reference)
    ).first()
    if project is None or not project.memberships.filter(user=user).exists():
        raise InvalidInput(f"{user.username} is not a member of a project {reference!r}.", field="project")
    return project


def _check_residency(resource: ComputeResource, project: Project | None) -> None:
    """A compute resource given to projects takes their work only; a project limited to regions submits
    only to compute resources whose pools are all in them (never lands outside)."""
    given = [project.name for project in resource.projects.all()]
    if given and (project is None or project.name not in given):
        raise InvalidInput(
            f"Compute resource {resource.name} is for the work of project {', '.join(sorted(given))}; name "
            "one of them as the task's project, or use another compute resource.",
            field="project",
        )
    if project is None or not project.regions:
        return
    pools = [{"name": pool.name, "region": pool.region} for pool in resource.profile.pools.all()]
    if problem := residency_problem(project.name, project.regions, resource.name, pools):
        raise InvalidInput(problem, field="compute_resource")


def _time_limit(resource: ComputeResource, asked: int | None) -> int | None:
    """The task's time limit: the one asked for within the profile's bounds, else the profile's default;
    InvalidInput saying which bound it breaks."""
    profile = resource.profile
    if asked is None:
        if profile.time_limit_default_seconds is not None:
            return int(profile.time_limit_default_seconds)
        if profile.time_limit_required:
            raise InvalidInput(
                f"{resource.name} needs a time limit: give time_limit_seconds (at most "
                f"{describe_seconds(profile.time_limit_max_seconds or MAX_TIME_LIMIT_SECONDS)}).",
                field="time_limit_seconds",
            )
        return None
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < MIN_TIME_LIMIT_SECONDS:
        raise InvalidInput(
            f"time_limit_seconds is a whole number of seconds, at least {MIN_TIME_LIMIT_SECONDS}; {asked!r} "
            "was given.",
            field="time_limit_seconds",
        )
    most = profile.time_limit_max_seconds or MAX_TIME_LIMIT_SECONDS
    if asked > most:
        raise InvalidInput(
            f"{resource.name} allows a time limit of at most {describe_seconds(most)}; "
            f"{describe_seconds(asked)} was asked for.",
            field="time_limit_seconds",
        )
    return asked


def _check_environment(spec: dict[str, Any]) -> None:
    """The task's environment follows the rule every agent checks again (protocol.environment); its image
    is an image reference (protocol.images; a path only an HPC pool takes); its declared volumes are names
    (protocol.volumes)."""
    try:
        task_environment.checked(spec.get("environment"))
    except task_environment.NameRefused as error:
        raise InvalidInput(str(error), field="spec.environment") from None
    if spec.get("image") not in (None, ""):
        try:
            task_images.checked(spec["image"], paths=True)
        except task_images.ImageRefused as error:
            raise InvalidInput(str(error), field="spec.image") from None
    try:
        task_sessions.parse(spec.get("gateway_session"))
    except task_sessions.SessionRefused as error:
        raise InvalidInput(str(error), field="spec.gateway_session") from None
    try:  # which volumes the pool offers is its agent's to say, when the task is placed there
        task_volumes.wanted(spec.get("volumes"))
    except task_volumes.VolumeRefused as error:
        raise InvalidInput(str(error), field="spec.volumes") from None


Placing = dict[tuple[str, str | None], tuple[ComputeResource, Project | None]]


def _where(user: User, request: TaskRequest, seen: Placing) -> tuple[ComputeResource, Project | None]:
    """The request's compute resource and project, checked once per pair a submission names (a batch of
    a thousand tasks to one queue reads them once)."""
    key = (request.compute_resource, request.project)
    if key not in seen:
        resource = compute_resource_open_to(user, request.compute_resource)
        prefetch_related_objects([resource], "projects", "profile__pools")  # each task's checks read them
        project = _project(user, request.project)
        _check_residency(resource, project)
        seen[key] = (resource, project)
    return seen[key]


def _build(tenant: Tenant, user: User, request: TaskRequest, now: datetime, seen: Placing) -> Task:
    resource, project = _where(user, request, seen)
    if not 1 <= request.max_attempts <= 20:
        raise InvalidInput("max_attempts is between 1 and 20.", field="max_attempts")
    _check_environment(request.spec or {})
    secrets_check(user=user, project=project, spec=request.spec or {})
    return Task(
        idempotency_key=request.idempotency_key,
        name=request.name,
        compute_resource=resource,
        compute_resource_name=resource.name,
        submitter=user,
        project=project,
        size_units=_size(resource, request.gpus, tenant),
        nodes=resource.profile.nodes,
        sharing=resource.profile.sharing,
        priority=request.priority,
        max_attempts=request.max_attempts,
        time_limit_seconds=_time_limit(resource, request.time_limit_seconds),
        spec=request.spec or {},
        submitted_at=now,
        queued_at=now,
    )


@transaction.atomic
def tasks_submit(
    *, tenant: Tenant, user: User, requests: list[TaskRequest], token: ApiToken | None = None
) -> list[Task]:
    """Queue one or many tasks, all or none: one refused request refuses the batch, naming its index.

    Submitted with an AI agent's delegated token, the tasks are the user's (their policies, their
    project) and say which agent submitted them; the token's own GPU quota caps what its unfinished
    tasks hold at once. A request whose idempotency key its submitter used before returns the task that
    key made, and queues nothing (a retried call, a model calling twice)."""
    now = timezone.now()
    made = _made_before(user, requests)
    tasks = []
    seen: Placing = {}
    for index, request in enumerate(requests):
        if request.idempotency_key in made:
            continue
        try:
            tasks.append(_build(tenant, user, request, now, seen))
        except InvalidInput as error:
            if len(requests) == 1:
                raise
            raise InvalidInput(f"Task {index}: {error.message}", field=f"{index}.{error.field}") from None
    if token is not None and token.agent:
        _within_quota(token, tasks)
        for task in tasks:
            task.submitted_with, task.submitted_by_agent = token, token.agent
    try:
        with transaction.atomic():  # a savepoint: the same key sent twice at once keeps the first
            Task.objects.bulk_create(tasks)
    except IntegrityError:
        # Another submission with one of these keys committed between the look and the insert: the
        # keys' tasks are theirs now. Anything else is not ours to hide.
        if len(_made_before(user, requests)) == len(made):
            raise
        return tasks_submit(tenant=tenant, user=user, requests=requests, token=token)
    fresh = iter(tasks)  # in the requests' order, each the task its key made before, or the new one
    answer = [made.get(request.idempotency_key) or next(fresh) for request in requests]
    TaskEvent.objects.bulk_create(
        TaskEvent(
            task=task,
            at=now,
            actor=token.acting if token is not None else user.username,
            from_state="",
            to_state=TaskState.QUEUED,
            message="submitted",
        )
        for task in tasks
    )
    if tasks:
        publish_event(tenant=tenant, kind="tasks.submitted", data={"ids": [str(task.pk) for task in tasks]})
        wake.request_cycle(tenant)
    return answer


def _made_before(user: User, requests: list[TaskRequest]) -> dict[str, Task]:
    """The tasks the user's earlier submissions made under these requests' idempotency keys, by key."""
    keys = [request.idempotency_key for request in requests if request.idempotency_key]
    if len(keys) != len(set(keys)):
        raise InvalidInput("Two tasks of one submission share an idempotency key; give each its own.")
    for key in keys:
        if len(key) > 100:
            raise InvalidInput("An idempotency key is at most 100 characters.", field="idempotency_key")
    if not keys:
        return {}
    return {
        task.idempotency_key: task for task in Task.objects.filter(submitter=user, idempotency_key__in=keys)
    }


def _within_quota(token: ApiToken, tasks: list[Task]) -> None:
    if token.gpu_quota_units is None:
        return
    ApiToken.objects.select_for_update().get(pk=token.pk)  # one submission at a time per token
    holding = sum(
        Task.objects.filter(submitted_with=token)
        .exclude(state__in=ENDED_STATES)
        .values_list("size_units", flat=True)
    )
    asked = sum(task.size_units for task in tasks)
    if holding + asked > token.gpu_quota_units:
        raise InvalidInput(
            f"Agent {token.agent}'s quota is {describe(token.gpu_quota_units)} of unfinished tasks; it holds "
            f"{describe(holding)} and asks for {describe(asked)} more. Wait for its tasks to end, or ask "
            f"{token.user.username} for a larger quota."
        )


@transaction.atomic
def task_cancel(*, tenant: Tenant, user: User, task: Task, why: str = "", actor: str = "") -> Task:
    """Abort a task that has not ended. Its submitter, and any tenant admin, may cancel it. `why` and
    `actor` say so where Klique cancels it for them (an app stopped for being idle)."""
    if task.submitter_id != user.pk and not user.has_role(Role.ADMIN):
        raise Forbidden("Only the task's submitter or a tenant admin may cancel it.")
    task = Task.objects.select_for_update().get(pk=task.pk)
    if task.state in ENDED_STATES:
        raise InvalidInput(f"Task {task.pk} already ended ({task.state}); there is nothing to cancel.")
    if task.state in (TaskState.DISPATCHING, TaskState.RUNNING) and task.pool_id is not None:
        # Desired state: the run is asked to stop now, and again at each heartbeat that still lists it.
        run = run_request_stop(task, kind="abort")
        lease = str(run.pk) if run is not None else str(task.lease_id or "")
        wake.notify_pool(
            tenant=tenant,
            pool_id=task.pool_id,
            message={"type": "abort", "task_id": str(task.pk), "lease_id": lease, "grace_seconds": 0},
        )
    transition(
        task,
        to_state=TaskState.ABORTED,
        actor=actor or user.username,
        message="cancelled",
        reason_code="cancelled",
        reason=why or f"Cancelled by {user.username}.",
    )
    publish_event(tenant=tenant, kind="task.cancelled", data={"id": str(task.pk)})
    wake.request_cycle(tenant)
    return task
