"""Which environment variables a task may set, through its spec or the secrets it names.

One rule, checked in three places: when a secret is kept, when a task is submitted, and by the agent
before it starts the task (an agent never trusts that the plane checked). A name must match an allow
pattern and must not be one of the variables below, each refused for a reason a user can read:

- variables that steer how programs are found and loaded (`PATH`, `LD_*`, `PYTHONPATH`, `BASH_ENV`,
  `IFS`, ...): in any process that is not the task's own they would run code of the user's choosing;
- the account's identity (`HOME`, `USER`, `LOGNAME`, `SHELL`), which the agent sets for the account
  the task runs as;
- what Klique and the batch systems set or read to place the job (`KLIQUE_*`, `SLURM_*`, `SBATCH_*`,
  `PBS_*`, `LSB_*`, `CUDA_VISIBLE_DEVICES`, ...): `SBATCH_ACCOUNT` would charge another account.

Matching ignores case: some shells tie a lowercase name to its variable (zsh's `path` is `PATH`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_VALUE_BYTES = 64 * 1024
MAX_VARIABLES = 256

_LOADER = "it changes which programs and libraries a process loads"
_SHELL = "shells read it to decide what to run"
_INTERPRETER = "interpreters read it to load code before the program runs"
_IDENTITY = "Klique sets it for the account the task runs as"
_PLACEMENT = "Klique or the batch system sets it to place the job"

# (pattern over the whole name, case ignored; why a task cannot set it)
REFUSED: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), reason)
    for pattern, reason in (
        (r"PATH", _LOADER),
        (r"LD_\w*|DYLD_\w*|GCONV_PATH|LOCPATH|NLSPATH|GLIBC_TUNABLES|MALLOC_\w*", _LOADER),
        (r"HOSTALIASES|RES_OPTIONS|LOCALDOMAIN", _LOADER),
        (r"IFS|ENV|BASH_ENV|BASH_FUNC_\w*|BASHOPTS|SHELLOPTS|PS4|PROMPT_COMMAND|CDPATH|GLOBIGNORE", _SHELL),
        (r"FPATH|ZDOTDIR|KSH_\w*|ZSH_\w*", _SHELL),
        (r"PYTHON\w*|PERL5\w*|PERLLIB|PERL_\w*|RUBY\w*|GEM_\w*|NODE_OPTIONS|NODE_PATH", _INTERPRETER),
        (r"JAVA_TOOL_OPTIONS|_JAVA_OPTIONS|JDK_JAVA_OPTIONS", _INTERPRETER),
        (r"LUA_INIT\w*|LUA_PATH\w*|LUA_CPATH\w*", _INTERPRETER),
        (r"TCLLIBPATH|R_PROFILE\w*|R_ENVIRON\w*|OPENSSL_CONF|OPENSSL_ENGINES", _INTERPRETER),
        (r"HOME|USER|LOGNAME|SHELL|MAIL|USERNAME", _IDENTITY),
        (r"KLIQUE_\w*|SLURM_\w*|SBATCH_\w*|SRUN_\w*|SALLOC_\w*|SCRUN_\w*|PBS_\w*|QSUB_\w*", _PLACEMENT),
        (r"LSB_\w*|LSF_\w*|BSUB_\w*|APPTAINER\w*|SINGULARITY\w*|ENROOT_\w*|PYXIS_\w*", _PLACEMENT),
        (r"(CUDA|NVIDIA|ROCR|HIP|ZE_AFFINITY|GPU_DEVICE)_VISIBLE_DEVICES|GPU_DEVICE_ORDINAL", _PLACEMENT),
        (r"NVIDIA_\w*|CUDA_MPS_\w*", _PLACEMENT),
    )
)  # fmt: skip


class NameRefused(ValueError):
    """An environment variable a task may not set; the message says which and why."""


def refusal(name: object) -> str | None:
    """Why a task cannot set `name`, as a sentence; None when it may."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        shown = repr(name)[:60]
        return (
            f"{shown} is not an environment variable name: use letters, digits and _, not starting "
            "with a digit (at most 128)."
        )
    for pattern, reason in REFUSED:
        if pattern.fullmatch(name):
            return f"{name} cannot be set by a task: {reason}. Choose another name."
    return None


def check_name(name: object) -> str:
    """The name, or NameRefused saying why it cannot be set."""
    why = refusal(name)
    if why:
        raise NameRefused(why)
    assert isinstance(name, str)
    return name


def check_value(name: str, value: object) -> str:
    """A value as the text the task gets; NameRefused for what no environment can hold."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise NameRefused(f"The value of {name} must be text or a number.")
    text = str(value)
    if "\x00" in text or len(text.encode()) > MAX_VALUE_BYTES:
        raise NameRefused(f"The value of {name} is text of at most {MAX_VALUE_BYTES} bytes, without NUL.")
    return text


def checked(environment: object, what: str = "The task's environment") -> dict[str, str]:
    """A task's environment, names and values checked, or NameRefused naming the first problem."""
    if environment is None:
        return {}
    if not isinstance(environment, Mapping):
        raise NameRefused(f'{what} must be an object of names to values, such as {{"EPOCHS": "3"}}.')
    if len(environment) > MAX_VARIABLES:
        raise NameRefused(f"{what} holds {len(environment)} variables; at most {MAX_VARIABLES}.")
    return {check_name(name): check_value(name, value) for name, value in environment.items()}
