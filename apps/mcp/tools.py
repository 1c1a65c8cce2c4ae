"""What each MCP tool does, in the caller's tenant and as the caller: the same services and selectors the
REST API calls, the same role and scope rule (apps.accounts.access), the same audit record. Each runs in a
thread (Django's ORM), and either answers with plain data or raises Refused with words a model can act on.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from django.core.files.storage import default_storage
from django.db import transaction
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts import access
from apps.accounts.models import Role, User
from apps.audit.services import record
from apps.configuration.services import batch_preview
from apps.core.errors import KliqueError
from apps.core.ids import as_uuid
from apps.fleet import selectors as fleet
from apps.mcp.identity import Identity
from apps.metering import selectors as usage
from apps.scheduling import selectors, services
from apps.scheduling.engine import to_gpus_text
from apps.scheduling.models import ENDED_STATES, Task, TaskState
from gateway import selectors as gateway
from gateway import wallets
from gateway.models import Budget

T = TypeVar("T")

MAX_LIST = 100
MAX_LOG_LINES = 500


class Refused(Exception):
    """The tool cannot do what was asked; the message says what was wrong and what to do."""


class Caller:
    """The identity the request was authenticated as, moments before (apps.mcp.asgi, on every request)."""

    def __init__(self, identity: Identity) -> None:
        self.tenant, self.user, self.token = identity.tenant, identity.user, identity.token
        self.origin = identity.origin

    def may(self, *, needed: str = Role.VIEWER, write: bool = False, submit: bool = False) -> None:
        refused = access.refusal(self.user, self.token, needed=needed, write=write, submit=submit)
        if refused:
            if self.token.agent:
                record(
                    actor=self.token.acting,
                    on_behalf_of=self.user.username,
                    action="token.refused",
                    target="mcp",
                    reason=refused,
                )
            raise Refused(refused)

    def audit(self, action: str, target: str) -> None:
        acting = self.token.acting
        record(
            actor=acting,
            action=action,
            target=target,
            on_behalf_of=self.user.username if acting != self.user.username else "",
        )


def run_as(identity: Identity, work: Callable[[Caller], T]) -> T:
    """`work` in the caller's tenant as the caller; the project's own refusals become Refused."""
    with schema_context(identity.tenant.schema_name):
        try:
            return work(Caller(identity))
        except KliqueError as error:
            raise Refused(str(error)) from None


# The tools' bodies --------------------------------------------------------------------------------------


def list_compute_resources(caller: Caller) -> list[dict[str, Any]]:
    caller.may()
    depths, waits = selectors.queue_depths(), selectors.queue_wait(by="compute_resource")
    rows = []
    for resource in selectors.compute_resources_for(caller.user).order_by("name"):
        depth = depths.get(str(resource.pk), {"queued": 0, "active": 0})
        stats = waits.get(str(resource.pk))
        rows.append(
            {
                "name": resource.name,
                "id": str(resource.pk),
                "size": resource.profile.size_text(),
                "gpus_from_task": resource.profile.size_from_task,
                "group": resource.policy.group.name,
                "reservation_gpus": to_gpus_text(resource.policy.reservation_units),
                "limit_gpus": to_gpus_text(resource.policy.limit_units),
                "queued": depth["queued"],
                "active": depth["active"],
                "wait_p50_seconds": None if stats is None else stats.p50_seconds,
                "wait_p95_seconds": None if stats is None else stats.p95_seconds,
            }
        )
    return rows


def task_view(task: Task) -> dict[str, Any]:
    return {
        "id": str(task.pk),
        "name": task.name,
        "compute_resource": task.compute_resource_name,
        "state": task.state,
        "reason": task.reason,
        "reason_code": task.reason_code,
        "gpus": to_gpus_text(task.size_units),
        "time_limit_seconds": task.time_limit_seconds,
        "nodes": task.nodes,
        "pool": task.pool.name if task.pool is not None else None,
        "project": task.project.name if task.project is not None else None,
        "submitter": task.submitter.username,
        "submitted_by_agent": task.submitted_by_agent,
        "attempts": task.attempts,
        "exit_code": task.exit_code,
        "submitted_at": task.submitted_at.isoformat() if task.submitted_at else None,
        "started_at": task.started_at.isoformat() if task.started_at else None,
        "ended_at": task.ended_at.isoformat() if task.ended_at else None,
    }


def _task(caller: Caller, task_id: str) -> Task:
    """A task of the caller's tenant; another tenant's, or none, is not found (never told apart)."""
    identifier = as_uuid(task_id.strip())
    task = selectors.tasks_visible_to(caller.user).filter(pk=identifier).first() if identifier else None
    if task is None:
        raise Refused(f"No task {task_id!r} here. list_tasks shows the tasks you may see, with their ids.")
    return task


def submit_task(
    caller: Caller,
    *,
    compute_resource: str,
    command: list[str],
    gpus: str | None,
    name: str,
    project: str | None,
    secrets: list[str],
    outputs: list[str],
    environment: dict[str, str],
    idempotency_key: str,
    time_limit_seconds: int | None = None,
) -> dict[str, Any]:
    caller.may(needed=Role.MEMBER, write=True, submit=True)
    spec: dict[str, Any] = {"command": command}
    if secrets:
        spec["secrets"] = secrets
    if outputs:
        spec["outputs"] = outputs
    if environment:
        spec["environment"] = environment
    request = services.TaskRequest(
        compute_resource=compute_resource,
        gpus=gpus,
        name=name,
        project=project,
        spec=spec,
        idempotency_key=idempotency_key,
        time_limit_seconds=time_limit_seconds,
    )
    with transaction.atomic():
        (task,) = services.tasks_submit(
            tenant=caller.tenant, user=caller.user, requests=[request], token=caller.token
        )
        caller.audit("mcp.submit_task", f"task {task.pk}")
    return task_view(task)


def task_status(caller: Caller, *, task_id: str) -> dict[str, Any]:
    caller.may()
    return task_view(_task(caller, task_id))


def why_pending(caller: Caller, *, task_id: str) -> dict[str, Any]:
    caller.may()
    task = _task(caller, task_id)
    why = selectors.why(task)
    return {
        "state": why.state,
        "reason_code": why.reason_code,
        "reason": why.reason,
        "position": why.position,
        "queued_ahead": why.queued_ahead,
        "waiting_seconds": why.waiting_seconds,
    }


def _readable(caller: Caller, task_id: str) -> Task:
    """A task whose output (logs, files) the caller may read."""
    caller.may()
    task = _task(caller, task_id)
    if not selectors.may_read_output(caller.user, task):
        raise Refused(
            f"You may not read the log or outputs of task {task.pk}: {selectors.output_readers(task)} "
            "Ask one of them to share what you need."
        )
    return task


def task_logs(caller: Caller, *, task_id: str, after: int, last: int) -> dict[str, Any]:
    task = _readable(caller, task_id)
    lines, cursor, more = fleet.task_log_tail(
        task, after=max(0, after), lines=min(max(1, last), MAX_LOG_LINES)
    )
    return {
        "task_id": str(task.pk),
        "state": task.state,
        "lines": [f"[{stream}] {line}" for stream, line in lines],
        "earlier_lines_omitted": more,  # read them with a smaller `after`, or the log resource
        "next_after": cursor,  # pass as `after` to read only what comes next
        "ended": task.state in ENDED_STATES,
    }


def cancel_task(caller: Caller, *, task_id: str) -> dict[str, Any]:
    caller.may(needed=Role.MEMBER, write=True, submit=True)
    task = _task(caller, task_id)
    with transaction.atomic():
        task = services.task_cancel(tenant=caller.tenant, user=caller.user, task=task)
        caller.audit("mcp.cancel_task", f"task {task.pk}")
    return task_view(task)


def list_tasks(caller: Caller, *, state: str | None, mine: bool, limit: int) -> list[dict[str, Any]]:
    caller.may()
    tasks = selectors.tasks_visible_to(caller.user)
    if state:
        if state not in TaskState.values:
            raise Refused(f"Unknown state {state!r}; use one of {', '.join(TaskState.values)}.")
        tasks = tasks.filter(state=state)
    if mine:
        tasks = tasks.filter(submitter=caller.user)
    return [task_view(task) for task in tasks.order_by("-submitted_at")[: max(1, min(limit, MAX_LIST))]]


def usage_summary(caller: Caller, *, by: str, everyone: bool) -> dict[str, Any]:
    caller.may()
    if everyone and not caller.user.has_role(Role.ADMIN):
        raise Refused("Only a tenant admin may read everyone's usage; call again without everyone.")
    month = timezone.now().astimezone(UTC).date().replace(day=1)
    since = datetime.combine(month, datetime.min.time(), tzinfo=UTC).isoformat()
    summary = usage.usage_summary(
        user_id=None if everyone else caller.user.pk, by=by, grain="day", bounds={"since": since}
    )
    return {**summary, "since": since, "who": "everyone" if everyone else caller.user.username}


def _amount(unit: str, value: int | None) -> str | None:
    return None if value is None else wallets.amount_text(unit, value)


def budget_status(caller: Caller) -> list[dict[str, Any]]:
    caller.may()
    now = timezone.now()
    rows = []
    for budget in gateway.budgets_applying_to(caller.user).order_by("scope", "created_at"):
        standing = wallets.standing(budget, now=now)
        rows.append(
            {
                "name": wallets.budget_label(budget),
                "scope": budget.scope,
                "wallet": budget.period == Budget.Period.NONE,
                "unit": budget.unit,
                "period": budget.period,
                "limit": _amount(budget.unit, wallets.enforced(budget).limit),
                "spent": _amount(budget.unit, standing.spent),
                "held": _amount(budget.unit, standing.held),
                "left": _amount(budget.unit, standing.left),
                "resets_on": standing.resets.isoformat() if standing.resets else None,
                "pays_for": "gateway calls"
                if budget.unit == Budget.Unit.TOKENS
                else "gateway calls, GPU time, storage",
            }
        )
    return rows


def preview_batch_script(
    caller: Caller,
    *,
    compute_resource: str,
    command: list[str],
    gpus: str | None,
    name: str,
    scheduler: str | None,
) -> dict[str, Any]:
    caller.may(needed=Role.MEMBER, write=True, submit=True)
    resource = services.compute_resource_open_to(caller.user, compute_resource)
    preview = batch_preview(
        resource=resource,
        user=caller.user,
        url=caller.origin,
        scheduler=scheduler,
        template=None,
        gpus=gpus,
        name=name,
        spec={"command": command},
    )
    return {
        "compute_resource": resource.name,
        "scheduler": preview.scheduler,
        "template_from": preview.template_from,
        "script": preview.script,
        "submit": preview.submit,
    }


MAX_LOG_TEXT_LINES = 5000
MAX_OUTPUT_BYTES = 4 * 1024 * 1024  # an output read through MCP; larger ones are downloaded over the API


def log_text(caller: Caller, *, task_id: str) -> str:
    """A task's output as one text, the latest MAX_LOG_TEXT_LINES lines, each with its stream."""
    task = _readable(caller, task_id)
    lines, _, more = fleet.task_log_tail(task, lines=MAX_LOG_TEXT_LINES)
    head = (
        f"(earlier lines omitted: the latest {MAX_LOG_TEXT_LINES} follow; task_logs reads on)\n"
        if more
        else ""
    )
    return head + "\n".join(f"[{stream}] {line}" for stream, line in lines)


def output_list(caller: Caller, *, task_id: str) -> list[dict[str, Any]]:
    task = _readable(caller, task_id)
    return [
        {"name": output.name, "bytes": output.size, "uri": f"klique://tasks/{task.pk}/outputs/{output.name}"}
        for output in fleet.task_outputs(task).order_by("name")
    ]


def output_content(caller: Caller, *, task_id: str, name: str) -> str | bytes:
    """One output of the task's latest run: text where it is UTF-8, bytes otherwise."""
    task = _readable(caller, task_id)
    output = fleet.task_output(task, name)
    if output is None:
        raise Refused(
            f"Task {task.pk} has no output {name!r} in its latest run; "
            f"klique://tasks/{task.pk}/outputs lists them."
        )
    download = f"{caller.origin}/api/v1/tasks/{task.pk}/outputs/{output.name}"
    if output.size > MAX_OUTPUT_BYTES:
        raise Refused(
            f"Output {output.name} is {output.size:,} bytes, more than the {MAX_OUTPUT_BYTES:,} read "
            "through MCP; "
            f"download it with your token from {download}."
        )
    try:
        with default_storage.open(output.stored, "rb") as stored:
            content: bytes = stored.read(MAX_OUTPUT_BYTES + 1)
    except OSError:
        raise Refused(
            f"Output {output.name} is listed but its file is gone from the plane's store; "
            "tell an administrator."
        ) from None
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError:
        return content


def policies(caller: Caller, *, username: str) -> list[dict[str, Any]]:
    """The resource policies that apply to a person: their groups' reservations, limits, what is in use."""
    caller.may()
    person = caller.user
    if username not in ("me", caller.user.username):
        if not caller.user.has_role(Role.ADMIN):
            raise Refused(
                "You may read your own policies (klique://users/me/policies); "
                "a tenant admin may read anyone's."
            )
        found = User.objects.filter(username=username).first()
        if found is None:
            raise Refused(f"No person {username!r} in this tenant.")
        person = found
    return selectors.policies_for(person)
