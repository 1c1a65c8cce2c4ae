"""A task's secrets printed in its output are masked in the logs its agent reports, whichever way the plane
reads the task: a report alone, or a burst of them read together. The plane reads a report's task by its
own compiled SQL (apps.fleet.selectors); its spec, which names the secrets, must be the spec the ORM
reads, not its JSON text (which named no secret to mask, so every value was stored as printed)."""

from __future__ import annotations

import asyncio
from typing import Any

from django.db import connections
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.fleet.models import TaskReport
from apps.scheduling.models import Task
from apps.vault.services import secret_set
from tests.fleet.test_bursts import answers, assigned, sent_while_busy
from tests.fleet.test_fencing import run_of

VALUE = "hf_abcdef123456"
PRINTED = [f"token is {VALUE} here", f"twice: {VALUE}{VALUE}", "nothing secret"]
MASKED = ["token is *** here", "twice: ******", "nothing secret"]


def test_a_secret_printed_by_a_task_is_masked_in_the_logs_its_agent_reports(fleet: dict[str, Any]) -> None:
    with schema_context("fleet"):
        secret_set(user=User.objects.get(username="fay"), scope="user", name="HF_TOKEN", value=VALUE)
        Task.objects.filter(pk=fleet["task"]).update(spec={"command": ["true"], "secrets": ["HF_TOKEN"]})
    connections.close_all()

    async def scenario() -> list[dict[str, Any]]:
        client, (assign,) = await assigned(fleet)
        assert assign["secrets"] == {"HF_TOKEN": VALUE}  # the run was given it
        run = run_of(assign)
        await client.send_json_to({"type": "accepted", **run})
        acks = []
        for seq in (1, 2):  # one report at a time
            await client.send_json_to(
                {"type": "log", **run, "seq": seq, "stream": "stdout", "lines": PRINTED}
            )
            acks.append(await client.receive_json_from(timeout=10))
        burst = [  # several, read together
            {"type": "log", **run, "seq": seq, "stream": "stderr", "lines": PRINTED} for seq in (3, 4, 5)
        ]
        await sent_while_busy(client, burst)
        acks += await answers(client, len(burst))
        await client.disconnect()
        return acks

    acks = asyncio.run(scenario())
    assert [(ack["seq"], ack["verdict"]) for ack in acks] == [(seq, "applied") for seq in (1, 2, 3, 4, 5)]
    with schema_context("fleet"):
        stored = list(TaskReport.objects.filter(task_id=fleet["task"], kind="log").order_by("seq"))
    connections.close_all()
    assert [report.seq for report in stored] == [1, 2, 3, 4, 5]
    for report in stored:
        assert report.body["lines"] == MASKED, report.seq
        assert VALUE not in str(report.body)
