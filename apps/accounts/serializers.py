"""Input and output shapes of the accounts API."""

from __future__ import annotations

from rest_framework import serializers

from apps.accounts.models import ApiToken, Group, Project, ProjectMembership, Role, User
from apps.audit.models import AuditEvent
from apps.core.schema import GpusField
from apps.core.serializers import PlainOut
from apps.scheduling.engine import SizeError, to_gpus_text, units


class UserOut(PlainOut):
    """A person. Its fields are declared, not read off the model: a ModelSerializer introspects the model
    on every use, which costs more than the rest of a `GET /api/v1/me/` (bench/request_path.py); and bound
    once (apps.core.serializers)."""

    id = serializers.UUIDField(read_only=True)
    username = serializers.CharField(read_only=True)
    email = serializers.EmailField(read_only=True)
    role = serializers.ChoiceField(choices=Role.choices, read_only=True)
    kind = serializers.ChoiceField(choices=User.Kind.choices, read_only=True)
    is_active = serializers.BooleanField(read_only=True)
    date_joined = serializers.DateTimeField(read_only=True)


class UserIn(serializers.Serializer[User]):
    username = serializers.RegexField(
        r"^[A-Za-z0-9._@+-]{2,150}$",
        error_messages={"invalid": "Use 2 to 150 letters, digits and . _ @ + - in a username."},
    )
    email = serializers.EmailField(required=False, default="")
    role = serializers.ChoiceField(choices=Role.choices, default=Role.MEMBER)


class UserPatch(serializers.Serializer[User]):
    email = serializers.EmailField(required=False)
    role = serializers.ChoiceField(choices=Role.choices, required=False)
    is_active = serializers.BooleanField(required=False)


class ServiceAccountOut(serializers.ModelSerializer[User]):
    name = serializers.CharField(source="username")

    class Meta:
        model = User
        fields = ["id", "name", "description", "role", "is_active", "date_joined"]


class ServiceAccountIn(serializers.Serializer[User]):
    name = serializers.RegexField(
        r"^[a-z0-9][a-z0-9._-]{1,99}$",
        error_messages={
            "invalid": "Use 2 to 100 lowercase letters, digits and . _ - in a service account's name."
        },
    )
    description = serializers.CharField(required=False, default="", max_length=500, allow_blank=True)
    role = serializers.ChoiceField(choices=Role.choices, default=Role.MEMBER)


class ServiceAccountPatch(serializers.Serializer[User]):
    role = serializers.ChoiceField(choices=Role.choices, required=False)
    is_active = serializers.BooleanField(required=False)


class GroupOut(serializers.ModelSerializer[Group]):
    members: serializers.PrimaryKeyRelatedField[User] = serializers.PrimaryKeyRelatedField(
        many=True, read_only=True
    )

    class Meta:
        model = Group
        fields = ["id", "name", "description", "members", "created_at"]


class GroupIn(serializers.Serializer[Group]):
    name = serializers.CharField(max_length=100)
    description = serializers.CharField(required=False, max_length=500, allow_blank=True)
    members = serializers.PrimaryKeyRelatedField(
        many=True,
        required=False,
        queryset=User.objects.all(),
        error_messages={"does_not_exist": "No user with id {pk_value} in this tenant."},
    )


class ProjectOut(serializers.ModelSerializer[Project]):
    class Meta:
        model = Project
        fields = ["id", "name", "description", "cost_center", "regions", "created_at"]


class ProjectIn(serializers.Serializer[Project]):
    name = serializers.CharField(max_length=100)
    description = serializers.CharField(required=False, max_length=500, allow_blank=True)
    cost_center = serializers.CharField(required=False, max_length=100, allow_blank=True)
    regions = serializers.ListField(
        child=serializers.CharField(max_length=60),
        required=False,
        max_length=20,
        help_text="data residency: the regions its work must run in (pools' regions); empty for anywhere",
    )


class MembershipOut(serializers.ModelSerializer[ProjectMembership]):
    user = serializers.UUIDField(source="user.id")
    username = serializers.CharField(source="user.username")

    class Meta:
        model = ProjectMembership
        fields = ["user", "username", "role", "created_at"]


class MembershipIn(serializers.Serializer[ProjectMembership]):
    user = serializers.PrimaryKeyRelatedField(
        queryset=User.objects.all(),
        error_messages={"does_not_exist": "No user with id {pk_value} in this tenant."},
    )
    role = serializers.ChoiceField(choices=Role.choices, default=Role.MEMBER)


class TokenOut(serializers.ModelSerializer[ApiToken]):
    prefix = serializers.SerializerMethodField()
    user = serializers.CharField(source="user.username")

    class Meta:
        model = ApiToken
        fields = [
            "id", "name", "prefix", "user", "scope", "agent", "gpu_quota", "created_at", "expires_at",
            "revoked_at", "last_used_at",
        ]  # fmt: skip

    gpu_quota = serializers.SerializerMethodField()

    def get_prefix(self, token: ApiToken) -> str:
        return f"klq_{token.prefix}"

    def get_gpu_quota(self, token: ApiToken) -> str | None:
        return None if token.gpu_quota_units is None else to_gpus_text(token.gpu_quota_units)


class TokenCreated(TokenOut):
    token = serializers.CharField(help_text="The whole token. It is shown this once and never again.")

    class Meta(TokenOut.Meta):
        fields = [*TokenOut.Meta.fields, "token"]


class TokenIn(serializers.Serializer[ApiToken]):
    name = serializers.CharField(max_length=100)
    expires_in_days = serializers.IntegerField(required=False, min_value=1)
    scope = serializers.ChoiceField(choices=ApiToken.Scope.choices, default=ApiToken.Scope.ADMIN)
    agent = serializers.RegexField(
        r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}$",
        required=False,
        default="",
        error_messages={"invalid": "Name the agent with letters, digits, spaces and . _ - (at most 100)."},
        help_text="makes a delegated token: an AI agent acting for you, with scope read or submit",
    )
    gpu_quota = GpusField(
        required=False, max_length=20, help_text='a delegated token\'s own GPU quota, e.g. "2"'
    )

    def validate_gpu_quota(self, value: str) -> int:
        try:
            return units(value)
        except SizeError as error:
            raise serializers.ValidationError(str(error)) from None


class AuditEventOut(serializers.ModelSerializer[AuditEvent]):
    class Meta:
        model = AuditEvent
        fields = ["id", "at", "actor", "on_behalf_of", "action", "target", "detail", "request_id"]
