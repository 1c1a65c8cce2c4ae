"""The pure scheduling engine: a snapshot of one tenant in, decisions out. No Django, no I/O."""

from protocol.units import UNITS_PER_GPU

from .cycle import schedule
from .model import (
    Allocation,
    Decision,
    Placement,
    Policy,
    Pool,
    Preemption,
    Profile,
    Queue,
    Reason,
    Sharing,
    Snapshot,
    Task,
)
from .resident import Resident
from .state import task_order
from .units import SizeError, describe, describe_seconds, gpus, mig_fraction, to_gpus_text, units

__all__ = [
    "UNITS_PER_GPU",
    "Allocation",
    "Decision",
    "Placement",
    "Policy",
    "Pool",
    "Preemption",
    "Profile",
    "Queue",
    "Reason",
    "Resident",
    "Sharing",
    "SizeError",
    "Snapshot",
    "Task",
    "describe",
    "describe_seconds",
    "gpus",
    "mig_fraction",
    "schedule",
    "task_order",
    "to_gpus_text",
    "units",
]
