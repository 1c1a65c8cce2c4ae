"""Following a task's output over a websocket (`klique logs -f`, the portal's log pane)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.db import DatabaseError, close_old_connections
from django_tenants.utils import schema_context

from apps.accounts.consumers import WebsocketIdentity, resolve_identity
from apps.accounts.models import User
from apps.core.events import logs_group
from apps.core.websocket import DirectDispatch, WebsocketRejected
from apps.fleet.selectors import task_logs
from apps.scheduling.models import Task
from apps.scheduling.selectors import may_read_output, output_readers

logger = logging.getLogger(__name__)

LOG_POLL_SECONDS = 2.0  # how often a follower reads the store when no live chunk woke it
ENDED = ("completed", "failed", "aborted")


def _after(scope: dict[str, Any]) -> int:
    """The ?after= cursor the client already has (0: from the start)."""

    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("after", ["0"])
    try:
        return max(0, int(values[-1]))
    except ValueError:
        raise WebsocketRejected("after is the cursor of the last chunk read, a whole number.", 4400) from None


class TaskLogsConsumer(DirectDispatch, AsyncJsonWebsocketConsumer):
    """Streams one task's output: what it has written after the client's cursor (?after=, from the start
    without one), then each new chunk as its agent reports it, then {"type": "end", "state": ...} when
    the task ends. Same handshake as the events stream.

    The store is the truth and the channel layer only a doorbell: each live message, and a read every
    LOG_POLL_SECONDS when none comes, sends what the store holds after the last cursor sent. So a chunk
    whose live message was lost (Redis restarting) is sent anyway, in order and once, and the end is
    delivered even if its own message never arrives. A client that reconnects with the cursor it has
    gets only what came since."""

    identity: WebsocketIdentity | None = None
    group: str | None = None
    cursor = 0
    task_id = ""
    done = False
    poller: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        await self.accept()
        self.task_id = str(self.scope["url_route"]["kwargs"]["task_id"])
        self.lock = asyncio.Lock()
        try:
            self.cursor = _after(self.scope)
            self.identity = await database_sync_to_async(resolve_identity)(self.scope)
            await database_sync_to_async(self._check_reader)()
        except WebsocketRejected as rejected:
            await self.send_json({"type": "error", "detail": str(rejected)})
            await self.close(code=rejected.code)
            return
        self.group = logs_group(self.identity.schema_name, self.task_id)
        try:
            await self.channel_layer.group_add(self.group, self.channel_name)
        except Exception as error:  # the channel layer down: the store is read on a timer instead
            logger.warning("log follower of task %s without live chunks: %s", self.task_id, error)
            self.group = None
        await self._catch_up()
        if not self.done:
            self.poller = asyncio.create_task(self._poll())

    def _check_reader(self) -> None:
        assert self.identity is not None
        with schema_context(self.identity.schema_name):
            task = Task.objects.select_related("submitter", "project").filter(pk=self.task_id).first()
            if task is None:
                raise WebsocketRejected("No such task in this tenant.", 4404)
            reader = User.objects.filter(pk=self.identity.user_id).first()
            if reader is None or not may_read_output(reader, task):
                raise WebsocketRejected(output_readers(task), 4403)

    def _read(self, after: int) -> tuple[list[dict[str, Any]], str]:
        assert self.identity is not None
        try:
            with schema_context(self.identity.schema_name):
                state = Task.objects.filter(pk=self.task_id).values_list("state", flat=True).first()
                task = Task(pk=self.task_id)
                chunks = [{**chunk, "at": chunk["at"].isoformat()} for chunk in task_logs(task, after=after)]
        finally:
            close_old_connections()
        return chunks, state or ""

    async def _catch_up(self) -> None:
        """Send what the store holds after the last cursor sent, then the end if the task has ended."""
        async with self.lock:
            if self.done:
                return
            chunks, state = await database_sync_to_async(self._read)(self.cursor)
            for chunk in chunks:
                await self.send_json({"type": "log", **chunk})
                self.cursor = max(self.cursor, int(chunk["cursor"]))
            if state in ENDED:
                self.done = True
                await self.send_json({"type": "end", "state": state, "cursor": self.cursor})
                await self.close()

    async def _poll(self) -> None:
        while not self.done:
            await asyncio.sleep(LOG_POLL_SECONDS)
            try:
                await self._catch_up()
            except DatabaseError as error:  # the database restarting: try again on the next tick
                logger.warning("log follower of task %s: the store cannot be read (%s)", self.task_id, error)

    async def disconnect(self, code: int) -> None:
        self.done = True
        if self.poller is not None:
            self.poller.cancel()
        if self.group is not None:
            with contextlib.suppress(Exception):
                await self.channel_layer.group_discard(self.group, self.channel_name)

    async def task_log(self, message: dict[str, Any]) -> None:
        """A live chunk or end: the doorbell to read the store."""
        try:
            await self._catch_up()
        except DatabaseError as error:
            logger.warning("log follower of task %s: the store cannot be read (%s)", self.task_id, error)
