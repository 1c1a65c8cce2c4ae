"""`klique-agent`: connects out to the control plane, pulls the work of its pool and runs it.

    klique-agent --url http://demo.localhost:8000 --token-file /etc/klique/agent.token --gpus 4
    KLIQUE_AGENT_TOKEN=kqa_... klique-agent --url https://acme.klique.example --backend slurm \
        --config agent.toml

The agent token comes from a file only its owner may read (--token-file) or from the environment
(KLIQUE_AGENT_TOKEN); --token still works but puts the token where anyone on the host can read it (ps,
/proc), and the agent says so. Its holder receives the secrets of every task of the pool. The first hello
binds the token to this agent: its id and a random instance key the agent keeps in its work folder, so a
copy of the token used from elsewhere is refused and shown to the pool's admins.

The agent only ever opens an outbound websocket. It reconnects with exponential backoff and jitter,
reset only by the plane's welcome. Every report (status, log, metric, result) names its run's lease and a
sequence number within that run, and stays in the outbox until the plane answers it with a verdict
(applied, duplicate, stale): a reconnect replays what was not answered, the plane counts nothing twice,
and a report of a run the plane gave to another attempt is dropped. Outputs are streamed up with their
checksum and retried with backoff while the plane cannot take them. SIGTERM stops the running tasks (with
their grace period) and the agent cleanly.

What the agent records (a run started, a report numbered, an answer received) is committed to its state
before anything that depends on it is sent: the changes one turn of its event loop makes are one
transaction, committed once, and then what that turn has to send goes out, in order (`Agent._flush`).
If the state cannot be written (a full disk), nothing of it is sent and the commit is tried again; if
SQLite gave the changes up, the agent exits (STATE_LOST_EXIT) and its restart takes the runs back from
what the state holds, as after a crash.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import re
import secrets
import signal
import socket
import sqlite3
import sys
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
import websockets

from agents import __version__
from agents.backend import Backend, Refused, free_port
from agents.baremetal import BareMetal, detect_gpus
from agents.hpc import DIALECTS, Batch, Settings
from agents.state import Position, State, StateLost
from agents.tunnel import AppTunnel
from klique.sdk import loopback
from protocol import apps as protocol_apps
from protocol import clusters, messages, sessions
from protocol import outputs as protocol_outputs

logger = logging.getLogger("klique.agent")


def websocket_address(url: str) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The agents' websocket URL for a tenant address, the Host header, and where to connect.

    Names under .localhost mean this machine (RFC 6761): connect to 127.0.0.1 and name the tenant in Host.
    """
    parts = urlsplit(url.rstrip("/"))
    scheme = "wss" if parts.scheme == "https" else "ws"
    address = urlunsplit((scheme, parts.netloc, "/agents/ws/", "", ""))
    host = parts.hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return address, {}, {"host": "127.0.0.1", "port": parts.port or (443 if scheme == "wss" else 80)}
    return address, {}, {}


CAPACITY_SECONDS = 30.0  # how often the environment is asked for its CPUs and nodes
UPLOAD_PATIENCE_SECONDS = 600.0  # how long an output upload is retried while the plane cannot take it
# Answers that mean "not now": the plane down or restarting, its store full or not writable, a checksum
# that did not match what arrived.
RETRIED_STATUSES = frozenset({408, 422, 425, 429, 500, 502, 503, 504, 507})


class UploadFailed(Exception):
    """An output could not be stored; the message says why (the plane's own words where it gave some)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


async def _chunks(path: Path) -> AsyncIterator[bytes]:
    """The file in pieces, so that it is never held in memory whole."""
    with open(path, "rb") as handle:
        while chunk := handle.read(1024 * 1024):
            yield chunk


def _detail(response: httpx.Response) -> str:
    """What the plane said, in a sentence: its JSON detail, or the start of whatever else it sent (a proxy's
    HTML error page), never a parse error of it."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, str) and detail:
        return detail
    text = " ".join(response.text.split())[:200]
    return text or response.reason_phrase


def _refusal(answer: httpx.Response) -> str | None:
    """None for an answer that took the call; what the plane said, to retry on, for one meaning "not
    now"; UploadFailed for one that will never work."""
    if answer.status_code < 400:
        return None
    problem = f"the plane answered {answer.status_code}: {_detail(answer)}"
    if answer.status_code not in RETRIED_STATUSES:
        raise UploadFailed(problem)
    return problem


async def _put_in_bucket(ticket: protocol_outputs.Ticket, path: Path, size: int) -> str | None:
    """PUT the file to the bucket's presigned URL with the headers it was signed with; None when stored,
    else what the bucket said (every refusal is retried from a new ticket: an expired URL, a bucket away).
    Redirects are not followed, nor proxies from the environment bypassed: only the URL signed."""
    try:
        async with httpx.AsyncClient(timeout=300, follow_redirects=False) as bucket:
            answer = await bucket.put(
                ticket.url, content=_chunks(path), headers={**ticket.headers, "Content-Length": str(size)}
            )
    except httpx.TransportError as error:
        return f"the bucket cannot be reached ({type(error).__name__}: {error})"
    if answer.status_code < 300:
        return None
    code, message = (re.search(f"<{tag}>([^<]*)</{tag}>", answer.text) for tag in ("Code", "Message"))
    said = " ".join(match[1] for match in (code, message) if match) or answer.reason_phrase
    return f"the bucket answered {answer.status_code}: {said[:300]}"


class Backoff:
    """Exponential backoff with full jitter, capped."""

    def __init__(self, base: float = 0.5, cap: float = 30.0) -> None:
        self.base, self.cap, self.failures = base, cap, 0

    def next(self) -> float:
        self.failures += 1
        return random.uniform(0, min(self.cap, self.base * 2**self.failures))  # noqa: S311 -- jitter, not secrecy

    def reset(self) -> None:
        self.failures = 0


class Agent:
    def __init__(self, *, url: str, token: str, backend: Backend, agent_id: str, instance: str = "") -> None:
        self.url, self.token, self.backend, self.agent_id = url, token, backend, agent_id
        self.instance = instance  # this agent's instance key, which its token is bound to
        self.state = backend.state  # the outbox and sequence numbers live beside the runs, in SQLite
        self.socket: Any = None
        self.stopping = asyncio.Event()
        self.heartbeat_seconds = 10.0
        self.capacity: dict[str, Any] = {}  # as last asked of the environment; hello and heartbeats send it
        self.upload_patience = UPLOAD_PATIENCE_SECONDS
        self.tunnels: dict[str, asyncio.Task[None]] = {}  # task id -> the tunnel of the app it runs
        self._outgoing: list[tuple[Any, str]] = []  # (socket, message) to send once the state is committed
        self._flushing: asyncio.Task[None] | None = None
        self.on_state_lost: Callable[[StateLost], None] = _state_lost

    async def _follow_capacity(self) -> None:
        """Ask the environment for its CPUs and nodes every CAPACITY_SECONDS, beside the connection: on a
        cluster that is a command, which must not hold up a hello or a heartbeat."""
        while not self.stopping.is_set():
            try:
                self.capacity = await self.backend.capacity()
            except Exception:  # a surprise here must not stop the agent; the figures stay as they were
                logger.exception("reading the environment's capacity failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), timeout=CAPACITY_SECONDS)

    async def run(self) -> None:
        capacity = asyncio.create_task(self._follow_capacity())
        self.state.group_commits(self._flush_soon)
        try:
            await self._connect_forever()
        finally:
            capacity.cancel()
            self.state.group_commits(None)
            with contextlib.suppress(sqlite3.Error):
                self.state.commit()  # what the last turn recorded (an answer to a report)

    def _flush_soon(self) -> None:
        """Commit the state and send what waits, once the loop has run what is ready now (which may
        change the state and send more: it all goes in the same commit)."""
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        backoff = Backoff(base=0.1, cap=5.0)
        try:
            while True:
                try:
                    self.state.commit()
                except StateLost as lost:
                    self._outgoing.clear()
                    self.on_state_lost(lost)
                    return
                except sqlite3.Error as error:  # still open: nothing lost, nothing sent; try again
                    delay = backoff.next()
                    logger.warning(
                        "the agent's state cannot be written (%s); trying again in %.1f s", error, delay
                    )
                    await asyncio.sleep(delay)
                    continue
                backoff.reset()
                batch, self._outgoing = self._outgoing, []
                for socket_, text in batch:
                    if socket_ is self.socket:  # not one queued for a connection since closed
                        with contextlib.suppress(websockets.WebSocketException):
                            await socket_.send(text)
                if not self._outgoing and not self.state.uncommitted:
                    return
        finally:
            self._flushing = None

    def _post(self, message: dict[str, Any], socket_: Any = None) -> None:
        """Send the message on the connection once what the state holds now is committed."""
        socket_ = socket_ or self.socket
        if socket_ is not None and socket_ is self.socket:
            self._outgoing.append((socket_, json.dumps(message)))
            self._flush_soon()

    async def _connect_forever(self) -> None:
        address, headers, connect_to = websocket_address(self.url)
        backoff = Backoff()
        while not self.stopping.is_set():
            try:
                async with websockets.connect(
                    address,
                    additional_headers={"Authorization": f"Bearer {self.token}", **headers},
                    open_timeout=10,
                    **connect_to,
                ) as socket_:
                    await self._session(socket_, backoff)
            except (OSError, websockets.WebSocketException, TimeoutError) as error:
                logger.warning("connection to %s lost (%s)", address, error)
            finally:
                self.socket = None
            if not self.stopping.is_set():
                delay = (
                    backoff.next()
                )  # reset only by a welcome: a plane that accepts and fails still backs off
                logger.info("reconnecting in %.1f s", delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), timeout=delay)

    async def _session(self, socket_: Any, backoff: Backoff | None = None) -> None:
        # From here to the replay queued, nothing else runs: every report is in the replay or after it.
        self.socket = socket_
        hello = messages.Hello(
            agent_id=self.agent_id,
            backend=self.backend.name,
            version=__version__,
            instance=self.instance,
            inventory=self.backend.inventory(),
            capacity=self.capacity,
            held=self.held(),
            problem=self.backend.problem,
        )
        self._post(hello.as_json())
        for pending in self.state.pending():  # replay what the plane has not answered
            self._post(pending)
        welcomed = asyncio.Event()
        heartbeat = asyncio.create_task(self._heartbeats(socket_, welcomed))
        stop = asyncio.create_task(self.stopping.wait())
        try:
            async for raw in socket_:
                try:
                    message = messages.parse_from_plane(json.loads(raw))
                except (ValueError, messages.ProtocolError) as error:
                    logger.warning("the plane sent a message this agent cannot read: %s", error)
                    continue
                await self._on_message(message)
                if isinstance(message, messages.Welcome):
                    welcomed.set()
                    if backoff is not None:
                        backoff.reset()
                if stop.done():
                    break
        finally:
            heartbeat.cancel()
            stop.cancel()

    def held(self) -> tuple[messages.Held, ...]:
        """The runs this agent still has something of: those running, and those whose reports (a result
        above all) the plane has not answered. A run that ended while the agent was cut off is still the
        agent's until its result is in; otherwise the plane would take it for lost and run it again."""
        running = {task: self.state.lease(task) for task in self.backend.running()}
        ended = {(task, lease) for task, lease in self.state.pending_runs() if running.get(task) != lease}
        runs = [messages.Held(task, lease) for task, lease in running.items()]
        runs += [messages.Held(task, lease, ended=True) for task, lease in ended]
        return tuple(sorted(runs, key=lambda run: (run.task_id, run.lease_id)))

    def holding(self) -> list[str]:
        return sorted({run.task_id for run in self.held()})

    async def _heartbeats(self, socket_: Any, welcomed: asyncio.Event) -> None:
        await welcomed.wait()  # the welcome says how often: a pool with a short timeout needs them often
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            heartbeat = messages.Heartbeat(
                held=self.held(),
                queue=self.backend.queue(),
                capacity=self.capacity,
                problem=self.backend.problem,
            )
            self._post(heartbeat.as_json(), socket_)

    async def _on_message(
        self, message: messages.Welcome | messages.Assign | messages.Ack | messages.Stop | messages.Error
    ) -> None:
        if isinstance(message, messages.Welcome):
            self.heartbeat_seconds = message.heartbeat_seconds or 10.0
            for kept in message.keep:  # a run started before this agent knew leases learns its own
                if not self.state.lease(kept.task_id) and kept.lease_id:
                    self.state.lease_begin(kept.task_id, kept.lease_id, 1)
            for stop in message.stop:
                await self._stop(stop)
        elif isinstance(message, messages.Assign):
            await self._assign(message)
        elif isinstance(message, messages.Ack):
            self.state.acknowledge(message.task_id, message.lease_id, message.seq)
            if message.verdict == messages.STALE:
                logger.info("report %s of task %s dropped: %s", message.seq, message.task_id, message.detail)
        elif isinstance(message, messages.Stop):
            await self._stop(message)
        else:
            logger.warning("the plane refused a message: %s", message.detail)

    async def _stop(self, stop: messages.Stop) -> None:
        """Stop the run the message names; a stop of another run of the task (an earlier lease) is moot."""
        if self.state.lease(stop.task_id) in (stop.lease_id, ""):
            await self.backend.stop(stop.task_id, stop.grace_seconds if stop.kind == "preempt" else 0.0)

    async def _assign(self, assignment: messages.Assign) -> None:
        task_id, lease = assignment.task_id, assignment.lease_id
        holding = self.state.lease(task_id)
        if holding and holding != lease and any(run.task_id == task_id for run in self.held()):
            reason = (
                f"this agent still holds an earlier run of the task (lease {holding}); offer it again later"
            )
            await self._send(messages.Rejected(task_id, lease, reason).as_json())
            return
        self.state.lease_begin(task_id, lease, assignment.attempt)
        try:
            handed = self._with_plane(self._with_gateway(self._with_app_port(assignment.as_json())))
            await self.backend.start(handed, self.report)
        except Refused as refused:
            self.state.lease_end(task_id)
            await self._send(messages.Rejected(task_id, lease, str(refused), refused.permanent).as_json())
            return
        await self._send(messages.Accepted(task_id, lease).as_json())
        if "app" in (handed.get("spec") or {}):
            self.open_tunnel(task_id, handed["spec"])

    def _plane(self) -> str:
        """The plane's address as this agent reaches it, over HTTP."""
        parts = urlsplit(self.url.rstrip("/"))
        scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
        return urlunsplit((scheme, parts.netloc, parts.path, "", ""))

    def _with_gateway(self, assignment: dict[str, Any]) -> dict[str, Any]:
        """A run with a gateway session (protocol.sessions) is told where the gateway is: the plane's
        address as this agent reaches it."""
        secrets = assignment.get("secrets") or {}
        if sessions.KEY_VARIABLE not in secrets or "gateway_session" not in (assignment.get("spec") or {}):
            return assignment
        return {**assignment, "secrets": {**secrets, sessions.BASE_VARIABLE: self._plane() + "/v1"}}

    def _with_plane(self, assignment: dict[str, Any]) -> dict[str, Any]:
        """A Slurm cluster's controller asks the plane for its workers (protocol.clusters): it is told
        where the plane is. A Slurm worker runs only where the agent makes Kubernetes pods."""
        spec = assignment.get("spec") or {}
        if clusters.WORKER_SECTION in spec and not getattr(self.backend, "makes_clusters", False):
            raise Refused(
                f"A Slurm cluster's worker runs on a Kubernetes pool; a {self.backend.name} pool cannot run "
                "one. Give the cluster a worker compute resource whose pools are Kubernetes pools.",
                permanent=True,
            )
        if ((spec.get("app") or {}).get("cluster") or {}).get("service") != "slurm":
            return assignment
        return {**assignment, "plane_url": self._plane()}

    def _with_app_port(self, assignment: dict[str, Any]) -> dict[str, Any]:
        """An app's assignment with the port it is to serve on (a free one of this host, unless its
        template fixed one); Refused where the backend cannot serve apps, or the app section is wrong."""
        spec = assignment.get("spec") or {}
        if "app" not in spec:
            return assignment
        if not hasattr(self.backend, "app_upstream"):
            raise Refused(
                f"Apps run on bare-metal, HPC and Kubernetes pools; a {self.backend.name} pool does not "
                "serve them. Launch it on a compute resource whose pools are one of those.",
                permanent=True,
            )
        try:
            app = protocol_apps.AppSpec.parse(spec["app"])
        except protocol_apps.TemplateInvalid as error:
            raise Refused(f"The app cannot be run: {error}", permanent=True) from None
        if app.cluster is not None and not getattr(self.backend, "makes_clusters", False):
            raise Refused(
                f"A {app.cluster.service} cluster is made on a Kubernetes pool's nodes; a "
                f"{self.backend.name} pool cannot make one. Launch it on a compute resource whose pools are "
                "Kubernetes pools.",
                permanent=True,
            )
        if app.port is None and not self.backend.app_ports_here:  # type: ignore[attr-defined]
            return assignment  # the node that runs it picks its port (agents.node)
        return {**assignment, "spec": protocol_apps.with_port(spec, app.port or free_port())}

    def open_tunnel(self, task_id: str, spec: dict[str, Any]) -> None:
        """Serve the app the run runs through its tunnel, until the run ends."""
        try:
            app = protocol_apps.AppSpec.parse(spec.get("app"))
        except protocol_apps.TemplateInvalid as error:
            logger.warning("task %s: its app cannot be served: %s", task_id, error)
            return
        locate = getattr(self.backend, "app_upstream", None)
        if locate is None or task_id in self.tunnels:
            return

        async def fail(reason: str) -> None:
            await self.backend.fail(task_id, reason)  # type: ignore[attr-defined]

        async def say(line: str) -> None:
            await self.report(task_id, "log", {"stream": "klique", "lines": [line]})

        tunnel = AppTunnel(
            url=self.url,
            credentials={"Authorization": f"Bearer {self.token}", "X-Klique-Instance": self.instance},
            task_id=task_id,
            lease_id=self.state.lease(task_id),
            app=app,
            locate=lambda: locate(task_id, app),
            fail=fail,
            say=say,
        )
        running = asyncio.create_task(tunnel.run())
        self.tunnels[task_id] = running
        running.add_done_callback(lambda done: self._tunnel_ended(task_id, done))

    def _tunnel_ended(self, task_id: str, done: asyncio.Task[None]) -> None:
        """Forget a tunnel that ended, unless a newer run of the task has its own by now."""
        if self.tunnels.get(task_id) is done:
            del self.tunnels[task_id]

    def reopen_tunnels(self, task_ids: list[str]) -> None:
        """After a restart: the apps of the runs this agent took back are served again."""
        spec_of: Any = getattr(self.backend, "spec_of", None)
        for task_id in task_ids if spec_of is not None else []:
            spec = spec_of(task_id)
            if "app" in spec:
                self.open_tunnel(task_id, spec)

    async def report(
        self, task_id: str, kind: str, body: dict[str, Any], offset: Position | None = None
    ) -> None:
        """Keep the report in the outbox (with the log offset it reaches) and send it if connected."""
        if kind == "result" and (tunnel := self.tunnels.pop(task_id, None)) is not None:
            tunnel.cancel()  # the app's run ended: so does its route
        await self._send(self.state.enqueue(task_id, kind, body, offset=offset))

    async def _send(self, message: dict[str, Any]) -> None:
        self._post(message)

    async def upload(self, task_id: str, name: str, path: Path) -> None:
        """Store an output file where the task's project keeps them (the plane's file store or its bucket,
        as a ticket says: protocol/outputs.py), streamed from disk with its SHA-256, under the run's lease;
        retried from a new ticket with backoff while it cannot be stored now (the plane or the bucket down,
        restarting, full or not writable, a URL expired) for up to upload_patience seconds. Raises
        UploadFailed saying why."""
        claim = protocol_outputs.Claim(
            sha256=await asyncio.to_thread(_sha256, path), size=path.stat().st_size
        )
        base, headers = loopback(self.url)
        auth = {"Authorization": f"Bearer {self.token}", "X-Klique-Lease": self.state.lease(task_id)}
        backoff = Backoff(base=0.5, cap=15.0)
        deadline = asyncio.get_running_loop().time() + self.upload_patience
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=300) as plane:
            while True:
                try:
                    problem = await self._store(
                        plane, auth, task=task_id, quoted=quote(name), claim=claim, path=path
                    )
                except httpx.TransportError as error:
                    problem = f"the plane cannot be reached ({type(error).__name__}: {error})"
                if problem is None:
                    return
                if asyncio.get_running_loop().time() > deadline or self.stopping.is_set():
                    raise UploadFailed(f"{problem}; gave up after {self.upload_patience:.0f} s of retries")
                logger.warning("output %s of task %s not stored yet (%s); retrying", name, task_id, problem)
                await asyncio.sleep(backoff.next())

    async def _store(
        self,
        plane: httpx.AsyncClient,
        auth: dict[str, str],
        *,
        task: str,
        quoted: str,
        claim: protocol_outputs.Claim,
        path: Path,
    ) -> str | None:
        """One try: None when stored, else what to retry on; UploadFailed for what will never work."""
        claimed = claim.to_json()
        answer = await plane.post(protocol_outputs.tickets_path(task, quoted), json=claimed, headers=auth)
        if answer.status_code == 404:  # a plane older than tickets: it has the file store only
            ticket = protocol_outputs.Ticket(store=protocol_outputs.PLANE)
        elif problem := _refusal(answer):
            return problem
        else:
            try:
                ticket = protocol_outputs.Ticket.from_json(answer.json())
            except (ValueError, messages.ProtocolError) as error:
                raise UploadFailed(f"the plane's ticket cannot be read: {error}") from None
        if ticket.store == protocol_outputs.PLANE:
            answer = await plane.put(
                protocol_outputs.plane_path(task, quoted),
                content=_chunks(path),
                headers={**auth, "X-Klique-Sha256": claim.sha256, "Content-Length": str(claim.size)},
            )
            return _refusal(answer)
        problem = await _put_in_bucket(ticket, path, claim.size)
        if problem:
            return problem
        answer = await plane.post(protocol_outputs.receipts_path(task, quoted), json=claimed, headers=auth)
        return _refusal(answer)

    async def shutdown(self, grace_seconds: float) -> None:
        await self.backend.stop_all(grace_seconds)
        await asyncio.sleep(0.2)  # let the last results go out while the socket is open
        self.stopping.set()
        if self.socket is not None:
            await self.socket.close()


class Checked(str):
    """What --check found: the configuration is usable (the agent exits 0 after saying so)."""


def _backend(args: argparse.Namespace) -> Backend | str:  # noqa: PLR0911 -- one return per backend
    """The backend the arguments ask for, or a sentence saying what is missing."""
    work_dir = args.work_dir.resolve()
    state = State(work_dir / "agent.sqlite", shared=args.shared_state)
    if args.backend == "kubernetes":
        return _kubernetes(args, state)
    if args.shared_state:
        return "klique-agent: --shared-state is for the Kubernetes backend with leader election only."
    if args.backend == "cloud":
        return _cloud(args, state)
    if args.backend in DIALECTS:
        try:
            config = tomllib.loads(args.config.read_text()) if args.config else {}
            settings = Settings.read(config, args.backend, work_dir)
        except (OSError, tomllib.TOMLDecodeError, ValueError, TypeError) as error:
            return f"klique-agent: the configuration {args.config} cannot be used: {error}"
        return Batch(DIALECTS[args.backend](), settings, state, args.url)
    detected = detect_gpus()
    if detected is None and args.gpus is None:
        return "klique-agent: NVML finds no GPU here; pass --gpus N to offer a configured inventory."
    gpus, mig = detected if detected is not None else (args.gpus, [])
    source = "nvml" if detected is not None else "configured"
    return BareMetal(
        gpus,
        work_dir,
        state,
        source,
        shared_path=args.shared_path,
        image_archives=str(Path(args.image_archives).resolve()) if args.image_archives else "",
        mig=mig,
    )


def _check_shared_state(args: argparse.Namespace, leader_election: bool) -> None:
    if args.shared_state and not leader_election:
        raise ValueError(
            "--shared-state needs leader_election = true in [agent.kubernetes], so that one agent at a time "
            "opens the state"
        )


def _kubernetes(args: argparse.Namespace, state: State) -> Backend | str:
    """The Kubernetes backend, its pod templates checked; or a sentence saying what is wrong."""
    try:
        from agents.kubernetes import Api, Kubernetes, KubeSettings  # noqa: PLC0415 -- the kubernetes extra
    except ImportError as missing:
        return f"klique-agent: the Kubernetes backend needs the kubernetes extra ({missing})."
    try:
        config = tomllib.loads(args.config.read_text()) if args.config else {}
        settings = KubeSettings.read(config, args.agent_id)
        _check_shared_state(args, settings.leader_election)
    except (OSError, tomllib.TOMLDecodeError, ValueError, TypeError) as error:
        return f"klique-agent: the configuration {args.config} cannot be used: {error}"
    if args.check:
        return Checked(f"klique-agent: {len(settings.templates)} pod template(s) render and pass the schema")
    try:
        api = Api(settings)
    except Exception as error:  # the kubeconfig or in-cluster credentials, unreadable
        return f"klique-agent: the Kubernetes credentials cannot be loaded: {error}"
    backend = Kubernetes(settings, state, api)
    if settings.leader_election:
        identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}-{os.getpid()}"
        try:
            backend.leadership = settings.leadership(api, identity)
        except ValueError as error:
            return f"klique-agent: the configuration {args.config} cannot be used: {error}"
    return backend


def _cloud(args: argparse.Namespace, state: State) -> Backend | str:
    """The autoscaler, its settings checked and its provider asked what it can; or what is wrong."""
    from agents.cloud.autoscaler import Autoscaler  # noqa: PLC0415 -- the cloud extra
    from agents.cloud.ec2 import Ec2  # noqa: PLC0415
    from agents.cloud.providers import ProviderError  # noqa: PLC0415
    from agents.cloud.settings import CloudSettings  # noqa: PLC0415

    try:
        config = tomllib.loads(args.config.read_text()) if args.config else {}
        settings = CloudSettings.read(config)
    except (OSError, tomllib.TOMLDecodeError, ValueError, TypeError) as error:
        return f"klique-agent: the configuration {args.config} cannot be used: {error}"
    try:
        provider = Ec2(settings.region, settings.endpoint_url)
    except ImportError as missing:
        return f"klique-agent: the cloud backend needs the cloud extra ({missing})."
    refusal: ProviderError | None = None
    gpus = settings.gpus_per_instance
    try:
        provider.check(settings.instance_type, settings.image, settings.subnet)
        gpus = gpus or provider.gpus_of(settings.instance_type)
    except ProviderError as refused:
        if args.check or gpus is None:  # without its GPU count the pool's tasks cannot be sized
            return f"klique-agent: {refused}"
        refusal = refused  # the agent runs, says so as its pool's problem, and checks again
    if not gpus:
        return (
            f"klique-agent: {settings.provider} does not say how many GPUs a {settings.instance_type} has; "
            "set [agent.cloud] gpus_per_instance."
        )
    if args.check:
        return Checked(
            f"klique-agent: up to {settings.max_instances} {settings.instance_type} instances of {gpus} "
            f"GPU(s) in {settings.region}"
        )
    work_dir = args.work_dir.resolve()
    autoscaler = Autoscaler(settings, state, provider, work_dir, args.agent_id, gpus_per_instance=gpus)
    if refusal is not None:
        autoscaler.refused(refusal, time.time())
    return autoscaler


TOKEN_VARIABLE = "KLIQUE_AGENT_TOKEN"  # noqa: S105 -- the variable's name, not a token


def agent_token(file: Path | None, given: str | None, environment: Mapping[str, str]) -> str:
    """The agent token from a file only its owner reads, the environment, or (warned) the command line;
    or a sentence starting with "klique-agent:" that says what is wrong."""
    if file is not None:
        try:
            status = file.stat()
        except OSError as error:
            return f"klique-agent: the token file {file} cannot be read: {error.strerror}."
        if status.st_mode & 0o077:
            return (
                f"klique-agent: the token file {file} may be read by others "
                f"(mode {status.st_mode & 0o777:o}); run chmod 600 {file}."
            )
        if status.st_uid != os.geteuid():
            return f"klique-agent: the token file {file} belongs to another account; the agent's must own it."
        token = file.read_text().strip()
    elif environment.get(TOKEN_VARIABLE):
        token = environment[TOKEN_VARIABLE].strip()
    elif given:
        logger.warning(
            "the agent token was given with --token: every user of this host can read it (ps, /proc); "
            "give it with --token-file (mode 600) or %s instead",
            TOKEN_VARIABLE,
        )
        token = given.strip()
    else:
        how = f"--token-file FILE (mode 600) or {TOKEN_VARIABLE}"
        return f"klique-agent: give the pool's agent token with {how}."
    if not token:
        return "klique-agent: the agent token is empty."
    return token


def instance_key(work_dir: Path) -> str:
    """This agent's instance key, made once and kept in its work folder (mode 600): the plane binds the
    agent token to it at the first hello, so the token alone, copied elsewhere, is refused."""
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / "instance.key"
    if not path.exists():  # written whole, then linked in: of agents sharing the folder, the first one's
        draft = work_dir / f".instance.key.{os.getpid()}.{secrets.token_hex(4)}"
        descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secrets.token_hex(32))
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(draft, path)
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    return path.read_text().strip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="klique-agent", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the tenant's address, e.g. https://acme.klique.example")
    parser.add_argument(
        "--token-file", type=Path, help="a file holding the pool's agent token, readable by its owner only"
    )
    parser.add_argument(
        "--token", help="the agent token itself: visible to every user of this host (prefer --token-file)"
    )
    parser.add_argument(
        "--backend", choices=["baremetal", *DIALECTS, "kubernetes", "cloud"], default="baremetal"
    )
    parser.add_argument(
        "--config", type=Path, help="a TOML file: [agent.slurm] (or pbs, lsf, kubernetes, cloud) settings"
    )
    parser.add_argument(
        "--check", action="store_true", help="check the configuration (pod templates too) and exit"
    )
    parser.add_argument("--gpus", type=int, help="GPUs to offer when NVML finds none (tests, demos)")
    parser.add_argument(
        "--shared-path",
        default="",
        help="bare-metal: the shared file system's path, mounted at the same path into tasks' containers",
    )
    parser.add_argument(
        "--image-archives",
        default="",
        help="bare-metal: a folder of image archives (docker/podman save): a missing image is loaded from it",
    )
    parser.add_argument("--agent-id", default=socket.gethostname())
    parser.add_argument("--work-dir", type=Path, default=Path(".klique-agent"))
    parser.add_argument(
        "--shared-state",
        action="store_true",
        help="the work folder is on a volume agents of several hosts mount (Kubernetes, leader election):"
        " the state is opened only once this agent leads, with a journal that needs no shared memory",
    )
    parser.add_argument("--grace-seconds", type=float, default=30.0, help="for running tasks at shutdown")
    parser.add_argument(
        "--upload-patience",
        type=float,
        default=UPLOAD_PATIENCE_SECONDS,
        help="seconds an output upload is retried while the plane cannot take it",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(
        logging.WARNING
    )  # not a line per request to an app through its tunnel
    if args.check:
        checked = _backend(args)
        if isinstance(checked, Checked):
            print(checked)
            return 0
        print(checked if isinstance(checked, str) else "klique-agent: the configuration is usable")
        return 2 if isinstance(checked, str) else 0
    token = agent_token(args.token_file, args.token, os.environ)
    if token.startswith("klique-agent:"):
        print(token, file=sys.stderr)
        return 2
    backend = _backend(args)
    if isinstance(backend, str):
        print(backend, file=sys.stderr)
        return 2
    agent = Agent(
        url=args.url,
        token=token,
        backend=backend,
        agent_id=args.agent_id,
        instance=instance_key(args.work_dir),
    )
    agent.upload_patience = args.upload_patience
    backend.upload = agent.upload
    follow = getattr(backend, "follow", None)  # a backend with a loop of its own (the autoscaler)
    if follow is not None:
        from agents.cloud.plane import Plane  # noqa: PLC0415 -- only the cloud backend has one

        backend.plane = Plane(args.url, token)  # type: ignore[attr-defined]

    async def serve() -> None:
        leadership = getattr(backend, "leadership", None)
        renewing: list[asyncio.Task[None]] = []  # held here: the loop keeps only a weak reference
        if leadership is not None:  # a standby waits here, before it says anything to the plane
            await leadership.lead()
            renewing.append(asyncio.create_task(leadership.keep(_stop_acting)))
        adopted = backend.adopt(agent.report)
        if adopted:
            logger.info("took back %d tasks: %s", len(adopted), ", ".join(adopted))
            agent.reopen_tunnels(adopted)
        loop = asyncio.get_running_loop()
        for sign in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sign, lambda: asyncio.ensure_future(agent.shutdown(args.grace_seconds)))
        if follow is not None:
            renewing.append(asyncio.create_task(follow(agent.stopping)))
        await agent.run()
        if leadership is not None:
            await asyncio.to_thread(leadership.release)  # a standby takes over at once

    asyncio.run(serve())
    return 0


LOST_LEASE_EXIT = 75  # EX_TEMPFAIL: the pod restarts and stands by
STATE_LOST_EXIT = 74  # EX_IOERR: the agent's state could not be written; a restart reads it again


def _state_lost(lost: StateLost) -> None:
    """What this process holds in memory is not what its state holds, and nothing of the difference was
    sent: restarting (the service manager or the pod does) takes the runs back from the state."""
    logger.critical("%s; exiting so that a restart takes the runs back from the state as it is", lost)
    logging.shutdown()
    os._exit(STATE_LOST_EXIT)


def _stop_acting() -> None:
    """The Lease is lost: another agent may act for the pool now. Nothing more goes out from this
    process, not even a clean stop's last reports; the Jobs stay for whichever agent holds the Lease."""
    logging.shutdown()
    os._exit(LOST_LEASE_EXIT)


if __name__ == "__main__":
    sys.exit(main())
