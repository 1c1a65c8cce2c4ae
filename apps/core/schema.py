"""Fields whose OpenAPI description says what their validation takes, and the bearer scheme, so that the
schema describes request bodies as they are validated (and a fuzzer's valid data is valid)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.core.middleware import NUL_REFUSED, has_nul

AMOUNT_PATTERN = r"^\d{1,18}(\.\d{1,6})?$"
GPUS_PATTERN = r"^\d{1,6}(\.(0|25|5|75))?$"


@extend_schema_field({"type": "string", "pattern": AMOUNT_PATTERN, "example": "25.50"})
class AmountField(serializers.DecimalField):
    """An amount that is 0 or more, up to six decimals (limits, top-ups); a number also passes."""

    def __init__(self, **options: object) -> None:
        super().__init__(max_digits=24, decimal_places=6, **options)  # type: ignore[arg-type]


@extend_schema_field({"type": "string", "pattern": GPUS_PATTERN, "example": "2"})
class GpusField(serializers.CharField):
    """A number of GPUs as text ("2", "0.5"; fractions such as "3/7" are taken too)."""


@extend_schema_field({"type": "object", "additionalProperties": True})
class DocumentField(serializers.JSONField):
    """A JSON object, checked whole by the service that takes it (which says what it lacks). Sent in a
    form, it is JSON text parsed here, so the text rule of the API's parsers is applied here too."""

    def to_internal_value(self, data: Any) -> Any:
        value = super().to_internal_value(data)
        if has_nul(value):
            raise serializers.ValidationError(NUL_REFUSED)
        return value


class BearerTokenScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    target_class = "apps.accounts.authentication.BearerTokenAuthentication"
    name = "bearer"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A Klique token, klq_<prefix>_<secret> (agents: kqa_ tokens, their own paths).",
        }
