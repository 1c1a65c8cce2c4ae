"""The MCP tools and resources in one tenant never reach another's objects: a task id of tenant A asked
for in tenant B is not found, in the same words as an id that does not exist, for every tool and resource
that takes one; in A, the same calls find it (so the refusals are about the tenant, not the call)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from django_tenants.utils import schema_context

from apps.accounts.models import ApiToken, User
from apps.mcp import tools
from apps.mcp.identity import Identity
from tests.world import World

pytestmark = pytest.mark.django_db

NOT_FOUND = "list_tasks shows the tasks you may see"


def identity(tenant: Any, username: str) -> Identity:
    with schema_context(tenant.schema_name):
        user = User.objects.get(username=username)
        token = ApiToken.objects.filter(user=user, agent="").first()
        assert token is not None
        return Identity(tenant=tenant, user=user, token=token, origin="http://example.test")


def calls(task_id: str) -> list[Callable[[tools.Caller], Any]]:
    return [
        partial(tools.task_status, task_id=task_id),
        partial(tools.why_pending, task_id=task_id),
        partial(tools.task_logs, task_id=task_id, after=0, last=10),
        partial(tools.log_text, task_id=task_id),
        partial(tools.output_list, task_id=task_id),
        partial(tools.output_content, task_id=task_id, name="result.txt"),
        partial(tools.cancel_task, task_id=task_id),
    ]


def test_another_tenants_task_is_not_found_by_any_tool_or_resource(world: World) -> None:
    charlie = identity(world.tenant_b, "charlie")  # globex's admin
    for task_id in (world.task_a, str(uuid.uuid4())):
        for call in calls(task_id):
            with pytest.raises(tools.Refused) as refused:
                tools.run_as(charlie, call)
            assert NOT_FOUND in str(refused.value), (call, refused.value)

    alice = identity(world.tenant_a, "alice")  # acme's admin: the same task, found
    assert tools.run_as(alice, partial(tools.task_status, task_id=world.task_a))["id"] == world.task_a
    content = tools.run_as(alice, partial(tools.output_content, task_id=world.task_a, name="result.txt"))
    assert content == "accuracy 0.93\n"


def test_only_its_submitter_or_an_admin_cancels_a_task_through_mcp(world: World) -> None:
    carol = identity(world.tenant_a, "carol")  # a member, not bob
    with pytest.raises(tools.Refused) as refused:
        tools.run_as(carol, partial(tools.cancel_task, task_id=world.task_a))
    assert "Only the task's submitter or a tenant admin may cancel it." in str(refused.value)
    cancelled = tools.run_as(
        identity(world.tenant_a, "alice"), partial(tools.cancel_task, task_id=world.task_a)
    )
    assert cancelled["state"] == "aborted"


def test_a_task_submitted_through_mcp_may_give_its_time_limit_within_its_profile_s_bounds(
    world: World,
) -> None:
    bob = identity(world.tenant_a, "bob")
    submit = partial(
        tools.submit_task, compute_resource="Research: 4 GPUs", command=["python", "train.py"], gpus=None,
        name="", project=None, secrets=[], outputs=[], environment={}, idempotency_key="",
    )  # fmt: skip
    assert tools.run_as(bob, partial(submit, time_limit_seconds=7200))["time_limit_seconds"] == 7200
    assert tools.run_as(bob, submit)["time_limit_seconds"] is None
    with pytest.raises(tools.Refused) as refused:
        tools.run_as(bob, partial(submit, time_limit_seconds=30))
    assert "at least 60" in str(refused.value)
