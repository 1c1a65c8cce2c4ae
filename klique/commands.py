"""The user's commands: `klique submit`, `tasks`, `cancel`, `why`, `queues`. They speak to the REST API
through the SDK, so they work from any machine that can reach the tenant's address."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TextIO

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
    submit.add_argument(
        "--time-limit",
        type=seconds_of,
        metavar="DURATION",
        help="how long a run may last (90s, 45m, 2h, 1d; a number is seconds): past it the run is stopped; "
        "a task with a limit may run in gaps before a waiting larger task",
    )
    submit.add_argument(
        "--output",
        action="append",
        default=[],
        metavar="PATTERN",
        help="keep the files matching this pattern in the task's folder as outputs (repeatable): '*.pt'",
    )
    submit.add_argument(
        "--idempotency-key",
        default="",
        help="your own key for this submission: submitting again with it returns the same task (a CI retry)",
    )
    submit.add_argument(
        "--wait",
        action="store_true",
        help="follow the task to its end, printing its output; the exit code is its outcome (0 completed, "
        "its own exit code or 1 failed, 3 aborted, 124 timed out)",
    )
    submit.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="with --wait: give up after this long, and cancel the task",
    )
    submit.add_argument(
        "--json",
        action="store_true",
        help="print the task as JSON on stdout (at its end, with --wait; its output then goes to stderr)",
    )
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
    simulate.add_argument("--json", action="store_true", help="print the whole result as JSON, for scripts")


class Outcome(NamedTuple):
    """What a command prints, and the exit code it ends with."""

    text: str
    code: int


def run(args: argparse.Namespace, client: Client | None = None) -> int:
    """Run a user command; returns the exit code. `client` lets tests bring their own transport."""
    try:
        client = client or Client.from_environment(args.url, args.token)
        said = HANDLERS[args.command](args, client)
        outcome = said if isinstance(said, Outcome) else Outcome(said, 0)
        print(outcome.text, flush=True)
        return outcome.code
    except KliqueError as error:
        print(
            f"klique {args.command}: {error.message}",
            file=sys.stderr if getattr(args, "json", False) else sys.stdout,
        )
        return 1


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


def seconds_of(text: str) -> int:
    """Seconds from "90s", "45m", "2h", "1d" or a plain number of seconds."""
    text = text.strip().lower()
    unit = DURATION_UNITS.get(text[-1:], 0)
    number = text[:-1] if unit else text
    if not number.isdigit() or int(number) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: give 90s, 45m, 2h, 1d or seconds.")
    return int(number) * (unit or 1)


def _submit(args: argparse.Namespace, client: Client) -> str | Outcome:
    command = list(args.argv)
    task = client.submit(
        args.compute_resource,
        gpus=args.gpus,
        name=args.name,
        project=args.project,
        priority=args.priority,
        command=command or None,
        outputs=args.output,
        idempotency_key=args.idempotency_key,
        time_limit_seconds=args.time_limit,
    )
    if args.wait:
        return wait(client, task, timeout=args.timeout, as_json=args.json)
    if args.json:
        return json.dumps(task)
    return f"Submitted {task['id']} to {task['compute_resource']} ({task['gpus']} GPUs): {task['state']}."


# The exit codes of `klique submit --wait`, beside the task's own exit code when it failed with one.
EXIT_FAILED, EXIT_ABORTED, EXIT_TIMED_OUT, EXIT_INTERRUPTED = 1, 3, 124, 130


def outcome_code(task: dict[str, Any]) -> int:
    """The exit code that says how a task ended: 0 completed; its own exit code (1 to 255) or 1 failed; 3
    aborted (cancelled, or lost for good)."""
    if task["state"] == "completed":
        return 0
    if task["state"] == "failed":
        code = task.get("exit_code")
        return code if isinstance(code, int) and 0 < code < 256 else EXIT_FAILED
    return EXIT_ABORTED


def wait(client: Client, task: dict[str, Any], *, timeout: float | None, as_json: bool) -> Outcome:
    """Follow `task` to its end: its output as it comes (on stdout, or stderr with --json), and what it is
    waiting for on stderr whenever that changes (and every 30 s on a terminal); at the end, its state as
    a line or as JSON, and its outcome as the exit code. Past `timeout`, or on Ctrl-C (a CI job being
    cancelled), the task is cancelled, so no GPU is left working for a job that stopped waiting."""
    out = sys.stderr if as_json else sys.stdout
    notes = Progress(task["id"], sys.stderr)
    notes.saw(task)

    async def follow() -> None:
        async def output() -> None:
            async for message in client.follow_logs(task["id"]):
                if message["type"] == "log":
                    out.write("".join(f"{line}\n" for line in message["lines"]))
                    out.flush()
                elif message["type"] == "end":
                    return

        async def watch() -> None:
            while True:
                await asyncio.sleep(POLL_SECONDS)
                with contextlib.suppress(KliqueError):  # a missed look is told at the next one
                    notes.saw(await asyncio.to_thread(client.task, task["id"]))

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait_for(output(), timeout)
        finally:
            watcher.cancel()

    previous = signal.signal(signal.SIGTERM, _interrupted)  # a CI job cancelled: stop like Ctrl-C
    try:
        asyncio.run(follow())
    except TimeoutError:
        client.cancel(task["id"])
        ended = client.task(task["id"])
        return _ended(
            ended, as_json, EXIT_TIMED_OUT, f"Gave up after {duration(timeout or 0)}; cancelled it."
        )
    except KeyboardInterrupt:
        client.cancel(task["id"])
        return _ended(client.task(task["id"]), as_json, EXIT_INTERRUPTED, "Interrupted; cancelled it.")
    except (OSError, websockets.WebSocketException) as error:
        raise KliqueError(f"Cannot follow task {task['id']}: {error}.") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    ended = client.task(task["id"])
    return _ended(ended, as_json, outcome_code(ended), "")


def _cancel_quietly(client: Client, task_id: str) -> None:
    """Cancel a task we stop waiting for; one that ended meanwhile has nothing to cancel."""
    with contextlib.suppress(KliqueError):
        client.cancel(task_id)


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _ended(task: dict[str, Any], as_json: bool, code: int, note: str) -> Outcome:
    if as_json:
        if note:
            print(f"klique: {note}", file=sys.stderr)
        return Outcome(json.dumps({**task, "outcome_exit_code": code}), code)
    exit_code = "" if task.get("exit_code") is None else f", exit code {task['exit_code']}"
    reason = f": {task['reason']}" if task.get("reason") and task["state"] != "completed" else ""
    text = f"Task {task['id']} {task['state']}{exit_code}{reason}"
    return Outcome(f"{note} {text}".strip() if note else text, code)


POLL_SECONDS = 5.0
TERMINAL_EVERY = 30.0


class Progress:
    """What a waiting task is doing, said on stderr when it changes, and every 30 s on a terminal."""

    def __init__(self, task_id: str, stream: TextIO) -> None:
        self.task_id, self.stream = task_id, stream
        self.last: tuple[str, str] | None = None
        self.said_at = 0.0
        self.started = time.monotonic()

    def saw(self, task: dict[str, Any]) -> None:
        now = time.monotonic()
        key = (task["state"], task.get("reason") or "")
        interactive = self.stream.isatty() and now - self.said_at >= TERMINAL_EVERY
        if key == self.last and not interactive:
            return
        self.last, self.said_at = key, now
        where = f" on pool {task['pool']}" if task.get("pool") else ""
        reason = f": {task['reason']}" if task.get("reason") else ""
        waited = duration(now - self.started)
        self.stream.write(f"[klique] task {self.task_id} {task['state']}{where} ({waited}){reason}\n")
        self.stream.flush()


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
    if args.json:
        return json.dumps(result, indent=2)
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
    overall = table(["", "current", "proposed (draft)"], rows)
    parts = [overall, f"Per team (policy), current -> proposed:\n{_teams_table(current, proposed)}"]
    if current.get("resources") or proposed.get("resources"):
        parts.append(f"Per compute resource, current -> proposed:\n{_resources_table(current, proposed)}")
    if current.get("objectives"):
        parts.append(f"Queue-wait objectives, current -> proposed:\n{_objectives_table(current, proposed)}")
    return "\n\n".join(parts)


def _paired(
    current: dict[str, Any], proposed: dict[str, Any], part: str, key: str
) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, before, after) for each row of `part` on either side, by its `key`; {} where it is absent."""
    before = {row[key]: row for row in current.get(part, [])}
    after = {row[key]: row for row in proposed.get(part, [])}
    return [(name, before.get(name, {}), after.get(name, {})) for name in sorted(set(before) | set(after))]


def _resources_table(current: dict[str, Any], proposed: dict[str, Any]) -> str:
    rows = []
    for name, old, new in _paired(current, proposed, "resources", "compute_resource"):
        rows.append(
            [
                name,
                f"{old.get('jobs_started', 0)} -> {new.get('jobs_started', 0)}",
                _change(old.get("wait_p50_seconds"), new.get("wait_p50_seconds")),
                _change(old.get("wait_p95_seconds"), new.get("wait_p95_seconds")),
                _change(old.get("wait_p99_seconds"), new.get("wait_p99_seconds")),
            ]
        )
    return table(["compute resource", "started", "wait p50", "wait p95", "wait p99"], rows)


def _objectives_table(current: dict[str, Any], proposed: dict[str, Any]) -> str:
    """Each objective's attainment before and after (its percentile's share of jobs within target), MISSED
    where the draft would break an objective the current setup keeps."""
    after = {row["objective"]: row for row in proposed.get("objectives", [])}
    rows = []
    for old in current.get("objectives", []):
        new = after.get(old["objective"], {})
        verdict = _share(old.get("attainment")) + " -> " + _share(new.get("attainment"))
        if old.get("met") and new.get("met") is False:
            verdict += " MISSED"
        elif old.get("met") is False and new.get("met"):
            verdict += " met"
        rows.append(
            [
                old["objective"],
                f"p{old['percentile']:g} within {duration(old['target_seconds'])}",
                _change(old.get("value_seconds"), new.get("value_seconds")),
                verdict,
            ]
        )
    return table(["objective", "promise", "value", "attainment"], rows)


def _teams_table(current: dict[str, Any], proposed: dict[str, Any]) -> str:
    """Each policy's waits, reservation use, borrowing and preemptions suffered, before and after, with
    what got worse marked: an average that improves can hide one team's p95 that doubles."""
    rows = []
    for name, old, new in _paired(current, proposed, "teams", "policy"):
        rows.append(
            [
                name,
                _change(old.get("wait_p50_seconds"), new.get("wait_p50_seconds")),
                _change(old.get("wait_p95_seconds"), new.get("wait_p95_seconds")),
                _change(old.get("wait_p99_seconds"), new.get("wait_p99_seconds")),
                f"{_share(old.get('reservation_use'))} -> {_share(new.get('reservation_use'))}",
                f"{old.get('borrowed_gpu_hours', 0)} -> {new.get('borrowed_gpu_hours', 0)}",
                f"{old.get('preemptions_suffered', 0)} -> {new.get('preemptions_suffered', 0)}",
            ]
        )
    headers = ["policy", "wait p50", "wait p95", "wait p99", "reservation use", "borrowed GPU-h", "preempted"]
    return table(headers, rows)


def _change(old: float | None, new: float | None) -> str:
    """A wait before and after; WORSE where it grew by more than a minute and a tenth."""
    if old is None and new is None:
        return "-"
    text = f"{duration(old) if old is not None else '-'} -> {duration(new) if new is not None else '-'}"
    if old is not None and new is not None and new > old * 1.1 + 60:
        text += " WORSE"
    elif old is not None and new is not None and new < old * 0.9 - 60:
        text += " better"
    return text


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


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


HANDLERS: dict[str, Callable[[argparse.Namespace, Client], str | Outcome]] = {
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
