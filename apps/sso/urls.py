"""Single sign-on: its configuration in the API, and the sign-in pages (OIDC's round trip, passwords)."""

from __future__ import annotations

from django.urls import path

from apps.sso import views
from apps.sso.apis import SsoView

urlpatterns = [
    path("sso/", SsoView.as_view(), name="sso"),
]

sign_in_urlpatterns = [
    path("auth/sso/login/", views.SignIn.as_view(), name="oidc_authentication_init"),
    path("auth/sso/callback/", views.Callback.as_view(), name="oidc_authentication_callback"),
    path("auth/logout/", views.sign_out, name="sign-out"),
    path("auth/login/", views.password_sign_in, name="password-sign-in"),
]
