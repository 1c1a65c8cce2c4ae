"""The user's commands: `klique submit`, `tasks`, `cancel`, `why`, `queues`. They speak to the REST API
through the SDK, so they work from any machine that can reach the tenant's address."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import websockets

from klique.sdk import Client, KliqueError
from klique.tables import duration, table


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def connection(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--url", help="the tenant's address (default: $KLIQUE_URL)")
        parser.add_argument("--token", help="an API token (default: $KLIQUE_TOKEN)")
        return parser

    submit = connection(commands.add_parser("submit", help="submit a task to a compute resource"))
    submit.add_argument("compute_resource", help="its name, as `klique queues` shows it")
    submit.add_argument("--gpus", help="the size, where the compute resource takes it from the task")
    submit.add_argument("--name", default="")
    submit.add_argument("--project")
    submit.add_argument("--priority", type=int, default=0)
    submit.set_defaults(argv=[])  # the command to run follows `--` (see klique.cli.parse_args)
    tasks = connection(commands.add_parser("tasks", help="list tasks, newest first"))
    tasks.add_argument("--state")
    tasks.add_argument("--queue", help="only this compute resource")
    tasks.add_argument("--mine", action="store_true")
    tasks.add_argument("--limit", type=int, default=50)
    for name, text in (("cancel", "cancel a task"), ("why", "say why a task waits, and where it stands")):
        parser = connection(commands.add_parser(name, help=text))
        parser.add_argument("task", help="its id, or the start of it")
    connection(commands.add_parser("queues", help="the compute resources, and how their queues are doing"))
    logs = connection(commands.add_parser("logs", help="a task's output"))
    logs.add_argument("task", help="its id, or the start of it")
    logs.add_argument(
        "-f", "--follow", action="store_true", help="keep printing output as it comes, until it ends"
    )
    outputs = connection(commands.add_parser("outputs", help="the files a task left, and downloading them"))
    outputs.add_argument("task", help="its id, or the start of it")
    outputs.add_argument("--download", metavar="DIR", help="save every output under DIR")
    config = connection(commands.add_parser("config", help="the resource configuration (admins)"))
    config.add_argument("action", choices=["show", "pull", "push", "validate", "provision"])
    config.add_argument("file", nargs="?", help="push: the document to make the draft (JSON)")
    simulate = connection(
        commands.add_parser("simulate", help="replay recent work against the draft configuration (admins)")
    )
    simulate.add_argument("--days", type=int, help="replay the tasks of the last N days (default 7)")
    usage = connection(commands.add_parser("usage", help="GPU-hours, tokens, storage and cost, summed"))
    usage.add_argument(
        "--by", default="project", choices=["project", "user", "pool", "gpu_class", "model", "kind"]
    )
    usage.add_argument("--since", help="from this day or time (ISO 8601), as 2026-11-01")
    usage.add_argument("--until", help="up to this day or time (ISO 8601), not included")
    simulate.add_argument("--trace", help="replay a CSV trace: timestamp,duration,num_gpus,compute_resource")


def run(args: argparse.Namespace, client: Client | None = None) -> int:
    """Run a user command; returns the exit code. `client` lets tests bring their own transport."""
    try:
        client = client or Client.from_environment(args.url, args.token)
        print(HANDLERS[args.command](args, client))
        return 0
    except KliqueError as error:
        print(f"klique {args.command}: {error.message}")
        return 1


def _submit(args: argparse.Namespace, client: Client) -> str:
    command = list(args.argv)
    task = client.submit(
        args.compute_resource,
        gpus=args.gpus,
        name=args.name,
        project=args.project,
        priority=args.priority,
        command=command or None,
    )
    return f"Submitted {task['id']} to {task['compute_resource']} ({task['gpus']} GPUs): {task['state']}."


def _tasks(args: argparse.Namespace, client: Client) -> str:
    rows = client.tasks(state=args.state, compute_resource=args.queue, mine=args.mine, limit=args.limit)
    if not rows:
        return "No tasks."
    return table(
        ["id", "name", "state", "gpus", "compute resource", "pool", "submitter", "reason"],
        [
            [
                row["id"][:8],
                row["name"],
                row["state"],
                row["gpus"],
                row["compute_resource"],
                row["pool"],
                row["submitter"],
                row["reason"],
            ]
            for row in rows
        ],
    )


def _cancel(args: argparse.Namespace, client: Client) -> str:
    task = client.cancel(args.task)
    return f"Cancelled {task['id']} ({task['name'] or 'unnamed'}): {task['state']}."


def _why(args: argparse.Namespace, client: Client) -> str:
    task = client.task(args.task)
    why = client.why(task["id"])
    if why["state"] != "queued":
        return f"Task {task['id']} is {why['state']}" + (f" in pool {task['pool']}." if task["pool"] else ".")
    return (
        f"Task {task['id']} is queued in {task['compute_resource']}: position {why['position']} "
        f"({why['queued_ahead']} ahead), waiting {duration(why['waiting_seconds'])}.\n{why['reason']}"
    )


def _queues(args: argparse.Namespace, client: Client) -> str:
    rows = client.queues()
    if not rows:
        return "No compute resources yet; a tenant admin provisions them."
    return table(
        ["compute resource", "open", "size", "reserved", "limit", "queued", "active", "wait p50", "wait p95"],
        [
            [
                row["name"],
                "yes" if row["open_to_you"] else "no",
                row["size"],
                row["reservation_gpus"],
                row["limit_gpus"],
                row["queued"],
                row["active"],
                duration(row["wait_p50_seconds"]),
                duration(row["wait_p95_seconds"]),
            ]
            for row in rows
        ],
    )


def _usage(args: argparse.Namespace, client: Client) -> str:
    summary = client.usage(by=args.by, since=_day(args.since), until=_day(args.until))
    if not summary["rows"]:
        return "No usage recorded yet for what you may see."
    rows = [
        [
            row[args.by] or "(none)",
            row["gpu_hours"].rstrip("0").rstrip(".") or "0",
            f"{row['tokens_in']:,}",
            f"{row['tokens_out']:,}",
            row["gb_hours"].rstrip("0").rstrip(".") or "0",
            f"{float(row['cost_usd']):,.2f}",
        ]
        for row in summary["rows"]
    ]
    rows.append(["total", "", "", "", "", f"{float(summary['total_cost_usd']):,.2f}"])
    return table(
        [args.by.replace("_", " "), "GPU-hours", "tokens in", "tokens out", "GB-hours", "cost USD"], rows
    )


def _day(value: str | None) -> str | None:
    """A day as the API takes a time: midnight UTC of it."""
    return f"{value}T00:00:00+00:00" if value and len(value) == 10 else value


def _report(report: dict[str, Any]) -> str:
    lines = [
        f"{kind[:-1]}: {item['where']}: {item['message']}"
        for kind in ("errors", "warnings")
        for item in report[kind]
    ]
    verdict = "The draft is valid." if report["ok"] else "The draft has errors; provisioning would refuse it."
    return "\n".join([verdict, *lines])


def _config(args: argparse.Namespace, client: Client) -> str:
    """show: what is provisioned; pull: the draft; push FILE: replace the draft; validate; provision."""
    if args.action in {"show", "pull"}:
        return json.dumps(client.configuration("active" if args.action == "show" else "draft"), indent=2)
    if args.action == "push":
        if not args.file:
            raise KliqueError("Name the JSON file to push: klique config push draft.json")
        try:
            with open(args.file, encoding="utf-8") as handle:
                document = json.load(handle)
        except OSError as error:
            raise KliqueError(f"Cannot read {args.file}: {error.strerror}.") from None
        except json.JSONDecodeError as error:
            raise KliqueError(f"{args.file} is not JSON: {error.msg} at line {error.lineno}.") from None
        client.save_draft(document)
        return "Draft saved. `klique config validate` checks it; `klique config provision` makes it live."
    if args.action == "validate":
        return _report(client.validate())
    result = client.provision()
    created = ", ".join(f"{count} {kind}" for kind, count in result["created"].items() if count) or "nothing"
    deleted = ", ".join(f"{count} {kind}" for kind, count in result["deleted"].items() if count) or "nothing"
    return f"Provisioned. Created {created}; deleted {deleted}; ended {result['ended_tasks']} queued tasks."


def _simulate(args: argparse.Namespace, client: Client) -> str:
    trace = None
    if args.trace:
        try:
            with open(args.trace, encoding="utf-8") as handle:
                trace = handle.read()
        except OSError as error:
            raise KliqueError(f"Cannot read the trace {args.trace}: {error.strerror}.") from None
    result = client.simulate(days=args.days, trace=trace)
    current, proposed = result["current"], result["proposed"]
    rows = [
        ["jobs replayed", current["jobs"], proposed["jobs"]],
        ["refused (no compute resource or too large)", current["refused"], proposed["refused"]],
        ["finished", current["finished"], proposed["finished"]],
        ["GPU utilization", f"{current['gpu_utilization']:.1%}", f"{proposed['gpu_utilization']:.1%}"],
        ["queue wait p50", duration(current["wait_p50_seconds"]), duration(proposed["wait_p50_seconds"])],
        ["queue wait p95", duration(current["wait_p95_seconds"]), duration(proposed["wait_p95_seconds"])],
        [
            "mean completion time",
            duration(current["mean_completion_seconds"]),
            duration(proposed["mean_completion_seconds"]),
        ],
        [
            "reservation violation",
            duration(current["reservation_violation_seconds"]),
            duration(proposed["reservation_violation_seconds"]),
        ],
        ["preemptions", current["preemptions"], proposed["preemptions"]],
    ]
    return table(["", "current", "proposed (draft)"], rows)


def _logs(args: argparse.Namespace, client: Client) -> str:
    if not args.follow:
        return "\n".join(line for chunk in client.logs(args.task) for line in chunk["lines"])
    task_id = client.resolve(args.task)

    async def follow() -> str:
        async for message in client.follow_logs(task_id):
            if message["type"] == "log":
                for line in message["lines"]:
                    print(line, flush=True)
            elif message["type"] == "end":
                return f"-- task {message['state']} --"
        return "-- the connection closed --"

    try:
        return asyncio.run(follow())
    except (OSError, websockets.WebSocketException) as error:
        raise KliqueError(f"Cannot follow the task's output: {error}.") from None


def _outputs(args: argparse.Namespace, client: Client) -> str:
    rows = client.outputs(args.task)
    if not rows:
        return "No outputs."
    if args.download:
        target = Path(args.download)
        for row in rows:
            path = (target / row["name"]).resolve()
            if not path.is_relative_to(target.resolve()):
                raise KliqueError(f"Output name {row['name']!r} would be saved outside {target}.")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(client.download(args.task, row["name"]))
        return f"Saved {len(rows)} outputs under {target}."
    return table(
        ["name", "bytes", "sha256", "at"], [[r["name"], r["size"], r["sha256"][:12], r["at"]] for r in rows]
    )


HANDLERS: dict[str, Callable[[argparse.Namespace, Client], str]] = {
    "submit": _submit,
    "tasks": _tasks,
    "cancel": _cancel,
    "why": _why,
    "queues": _queues,
    "simulate": _simulate,
    "config": _config,
    "logs": _logs,
    "outputs": _outputs,
    "usage": _usage,
}
