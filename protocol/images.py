"""The one rule for a task's `image`, checked where a task is submitted and again by the agent that runs it.

An image is named by an OCI reference, as registries and container engines write it:

    [registry[:port]/]path[/path...][:tag][@algorithm:digest]      e.g. localhost/trainer:2.1,
                                                                        nvcr.io/nvidia/pytorch:24.05-py3

optionally after `docker://` (the transport Apptainer and Pyxis take). For HPC pools only, an image may
also be an absolute path (an Apptainer `.sif` file, or a folder), which the pool's agent checks against
the folders its cluster allows.

The rule is an allow-list of the reference grammar, so that no value can be read by an engine as anything
but an image: never an option (`--privileged`, `-v/:/host`), never a second word, never shell syntax.
"""

from __future__ import annotations

import re

__all__ = ["ImageRefused", "checked", "engine_reference"]

TRANSPORT = "docker://"
MAX_LENGTH = 255  # the registries' own limit on a repository's name; references stay within it here

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
_REGISTRY = rf"{_HOST}(?::[0-9]{{1,5}})?"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,128}"
REFERENCE = re.compile(
    rf"(?:(?P<registry>{_REGISTRY})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?"
)
_PATH = re.compile(r"/[A-Za-z0-9_.,+@%=/-]{1,250}")
HOW = (
    "Name an image as registry/name:tag (e.g. localhost/trainer:2.1 or nvcr.io/nvidia/pytorch:24.05-py3): "
    "lower-case letters, digits and . _ - in the name, no spaces, quotes or options."
)


class ImageRefused(ValueError):
    """The value cannot name an image; the message says why and what to write instead."""


def checked(value: object, *, paths: bool = False) -> str:
    """`value` as an image reference, or ImageRefused. With `paths`, an absolute path is accepted too
    (HPC pools: an Apptainer image on the shared file system)."""
    if not isinstance(value, str):
        raise ImageRefused(f"The image must be text; {type(value).__name__} was given. {HOW}")
    if not value:
        raise ImageRefused(f"The image is empty. {HOW}")
    if len(value) > MAX_LENGTH:
        raise ImageRefused(f"The image's name is {len(value)} characters long; at most {MAX_LENGTH}.")
    if value.startswith("/"):
        if not paths:
            raise ImageRefused(
                f"{value[:60]!r} is a path: an image file is for HPC pools (Apptainer). Here, name an image "
                "the host's container engine holds. " + HOW
            )
        if not _PATH.fullmatch(value) or "/../" in f"{value}/" or "/./" in f"{value}/":
            raise ImageRefused(
                f"The image path {value[:60]!r} must be absolute and plain: letters, digits and "
                "_ . , + @ % = - / only, no '..' or '.' parts."
            )
        return value
    reference = value.removeprefix(TRANSPORT)
    match = REFERENCE.fullmatch(reference)
    if match is None or "://" in reference:
        raise ImageRefused(f"{value[:60]!r} is not an image reference. {HOW}")
    return value


def engine_reference(value: object) -> str:
    """The reference a container engine takes (podman, docker): checked, without the `docker://`
    transport; ImageRefused for anything else, paths included."""
    return checked(value).removeprefix(TRANSPORT)
