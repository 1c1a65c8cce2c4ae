"""A tenant's single sign-on: its OpenID Connect provider and how claims map to Klique users."""

from __future__ import annotations

from django.db import models


class Provider(models.Model):
    """One row per tenant. The client secret lives in the vault (tenant secret `SSO_CLIENT_SECRET`)."""

    issuer = models.URLField(max_length=500)
    client_id = models.CharField(max_length=200)
    # Discovered from the issuer's /.well-known/openid-configuration when saved.
    authorization_endpoint = models.URLField(max_length=500)
    token_endpoint = models.URLField(max_length=500)
    userinfo_endpoint = models.URLField(max_length=500)
    jwks_uri = models.URLField(max_length=500)
    end_session_endpoint = models.URLField(max_length=500, blank=True)
    # Claim mapping: who the user is, and which of their groups make them a tenant admin or a member
    # (anyone else signs in as a viewer). Klique groups named in the groups claim are joined.
    username_claim = models.CharField(max_length=100, default="preferred_username")
    groups_claim = models.CharField(max_length=100, default="groups")
    admin_groups = models.JSONField(default=list, blank=True)
    member_groups = models.JSONField(default=list, blank=True)
    # Password sign-in stays for break-glass admins only, and only when this is on.
    break_glass_passwords = models.BooleanField(default=False)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return self.issuer
