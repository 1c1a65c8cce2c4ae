"""The MCP server's tools: their names, JSON schemas (from the signatures, with bounds) and descriptions
written for a model choosing among them. Each runs its body (apps.mcp.tools) in a thread, as the identity
the request was authenticated as (apps.mcp.asgi puts it in the request's scope); a refusal is a tool error
whose text says what was wrong and what to do, never an HTTP error."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, Literal, TypeVar, cast

from channels.db import database_sync_to_async
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from apps.mcp import tools
from apps.mcp.identity import Identity

T = TypeVar("T")

SCOPE_KEY = "klique.identity"
INSTRUCTIONS = (
    "Klique queues GPU work across an organisation's clusters. Submit work to a compute resource you may "
    "use (list_compute_resources), follow it with task_status, why_pending and task_logs, and cancel it "
    "with cancel_task; usage_summary and budget_status say what was spent and what is left. You act as "
    "the person whose token you hold, within their role, groups, projects and quota. A task's log and "
    "outputs are resources: klique://tasks/{id}/logs and klique://tasks/{id}/outputs."
)

Command = Annotated[
    list[Annotated[str, Field(max_length=4096)]],
    Field(min_length=1, max_length=256, description='The program and its arguments: ["python", "train.py"].'),
]
TaskId = Annotated[
    str,
    Field(min_length=1, max_length=64, description="The task's id, as submit_task or list_tasks gave it."),
]
Gpus = Annotated[
    str | None,
    Field(
        max_length=20,
        pattern=r"^[0-9]+(\.[0-9]+)?$",
        description='GPUs for compute resources whose size comes from the task, e.g. "0.5" or "2".',
    ),
]
ComputeResource = Annotated[str, Field(min_length=1, max_length=200, description="Its name or id.")]
READ = ToolAnnotations(read_only_hint=True, open_world_hint=False)


async def _as_caller(
    ctx: Context, work: Callable[..., T], *, error: type[Exception] = ToolError, **arguments: Any
) -> T:
    """`work(caller, **arguments)` in a thread, as the authenticated identity; a refusal is `error` (a
    tool's error result, or a resource's error) with the refusal's words."""
    request = ctx.request_context.request
    identity = getattr(request, "scope", {}).get(SCOPE_KEY) if request is not None else None
    if not isinstance(identity, Identity):
        raise error("This call carries no Klique identity: send your Klique token as a bearer token.")
    try:
        answer = await database_sync_to_async(tools.run_as)(identity, partial(work, **arguments))
    except tools.Refused as refused:
        raise error(str(refused)) from None
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
        compute_resource: ComputeResource,
        command: Command,
        gpus: Gpus = None,
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
        time_limit_seconds: Annotated[
            int | None,
            Field(
                ge=60,
                le=30 * 86_400,
                description="How long a run may last (seconds); past it the run is stopped. A task with a "
                "limit may run in gaps before a waiting larger task. Default: the compute resource's.",
            ),
        ] = None,
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
            time_limit_seconds=time_limit_seconds,
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

    @server.tool(annotations=READ)
    async def usage_summary(
        ctx: Context,
        by: Annotated[
            Literal["kind", "project", "pool", "gpu_class", "model", "user"],
            Field(description="Group the totals by this."),
        ] = "kind",
        everyone: Annotated[
            bool, Field(description="Everyone's usage, not only yours (tenant admins).")
        ] = False,
    ) -> dict[str, Any]:
        """Your usage this month, from the usage ledger: GPU-hours, gateway tokens in and out, storage
        GB-hours and their cost in USD, grouped by kind (gpu, tokens, storage), project, pool, GPU class
        or model; the same figures as the usage API's summary."""
        return await _as_caller(ctx, tools.usage_summary, by=by, everyone=everyone)

    @server.tool(annotations=READ)
    async def budget_status(ctx: Context) -> dict[str, Any]:
        """The gateway budgets and wallets your work draws from (the tenant's, yours, your projects'):
        each one's limit, what is spent this period, what calls in flight hold, what is left, and when it
        resets. A budget in tokens pays for LLM gateway calls; one in USD (a wallet) also for GPU time."""
        return {"budgets": await _as_caller(ctx, tools.budget_status)}

    @server.tool(annotations=READ)
    async def preview_batch_script(
        ctx: Context,
        *,
        compute_resource: ComputeResource,
        command: Command,
        gpus: Gpus = None,
        name: Annotated[str, Field(max_length=200)] = "",
        scheduler: Annotated[
            Literal["slurm", "pbs", "lsf"] | None,
            Field(description="The HPC scheduler to render for; by default the resource's first HPC pool's."),
        ] = None,
    ) -> dict[str, Any]:
        """The batch script a task would get on a compute resource's HPC (Slurm, PBS or LSF) pools, and
        the command that submits it, rendered as the agent renders it; nothing is submitted. Use it to
        check directives, modules and the command line before submit_task."""
        return await _as_caller(
            ctx,
            tools.preview_batch_script,
            compute_resource=compute_resource,
            command=command,
            gpus=gpus,
            name=name,
            scheduler=scheduler,
        )

    _resources(server)
    _prompts(server)
    return server


def _resources(server: MCPServer) -> None:
    @server.resource(
        "klique://tasks/{task_id}/logs",
        name="task_logs",
        title="A task's log",
        description="The latest lines a task wrote, each with its stream (stdout or stderr).",
        mime_type="text/plain",
    )
    async def logs(task_id: str, ctx: Context) -> str:
        return await _as_caller(ctx, tools.log_text, error=ResourceError, task_id=task_id)

    @server.resource(
        "klique://tasks/{task_id}/outputs",
        name="task_outputs",
        title="A task's outputs",
        description="The files a task's latest run kept, with their sizes and resource addresses.",
        mime_type="application/json",
    )
    async def outputs(task_id: str, ctx: Context) -> str:
        listed = await _as_caller(ctx, tools.output_list, error=ResourceError, task_id=task_id)
        return json.dumps({"outputs": listed})

    @server.resource(
        "klique://tasks/{task_id}/outputs/{+name}",
        name="task_output",
        title="One output of a task",
        description="One file a task's latest run kept (text, or bytes); up to 4 MiB through MCP.",
    )
    async def output(task_id: str, name: str, ctx: Context) -> str | bytes:
        return await _as_caller(ctx, tools.output_content, error=ResourceError, task_id=task_id, name=name)

    @server.resource(
        "klique://users/{username}/policies",
        name="policies",
        title="The resource policies that apply",
        description="Your groups' reservations and limits, what is in use and the compute resources each "
        "opens to you; username 'me' for yourself.",
        mime_type="application/json",
    )
    async def policies(username: str, ctx: Context) -> str:
        rows = await _as_caller(ctx, tools.policies, error=ResourceError, username=username)
        return json.dumps({"policies": rows})


def _prompts(server: MCPServer) -> None:
    @server.prompt(name="submit_a_training_run", title="Submit a training run")
    def submit_a_training_run(
        command: Annotated[str, Field(description="What to run, e.g. 'python train.py --epochs 3'.")],
        gpus: Annotated[str, Field(description="GPUs it needs, e.g. '4'.")] = "",
    ) -> str:
        """Plan and submit a training run on the right compute resource, then follow it."""
        needs = f" It needs {gpus} GPUs." if gpus else ""
        return (
            f"Submit this training run to Klique: {command}.{needs}\n"
            "1. Call list_compute_resources and choose the one whose size fits (a fixed size, or "
            "gpus_from_task with gpus) with the shortest wait (wait_p95_seconds) and room under its limit.\n"
            "2. If it runs on an HPC cluster, call preview_batch_script and check the script.\n"
            "3. Call budget_status if the work costs money, and stop if a wallet it draws from is spent.\n"
            "4. Call submit_task with command as a list of strings (never one shell string) and an "
            "idempotency_key of your own, so that a retry does not submit it twice.\n"
            "5. Follow it with task_status and task_logs (pass next_after back as after); if it waits, "
            "why_pending says why. Report its outcome and the last lines of its log."
        )

    @server.prompt(name="why_is_my_task_waiting", title="Why is my task waiting")
    async def why_is_my_task_waiting(
        task_id: Annotated[str, Field(description="The task's id.")], ctx: Context
    ) -> str:
        """Explain why a task is not running yet, in the scheduler's words, and what would help."""
        why = await _as_caller(ctx, tools.why_pending, error=ResourceError, task_id=task_id)
        return (
            f"My Klique task {task_id} is not running. The scheduler says: {json.dumps(why)}.\n"
            "Explain why in plain words. Then check what would help: list_compute_resources (is another "
            "compute resource with the same size less busy?), the policies resource "
            "klique://users/me/policies (is my group at its limit?) and budget_status (is a wallet "
            "spent?). Suggest one concrete next step, and do not cancel or resubmit without asking."
        )
