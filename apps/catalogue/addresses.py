"""Where an app is served: a host of its own under the tenant's (app-<slug>.<tenant's host>).

An app on a host of its own is a separate origin: its pages' scripts cannot read the portal's cookies or
call the portal's API as the person viewing them, and an app needs no base path (JupyterLab, code-server
and model servers all serve from /). `https://<tenant>/apps/<id>/` is the app's stable address: it checks
who asks and sends them on to the app's host with a one-time ticket (apps.catalogue.views). The tenant's
DNS and certificate cover *.<tenant's host>; under .localhost, browsers resolve every name to this
machine.
"""

from __future__ import annotations

import re

PREFIX = "app-"
APP_LABEL = re.compile(r"app-([a-z0-9]{16})")


def app_host(slug: str, tenant_host: str) -> str:
    return f"{PREFIX}{slug}.{tenant_host}"


def parse_app_host(host: str) -> tuple[str, str] | None:
    """(slug, the tenant's host) for an app's host (port kept), else None."""
    label, _, rest = host.lower().partition(".")
    match = APP_LABEL.fullmatch(label)
    if match is None or not rest:
        return None
    return match[1], rest
