"""Who may do what in a tenant, one rule for every way in (the REST API's permission class, the MCP
server's tools): the role an action needs, and a token's scope, which can only narrow its user's role."""

from __future__ import annotations

from apps.accounts.models import ApiToken, User


def refusal(user: User, token: ApiToken | None, *, needed: str, write: bool, submit: bool = False) -> str:
    """Why `user`, through `token` (None for a session), may not do an action that needs the role
    `needed`; "" when they may. `write`: the action changes something; `submit`: it submits or cancels
    tasks, which a token of scope submit may do."""
    if not user.has_role(needed):
        return (
            f"This needs the {needed} role in this tenant and {user.username} is a {user.role}. "
            "Ask a tenant admin for access."
        )
    if token is None or token.scope == ApiToken.Scope.ADMIN or not write:
        return ""
    if token.scope == ApiToken.Scope.SUBMIT and submit:
        return ""
    who = f"agent {token.agent}'s token" if token.agent else f"token klq_{token.prefix}"
    return f"This {who} has scope {token.scope}, which does not allow this. " + (
        "It may only read."
        if token.scope == ApiToken.Scope.READ
        else "It may read and submit or cancel tasks."
    )
