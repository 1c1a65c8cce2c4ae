"""The internal route: an ASGI application that serves each app at its own host (app-<slug>.<tenant's host>),
HTTP and websockets, through the tunnel its agent opened (apps.catalogue.tunnel).

Every request is admitted first: the app's host's cookie (from a one-time ticket, apps.catalogue.tickets)
or a bearer token of the tenant names a person, and the app must be shared with them; anyone else gets
404, as for an app that does not exist. Klique's own credentials (the cookie, a Klique bearer token) are
taken out of the request before it goes on: the app never sees them.

A request goes to the tunnel's channel over the channel layer; its answer comes back on a channel of the
request's own, read by one task into a queue (a receive that times out would unsubscribe the channel).
The body is streamed both ways in chunks; credits hold the app's answer back while the client is slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import secrets
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs

from channels.layers import get_channel_layer
from django.conf import settings
from django.contrib.sessions.backends.db import SessionStore
from django.db import DatabaseError
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.accounts.services import TokenRejected, token_authenticate
from apps.catalogue import addresses, selectors, services, tickets
from apps.catalogue.admissions import ADMISSIONS, Admission
from apps.catalogue.models import AppInstance
from apps.core.threads import in_db_thread
from apps.core.tunnels import ACCEPT_SECONDS, ACCEPTED, Stream, dropped
from apps.core.tunnels import reason as _reason
from protocol import tunnel
from tenants.selectors import tenant_for_host

logger = logging.getLogger(__name__)

MAX_BODY = 256 * 1024 * 1024  # the largest request body the route passes on
ANSWER_SECONDS = 300.0  # the longest pause in the app's answer (its first byte, or between chunks)
ENTER_PATH = "/_klique/enter"
RESUME_POLL_SECONDS = 0.5  # how often a websocket whose tunnel dropped looks for the next one
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

Scope = dict[str, Any]


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return ""


def _session_user(session_key: str) -> User | None:
    data = SessionStore(session_key=session_key).load()  # an expired or deleted session loads empty
    user_id = data.get("_auth_user_id")
    return User.objects.filter(pk=user_id, is_active=True).first() if user_id else None


def _cookie(scope: Scope) -> str:
    jar: SimpleCookie = SimpleCookie()
    with contextlib.suppress(Exception):
        jar.load(_header(scope, b"cookie"))
    morsel = jar.get(tickets.COOKIE)
    return morsel.value if morsel is not None else ""


def _admit(scope: Scope) -> Admission:  # noqa: PLR0911 -- one answer per reason to refuse
    """Who asks, for which app, and whether the route serves it to them (in the database thread)."""
    host = _header(scope, b"host")
    parsed = addresses.parse_app_host(host)
    tenant = tenant_for_host(parsed[1].split(":")[0]) if parsed else None
    if parsed is None or tenant is None or tenant.is_suspended or tenant.schema_name == "public":
        return Admission(404, "No app is served at this address.")
    slug, tenant_host = parsed
    with schema_context(tenant.schema_name):
        app = AppInstance.objects.select_related("task", "project").filter(slug=slug).first()
        if app is None:
            return Admission(404, "No app is served at this address.")
        user, set_cookie, location = _who(scope, app, tenant)
        if user is None and location:
            return Admission(
                403, "This sign-in link was used already or has expired.", tenant_host=tenant_host
            )
        if user is None:
            here = f"{_scheme(scope)}://{tenant_host}/apps/{app.pk}/"
            return Admission(401, f"Sign in to reach this app: open {here}", tenant_host=tenant_host)
        if not selectors.can_reach(user, app):
            return Admission(404, "No app is served at this address.")
        if location:
            return Admission(303, location=location, set_cookie=set_cookie)
        state = selectors.app_state(app)
        if not app.tunnel_channel or state.state in (selectors.STOPPED, selectors.STOPPING):
            page = f"{_scheme(scope)}://{tenant_host}/apps/{app.pk}/"
            status = 409 if state.state == selectors.STOPPED else 503
            return Admission(status, f"{app.name} is {state.state}: {state.detail} See {page}")
        services.app_touch(app)
        return Admission(
            0,
            app_id=str(app.pk),
            channel=app.tunnel_channel,
            schema=tenant.schema_name,
            tenant_host=tenant_host,
        )


def _who(scope: Scope, app: AppInstance, tenant: Any) -> tuple[User | None, str, str]:
    """(the person, a cookie to set, where to send them) from a ticket, the app host's cookie, or a token."""
    if scope["type"] == "http" and scope["path"] == ENTER_PATH:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        session_key = tickets.redeem((query.get("ticket") or [""])[0], app_id=str(app.pk))
        user = _session_user(session_key) if session_key else None
        target = (query.get("next") or ["/"])[0]
        if not target.startswith("/") or target.startswith("//") or "\\" in target:
            target = "/"
        cookie = tickets.cookie(session_key=session_key, app_id=str(app.pk)) if session_key else ""
        return user, cookie, target
    scheme, _, presented = _header(scope, b"authorization").partition(" ")
    if scheme.lower() == "bearer" and presented.startswith("klq_"):
        try:
            return token_authenticate(tenant=tenant, presented=presented.strip())[0], "", ""
        except TokenRejected:
            return None, "", ""
    cookie = _cookie(scope)
    session_key = tickets.cookie_session(cookie, app_id=str(app.pk)) if cookie else None
    return (_session_user(session_key) if session_key else None), "", ""


def _passed_headers(scope: Scope) -> list[list[str]]:
    """The request's headers as the app gets them: hop-by-hop ones and Klique's credentials left out, the
    original host and scheme said in X-Forwarded-*."""
    kept: list[tuple[bytes, bytes]] = []
    for name, value in scope["headers"]:
        lower = name.lower()
        if lower in tunnel.HOP_BY_HOP or lower in tunnel.WEBSOCKET_HANDSHAKE:
            continue
        if lower == b"authorization" and value.split(b" ", 1)[-1].strip().startswith(b"klq_"):
            continue
        if lower == b"cookie":
            if cookies := _without_klique_cookie(value):
                kept.append((lower, cookies))
            continue
        kept.append((lower, value))
    kept += [
        (b"x-forwarded-host", _header(scope, b"host").encode("latin-1")),
        (b"x-forwarded-proto", _scheme(scope).encode()),
    ]
    if client := scope.get("client"):
        kept.append((b"x-forwarded-for", str(client[0]).encode()))
    return tunnel.header_list(kept)


def _without_klique_cookie(value: bytes) -> bytes:
    parts = [part.strip() for part in value.split(b";")]
    return b"; ".join(part for part in parts if part and not part.startswith(tickets.COOKIE.encode() + b"="))


def _same_origin(scope: Scope) -> bool:
    """Whether a request that may change something comes from the app's own pages (or from no page: a
    program's call has no Origin). Another site's page cannot act through a visitor's cookie."""
    origin = _header(scope, b"origin")
    if not origin:
        return True
    return origin.lower() == f"{_scheme(scope)}://{_header(scope, b'host')}".lower()


def _scheme(scope: Scope) -> str:
    """http or https, for websockets too (whose scope says ws or wss)."""
    return "https" if scope.get("scheme") in ("https", "wss") else "http"


def _target(scope: Scope) -> str:
    path: bytes = scope.get("raw_path") or scope["path"].encode()
    query: bytes = scope.get("query_string") or b""
    return (path + (b"?" + query if query else b"")).decode("latin-1")


async def _page(send: Any, status: int, detail: str, *, location: str = "", cookie: str = "") -> None:
    headers = [(b"content-type", b"text/html; charset=utf-8"), (b"cache-control", b"no-store")]
    if location:
        headers.append((b"location", location.encode("latin-1", "replace")))
    if cookie:
        secure = "; Secure" if not settings.DEBUG else ""
        value = f"{tickets.COOKIE}={cookie}; Path=/; HttpOnly; SameSite=Lax; Max-Age={tickets.COOKIE_SECONDS}"
        headers.append((b"set-cookie", (value + secure).encode()))
    body = f"<!doctype html><title>Klique</title><p>{html.escape(detail)}</p>\n".encode()
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AppRoute:
    """The ASGI application for app hosts: config.asgi sends it every request whose host is an app's."""

    def __init__(self) -> None:
        self.admissions = ADMISSIONS

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        key = admissions_key(scope)
        admission = self.admissions.get(key)
        cached = admission is not None
        if admission is None:
            admission = await self._admission(scope)
            self.admissions.keep(key, admission)
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, admission)
            return
        if admission.status:
            await _page(send, admission.status, admission.detail, location=admission.location,
                        cookie=admission.set_cookie)  # fmt: skip
            return
        if scope["method"] not in SAFE_METHODS and not _same_origin(scope):
            await _page(send, 403, "A request that changes something must come from the app's own pages.")
            return
        if not await self._http(scope, receive, send, admission, retry=cached):
            await self._http(scope, receive, send, await self._admission(scope), retry=False)

    async def _admission(self, scope: Scope) -> Admission:
        try:
            return await in_db_thread(_admit)(scope)
        except DatabaseError:
            return Admission(503, "Klique's database is unavailable; try again shortly.")

    async def _http(
        self, scope: Scope, receive: Any, send: Any, admission: Admission, *, retry: bool
    ) -> bool:
        """Serve the request through the tunnel; False (nothing sent yet) where the tunnel of an admission
        taken from the cache did not take it, to be admitted afresh."""
        if admission.status:
            await _page(send, admission.status, admission.detail)
            return True
        declared = _header(scope, b"content-length")
        if declared.isdigit() and int(declared) > MAX_BODY:
            await _page(send, 413, f"The request body is larger than the route passes ({MAX_BODY} bytes).")
            return True
        stream = Stream(get_channel_layer(), admission.channel)
        body = bool(declared and declared != "0") or bool(_header(scope, b"transfer-encoding"))
        head = {
            "method": scope["method"],
            "target": _target(scope),
            "headers": _passed_headers(scope),
            "body": body,
        }
        try:
            await stream.open(head)
            kind, _ = await stream.next(ACCEPT_SECONDS)
            if kind != ACCEPTED:
                self.admissions.forget(admission.channel)
                await services_tunnel_stale(admission)
                if retry:
                    return False
                await _page(
                    send, 502, "The app's tunnel does not answer; its agent reconnects it. Try again."
                )
                return True
            upload = asyncio.create_task(_upload(receive, stream))
            try:
                answered = await _answer(send, stream, retry=retry and not body)
            finally:
                upload.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await upload
            if not answered:
                self.admissions.forget(admission.channel)
            return answered
        finally:
            await stream.close()

    async def _websocket(self, scope: Scope, receive: Any, send: Any, admission: Admission) -> None:
        await receive()  # websocket.connect
        if not admission.status and not _same_origin(scope):
            admission = Admission(403, "A websocket to the app must come from the app's own pages.")
        if admission.status:
            await send({"type": "websocket.close", "code": 4000 + min(admission.status, 999)})
            return
        stream = Stream(get_channel_layer(), admission.channel)
        passed = _passed_headers(scope)
        if subprotocols := scope.get("subprotocols") or []:
            passed.append(["sec-websocket-protocol", ", ".join(subprotocols)])
        head = {
            "method": "GET",
            "target": _target(scope),
            "headers": passed,
            "websocket": True,
            "resume": secrets.token_hex(16),  # the agent keeps it under this id if the tunnel drops
        }
        relay = Relay(receive, send, stream, admission, head)
        try:
            await stream.open(head)
            kind, _ = await stream.next(ACCEPT_SECONDS)
            if kind == ACCEPTED:
                kind, payload = await stream.next(ANSWER_SECONDS)
            if kind != tunnel.HEAD:
                await send({"type": "websocket.close", "code": 1011})
                return
            answer = tunnel.Frame(0, kind, payload).document()
            chosen = answer.get("subprotocol")
            await send(
                {"type": "websocket.accept", "subprotocol": chosen if isinstance(chosen, str) else None}
            )
            await relay.run()
        finally:
            await relay.stream.close()


async def services_tunnel_stale(admission: Admission) -> None:
    """A tunnel channel that took nothing: its web process is gone. Forget it, so the page says so."""

    def forget() -> None:
        with schema_context(admission.schema):
            services.tunnel_closed(app_id=admission.app_id, channel=admission.channel)

    with contextlib.suppress(DatabaseError):
        await in_db_thread(forget)()


async def _upload(receive: Any, stream: Stream) -> None:
    """The request body, chunk by chunk, then END; RESET (and the app's answer is not awaited) when it is too
    large or the client went away."""
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            await stream.send(tunnel.RESET, b'{"reason": "the client went away"}')
            return
        body = message.get("body", b"")
        total += len(body)
        if total > MAX_BODY:
            await stream.send(tunnel.RESET, b'{"reason": "the request body is too large"}')
            await stream.frames.put((tunnel.RESET, b"413"))
            return
        for start in range(0, len(body), tunnel.MAX_CHUNK):
            await stream.send(tunnel.DATA, body[start : start + tunnel.MAX_CHUNK])
        if not message.get("more_body"):
            await stream.send(tunnel.END)
            return


async def _answer(send: Any, stream: Stream, *, retry: bool) -> bool:
    """The app's answer to the client; False (nothing sent) where the tunnel dropped before the app
    answered and `retry` allows the request to be admitted afresh (it had no body to send again)."""
    kind, payload = await stream.next(ANSWER_SECONDS)
    if kind == tunnel.RESET and retry and dropped(payload):
        return False
    if kind != tunnel.HEAD:
        if payload == b"413":
            await _page(send, 413, f"The request body is larger than the route passes ({MAX_BODY} bytes).")
        elif kind == tunnel.RESET and payload:
            await _page(send, 502, _reason(payload))
        else:
            await stream.send(tunnel.RESET, b'{"reason": "no answer in time"}')
            await _page(send, 504, f"The app did not answer within {ANSWER_SECONDS:.0f} seconds.")
        return True
    try:
        head = tunnel.Frame(0, kind, payload).document()
        status, headers = int(head.get("status", 502)), tunnel.headers(head.get("headers", []))
    except (tunnel.FrameError, ValueError, TypeError):
        await _page(send, 502, "The app's answer could not be read.")
        return True
    await send({"type": "http.response.start", "status": status, "headers": headers})
    delivered = 0
    while True:
        kind, payload = await stream.next(ANSWER_SECONDS)
        if kind == tunnel.DATA:
            await send({"type": "http.response.body", "body": payload, "more_body": True})
            delivered += 1
            if delivered % (tunnel.WINDOW // 2) == 0:
                await stream.send(tunnel.CREDIT, (tunnel.WINDOW // 2).to_bytes(4, "big"))
        elif kind == tunnel.END:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return True
        else:  # the tunnel dropped or the app broke off: the client must not take a cut body for whole
            logger.info("an answer through the route was cut off: %s", _reason(payload))
            raise ConnectionAbortedError(_reason(payload))


class Relay:
    """A websocket through the route: the client's messages up, the app's down, until either side closes.
    When the tunnel drops, the client's socket stays open: the relay waits for the agent's next tunnel
    and opens the websocket again there, each side sending again what the other missed
    (protocol.tunnel). Where that cannot be done in time, the client's socket closes with 1012 and the
    client reconnects."""

    def __init__(self, receive: Any, send: Any, stream: Stream, admission: Admission, head: dict[str, Any]):
        self.receive, self.send, self.stream = receive, send, stream
        self.admission, self.head = admission, head
        self.outbox = tunnel.Outbox()  # the client's messages the agent has not acknowledged
        self.received = 0  # the app's messages received
        self.attached = True
        self.ended = False  # an END went either way: the agent lets the app's end go by itself
        self.lock = asyncio.Lock()  # the client's messages go up in order, also across a resume

    async def run(self) -> None:
        client = asyncio.create_task(self._upward())
        try:
            while not client.done():
                getter = asyncio.create_task(self.stream.frames.get())
                done, _ = await asyncio.wait({getter, client}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return
                kind, payload = getter.result()
                if kind in (tunnel.DATA, tunnel.TEXT):
                    self.received += 1
                    if kind == tunnel.DATA:
                        await self.send({"type": "websocket.send", "bytes": payload})
                    else:
                        await self.send({"type": "websocket.send", "text": payload.decode(errors="replace")})
                    if self.received % tunnel.ACK_EVERY == 0:
                        await self.stream.send(tunnel.ACK, tunnel.ack_payload(self.received))
                elif kind == tunnel.ACK:
                    with contextlib.suppress(tunnel.FrameError):
                        self.outbox.acknowledged(tunnel.ack_count(tunnel.Frame(0, kind, payload)))
                elif kind == tunnel.END:
                    self.received += 1
                    self.ended = True
                    with contextlib.suppress(Exception):  # the agent lets the app's end go on this word
                        await self.stream.send(tunnel.END)
                    await self._close(_close_code(payload))
                    return
                elif kind != tunnel.RESET or not dropped(payload):  # the agent gave it up
                    await self._close(1011)
                    return
                elif not await self._resume():  # the tunnel dropped, and the next one did not take it
                    await self._close(1012)
                    return
        finally:
            client.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await client
            if self.attached and not self.ended:  # the agent must not keep the app's end open for nobody
                with contextlib.suppress(Exception):
                    await self.stream.send(tunnel.RESET, b'{"reason": "the client went away"}')

    async def _close(self, code: int) -> None:
        await self.send({"type": "websocket.close", "code": code if 1000 <= code < 5000 else 1000})

    async def _upward(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "websocket.disconnect":
                async with self.lock:
                    if self.attached:
                        await self.stream.send(tunnel.END, b'{"code": %d}' % int(message.get("code", 1000)))
                        self.ended = True
                return
            if message.get("bytes") is not None:
                kind, data = tunnel.DATA, message["bytes"][: tunnel.MAX_MESSAGE]
            elif message.get("text") is not None:
                kind, data = tunnel.TEXT, message["text"].encode()[: tunnel.MAX_MESSAGE]
            else:
                continue
            async with self.lock:
                self.outbox.record(kind, data)
                if self.attached:
                    await self.stream.send(kind, data)

    async def _resume(self) -> bool:
        """Open the websocket again on the agent's next tunnel; False where it cannot be, in time."""
        async with self.lock:
            self.attached = False
        old = self.stream
        await old.close()
        if self.outbox.overflowed:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + tunnel.RESUME_SECONDS
        while loop.time() < deadline:
            channel = await _current_tunnel(self.admission)
            if channel is None:  # the app stopped
                return False
            if channel and channel != old.channel:
                resumed = await self._reopen(channel)
                if resumed is not None:
                    return resumed
            await asyncio.sleep(RESUME_POLL_SECONDS)
        return False

    async def _reopen(self, channel: str) -> bool | None:
        """True once resumed on `channel`; False where the agent cannot resume it; None to try again."""
        stream = Stream(get_channel_layer(), channel)
        await stream.open({**self.head, "received": self.received})
        kind, payload = await stream.next(ACCEPT_SECONDS)
        if kind == ACCEPTED:
            kind, payload = await stream.next(ACCEPT_SECONDS)
        theirs = None
        if kind == tunnel.HEAD:
            with contextlib.suppress(tunnel.FrameError):
                theirs = tunnel.Frame(0, kind, payload).document().get("received")
        counted = isinstance(theirs, int) and not isinstance(theirs, bool)
        async with self.lock:  # nothing the client sends slips between what is sent again and after
            missed = self.outbox.after(theirs) if counted else None  # type: ignore[arg-type]
            if missed is not None:
                self.stream, self.attached = stream, True
                for missed_kind, missed_payload in missed:
                    await stream.send(missed_kind, missed_payload)
        if missed is None:
            await stream.close()
            return False if kind in (tunnel.HEAD, tunnel.RESET) and payload else None
        logger.info("a websocket of app %s moved to its agent's new tunnel", self.admission.app_id)
        return True


def _close_code(payload: bytes) -> int:
    with contextlib.suppress(tunnel.FrameError, ValueError, TypeError):
        return int(tunnel.Frame(0, tunnel.END, payload).document().get("code", 1000))
    return 1000


async def _current_tunnel(admission: Admission) -> str | None:
    """The app's tunnel now ("" while its agent reconnects it); None once the app is stopping or stopped."""

    def read() -> str | None:
        with schema_context(admission.schema):
            app = AppInstance.objects.select_related("task").filter(pk=admission.app_id).first()
            if app is None or selectors.app_state(app).state in (selectors.STOPPED, selectors.STOPPING):
                return None
            return app.tunnel_channel

    try:
        return await in_db_thread(read)()
    except DatabaseError:
        return ""


def admissions_key(scope: Scope) -> tuple[str, str, str] | None:
    """What an admission is kept under: the host and the credential (a token, or the app host's cookie)."""
    if scope["type"] != "http" or scope["path"] == ENTER_PATH:
        return None
    credential = _header(scope, b"authorization") or _cookie(scope)
    return (_header(scope, b"host"), credential, _scheme(scope)) if credential else None


def is_app_host(scope: Scope) -> bool:
    host = _header(scope, b"host")
    return host[:4].lower() == addresses.PREFIX and addresses.parse_app_host(host) is not None
