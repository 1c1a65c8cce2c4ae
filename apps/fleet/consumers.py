"""The agents' websocket (/agents/ws/): one connection per agent, outbound from the agent's side."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.db import DatabaseError, close_old_connections, transaction
from django_tenants.utils import schema_context

from apps.core import deferred
from apps.core.errors import InvalidInput, NotFound
from apps.core.websocket import DirectDispatch, header
from apps.fleet import credentials, dispatch, errors, selectors, session
from apps.fleet.models import AgentToken
from apps.scheduling import lifecycle, wake
from protocol import messages

logger = logging.getLogger(__name__)

# Close codes: 4401 a bad or revoked token, 4403 a token bound to another agent, 4400 an agent that
# speaks another protocol version, 1011 the plane could not serve the message (its database is down):
# the agent reconnects with backoff, and its outbox keeps what was not acknowledged.
CLOSE_TOKEN, CLOSE_BOUND, CLOSE_PROTOCOL, CLOSE_UNAVAILABLE = 4401, 4403, 4400, 1011

# Pools (by channel group) one of whose agents in this process is asking for placed work now; True when a
# notice came while it asked, so it asks once more. And the dispatch notices that one agent here took up
# already (each agent of the pool gets its own copy). One event loop per process: no lock is needed.
_asking: dict[str, bool] = {}
_taken_up: OrderedDict[str, None] = OrderedDict()
TAKEN_UP_KEPT = 4096

# Messages an agent sent while the last were applied are applied together: accepted, rejected and reports
# in one trip to the database thread and one transaction, at most BURST of them (where one is refused, the
# burst is applied again with each in a savepoint of its own, so one refused rolls back alone). The agent's
# messages wait here, in order, at most INBOX of them; beyond that the socket is read no further until
# there is room.
BURST = 32
INBOX = 256
BURSTABLE = (messages.Accepted, messages.Rejected, messages.Report)


@dataclass(frozen=True, slots=True)
class Refusal:
    """What the agent is told about one message of a burst that the plane refused."""

    kind: str
    error: Exception


class AgentConsumer(DirectDispatch, AsyncJsonWebsocketConsumer):
    """Speaks the agent protocol (protocol.messages; apps.fleet.session, dispatch, credentials) for one
    pool-scoped agent token.

    The token is checked before the socket is accepted: with the database down the handshake is refused,
    so the agent backs off instead of counting a connection that serves nothing. Every database step
    runs in the tenant's schema, named explicitly. A message that breaks the protocol or that the plane
    refuses is answered {"type": "error", "detail": ..., "about": ...}; no message ends the consumer
    without a close code."""

    schema_name: str | None = None
    token: AgentToken | None = None
    agent_id: str | None = None
    # Set once a message could not be served: the connection is closing, and what the agent sent after
    # that message is not applied either. The agent sends it all again, in order, when it reconnects; a
    # later report applied here before the failed one arrives again would put the run's reports (its
    # log lines) out of order.
    failed: bool = False

    async def connect(self) -> None:
        self.inbox: deque[Any] = deque()
        self.room = asyncio.Event()
        self.draining: asyncio.Task[None] | None = None
        self.asking: set[asyncio.Task[None]] = set()  # dispatch notices being taken up
        try:
            self.tenant, self.token = await database_sync_to_async(self._authenticate)()
        except errors.AgentRejected as rejected:
            await self.accept()  # only to say why: the agent logs it and backs off
            await self.send_json(messages.Error(str(rejected), "connect").as_json())
            await self.close(code=CLOSE_TOKEN)
            return
        except DatabaseError as error:
            logger.warning("agent connection refused: the database is unavailable (%s)", error)
            await self.close(code=CLOSE_UNAVAILABLE)  # before accept: the handshake is refused
            return
        self.schema_name = self.tenant.schema_name
        await self.accept()
        try:
            await self.channel_layer.group_add(
                wake.pool_group(self.schema_name, self.token.pool_id), self.channel_name
            )
        except Exception as error:  # the channel layer (Redis) down: heartbeats still carry work and stops
            logger.warning("agent connection without live notices: the channel layer failed (%s)", error)

    def _authenticate(self) -> tuple[Any, AgentToken]:
        try:
            return credentials.agent_at_handshake(
                host=header(self.scope, b"host"), authorization=header(self.scope, b"authorization")
            )
        finally:
            close_old_connections()  # a connection broken by a database restart is not kept

    async def disconnect(self, code: int) -> None:
        if self.token is None or self.schema_name is None:
            return
        pending = [*self.asking, *([self.draining] if self.draining is not None else [])]
        if pending:  # what the agent sent before it went is applied first, and asks end
            await asyncio.wait(pending)
        with contextlib.suppress(Exception):  # the channel layer may be down; its group entry expires
            await self.channel_layer.group_discard(
                wake.pool_group(self.schema_name, self.token.pool_id), self.channel_name
            )
        if self.agent_id:
            with contextlib.suppress(DatabaseError):  # the heartbeat's age says it anyway
                await database_sync_to_async(self._in_schema)(
                    session.agent_gone, tenant=self.tenant, agent_id=self.agent_id
                )

    def _in_schema(self, function: Any, **arguments: Any) -> Any:
        assert self.schema_name is not None
        try:
            with schema_context(self.schema_name):
                return function(**arguments)
        except DatabaseError:
            close_old_connections()
            raise

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """Queue the message: a drain applies the queue in order, in bursts (BURST). While it is full the
        socket is not read (the agent's send waits), as when each message was applied before the next."""
        if self.token is None or self.failed:
            return
        while len(self.inbox) >= INBOX and not self.failed:
            self.room.clear()
            await self.room.wait()
        self.inbox.append(content)
        if self.draining is None or self.draining.done():
            self.draining = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        while self.inbox and not self.failed:
            burst = self._next_burst()
            self.room.set()
            if len(burst) == 1 and not isinstance(burst[0][1], BURSTABLE):
                kind, message = burst[0]
                await self._serve(kind, self._handle(message))
            else:
                await self._serve(burst[0][0], self._handle_burst(burst))

    def _next_burst(self) -> list[tuple[str, Any]]:
        """The next message alone (a hello, a heartbeat, one that is malformed), or the run of accepted,
        rejected and reports at the inbox's head, up to BURST of them."""
        burst: list[tuple[str, Any]] = []
        while self.inbox and len(burst) < BURST:
            content = self.inbox[0]
            kind = str(content.get("type"))[:30] if isinstance(content, dict) else ""
            message: Any
            try:
                message = messages.parse_from_agent(content)
            except messages.ProtocolError as error:
                message = error
            if burst and not isinstance(message, BURSTABLE):
                break
            self.inbox.popleft()
            burst.append((kind, message))
            if not isinstance(message, BURSTABLE):
                break
        return burst

    async def _serve(self, kind: str, handling: Any) -> None:
        """Await one message's (or burst's) handling; what the plane refuses is said to the agent, and a
        failure to serve it closes the connection, the rest of the inbox unapplied."""
        try:
            await handling
        except messages.ProtocolError as error:
            await self.send_json(messages.Error(f"Malformed {kind or 'message'}: {error}", kind).as_json())
        except (errors.AgentRejected, InvalidInput, NotFound) as refused:
            await self._refused(kind, refused)
        except DatabaseError as error:
            self.failed = True
            logger.warning(
                "agent %s: %s not served, the database is unavailable (%s)", self.agent_id, kind, error
            )
            await self._close_with(
                CLOSE_UNAVAILABLE, "The control plane's database is unavailable; reconnect later."
            )
        except Exception:
            self.failed = True
            logger.exception("agent %s: %s message failed", self.agent_id, kind)
            await self._close_with(
                CLOSE_UNAVAILABLE, f"The control plane failed to handle {kind}; reconnect."
            )
        finally:
            if self.failed:
                self.inbox.clear()
                self.room.set()

    async def _refused(self, kind: str, refused: Exception) -> None:
        await self.send_json(messages.Error(str(refused), kind).as_json())
        if isinstance(refused, errors.StaleLease) and refused.stop is not None:
            await self.send_json(refused.stop.as_json())

    async def _close_with(self, code: int, detail: str) -> None:
        with contextlib.suppress(Exception):
            await self.send_json(messages.Error(detail).as_json())
        await self.close(code=code)

    async def _handle(self, message: Any) -> None:
        """A message that comes alone: a hello, a heartbeat or one that is malformed (the rest come in
        bursts, _handle_burst)."""
        token = self.token
        assert token is not None
        if isinstance(message, messages.ProtocolError):
            raise message
        if isinstance(message, messages.Hello):
            await self._hello(token, message)
        elif self.agent_id is None:
            raise errors.AgentRejected("Say hello first.")
        elif isinstance(message, messages.Heartbeat):
            # One trip to the database thread (one connection drawn from the pool) for both.
            stops, assigned = await database_sync_to_async(self._in_schema)(
                self._heartbeat, token=token, heartbeat=message
            )
            for stop in stops:
                await self.send_json(stop.as_json())
            for assignment in assigned:
                await self.send_json(assignment)

    async def _handle_burst(self, burst: list[tuple[str, Any]]) -> None:
        """Apply accepted, rejected and reports in one transaction, then answer each in order: a report with
        its ack, a refusal with an error (and, for a stale lease, the stop). Nothing is answered before the
        burst commits, so an ack always means kept."""
        if self.agent_id is None:
            raise errors.AgentRejected("Say hello first.")
        try:
            answers = await database_sync_to_async(self._in_schema)(self._apply, burst=burst)
        except DatabaseError:
            if len(burst) == 1:
                raise
            # One transaction for many rows can meet another that locks them in another order (a deadlock
            # PostgreSQL breaks): apply them one by one instead, each in its own transaction, answering
            # those applied before one that fails.
            for one in burst:
                await self._answer(await database_sync_to_async(self._in_schema)(self._apply, burst=[one]))
            return
        await self._answer(answers)

    async def _answer(self, answers: list[Any]) -> None:
        for answer in answers:
            if isinstance(answer, Refusal):
                await self._refused(answer.kind, answer.error)
            elif answer is not None:
                await self.send_json(answer.as_json())

    def _apply(self, *, burst: list[tuple[str, Any]]) -> list[Any]:
        """In the database thread: each message's answer (an Ack, a Refusal or None), all in one
        transaction; a database failure undoes the burst.

        Messages are refused rarely (a lease that expired, a stranger's), so the burst is first applied
        with no savepoints, two statements fewer per message, the tasks and runs it names read in one round
        trip (selectors.burst_read), and the runs it ends end together (metered in
        one write to the ledger, what their GPUs go to decided once: lifecycle.ending_together), and the
        writes nobody reads back sent with the statement after them (apps.core.deferred). Where one
        is refused, that transaction is undone whole and the burst applied again with each message in a
        savepoint of its own, so that a refused message undoes its own writes alone and the others are
        kept; each run it ends is then metered with its own message."""
        token = self.token
        assert token is not None
        named = [(m.task_id, m.lease_id) for _, m in burst if isinstance(m, BURSTABLE)]
        reports = [(m.task_id, m.lease_id, m.seq) for _, m in burst if isinstance(m, messages.Report)]
        try:
            with (
                transaction.atomic(),
                deferred.writes_deferred(),
                selectors.burst_read(named, token.pool, reports),
                lifecycle.ending_together(),
            ):
                return [self._apply_one(token, message) for _, message in burst]
        except (errors.AgentRejected, InvalidInput, NotFound) as refused:
            if len(burst) == 1:
                return [Refusal(burst[0][0], refused)]
        answers: list[Any] = []
        with transaction.atomic():
            for kind, message in burst:
                try:
                    with transaction.atomic():
                        answers.append(self._apply_one(token, message))
                except (errors.AgentRejected, InvalidInput, NotFound) as refused:
                    answers.append(Refusal(kind, refused))
        return answers

    def _apply_one(self, token: AgentToken, message: Any) -> messages.Ack | None:
        if isinstance(message, messages.Accepted):
            dispatch.lease_accepted(
                tenant=self.tenant, pool=token.pool, agent_id=self.agent_id or "", accepted=message
            )
            return None
        if isinstance(message, messages.Rejected):
            return dispatch.lease_rejected(tenant=self.tenant, pool=token.pool, rejected=message)
        return dispatch.report(
            tenant=self.tenant, pool=token.pool, agent_id=self.agent_id or "", message=message
        )

    async def _hello(self, token: AgentToken, hello: messages.Hello) -> None:
        client = self.scope.get("client") or ("", 0)
        try:
            await database_sync_to_async(self._in_schema)(
                credentials.agent_bind,
                tenant=self.tenant,
                token=token,
                agent_id=hello.agent_id,
                instance=hello.instance,
                address=str(client[0] or ""),
            )
        except errors.AgentRejected as refused:  # a copy of another agent's token: nothing more
            await self._close_with(CLOSE_BOUND, str(refused))
            return
        self.agent_id = hello.agent_id
        welcome = await database_sync_to_async(self._in_schema)(
            session.agent_hello, tenant=self.tenant, token=token, hello=hello
        )
        await self.send_json(welcome.as_json())
        await self._dispatch()

    def _heartbeat(
        self, *, token: AgentToken, heartbeat: messages.Heartbeat
    ) -> tuple[list[messages.Stop], list[dict[str, Any]]]:
        """In the database thread: record the heartbeat (its own transaction), then hand out placed work."""
        stops = session.agent_heartbeat(
            tenant=self.tenant, token=token, agent_id=self.agent_id or "", heartbeat=heartbeat
        )
        return stops, self._assignments(token)

    def _assignments(self, token: AgentToken) -> list[dict[str, Any]]:
        return dispatch.dispatch(
            pool=token.pool,
            schema_name=self.schema_name or "",
            agent_id=self.agent_id or "",
            instance=token.instance_of_id is not None,
        )

    async def _dispatch(self) -> None:
        token = self.token
        assert token is not None
        assigned = await database_sync_to_async(self._in_schema)(self._assignments, token=token)
        for message in assigned:
            await self.send_json(message)

    async def _dispatch_once_here(self, notice: str) -> None:
        """A dispatch notice reaches every agent of the pool, but the pool's placed tasks go to whichever
        asks first: in this process, the first of its agents to get a notice asks, and asks once more
        after if another notice came meanwhile; the others ask nothing. A cloud instance's agent is asked
        for its own handed runs only, so it always asks. Every agent still asks after each heartbeat."""
        token = self.token
        assert token is not None
        assert self.schema_name is not None
        if token.instance_of_id is not None:
            await self._dispatch()
            return
        if notice:
            if notice in _taken_up:
                return  # another agent of this process took this notice up
            _taken_up[notice] = None
            while len(_taken_up) > TAKEN_UP_KEPT:
                _taken_up.popitem(last=False)
        group = wake.pool_group(self.schema_name, token.pool_id)
        if group in _asking:
            _asking[group] = True  # the agent asking now asks again after
            return
        _asking[group] = False
        try:
            while True:
                await self._dispatch()
                if not _asking[group]:
                    return
                _asking[group] = False
        finally:
            del _asking[group]

    async def _on_notice(self, notice: str) -> None:
        try:
            await self._dispatch_once_here(notice)
        except DatabaseError:
            self.failed = True
            await self._close_with(CLOSE_UNAVAILABLE, "The control plane's database is unavailable.")

    async def plane_message(self, event: dict[str, Any]) -> None:
        """A message for this pool's agents from elsewhere in the plane (dispatch, abort, preempt)."""
        message = event["message"]
        if message.get("type") == "revoked":
            if self.token is not None and message.get("token_id") == str(self.token.pk):
                await self._close_with(CLOSE_TOKEN, "This agent token was revoked.")
            return
        if message.get("type") == "dispatch":
            if self.agent_id is not None:  # asked beside the socket's messages, not in their way
                asking = asyncio.ensure_future(self._on_notice(str(event.get("notice") or "")))
                self.asking.add(asking)
                asking.add_done_callback(self.asking.discard)
            return
        await self.send_json(message)
