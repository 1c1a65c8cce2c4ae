"""The HPC backends, one module a scheduler (slurm, pbs, lsf) beside what they share (cluster) and the
backend that drives them (backend). Batch scripts themselves are rendered by protocol.batch and
protocol.scripts, which the plane uses for previews as well."""

from agents.hpc.backend import DIALECTS, Batch
from agents.hpc.cluster import (
    SYSTEM_PATH,
    Completed,
    Settings,
    agent_environment,
    execute,
    read_owned,
)
from agents.hpc.lsf import Lsf
from agents.hpc.pbs import Pbs
from agents.hpc.slurm import UNSETTLED_LOOKS, Slurm

__all__ = [
    "DIALECTS",
    "SYSTEM_PATH",
    "UNSETTLED_LOOKS",
    "Batch",
    "Completed",
    "Lsf",
    "Pbs",
    "Settings",
    "Slurm",
    "agent_environment",
    "execute",
    "read_owned",
]
