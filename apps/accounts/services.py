"""Writes to accounts: users, service accounts, groups, projects and API tokens.

Every function runs in the schema of the tenant it is given; callers pass the tenant explicitly.
"""

from __future__ import annotations

import functools
import hmac
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import QuerySet
from django.utils import timezone

from apps.accounts.models import ApiToken, Group, Project, ProjectMembership, Role, SignInFailure, User
from apps.accounts.tokens import hash_token, new_token, parse_prefix
from apps.audit.services import record
from apps.core import rows
from apps.core.errors import Conflict, InvalidInput
from apps.core.events import publish_event
from tenants.token_routes import token_route_forget, token_route_register, token_route_tenant

if TYPE_CHECKING:
    from tenants.models import Tenant

# last_used_at is a convenience for people auditing their tokens; writing it on every request would put
# a row update on the hot path, so it is refreshed at most this often.
LAST_USED_RESOLUTION = timedelta(minutes=1)


class TokenRejected(Exception):
    """A presented token cannot be used; the message tells its holder why and what to do."""


@dataclass(frozen=True)
class IssuedToken:
    token: ApiToken
    secret: str  # the whole token; it exists only in this object and in the response that shows it once


def _token_expiry(expires_in_days: int | None) -> datetime:
    days = settings.KLIQUE_TOKEN_DEFAULT_DAYS if expires_in_days is None else expires_in_days
    if not 1 <= days <= settings.KLIQUE_TOKEN_MAX_DAYS:
        raise InvalidInput(
            f"A token lives between 1 and {settings.KLIQUE_TOKEN_MAX_DAYS} days; {days} was asked for.",
            field="expires_in_days",
        )
    return timezone.now() + timedelta(days=days)


@transaction.atomic
def token_create(
    *,
    tenant: Tenant,
    user: User,
    name: str,
    expires_in_days: int | None = None,
    scope: str = ApiToken.Scope.ADMIN,
    agent: str = "",
    gpu_quota_units: int | None = None,
) -> IssuedToken:
    """Issue a token for `user` in `tenant`. The returned secret is the only copy there will ever be.

    With `agent`, the token is delegated: an AI agent acts for the user with it, at most with scope
    submit, and its unfinished tasks may hold at most `gpu_quota_units` at once."""
    if not user.is_active:
        raise InvalidInput(
            f"{user.username} is deactivated; reactivate the account before issuing it a token."
        )
    if scope not in ApiToken.Scope.values:
        raise InvalidInput(f"Unknown scope {scope!r}: read, submit or admin.", field="scope")
    if agent and scope == ApiToken.Scope.ADMIN:
        raise InvalidInput(
            "A delegated token acts with less than its user: give it scope read or submit.", field="scope"
        )
    if gpu_quota_units is not None and not agent:
        raise InvalidInput("A GPU quota belongs to a delegated token: name its agent.", field="gpu_quota")
    secret, prefix = new_token()
    token = ApiToken.objects.create(
        user=user,
        name=name,
        prefix=prefix,
        secret_hash=hash_token(secret),
        expires_at=_token_expiry(expires_in_days),
        scope=scope,
        agent=agent,
        gpu_quota_units=gpu_quota_units,
    )
    token_route_register(tenant=tenant, prefix=prefix, secret_hash=token.secret_hash)
    return IssuedToken(token=token, secret=secret)


def token_revoke(*, token: ApiToken) -> ApiToken:
    """Revoke at once: authentication reads the row on every request, so no process keeps using it."""
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
    return token


@functools.lru_cache(maxsize=1024)  # (one text per schema that requests name)
def token_read_sql(schema: str | None = None) -> str:
    """The token of one prefix (`%s`) and its user, as `token_from_row` takes it: in `schema` (quoted),
    or in the current schema where None. Ends in its WHERE clause: tenants.selectors.entering_statement
    appends a guard to it."""
    qualified = f"{schema}." if schema is not None else ""
    return (
        f"SELECT {rows.columns(ApiToken, 't')}, {rows.columns(User, 'u')} "  # noqa: S608 -- names only
        f"FROM {qualified}{ApiToken._meta.db_table} t JOIN {qualified}{User._meta.db_table} u "
        "ON u.id = t.user_id WHERE t.prefix = %s"
    )


def token_from_row(row: tuple[Any, ...] | None) -> ApiToken | None:
    """The token of a row of `token_read_sql`, its user with it."""
    if row is None:
        return None
    split = rows.width(ApiToken)
    token = rows.build(ApiToken, row[:split])
    token.user = rows.build(User, row[split:])
    return token


def _token_with_user(prefix: str) -> ApiToken | None:
    """The token of `prefix` in the current schema, its user with it."""
    with connection.cursor() as cursor:
        cursor.execute(token_read_sql(), [prefix])
        return token_from_row(cursor.fetchone())


@dataclass(frozen=True)
class TokenRead:
    """A token row already read for this request (in the round trip that found the tenant, see
    apps.accounts.authentication.BearerRead): `token` is None where no token has `prefix`."""

    prefix: str
    token: ApiToken | None


def token_authenticate(
    *, tenant: Tenant, presented: str, read: TokenRead | None = None
) -> tuple[User, ApiToken]:
    """The user a bearer token stands for in `tenant`, or TokenRejected saying why not. `read`: the row of
    the presented prefix, where the request has read it already in this tenant's schema."""
    prefix = parse_prefix(presented)
    if prefix is None:
        raise TokenRejected(
            "Malformed token: expected 'Authorization: Bearer klq_<8 characters>_<32 characters>'. "
            "Copy the whole token as it was shown when it was created."
        )
    presented_hash = hash_token(presented)
    token = read.token if read is not None and read.prefix == prefix else _token_with_user(prefix)
    if token is None or not hmac.compare_digest(token.secret_hash, presented_hash):
        owner = token_route_tenant(prefix=prefix, secret_hash=presented_hash)
        if owner is not None and owner.pk != tenant.pk:
            raise TokenRejected(
                "This token belongs to another tenant. Send it to that tenant's own address, "
                f"or create a token for {tenant.slug} there."
            )
        raise TokenRejected("Invalid token: no such token exists here. Create one with POST /api/v1/tokens/.")
    now = timezone.now()
    if token.revoked_at is not None:
        raise TokenRejected(
            f"Token klq_{prefix} was revoked on {token.revoked_at:%Y-%m-%d %H:%M} UTC. Create a new one."
        )
    if token.expires_at <= now:
        raise TokenRejected(
            f"Token klq_{prefix} expired on {token.expires_at:%Y-%m-%d %H:%M} UTC. Create a new one."
        )
    if not token.user.is_active:
        raise TokenRejected(
            f"The account {token.user.username} is deactivated. Ask a tenant admin to restore it."
        )
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token.user, token


PURGE_AFTER = timedelta(days=30)


def _purgeable(older_than: timedelta) -> QuerySet[ApiToken]:
    cutoff = timezone.now() - older_than
    return ApiToken.objects.filter(expires_at__lt=cutoff) | ApiToken.objects.filter(revoked_at__lt=cutoff)


def tokens_to_purge() -> bool:
    """Whether some token expired or was revoked long enough ago to be purged (periodic work due)."""
    return _purgeable(PURGE_AFTER).exists()


@transaction.atomic
def token_purge_expired(*, older_than: timedelta = PURGE_AFTER) -> int:
    """Delete tokens that expired or were revoked more than `older_than` ago; returns how many."""
    stale = _purgeable(older_than)
    prefixes = list(stale.values_list("prefix", flat=True))
    token_route_forget(prefixes=prefixes)
    ApiToken.objects.filter(prefix__in=prefixes).delete()
    return len(prefixes)


def _check_role(role: str) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise InvalidInput(
            f"Unknown role {role!r}; use one of {', '.join(Role.values)}.", field="role"
        ) from None


@transaction.atomic
def user_create(
    *, tenant: Tenant, username: str, email: str = "", role: str = Role.MEMBER, password: str | None = None
) -> User:
    """Add a person to `tenant`. Without a password they sign in through single sign-on or a token."""
    _ensure_username_free(username, field="username")
    user = User(username=username, email=email, role=_check_role(role))
    if password:
        user.set_password(password)
    else:
        user.set_unusable_password()
    user.save()
    publish_event(tenant=tenant, kind="user.created", data={"id": str(user.pk), "username": user.username})
    return user


@transaction.atomic
def user_update(
    *,
    tenant: Tenant,
    user: User,
    role: str | None = None,
    is_active: bool | None = None,
    email: str | None = None,
) -> User:
    if role is not None:
        user.role = _check_role(role)
    if is_active is not None:
        user.is_active = is_active
    if email is not None:
        user.email = email
    if user.role != Role.ADMIN or not user.is_active:
        _keep_one_admin(excluding=user)
    user.save()
    publish_event(tenant=tenant, kind="user.updated", data={"id": str(user.pk), "role": user.role})
    return user


def _keep_one_admin(*, excluding: User) -> None:
    """Refuse a change that would leave the tenant without an active admin to manage it."""
    was_admin = User.objects.filter(pk=excluding.pk, role=Role.ADMIN, is_active=True).exists()
    others = User.objects.filter(role=Role.ADMIN, is_active=True, kind=User.Kind.PERSON).exclude(
        pk=excluding.pk
    )
    if was_admin and not others.exists():
        raise InvalidInput(
            f"{excluding.username} is the tenant's last active admin; make someone else an admin first."
        )


@transaction.atomic
def service_account_create(
    *, tenant: Tenant, name: str, role: str = Role.MEMBER, description: str = ""
) -> User:
    """A non-person account for automation and CI; it acts only through the tokens issued to it."""
    _ensure_username_free(name, field="name")
    account = User(username=name, role=_check_role(role), kind=User.Kind.SERVICE, description=description)
    account.set_unusable_password()
    account.save()
    publish_event(tenant=tenant, kind="service_account.created", data={"id": str(account.pk), "name": name})
    return account


def _save_named(instance: Group | Project, *, what: str) -> None:
    """Save an object whose name is unique in the tenant, turning a clash into a Conflict."""
    try:
        with transaction.atomic():
            instance.save()
    except IntegrityError:
        raise Conflict(f"A {what} named {instance.name!r} already exists.", field="name") from None


def _ensure_username_free(username: str, *, field: str) -> None:
    if User.objects.filter(username__iexact=username).exists():
        raise Conflict(f"An account named {username!r} already exists in this tenant.", field=field)


@transaction.atomic
def group_save(
    *,
    tenant: Tenant,
    group: Group | None = None,
    name: str | None = None,
    description: str | None = None,
    members: list[User] | None = None,
) -> Group:
    """Create a group (group=None) or change one."""
    group = group or Group()
    if name is not None:
        group.name = name
    if description is not None:
        group.description = description
    _save_named(group, what="group")
    if members is not None:
        group.members.set(members)
    publish_event(tenant=tenant, kind="group.saved", data={"id": str(group.pk), "name": group.name})
    return group


@transaction.atomic
def group_delete(*, tenant: Tenant, group: Group) -> None:
    """Delete a group that no resource policy uses."""
    policies = list(group.policies.values_list("name", flat=True))
    if policies:
        raise Conflict(
            f"Group {group.name} is the group of policies {', '.join(policies)}; give them another group or "
            "remove them (and provision) first."
        )
    group_id = str(group.pk)
    group.delete()
    publish_event(tenant=tenant, kind="group.deleted", data={"id": group_id})


@transaction.atomic
def project_save(
    *,
    tenant: Tenant,
    project: Project | None = None,
    name: str | None = None,
    description: str | None = None,
    cost_center: str | None = None,
    admin: User | None = None,
    regions: list[str] | None = None,
) -> Project:
    """Create a project (project=None, with its first admin) or change one. `regions` limits where its
    work runs (data residency): each a region name as pools carry them; [] for anywhere."""
    creating = project is None
    project = project or Project()
    if regions is not None:
        project.regions = _checked_regions(regions)
    if name is not None:
        project.name = name
    if description is not None:
        project.description = description
    if cost_center is not None:
        project.cost_center = cost_center.strip()
    _save_named(project, what="project")
    if creating and admin is not None:
        ProjectMembership.objects.create(project=project, user=admin, role=Role.ADMIN)
    publish_event(tenant=tenant, kind="project.saved", data={"id": str(project.pk), "name": project.name})
    return project


REGION = re.compile(r"^[a-z0-9][a-z0-9-]{0,49}$")


def _checked_regions(regions: list[str]) -> list[str]:
    if len(regions) > 20:
        raise InvalidInput("A project is limited to at most 20 regions.", field="regions")
    for region in regions:
        if not isinstance(region, str) or not REGION.match(region):
            raise InvalidInput(
                f"Region {str(region)[:60]!r} is not a region name: lowercase letters, digits and dashes, as "
                "pools name theirs (eu-west-1).",
                field="regions",
            )
    return sorted(set(regions))


@transaction.atomic
def project_member_set(*, tenant: Tenant, project: Project, user: User, role: str) -> ProjectMembership:
    """Add `user` to `project` with `role`, or change the role they have there."""
    membership, _ = ProjectMembership.objects.update_or_create(
        project=project, user=user, defaults={"role": _check_role(role)}
    )
    publish_event(
        tenant=tenant,
        kind="project.member_set",
        data={"project": str(project.pk), "user": str(user.pk), "role": membership.role},
    )
    return membership


@transaction.atomic
def project_member_remove(*, tenant: Tenant, membership: ProjectMembership) -> None:
    project, user = membership.project, membership.user
    membership.delete()
    publish_event(
        tenant=tenant, kind="project.member_removed", data={"project": str(project.pk), "user": str(user.pk)}
    )


# --- limits on password sign-in -------------------------------------------------------------------

SIGN_IN_WINDOW = timedelta(minutes=15)
SIGN_IN_PER_ACCOUNT = 5  # within the window: then the account waits, whatever the password
SIGN_IN_PER_ADDRESS = 20  # within the window, over every account: a guesser moving across names


class SignInLimited(Exception):
    """Too many refused sign-ins; the message says for whom and how long to wait."""


def _address(request: Any) -> str:
    return str(getattr(request, "META", {}).get("REMOTE_ADDR") or "unknown")[:64]


def sign_in_check(*, request: Any, username: str, where: str) -> None:
    """Before a password is even looked at: refuse an account or an address past its limit, audited."""
    now = timezone.now()
    address = _address(request)
    recent = SignInFailure.objects.filter(at__gte=now - SIGN_IN_WINDOW)
    limits = (
        (
            f"the account {username[:60]}",
            recent.filter(username=username[:150]),
            SIGN_IN_PER_ACCOUNT,
        ),
        (f"the address {address}", recent.filter(address=address), SIGN_IN_PER_ADDRESS),
    )
    for what, failures, limit in limits:
        times = list(failures.order_by("-at").values_list("at", flat=True)[:limit])
        if len(times) < limit:
            continue
        minutes = max(1, int((times[-1] + SIGN_IN_WINDOW - now).total_seconds() // 60) + 1)

        record(actor=username[:150] or "?", action="password.limited", target=where, address=address)
        raise SignInLimited(
            f"Too many failed sign-ins for {what}: wait {minutes} minute{'s' if minutes > 1 else ''} and "
            "try again, or ask an administrator to reset the password."
        )


def sign_in_failed(*, request: Any, username: str) -> None:
    SignInFailure.objects.filter(at__lt=timezone.now() - SIGN_IN_WINDOW).delete()
    SignInFailure.objects.create(at=timezone.now(), username=username[:150], address=_address(request))


def sign_in_succeeded(*, username: str) -> None:
    """A right password clears the account's count (not the address's: a guesser who knows one password
    must not reset the count of the others)."""
    SignInFailure.objects.filter(username=username[:150]).delete()
