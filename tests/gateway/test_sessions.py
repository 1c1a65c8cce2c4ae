"""A run's gateway session (protocol.sessions): a key derived from the run's lease, registered with the
gateway at dispatch, that calls as the task's user (never above a member) with a quota of its own, and is
dead once the run is over, whichever way it ends. The e2e test (tests/e2e/test_agent_sessions.py) runs it
through a real agent."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.core.errors import InvalidInput
from apps.fleet import dispatch
from apps.fleet.credentials import session_key, task_token
from apps.scheduling.lifecycle import transition
from apps.scheduling.models import Task, TaskState
from apps.scheduling.services import TaskRequest, tasks_submit
from gateway import services
from gateway.models import Session, Usage
from gateway.services import CallerRefused
from protocol import sessions
from tests.world import HOST_A, World

pytestmark = pytest.mark.django_db


def here() -> str:
    """The schema the test is in (tenant A's)."""
    return str(connection.schema_name)  # type: ignore[attr-defined]  # django-tenants' connection


def submitted(world: World, persona: str = "alice", spec: dict[str, Any] | None = None) -> Task:
    user = User.objects.get(username=persona)
    request = TaskRequest(
        compute_resource="Research: 4 GPUs",
        name="agent",
        spec=spec if spec is not None else {"command": ["agent"], "gateway_session": {"tokens": 500}},
    )
    (task,) = tasks_submit(tenant=world.tenant_a, user=user, requests=[request])
    return task


def dispatched(task: Task) -> tuple[Task, str]:
    """As the dispatcher hands it to an agent: a run under a new lease, with its secrets; the key."""
    Task.objects.filter(pk=task.pk).update(state=TaskState.PLACED)
    task = Task.objects.select_related("submitter", "project").get(pk=task.pk)
    transition(task, to_state=TaskState.DISPATCHING, actor="scheduler", lease_id=uuid.uuid4())
    secrets = dispatch._with_session(task, here(), {"HF_TOKEN": "x"})
    return task, secrets[sessions.KEY_VARIABLE]


def caller(key: str) -> services.Caller:
    return services.caller_load(host=HOST_A, presented=key, project="")


@pytest.mark.parametrize(
    "value",
    [{"tokens": 0}, {"tokens": -5}, {"tokens": "100"}, {"tokens": True}, {"tokens": 10**10}, {}, [], "on",
     {"tokens": 5, "models": ["*"]}],
)  # fmt: skip
def test_a_gateway_session_that_does_not_validate_is_refused_at_submission(world: World, value: Any) -> None:
    with schema_context(world.tenant_a.schema_name), pytest.raises(InvalidInput) as refused:
        submitted(world, spec={"command": ["agent"], "gateway_session": value})
    assert refused.value.field == "spec.gateway_session"


def test_a_runs_key_calls_as_its_user_no_higher_than_a_member_with_its_own_quota(world: World) -> None:
    with schema_context(world.tenant_a.schema_name):
        task, key = dispatched(submitted(world, "alice"))  # a tenant admin's task
        assert key == session_key(schema_name=here(), task=task)  # the same run: the same key
        assert dispatch._with_session(task, here(), {})[sessions.KEY_VARIABLE] == key
        assert Session.objects.get(task_id=task.pk).key_hash != key  # kept by hash only
        assert key in dispatch._masked_values(task)  # a program that prints it shows it masked
    who = caller(key)
    assert (who.username, who.role, who.agent) == ("alice", "member", "session agent")
    assert who.token_prefix == f"kqs{task.pk.hex[:12]}"
    quota = who.budgets[-1]
    assert (quota.id, quota.unit, quota.limit, quota.period) == (f"session:{task.pk}", "tokens", 500, "none")
    assert quota.label == "session agent's quota"


@pytest.mark.parametrize("how", ["a forged signature", "a task token", "another task", "malformed"])
def test_only_the_runs_own_key_is_good(world: World, how: str) -> None:
    with schema_context(world.tenant_a.schema_name):
        task, key = dispatched(submitted(world))
        other = submitted(world)
        presented = {
            "a forged signature": key[:-4] + "AAAA",
            "a task token": task_token(schema_name=here(), task=task),
            "another task": f"kqs_{other.pk.hex}_{key.rsplit('_', 1)[-1]}",
            "malformed": "kqs_nothex_x",
        }[how]
    with pytest.raises(CallerRefused) as refused:
        caller(presented)
    assert refused.value.status == 401


@pytest.mark.parametrize(
    ("ending", "to_state"),
    [("completed", TaskState.COMPLETED), ("aborted", TaskState.ABORTED), ("failed", TaskState.FAILED),
     ("preempted", TaskState.PREEMPTED)],
)  # fmt: skip
def test_the_key_dies_when_the_run_is_over_however_it_ends(world: World, ending: str, to_state: str) -> None:
    with schema_context(world.tenant_a.schema_name):
        task, key = dispatched(submitted(world))
        transition(task, to_state=TaskState.RUNNING, actor="agent")
        assert caller(key).username == "alice"  # still running: still good
        transition(task, to_state=to_state, actor="test", ended_at=timezone.now())
        assert not Session.objects.filter(task_id=task.pk).exists()
    with pytest.raises(CallerRefused, match="a run's key dies when the run ends"):
        caller(key)


def test_the_next_run_gets_another_key_and_the_last_ones_is_dead(world: World) -> None:
    with schema_context(world.tenant_a.schema_name):
        task, first = dispatched(submitted(world))
        transition(task, to_state=TaskState.QUEUED, actor="scheduler")  # its lease expired
        task, second = dispatched(task)
    assert first != second
    assert caller(second).username == "alice"
    with pytest.raises(CallerRefused):
        caller(first)


def test_a_sessions_quota_counts_its_own_calls_only(world: World) -> None:
    with schema_context(world.tenant_a.schema_name):
        task, key = dispatched(submitted(world))
        now = datetime.now(UTC)
        for index, prefix in enumerate(
            [services.session_prefix(task.pk), services.session_prefix(task.pk), "other"]
        ):
            Usage.objects.create(
                request_id=f"kqr-session-{index}", at=now, user_id=uuid.uuid4(), username="alice",
                token_prefix=prefix, endpoint="chat.completions", model="m", tokens_in=10, tokens_out=5,
            )  # fmt: skip
    quota = caller(key).budgets[-1]
    assert services.ledger_spent_in(world.tenant_a.schema_name, quota, now) == 30


def test_a_task_without_a_session_gets_no_key(world: World) -> None:
    with schema_context(world.tenant_a.schema_name):
        task = submitted(world, spec={"command": ["batch"]})
        Task.objects.filter(pk=task.pk).update(state=TaskState.PLACED)
        task = Task.objects.select_related("submitter", "project").get(pk=task.pk)
        assert dispatch._with_session(task, here(), {"A": "1"}) == {"A": "1"}
        assert not Session.objects.exists()
