"""Writes to tasks: submit, cancel, state changes, retries, and the end of tasks whose queue goes away.

A task that could never run (larger than every pool of its profile, above its policy's limit or the
tenant's share, a size its profile does not take) is refused at submit with the field and the limit
named, never left queued forever.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.utils import timezone

from apps.accounts.models import ApiToken, Project, User
from apps.core.errors import InvalidInput
from apps.core.events import publish_event, publish_here
from apps.core.ids import as_uuid
from apps.fleet import notify
from apps.resources.models import ComputeResource, TaskSharing
from apps.scheduling import wake
from apps.scheduling.engine import UNITS_PER_GPU, SizeError, describe, units
from apps.scheduling.models import ENDED_STATES, RunOutcome, Task, TaskEvent, TaskRun, TaskState
from apps.scheduling.selectors import compute_resources_for
from protocol import environment as task_environment

if TYPE_CHECKING:
    from tenants.models import Tenant

logger = logging.getLogger(__name__)

SCHEDULER = "scheduler"
ONE_HOUR, ONE_MS = timedelta(hours=1), timedelta(milliseconds=1)  # running runs are metered by the hour
METER_LOCK_TIMEOUT = "500ms"  # how long an hourly metering pass waits for a lock before moving on

# Which state may follow which. PREEMPTED passes straight on to QUEUED (at the front of the queue).
TRANSITIONS: dict[str, frozenset[str]] = {
    TaskState.QUEUED: frozenset({TaskState.PLACED, TaskState.ABORTED}),
    TaskState.PLACED: frozenset(
        {TaskState.DISPATCHING, TaskState.QUEUED, TaskState.PREEMPTED, TaskState.ABORTED, TaskState.FAILED}
    ),
    TaskState.DISPATCHING: frozenset(
        {TaskState.RUNNING, TaskState.QUEUED, TaskState.PREEMPTED, TaskState.ABORTED, TaskState.FAILED}
    ),
    TaskState.RUNNING: frozenset(
        {TaskState.COMPLETED, TaskState.FAILED, TaskState.ABORTED, TaskState.PREEMPTED}
    ),
    TaskState.PREEMPTED: frozenset({TaskState.QUEUED}),
}


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


def _record(task: Task, *, to_state: str, actor: str, message: str, at: datetime) -> TaskEvent:
    return TaskEvent(task=task, at=at, actor=actor, from_state=task.state, to_state=to_state, message=message)


def transition(task: Task, *, to_state: str, actor: str, message: str = "", **fields: Any) -> Task:
    """Move a task to `to_state` if its lifecycle allows it, recording who, what and when."""
    if to_state not in TRANSITIONS.get(task.state, frozenset()):
        raise InvalidInput(f"Task {task.pk} is {task.state}; it cannot become {to_state}.")
    now = timezone.now()
    TaskEvent.objects.create(
        task=task, at=now, actor=actor, from_state=task.state, to_state=to_state, message=message
    )
    if task.state == TaskState.RUNNING and task.started_at is not None:
        meter_run(task, ended_at=now)
    task.state = to_state
    for name, value in fields.items():
        setattr(task, name, value)
    if to_state in ENDED_STATES:
        task.ended_at = now
    if to_state == TaskState.RUNNING:
        task.metered_until = None  # a new run: nothing of it is metered yet
    task.save()
    publish_here(kind=f"task.{to_state}", data={"id": str(task.pk)})
    return task


def meter_run(task: Task, *, ended_at: datetime) -> None:
    """What the run that ends now has not yet metered (all of it, or since the last whole hour that
    meter_running wrote) goes to the ledger as a GPU segment (data flow, step 5). Every way a run ends
    calls this in the transaction that ends it: `transition`, and the cycle's preemptions."""
    with transaction.atomic():  # the row lock orders this after a meter_running pass on the same run
        metered = (
            Task.objects.select_for_update()
            .filter(pk=task.pk)
            .values_list("metered_until", flat=True)
            .first()
        )
        _meter(task, started_at=_unmetered_from(task.started_at or ended_at, metered), ended_at=ended_at)
        task.metered_until = ended_at  # so that the caller's save() keeps the row's value current


def meter_running(*, now: datetime | None = None) -> int:
    """Meter each running run hour by hour up to the last whole hour: a long run's GPU time reaches the
    ledger, the hourly rollups and its wallet while it runs, not all at once when it stops. Each hour's
    segment ends at that hour's last millisecond, so that it counts in the hour it covers (the rollups
    count an event in the hour it ended); the next segment starts there. Returns how many segments were
    written. Celery beat runs it every few minutes; a pass that finds nothing new writes nothing.

    It gives way to the paths that end runs: a run whose row or ledger rows another transaction holds for
    over METER_LOCK_TIMEOUT is left to the next pass (or to its stop), rather than waiting behind a
    scheduling cycle or deadlocking with one."""
    from django.db import OperationalError, connection
    from django.db.models.functions import Coalesce

    last = (now or timezone.now()).replace(minute=0, second=0, microsecond=0) - ONE_MS
    due = Task.objects.alias(metered=Coalesce("metered_until", "started_at")).filter(
        state=TaskState.RUNNING, metered__lt=last
    )  # a run metered to the end of the last hour has nothing due until the next one ends
    written = 0
    for pk in due.order_by().values_list("pk", flat=True):
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute(f"SET LOCAL lock_timeout = '{METER_LOCK_TIMEOUT}'")
                written += _meter_hours(pk, last)
        except OperationalError as error:  # a lock not granted in time, or a deadlock PostgreSQL broke
            logger.warning("run of task %s left to the next metering pass: %s", pk, error)
    return written


def _meter_hours(pk: Any, last: datetime) -> int:
    """Write the whole hours of one running run up to `last`; how many segments."""
    task = (
        Task.objects.select_for_update(of=("self",))
        .select_related("submitter", "project", "pool", "compute_resource__policy__group")
        .filter(pk=pk, state=TaskState.RUNNING)
        .first()
    )
    if task is None or task.started_at is None:
        return 0  # it stopped meanwhile, and its stop metered it
    start = _unmetered_from(task.started_at, task.metered_until)
    end = start.replace(minute=0, second=0, microsecond=0) + ONE_HOUR - ONE_MS
    end = end if end > start else end + ONE_HOUR
    written = 0
    while end <= last:
        _meter(task, started_at=start, ended_at=end)
        start, end, written = end, end + ONE_HOUR, written + 1
    Task.objects.filter(pk=pk).update(metered_until=start)
    return written


def _unmetered_from(started_at: datetime, metered_until: datetime | None) -> datetime:
    """Where the part of a run not yet in the ledger starts: its start, or where the hourly passes left it."""
    return max(started_at, metered_until) if metered_until else started_at


def _meter(task: Task, *, started_at: datetime, ended_at: datetime) -> None:
    from apps.metering.services import run_segment

    resource = task.compute_resource
    run_segment(
        task_id=str(task.pk),
        started_at=started_at,
        ended_at=ended_at,
        username=task.submitter.username,
        project=task.project.name if task.project else "",
        group=resource.policy.group.name if resource is not None else "",
        pool=task.pool.name if task.pool else "",
        compute_resource=task.compute_resource_name,
        units=task.size_units,
    )


def _resolve_compute_resource(user: User, reference: str) -> ComputeResource:
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


def _check_environment(spec: dict[str, Any]) -> None:
    """The task's environment follows the rule every agent checks again (protocol.environment)."""
    try:
        task_environment.checked(spec.get("environment"))
    except task_environment.NameRefused as error:
        raise InvalidInput(str(error), field="spec.environment") from None


def _build(tenant: Tenant, user: User, request: TaskRequest, now: datetime) -> Task:
    from apps.vault.services import secrets_check

    resource = _resolve_compute_resource(user, request.compute_resource)
    if not 1 <= request.max_attempts <= 20:
        raise InvalidInput("max_attempts is between 1 and 20.", field="max_attempts")
    project = _project(user, request.project)
    _check_environment(request.spec or {})
    secrets_check(user=user, project=project, spec=request.spec or {})
    return Task(
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
    tasks hold at once."""
    now = timezone.now()
    tasks = []
    for index, request in enumerate(requests):
        try:
            tasks.append(_build(tenant, user, request, now))
        except InvalidInput as error:
            if len(requests) == 1:
                raise
            raise InvalidInput(f"Task {index}: {error.message}", field=f"{index}.{error.field}") from None
    if token is not None and token.agent:
        _within_quota(token, tasks)
        for task in tasks:
            task.submitted_with, task.submitted_by_agent = token, token.agent
    Task.objects.bulk_create(tasks)
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
    publish_event(tenant=tenant, kind="tasks.submitted", data={"ids": [str(task.pk) for task in tasks]})
    wake.request_cycle(tenant)
    return tasks


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
def task_cancel(*, tenant: Tenant, user: User, task: Task) -> Task:
    """Abort a task that has not ended. Its submitter, and any tenant admin, may cancel it."""
    task = Task.objects.select_for_update().get(pk=task.pk)
    if task.state in ENDED_STATES:
        raise InvalidInput(f"Task {task.pk} already ended ({task.state}); there is nothing to cancel.")
    if task.state in (TaskState.DISPATCHING, TaskState.RUNNING) and task.pool_id is not None:
        from apps.scheduling.runs import run_request_stop

        # Desired state: the run is asked to stop now, and again at each heartbeat that still lists it.
        run = run_request_stop(task, kind="abort")
        lease = str(run.pk) if run is not None else str(task.lease_id or "")
        notify.notify_pool(
            tenant=tenant,
            pool_id=task.pool_id,
            message={"type": "abort", "task_id": str(task.pk), "lease_id": lease, "grace_seconds": 0},
        )
    transition(
        task,
        to_state=TaskState.ABORTED,
        actor=user.username,
        message="cancelled",
        reason_code="cancelled",
        reason=f"Cancelled by {user.username}.",
    )
    publish_event(tenant=tenant, kind="task.cancelled", data={"id": str(task.pk)})
    wake.request_cycle(tenant)
    return task


@transaction.atomic
def task_finish(
    *, tenant: Tenant, task: Task, succeeded: bool, exit_code: int | None, actor: str, lost: str = ""
) -> Task:
    """Record a run's end. A failed run is queued again while attempts remain (retry policy). `lost` says
    why a run that never reported its end was given up (its pool went silent): the task's reason keeps it."""
    task = Task.objects.select_for_update().get(pk=task.pk)
    how = f"was lost ({lost})" if lost else f"failed with exit code {exit_code}"
    if succeeded:
        transition(task, to_state=TaskState.COMPLETED, actor=actor, exit_code=exit_code, pool=task.pool)
    elif task.attempts < task.max_attempts:
        transition(task, to_state=TaskState.FAILED, actor=actor, message=f"attempt {task.attempts} {how}")
        # A retry is a new run of the same task: it re-enters the queue, keeping its place by submit time.
        TaskEvent.objects.create(
            task=task,
            at=timezone.now(),
            actor=SCHEDULER,
            from_state=TaskState.FAILED,
            to_state=TaskState.QUEUED,
            message=f"retry {task.attempts + 1} of {task.max_attempts}",
        )
        Task.objects.filter(pk=task.pk).update(
            state=TaskState.QUEUED,
            pool=None,
            queued_at=timezone.now(),
            ended_at=None,
            exit_code=exit_code,
            reason_code="run_lost" if lost else "retrying",
            reason=f"Attempt {task.attempts} {how}; queued again.",
        )
        task.refresh_from_db()
    else:
        transition(
            task,
            to_state=TaskState.FAILED,
            actor=actor,
            exit_code=exit_code,
            reason_code="run_lost" if lost else "failed",
            reason=f"All {task.max_attempts} attempts failed; the last {how}.",
        )
    wake.request_cycle(tenant)
    return task


def tasks_end_for_removed_resources(*, resources: list[ComputeResource], actor: User) -> int:
    """End the queued tasks of compute resources that provisioning removes, saying so. Returns how many."""
    now = timezone.now()
    ended = 0
    for resource in resources:
        queued = list(Task.objects.filter(compute_resource=resource, state=TaskState.QUEUED))
        message = (
            f"Its compute resource {resource.name} was removed by {actor.username} "
            f"on {now:%Y-%m-%d %H:%M} UTC."
        )
        TaskEvent.objects.bulk_create(
            _record(task, to_state=TaskState.ABORTED, actor=actor.username, message=message, at=now)
            for task in queued
        )
        ended += Task.objects.filter(pk__in=[task.pk for task in queued]).update(
            state=TaskState.ABORTED, ended_at=now, reason_code="compute_resource_removed", reason=message
        )
    return ended


@transaction.atomic
def leases_expire() -> int:
    """Tasks handed out but not acknowledged in time go back to the queue. Returns how many."""
    now = timezone.now()
    expired = Task.objects.filter(state=TaskState.DISPATCHING, lease_expires_at__lt=now)
    count = 0
    for task in expired.select_for_update(skip_locked=True):
        TaskRun.objects.filter(task=task, lease_id__in=[task.lease_id], outcome=RunOutcome.LIVE).update(
            outcome=RunOutcome.EXPIRED, ended_at=now, note="its agent did not acknowledge it in time"
        )  # kept: the agent may still say it runs it, and it is the task's again if nothing ran since
        transition(
            task,
            to_state=TaskState.QUEUED,
            actor="scheduler",
            message="lease expired",
            pool=None,
            lease_expires_at=None,
            queued_at=now,
            reason_code="lease_expired",
            reason="Its agent did not acknowledge it in time; queued again.",
        )
        count += 1
    return count
