"""Exact GPU accounting: every size and capacity is an integer count of 1/840 of a GPU (the unit itself
is protocol.units', which the agents share).
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

from protocol.units import UNITS_PER_GPU

MAX_GPUS = 1_000_000  # more than any cluster holds: a size above it is a typo (or an attack on the columns)

# Compute slices per GPU for MIG, by GPU class; 7 where the class is not listed (A100, H100, H200, B200).
MIG_SLICES = {"a30": 4}
_MIG_PROFILE = re.compile(r"(\d)g\.(\d+)gb")


class SizeError(ValueError):
    """A size cannot be counted exactly; the message says why."""


def units(gpus: Fraction | int | str) -> int:
    """GPUs (a Fraction, an int, or text such as "0.25", "3/7", "8") as a whole number of units."""
    try:
        value = Fraction(gpus)
    except (ValueError, ZeroDivisionError):
        raise SizeError(f"{gpus!r} is not a number of GPUs.") from None
    if not 0 <= value <= MAX_GPUS:
        raise SizeError(f"{str(gpus)[:40]} is not a number of GPUs from 0 to {MAX_GPUS:,}.")
    count = value * UNITS_PER_GPU
    if count.denominator != 1:
        raise SizeError(f"{gpus} GPU cannot be counted exactly; use halves, thirds, ... tenths of a GPU.")
    return int(count)


def gpus(count: int) -> Fraction:
    return Fraction(count, UNITS_PER_GPU)


def to_gpus_text(count: int) -> str:
    """A count of units as the GPUs text the API and the configuration document take back: "8", "1/4"."""
    value = gpus(count)
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


@lru_cache(maxsize=4096)  # reasons name the same few sizes over and over
def describe(count: int) -> str:
    """A size as a person reads it: "8 GPUs", "1 GPU", "0.25 GPU", "3/7 GPU"."""
    value = gpus(count)
    if value.denominator == 1:
        return f"{value.numerator} GPU{'s' if value != 1 else ''}"
    decimal = float(value)
    text = f"{decimal:g}" if Fraction(f"{decimal:g}") == value else f"{value.numerator}/{value.denominator}"
    return f"{text} GPU"


def mig_fraction(profile: str, gpu_class: str = "") -> Fraction:
    """The share of a GPU one MIG slice such as "1g.10gb" or "3g.40gb" counts for on `gpu_class`."""
    match = _MIG_PROFILE.fullmatch(profile.strip().lower())
    if match is None:
        raise SizeError(f"{profile!r} is not a MIG profile; they look like 1g.10gb or 3g.40gb.")
    slices = MIG_SLICES.get(gpu_class.strip().lower(), 7)
    compute = int(match[1])
    if not 1 <= compute <= slices:
        raise SizeError(f"{profile} needs {compute} compute slices; a {gpu_class or 'GPU'} has {slices}.")
    return Fraction(compute, slices)


def describe_seconds(seconds: float) -> str:
    """A span as a person says it: "45 s", "10 min", "2 h", "1 h 30 min", "1 h 0 min 5 s"."""
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours and (minutes or secs):
        return f"{hours} h {minutes} min" + (f" {secs} s" if secs else "")
    if hours:
        return f"{hours} h"
    if minutes:
        return f"{minutes} min" + (f" {secs} s" if secs else "")
    return f"{secs} s"
