"""Beat's entry points that fan a tenant task out to every tenant."""

from __future__ import annotations

from celery import current_app, shared_task

from tenants.selectors import tenant_list


@shared_task(name="tenants.for_each_tenant")
def for_each_tenant(task_name: str) -> int:
    """Send `task_name(schema_name)` once per active tenant; returns how many were sent. Safe to repeat:
    the tasks it sends are idempotent. Not retried: beat sends it again on its next tick."""
    schemas = list(tenant_list().filter(status="active").values_list("schema_name", flat=True))
    for schema_name in schemas:
        current_app.send_task(task_name, args=(schema_name,))
    return len(schemas)
