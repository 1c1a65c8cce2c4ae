"""The MCP server's tools: their names, JSON schemas (from the signatures, with bounds) and descriptions
written for a model choosing among them. Each runs its body (apps.mcp.tools) in a thread, as the identity
the request was authenticated as (apps.mcp.asgi puts it in the request's scope); a refusal is a tool error
whose text says what was wrong and what to do, never an HTTP error."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, TypeVar, cast

from channels.db import database_sync_to_async
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from apps.mcp import tools
from apps.mcp.identity import Identity

T = TypeVar("T")

SCOPE_KEY = "klique.identity"
INSTRUCTIONS = (
    "Klique queues GPU work across an organisation's clusters. Submit work to a compute resource you may "
    "use (list_compute_resources), follow it with task_status, why_pending and task_logs, and cancel it "
    "with cancel_task. You act as the person whose token you hold, within their role, groups, projects "
    "and quota."
)

Command = Annotated[
    list[Annotated[str, Field(max_length=4096)]],
    Field(min_length=1, max_length=256, description='The program and its arguments: ["python", "train.py"].'),
]
TaskId = Annotated[
    str,
    Field(min_length=1, max_length=64, description="The task's id, as submit_task or list_tasks gave it."),
]
READ = ToolAnnotations(read_only_hint=True, open_world_hint=False)


async def _as_caller(ctx: Context, work: Callable[..., T], **arguments: Any) -> T:
    """`work(caller, **arguments)` in a thread, as the authenticated identity."""
    request = ctx.request_context.request
    identity = getattr(request, "scope", {}).get(SCOPE_KEY) if request is not None else None
    if not isinstance(identity, Identity):
        raise ToolError("This call carries no Klique identity: send your Klique token as a bearer token.")
    try:
        answer = await database_sync_to_async(tools.run_as)(identity, partial(work, **arguments))
    except tools.Refused as refused:
        raise ToolError(str(refused)) from None
    return cast("T", answer)


def build() -> MCPServer:
    server = MCPServer(name="klique", title="Klique", instructions=INSTRUCTIONS, version="1")

    @server.tool(annotations=READ)
    async def list_compute_resources(ctx: Context) -> dict[str, Any]:
        """The compute resources you may submit to: each one's name (what submit_task takes), its task size
        (fixed, or read from the task's gpus), your group's reservation and limit in GPUs, how many tasks
        are queued and active, and the median and 95th-percentile wait of the last day in seconds."""
        return {"compute_resources": await _as_caller(ctx, tools.list_compute_resources)}

    @server.tool(
        annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False)
    )
    async def submit_task(
        ctx: Context,
        *,
        compute_resource: Annotated[str, Field(min_length=1, max_length=200, description="Its name or id.")],
        command: Command,
        gpus: Annotated[
            str | None,
            Field(
                max_length=20,
                pattern=r"^[0-9]+(\.[0-9]+)?$",
                description='GPUs for compute resources whose size comes from the task, e.g. "0.5" or "2".',
            ),
        ] = None,
        name: Annotated[str, Field(max_length=200, description="A name to find the task by.")] = "",
        project: Annotated[str | None, Field(max_length=100, description="A project you belong to.")] = None,
        secrets: Annotated[
            list[Annotated[str, Field(max_length=100)]],
            Field(
                max_length=50, description="Names of vault secrets the task gets as environment variables."
            ),
        ] = [],  # noqa: B006 -- pydantic copies defaults
        outputs: Annotated[
            list[Annotated[str, Field(max_length=200)]],
            Field(max_length=50, description='File patterns to keep from the task\'s folder: ["*.json"].'),
        ] = [],  # noqa: B006
        environment: Annotated[
            dict[Annotated[str, Field(max_length=100)], Annotated[str, Field(max_length=4096)]],
            Field(max_length=100, description="Environment variables (never secrets: use `secrets`)."),
        ] = {},  # noqa: B006
        idempotency_key: Annotated[
            str,
            Field(
                max_length=100,
                description="Your own key for this submission: calling again with it returns the same task.",
            ),
        ] = "",
    ) -> dict[str, Any]:
        """Queue a task on a compute resource, as you. It waits until the scheduler places it within your
        group's reservation and limit (and your token's GPU quota, for an agent's delegated token); follow
        it with task_status, why_pending and task_logs. Returns the task with its id."""
        return await _as_caller(
            ctx,
            tools.submit_task,
            compute_resource=compute_resource,
            command=command,
            gpus=gpus,
            name=name,
            project=project,
            secrets=secrets,
            outputs=outputs,
            environment=environment,
            idempotency_key=idempotency_key,
        )

    @server.tool(annotations=READ)
    async def task_status(ctx: Context, task_id: TaskId) -> dict[str, Any]:
        """A task's state (queued, placed, dispatching, running, completed, failed, aborted), why it is in
        it, its size, pool, attempts, exit code and times."""
        return await _as_caller(ctx, tools.task_status, task_id=task_id)

    @server.tool(annotations=READ)
    async def why_pending(ctx: Context, task_id: TaskId) -> dict[str, Any]:
        """Why a task is not running yet, in the scheduler's words: its reason, its position in its compute
        resource's queue, how many tasks are ahead and how long it has waited."""
        return await _as_caller(ctx, tools.why_pending, task_id=task_id)

    @server.tool(annotations=READ)
    async def task_logs(
        ctx: Context,
        task_id: TaskId,
        after: Annotated[
            int, Field(ge=0, description="Only lines after this cursor (a call's next_after).")
        ] = 0,
        last: Annotated[
            int, Field(ge=1, le=tools.MAX_LOG_LINES, description="At most this many lines.")
        ] = 100,
    ) -> dict[str, Any]:
        """A task's output lines, the latest `last` of them after `after`, each with its stream; and the
        cursor to pass as `after` next time to read only new lines."""
        return await _as_caller(ctx, tools.task_logs, task_id=task_id, after=after, last=last)

    @server.tool(
        annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True)
    )
    async def cancel_task(ctx: Context, task_id: TaskId) -> dict[str, Any]:
        """Cancel a task that has not ended (yours, or any as a tenant admin); a running one is stopped."""
        return await _as_caller(ctx, tools.cancel_task, task_id=task_id)

    @server.tool(annotations=READ)
    async def list_tasks(
        ctx: Context,
        state: Annotated[str | None, Field(max_length=20, description="Only tasks in this state.")] = None,
        mine: Annotated[bool, Field(description="Only tasks you submitted.")] = True,
        limit: Annotated[int, Field(ge=1, le=tools.MAX_LIST)] = 20,
    ) -> dict[str, Any]:
        """Tasks of your tenant, newest first: yours by default, or everyone's with mine=false."""
        return {"tasks": await _as_caller(ctx, tools.list_tasks, state=state, mine=mine, limit=limit)}

    return server
