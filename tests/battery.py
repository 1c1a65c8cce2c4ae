"""The API test battery: every endpoint joins it by declaration, and each declaration is checked for
401 without a token, 403 without the role, 404 (or nothing of A's) from another tenant, 401 for a token
of another tenant, 400 with a readable message for bad input, and success for the role that may call it.

`tests/test_battery.py` also fails when an endpoint exists that nobody declared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.world import World

# For each role an endpoint may require: who holds it, and who is one step short of it (None: nobody is).
ROLE_HOLDERS: dict[str, tuple[str, str | None]] = {
    "viewer": ("dave", None),
    "member": ("bob", "dave"),
    "admin": ("alice", "bob"),
    "project_admin": ("carol", "bob"),
    "provider": ("root", "paula"),
    "provider_self": ("paula", None),
}


@dataclass(frozen=True)
class Endpoint:
    method: str
    route: str  # as Django spells it, e.g. "api/v1/projects/<uuid:project_id>/"
    role: str  # a key of ROLE_HOLDERS
    path: Callable[[World], str]
    body: Callable[[World], dict[str, Any]] | None = None
    bad_body: dict[str, Any] | None = None
    expect: int = 200
    names_object: bool = False  # the path names one of tenant A's objects: B must get 404
    a_ids: Callable[[World], list[str]] = field(default=lambda world: [])  # A's ids B must never see listed
    owner: str | None = None  # the persona whose own object the path names: other non-admins get `others`
    others: int = 404  # 404: someone else's is not there for them; 403: it is, but only its owner reads this

    @property
    def site(self) -> str:
        return "provider" if self.role.startswith("provider") else "tenant"

    @property
    def key(self) -> str:
        return f"{self.method} /{self.route}"


def fixed(path: str) -> Callable[[World], str]:
    return lambda world: path
