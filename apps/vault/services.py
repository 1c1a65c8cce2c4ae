"""The vault: write-only secrets, resolved and decrypted only to hand them to an agent at dispatch.

Values never leave the vault except in the `assign` message to the agent that runs the task (over its
websocket, never through Redis), are never logged, and every such read is in the audit log.

Each secret has an audience, the tasks that may be given it: a user's secret goes to that user's tasks,
a project's to the project's tasks, and a tenant secret to no task until a tenant admin grants it to
groups or projects (`audience`). Secrets the platform itself reads (single sign-on's client secret, the
gateway's upstream keys) go to no task at all: the apps that read them say which names they are
(`register_platform_names`), so a name in use by the gateway's configuration is protected the moment the
configuration names it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from apps.accounts.models import Group, Project, Role, User
from apps.accounts.permissions import is_project_admin
from apps.audit.services import record
from apps.core.errors import Forbidden, InvalidInput, NotFound
from apps.vault import crypto
from apps.vault.models import DataKey, Secret
from protocol import environment as task_environment


class SecretsHolder(Protocol):
    """What the vault reads of a task (apps.scheduling's Task) to give it its secrets: who submitted it,
    in which project, and the names its spec asks for."""

    pk: Any
    spec: Any
    submitter: User
    project: Project | None


MAX_VALUE_BYTES = 64 * 1024
MASKED = "***"
MIN_MASKED_LENGTH = 4  # shorter values would mask ordinary output ("1", "yes"), as CI systems find too

_platform_names: list[Callable[[], Iterable[str]]] = []


def register_platform_names(names: Callable[[], Iterable[str]]) -> None:
    """An app that reads tenant secrets for the platform's own use names them (called in its schema)."""
    _platform_names.append(names)


def platform_secret_names() -> set[str]:
    """The tenant secrets the platform itself reads in this schema: never given to a task."""
    return {name for names in _platform_names for name in names()}


@dataclass(frozen=True)
class Audience:
    """Who may be given a tenant secret: members' tasks of these groups, tasks of these projects."""

    groups: tuple[Group, ...] = ()
    projects: tuple[Project, ...] = ()


def _data_key() -> bytes:
    """The tenant's data key, made on first use."""
    row = DataKey.objects.filter(pk=1).first()
    if row is None:
        _, wrapped = crypto.new_data_key()
        row, _ = DataKey.objects.get_or_create(
            pk=1, defaults={"wrapped": wrapped, "master_key_id": crypto.current_key_id()}
        )
    return crypto.unwrap(bytes(row.wrapped))


def _bound_to(secret: Secret) -> str:
    schema = getattr(connection, "schema_name", "")  # django-tenants sets it per request and task
    return f"{schema}:{secret.pk}"


def _may_write(user: User, scope: str, project: Project | None) -> None:
    if not user.has_role(Role.MEMBER):
        raise Forbidden("Viewers cannot keep secrets; ask a tenant admin for the member role.")
    if scope == Secret.Scope.TENANT and not user.has_role(Role.ADMIN):
        raise Forbidden("Only tenant admins keep tenant secrets; keep it as your own (scope user).")
    if scope == Secret.Scope.PROJECT and (project is None or not is_project_admin(user, project)):
        raise Forbidden("Only the project's admins (and tenant admins) keep its secrets.")


def _check(name: str, value: str) -> None:
    why = task_environment.refusal(name)
    if why:  # tasks get a secret as an environment variable of this name: the task environment's rule
        raise InvalidInput(f"A secret cannot be named so. {why}", field="name")
    if "\x00" in value or len(value.encode()) > MAX_VALUE_BYTES:
        raise InvalidInput(f"A secret's value is text of at most {MAX_VALUE_BYTES} bytes, without NUL.")


@transaction.atomic
def secret_set(
    *,
    user: User,
    scope: str,
    name: str,
    value: str | None,
    project: Project | None = None,
    audience: Audience | None = None,
) -> Secret:
    """Keep (or replace) a secret; its value can never be read back through the API. `audience` (tenant
    secrets only) replaces who may be given it; None keeps it as it is. A value of None keeps the value
    (an existing secret's audience changes alone)."""
    _may_write(user, scope, project)
    if value is not None:
        _check(name, value)
    if audience is not None and scope != Secret.Scope.TENANT:
        raise InvalidInput(
            "Only tenant secrets have an audience: a project's secret goes to its tasks, a user's to "
            "their own.",
            field="audience",
        )
    if audience is not None and (audience.groups or audience.projects) and name in platform_secret_names():
        raise InvalidInput(
            f"{name} is used by the platform itself (single sign-on or the gateway) and is never given to "
            "a task; keep what tasks need under another name.",
            field="audience",
        )
    secret, created = Secret.objects.select_for_update().get_or_create(
        scope=scope,
        project=project if scope == Secret.Scope.PROJECT else None,
        owner=user if scope == Secret.Scope.USER else None,
        name=name,
        defaults={"created_by": user, "ciphertext": b""},
    )
    if value is None and created:
        raise InvalidInput("A new secret needs its value.", field="value")
    if value is not None:
        secret.ciphertext = crypto.seal(_data_key(), value, _bound_to(secret))
        secret.save(update_fields=["ciphertext", "updated_at"])
        record(actor=user.username, action="secret.written", target=f"secret {secret}")
    if audience is not None:
        secret.audience_groups.set(audience.groups)
        secret.audience_projects.set(audience.projects)
        granted = ", ".join(
            [*(f"group {g}" for g in audience.groups), *(f"project {p}" for p in audience.projects)]
        )
        record(
            actor=user.username,
            action="secret.audience",
            target=f"secret {secret}: {granted or 'no task'}",
        )
    return secret


@transaction.atomic
def secret_delete(*, user: User, secret: Secret) -> None:
    _may_write(user, secret.scope, secret.project)
    if secret.scope == Secret.Scope.USER and secret.owner_id != user.pk:
        raise Forbidden("A user's secrets are theirs alone.")
    record(actor=user.username, action="secret.deleted", target=f"secret {secret}")
    secret.delete()


def _tenant_secret_for(user: User, project: Project | None) -> Q:
    """Tenant secrets granted to one of the user's groups or to the task's project."""
    granted = Q(audience_groups__members=user)
    if project is not None:
        granted |= Q(audience_projects=project)
    return Q(scope=Secret.Scope.TENANT) & granted


def _resolve(user: User, project: Project | None, names: Sequence[str]) -> dict[str, Secret]:
    """For each name, the user's own secret, else the project's, else a tenant secret granted to the
    task; never one the platform itself reads."""
    candidates = (
        Secret.objects.filter(name__in=names)
        .filter(
            Q(scope=Secret.Scope.USER, owner=user)
            | Q(scope=Secret.Scope.PROJECT, project=project)
            | _tenant_secret_for(user, project)
        )
        .exclude(scope=Secret.Scope.TENANT, name__in=platform_secret_names())
        .distinct()
    )
    rank = {Secret.Scope.USER: 0, Secret.Scope.PROJECT: 1, Secret.Scope.TENANT: 2}
    chosen: dict[str, Secret] = {}
    for secret in sorted(candidates, key=lambda secret: rank[Secret.Scope(secret.scope)]):
        chosen.setdefault(secret.name, secret)
    return chosen


def secret_names(spec: object) -> list[str]:
    """The names a task's spec asks for (`"secrets": ["HF_TOKEN", ...]`), or InvalidInput."""
    names = spec.get("secrets", []) if isinstance(spec, dict) else []
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise InvalidInput('A task\'s "secrets" is a list of secret names, e.g. ["HF_TOKEN"].')
    for name in names:  # a secret kept before today's rule may bear a name no task can be given
        why = task_environment.refusal(name)
        if why:
            raise InvalidInput(f"The task cannot be given secret {name[:60]}. {why}", field="spec.secrets")
    return names


def secrets_check(*, user: User, project: Project | None, spec: object) -> None:
    """At submission: every secret the task names exists for its user, project or tenant."""
    names = secret_names(spec)
    if not names:
        return
    missing = sorted(set(names) - set(_resolve(user, project, names)))
    if not missing:
        return
    platform = sorted(set(missing) & platform_secret_names())
    if platform:
        raise InvalidInput(
            f"{', '.join(platform)} is used by the platform itself (single sign-on or the gateway) and is "
            "never given to a task.",
            field="spec.secrets",
        )
    ungranted = sorted(
        Secret.objects.filter(scope=Secret.Scope.TENANT, name__in=missing).values_list("name", flat=True)
    )
    if ungranted:
        where = f"project {project.name}" if project is not None else "your groups"
        raise InvalidInput(
            f"Tenant secret {', '.join(ungranted)} is not granted to {where}: a tenant admin grants a "
            "tenant secret to groups or projects (its audience) before tasks may be given it.",
            field="spec.secrets",
        )
    raise InvalidInput(
        f"No secret named {', '.join(missing)} for you, your project or the tenant; "
        "keep it with POST /api/v1/secrets/ first.",
        field="spec.secrets",
    )


def secret_values_for(task: SecretsHolder) -> dict[str, str]:
    """Decrypt the task's secrets to hand them to its agent, recording each read. NotFound names a
    secret deleted since the task was submitted."""
    names = secret_names(task.spec)
    if not names:
        return {}
    chosen = _resolve(task.submitter, task.project, names)
    missing = sorted(set(names) - set(chosen))
    if missing:
        raise NotFound(f"Secret {', '.join(missing)} was deleted after the task was submitted.")
    key = _data_key()
    values = {}
    for name, secret in chosen.items():
        values[name] = crypto.open_sealed(key, bytes(secret.ciphertext), _bound_to(secret))
        record(
            actor="scheduler",
            on_behalf_of=task.submitter.username,
            action="secret.read",
            target=f"secret {secret}",
            task=str(task.pk),
        )
    return values


def secret_values_to_mask(task: SecretsHolder) -> list[str]:
    """The values of the secrets the task was given, longest first, to mask in what it writes. Not a read
    for anyone (the values never leave the process), so not audited."""
    names = [name for name in secret_names_quietly(task.spec) if task_environment.refusal(name) is None]
    if not names:
        return []
    key = _data_key()
    values = {
        crypto.open_sealed(key, bytes(secret.ciphertext), _bound_to(secret))
        for secret in _resolve(task.submitter, task.project, names).values()
    }
    return sorted((value for value in values if len(value) >= MIN_MASKED_LENGTH), key=len, reverse=True)


def secret_names_quietly(spec: object) -> list[str]:
    names = spec.get("secrets", []) if isinstance(spec, dict) else []
    return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []


def mask(lines: Sequence[object], values: Sequence[str]) -> list[object]:
    """Lines with every known secret value (and every line of a multi-line one) replaced by ***."""
    pieces = sorted(
        {
            piece
            for value in values
            for piece in (value, *value.splitlines())
            if len(piece) >= MIN_MASKED_LENGTH
        },
        key=len,
        reverse=True,
    )
    if not pieces:
        return list(lines)
    masked: list[object] = []
    for line in lines:
        text = line
        if isinstance(text, str):
            for piece in pieces:
                if piece in text:
                    text = text.replace(piece, MASKED)
        masked.append(text)
    return masked


def vault_rotate() -> bool:
    """Re-wrap this tenant's data key with the current master key; True when it changed."""
    row = DataKey.objects.select_for_update().filter(pk=1).first()
    if row is None or row.master_key_id == crypto.current_key_id():
        return False
    row.wrapped = crypto.rewrap(bytes(row.wrapped))
    row.master_key_id = crypto.current_key_id()
    row.rotated_at = timezone.now()
    row.save(update_fields=["wrapped", "master_key_id", "rotated_at"])
    record(actor="klique manage vault_rotate", action="vault.rotated", target="data key")
    return True


def tenant_secret(name: str, *, reader: str) -> str:
    """A tenant secret's value for the plane's own use (single sign-on's client secret), audited."""
    secret = Secret.objects.filter(scope=Secret.Scope.TENANT, name=name).first()
    if secret is None:
        raise NotFound(f"No tenant secret {name}; keep it with POST /api/v1/secrets/.")
    value = crypto.open_sealed(_data_key(), bytes(secret.ciphertext), _bound_to(secret))
    record(actor=reader, action="secret.read", target=f"secret {secret}")
    return value


def _project_secret(project: Project, name: str) -> Secret | None:
    """The project's own secret of that name, else a tenant secret granted to the project; never one the
    platform itself reads."""
    candidates = (
        Secret.objects.filter(name=name)
        .filter(
            Q(scope=Secret.Scope.PROJECT, project=project)
            | Q(scope=Secret.Scope.TENANT, audience_projects=project)
        )
        .exclude(scope=Secret.Scope.TENANT, name__in=platform_secret_names())
        .distinct()
    )
    return min(candidates, key=lambda secret: secret.scope != Secret.Scope.PROJECT, default=None)


def project_secret_problem(project: Project, name: str) -> str | None:
    """Why the plane may not use secret `name` for project's own purposes (its output bucket), or None."""
    if _project_secret(project, name) is not None:
        return None
    if Secret.objects.filter(scope=Secret.Scope.TENANT, name=name).exists():
        return (
            f"tenant secret {name} is not granted to project {project.name}: a tenant admin adds the project "
            "to its audience, or the project keeps its own secret of that name"
        )
    return f"project {project.name} has no secret {name}; keep it with POST /api/v1/secrets/ (scope project)"


def project_secret(project: Project, name: str, *, reader: str) -> str:
    """The value of a secret the plane uses for a project (its output bucket's keys), audited; NotFound
    saying why when there is none the project may use."""
    secret = _project_secret(project, name)
    if secret is None:
        raise NotFound(f"{project_secret_problem(project, name)}.")
    value = crypto.open_sealed(_data_key(), bytes(secret.ciphertext), _bound_to(secret))
    record(actor=reader, action="secret.read", target=f"secret {secret}")
    return value
