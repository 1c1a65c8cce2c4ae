"""Output shapes whose fields are bound once per class, not on every use.

DRF binds a serializer's fields anew for every instance: `fields` deep-copies each declared field (its
arguments, its validators, its error messages) and binds the copy to the new serializer. For a response
of one object that is most of the serializer's cost: on `GET /api/v1/me/`, seven fields took about as
long as the request's round trip to PostgreSQL (bench/request_path.py).

`PlainOut` keeps one bound copy of its fields per class and renders with it. That is only sound for
fields whose output depends on the value and on the field's own arguments alone: not on the serializer
they are bound to, its context (the request) or other fields. So its fields come from an allow-list of
DRF's plain field classes, checked when the class is defined; a method field, a nested serializer or a
related field is refused there, with the name of the field. Rendering is DRF's own (`get_attribute`, a
skipped field, None left as None, `to_representation` of each field), so the output is the same.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rest_framework import fields, serializers

AnyField = fields.Field[Any, Any, Any, Any]

PLAIN_FIELDS: tuple[type[AnyField], ...] = (
    fields.BooleanField,
    fields.CharField,
    fields.ChoiceField,
    fields.DateField,
    fields.DateTimeField,
    fields.DecimalField,
    fields.DurationField,
    fields.EmailField,
    fields.FloatField,
    fields.IntegerField,
    fields.JSONField,
    fields.URLField,
    fields.UUIDField,
)


class PlainOut(serializers.Serializer[Any]):
    """A serializer for output only, of plain fields (PLAIN_FIELDS, exactly those classes), bound once."""

    _bound: ClassVar[list[tuple[str, AnyField]] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared: dict[str, AnyField] = cls._declared_fields
        for name, field in declared.items():
            if type(field) not in PLAIN_FIELDS:
                raise TypeError(
                    f"{cls.__name__}.{name} is a {type(field).__name__}, whose output may depend on the "
                    "serializer or its context; PlainOut takes only "
                    f"{', '.join(plain.__name__ for plain in PLAIN_FIELDS)}. Use serializers.Serializer."
                )
            if not field.read_only:
                raise TypeError(f"{cls.__name__}.{name}: PlainOut is for output; declare it read_only=True.")
        cls._bound = None

    @classmethod
    def _readable(cls) -> list[tuple[str, AnyField]]:
        bound = cls.__dict__.get("_bound")
        if bound is None:  # the first use of the class: bind its fields to one instance, kept
            bound = [(str(field.field_name), field) for field in cls()._readable_fields]
            cls._bound = bound
        return bound

    def to_representation(self, instance: Any) -> dict[str, Any]:
        shaped: dict[str, Any] = {}
        for name, field in self._readable():
            try:
                value = field.get_attribute(instance)
            except fields.SkipField:
                continue
            shaped[name] = None if value is None else field.to_representation(value)
        return shaped
