"""The vault: write-only secrets, resolved and decrypted only to hand them to an agent at dispatch.

Values never leave the vault except in the `assign` message to the agent that runs the task (over its
websocket, never through Redis), are never logged, and every such read is in the audit log.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from django.db import connection, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone
from rest_framework.exceptions import PermissionDenied

from apps.accounts.models import Project, Role, User
from apps.accounts.permissions import is_project_admin
from apps.audit.services import record
from apps.core.errors import InvalidInput, NotFound
from apps.vault import crypto
from apps.vault.models import DataKey, Secret
from protocol import environment as task_environment

if TYPE_CHECKING:
    from apps.scheduling.models import Task

MAX_VALUE_BYTES = 64 * 1024


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
        raise PermissionDenied("Viewers cannot keep secrets; ask a tenant admin for the member role.")
    if scope == Secret.Scope.TENANT and not user.has_role(Role.ADMIN):
        raise PermissionDenied("Only tenant admins keep tenant secrets; keep it as your own (scope user).")
    if scope == Secret.Scope.PROJECT and (project is None or not is_project_admin(user, project)):
        raise PermissionDenied("Only the project's admins (and tenant admins) keep its secrets.")


def _check(name: str, value: str) -> None:
    why = task_environment.refusal(name)
    if why:  # tasks get a secret as an environment variable of this name: the task environment's rule
        raise InvalidInput(f"A secret cannot be named so. {why}", field="name")
    if "\x00" in value or len(value.encode()) > MAX_VALUE_BYTES:
        raise InvalidInput(f"A secret's value is text of at most {MAX_VALUE_BYTES} bytes, without NUL.")


@transaction.atomic
def secret_set(*, user: User, scope: str, name: str, value: str, project: Project | None = None) -> Secret:
    """Keep (or replace) a secret; its value can never be read back through the API."""
    _may_write(user, scope, project)
    _check(name, value)
    secret, _ = Secret.objects.select_for_update().get_or_create(
        scope=scope,
        project=project if scope == Secret.Scope.PROJECT else None,
        owner=user if scope == Secret.Scope.USER else None,
        name=name,
        defaults={"created_by": user, "ciphertext": b""},
    )
    secret.ciphertext = crypto.seal(_data_key(), value, _bound_to(secret))
    secret.save(update_fields=["ciphertext", "updated_at"])
    record(actor=user.username, action="secret.written", target=f"secret {secret}")
    return secret


@transaction.atomic
def secret_delete(*, user: User, secret: Secret) -> None:
    _may_write(user, secret.scope, secret.project)
    if secret.scope == Secret.Scope.USER and secret.owner_id != user.pk:
        raise PermissionDenied("A user's secrets are theirs alone.")
    record(actor=user.username, action="secret.deleted", target=f"secret {secret}")
    secret.delete()


def secrets_visible_to(user: User) -> QuerySet[Secret]:
    """Names a user may see (never values): the tenant's, their projects', their own; admins see all
    but other users' own."""
    secrets = Secret.objects.select_related("project", "owner")
    mine = Q(scope=Secret.Scope.USER, owner=user)
    if user.has_role(Role.ADMIN):
        return secrets.filter(~Q(scope=Secret.Scope.USER) | mine)
    return secrets.filter(
        Q(scope=Secret.Scope.TENANT) | Q(scope=Secret.Scope.PROJECT, project__members=user) | mine
    ).distinct()


def _resolve(user: User, project: Project | None, names: Sequence[str]) -> dict[str, Secret]:
    """For each name, the user's own secret, else the project's, else the tenant's."""
    candidates = Secret.objects.filter(name__in=names).filter(
        Q(scope=Secret.Scope.USER, owner=user)
        | Q(scope=Secret.Scope.PROJECT, project=project)
        | Q(scope=Secret.Scope.TENANT)
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
    missing = sorted(set(names) - set(_resolve(user, project, names)))
    if missing:
        raise InvalidInput(
            f"No secret named {', '.join(missing)} for you, your project or the tenant; "
            "keep it with POST /api/v1/secrets/ first."
        )


def secret_values_for(task: Task) -> dict[str, str]:
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
