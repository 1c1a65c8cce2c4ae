"""Input and output shapes of the accounts API."""

from __future__ import annotations

from rest_framework import serializers

from apps.accounts.models import ApiToken, Group, Project, ProjectMembership, Role, User


class UserOut(serializers.ModelSerializer[User]):
    class Meta:
        model = User
        fields = ["id", "username", "email", "role", "kind", "is_active", "date_joined"]


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
        fields = ["id", "name", "description", "created_at"]


class ProjectIn(serializers.Serializer[Project]):
    name = serializers.CharField(max_length=100)
    description = serializers.CharField(required=False, max_length=500, allow_blank=True)


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
        fields = ["id", "name", "prefix", "user", "created_at", "expires_at", "revoked_at", "last_used_at"]

    def get_prefix(self, token: ApiToken) -> str:
        return f"klq_{token.prefix}"


class TokenCreated(TokenOut):
    token = serializers.CharField(help_text="The whole token. It is shown this once and never again.")

    class Meta(TokenOut.Meta):
        fields = [*TokenOut.Meta.fields, "token"]


class TokenIn(serializers.Serializer[ApiToken]):
    name = serializers.CharField(max_length=100)
    expires_in_days = serializers.IntegerField(required=False, min_value=1)
