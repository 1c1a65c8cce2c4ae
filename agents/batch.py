"""Batch scripts for Slurm, PBS and LSF: sandboxed Jinja2 templates fed only checked or quoted values.

A compute resource may carry a template per scheduler; without one, the default below is used. The
template sees:

    task_id, job_name, user            the task, its job name (safe characters only) and Linux account
    nodes, gpus_per_node, gpus         its size, whole GPUs
    gpu_type                           a MIG profile or GPU type asked for, or ""
    time_limit_minutes                 from the task, else the compute resource's default, else 0 (none)
    partition, account                 Slurm partition / PBS queue / LSF queue, and the charge account
    directives                         extra options the task asked for that the template allows
    workdir, output                    the task's folder on the cluster and its output file
    environment                        export lines for the task's environment values (quoted)
    run                                the line that runs the task under Klique's node reporter (quoted)

Every value that comes from a task is either checked against a small safe alphabet (letters, digits and
`_ . , : = + @ % / -`) or shell-quoted by Klique before the template sees it; anything else makes the
rendering fail rather than reach a shell. Newlines in any task value are refused: a line that starts with
`#SBATCH` must never be smuggled into a script. The template itself runs in Jinja2's sandbox, with
undefined names an error.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import SandboxedEnvironment

from protocol import environment as task_environment

SCHEDULERS = ("slurm", "pbs", "lsf")
UNITS_PER_GPU = 840

SAFE = re.compile(r"[A-Za-z0-9_/][A-Za-z0-9_.,:=+@%/-]{0,199}")  # never a leading "-": no options
OPTION = re.compile(r"-{1,2}[A-Za-z][A-Za-z0-9-]{0,40}")
# Options a template can never let a task set: they would change who runs the job, where its output
# goes or what runs, which Klique decides.
NEVER_ALLOWED = frozenset(
    {
        "--uid", "--gid", "--output", "-o", "--error", "-e", "--chdir", "-D", "--wrap", "--export",
        "--job-name", "-J", "-N", "--nodes", "--gpus", "--gpus-per-node", "--gres", "-G", "--account",
        "-A", "--partition", "-p", "-q", "-P", "-u", "-U", "-v", "-V", "-W", "-cwd", "-wd", "-gpu", "-n",
    }
)  # fmt: skip
REQUIRED_NAMES = ("nodes", "run")  # a template must place the task's size and run it

DEFAULT_TEMPLATES = {
    "slurm": """#!/bin/bash
#SBATCH --job-name={{ job_name }}
#SBATCH --nodes={{ nodes }}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={% if gpu_type %}{{ gpu_type }}:{% endif %}{{ gpus_per_node }}
#SBATCH --output={{ output }}
#SBATCH --chdir={{ workdir }}
{% if partition %}#SBATCH --partition={{ partition }}
{% endif %}{% if account %}#SBATCH --account={{ account }}
{% endif %}{% if time_limit_minutes %}#SBATCH --time={{ time_limit_minutes }}
{% endif %}{% for directive in directives %}#SBATCH {{ directive }}
{% endfor %}
{{ environment }}
{{ run }}
""",
    "pbs": """#!/bin/bash
#PBS -N {{ job_name }}
#PBS -l nodes={{ nodes }}:gpus={{ gpus_per_node }}
{%- if time_limit_minutes %},walltime={{ time_limit_minutes }}:00{% endif %}
#PBS -o {{ output }}
#PBS -j oe
{% if partition %}#PBS -q {{ partition }}
{% endif %}{% if account %}#PBS -A {{ account }}
{% endif %}{% for directive in directives %}#PBS {{ directive }}
{% endfor %}
cd {{ workdir }}
{{ environment }}
{{ run }}
""",
    "lsf": """#!/bin/bash
#BSUB -J {{ job_name }}
#BSUB -nnodes {{ nodes }}
#BSUB -n {{ nodes }}
#BSUB -R "span[ptile=1]"
#BSUB -gpu "num={{ gpus_per_node }}:mode=exclusive_process"
#BSUB -o {{ output }}
#BSUB -cwd {{ workdir }}
{% if partition %}#BSUB -q {{ partition }}
{% endif %}{% if account %}#BSUB -P {{ account }}
{% endif %}{% if time_limit_minutes %}#BSUB -W {{ time_limit_minutes }}
{% endif %}{% for directive in directives %}#BSUB {{ directive }}
{% endfor %}
{{ environment }}
{{ run }}
""",
}  # fmt: skip


class Unsafe(ValueError):
    """A value cannot go into a batch script; the message says which and why."""


class TemplateInvalid(ValueError):
    """A template that does not compile or does not place what it must."""


class Quoted(str):
    """Text Klique built and quoted itself; the template prints it as it is."""


def safe(value: object, what: str) -> str:
    """The value as text if it uses only the safe alphabet, else Unsafe naming it."""
    text = str(value)
    if not SAFE.fullmatch(text):
        raise Unsafe(
            f"{what} {text[:60]!r} cannot go into a batch script: use letters, digits and "
            "_ . , : = + @ % / - (at most 200, no spaces, quotes, $, backticks or newlines)."
        )
    return text


def one_line(value: object, what: str) -> str:
    text = str(value)
    if any(character in text for character in "\n\r\x00"):
        raise Unsafe(
            f"{what} holds a newline or NUL; batch scripts take one-line values (pass text in a file)."
        )
    return text


def _finalize(value: Any) -> Any:
    """Every `{{ }}` output passes here: Klique's quoted text and numbers as they are, text only if safe."""
    if isinstance(value, jinja2.Undefined):
        return str(value)  # StrictUndefined raises, naming what is undefined
    if isinstance(value, Quoted):
        return str(value)
    if isinstance(value, bool) or value is None:
        return "" if not value else "1"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return safe(value, "A value") if value else ""
    raise Unsafe(f"A template printed a {type(value).__name__}; print single values only.")


def _environment() -> SandboxedEnvironment:
    return SandboxedEnvironment(
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        finalize=_finalize,
    )


ENVIRONMENT = _environment()


def check_directives(allowed_directives: Sequence[str]) -> None:
    """Raise TemplateInvalid for an option that is malformed or that Klique must decide itself."""
    for option in allowed_directives:
        if not OPTION.fullmatch(option):
            raise TemplateInvalid(f"Allowed directive {option!r} is not an option such as --qos or -l.")
        if option in NEVER_ALLOWED:
            raise TemplateInvalid(
                f"Directive {option} cannot be left to tasks: Klique sets the job's size, account, "
                "partition, user and output itself."
            )


def check_template(text: str, scheduler: str, allowed_directives: Sequence[str] = ()) -> None:
    """Raise TemplateInvalid unless the template compiles, uses the task's size and run line, and
    renders a sample task into a script that starts with #!."""
    if scheduler not in SCHEDULERS:
        raise TemplateInvalid(f"Unknown scheduler {scheduler!r}: use one of {', '.join(SCHEDULERS)}.")
    check_directives(allowed_directives)
    try:
        parsed = ENVIRONMENT.parse(text)
    except jinja2.TemplateSyntaxError as error:
        raise TemplateInvalid(f"line {error.lineno}: {error.message}") from None
    names = jinja2.meta.find_undeclared_variables(parsed)
    missing = [name for name in REQUIRED_NAMES if name not in names]
    if not {"gpus_per_node", "gpus"} & names:
        missing.append("gpus_per_node (or gpus)")
    if missing:
        raise TemplateInvalid(
            f"The template must use {', '.join(missing)}: a job without the task's size or its run line "
            "would not be the task Klique placed."
        )
    script = render(text, sample_context(scheduler))
    if not script.startswith("#!"):
        raise TemplateInvalid("A batch script must start with #! (for example #!/bin/bash).")


def render(text: str, context: Mapping[str, Any]) -> str:
    """The script, or TemplateInvalid / Unsafe saying what is wrong."""
    try:
        return ENVIRONMENT.from_string(text).render(**context)
    except jinja2.TemplateSyntaxError as error:
        raise TemplateInvalid(f"line {error.lineno}: {error.message}") from None
    except jinja2.UndefinedError as error:
        raise TemplateInvalid(f"{error.message}; the names a template may use are in docs/hpc.md.") from None
    except jinja2.exceptions.SecurityError as error:
        raise TemplateInvalid(f"the sandbox refused: {error}") from None
    except (TypeError, ValueError, ArithmeticError) as error:
        if isinstance(error, Unsafe):
            raise
        raise TemplateInvalid(str(error)) from None


@dataclass(frozen=True)
class BatchRequest:
    """What a task asks of the batch system, checked: partition, account, time limit, extra directives."""

    partition: str = ""
    account: str = ""
    time_limit_minutes: int = 0
    directives: tuple[str, ...] = ()
    gpu_type: str = ""


def batch_request(
    spec: Mapping[str, Any], allowed_directives: Sequence[str], defaults: Mapping[str, Any]
) -> BatchRequest:
    """Read `spec["batch"]` (with the compute resource's defaults under it), refusing what is unsafe."""
    asked = spec.get("batch") or {}
    if not isinstance(asked, Mapping):
        raise Unsafe('The task\'s "batch" must be an object: {"partition": ..., "time_limit_minutes": ...}.')
    unknown = set(asked) - {"partition", "account", "time_limit_minutes", "directives", "gpu_type"}
    if unknown:
        raise Unsafe(f"Unknown batch settings: {', '.join(sorted(unknown))}.")
    merged = {**defaults, **asked}
    minutes = merged.get("time_limit_minutes") or 0
    if not isinstance(minutes, int) or isinstance(minutes, bool) or not 0 <= minutes <= 525_600:
        raise Unsafe("time_limit_minutes must be a whole number of minutes (at most a year).")
    directives = []
    asked_directives = merged.get("directives") or {}
    if not isinstance(asked_directives, Mapping):
        raise Unsafe('batch.directives must be an object such as {"--qos": "high"}.')
    for option, value in sorted(asked_directives.items()):
        if option not in allowed_directives:
            allowed = ", ".join(allowed_directives) or "none"
            raise Unsafe(
                f"Directive {option!r} is not allowed by this compute resource (allowed: {allowed})."
            )
        text = safe(value, f"The value of {option}")
        directives.append(f"{option}={text}" if option.startswith("--") else f"{option} {text}")
    return BatchRequest(
        partition=safe(merged["partition"], "The partition") if merged.get("partition") else "",
        account=safe(merged["account"], "The account") if merged.get("account") else "",
        time_limit_minutes=minutes,
        directives=tuple(directives),
        gpu_type=safe(merged["gpu_type"], "The GPU type") if merged.get("gpu_type") else "",
    )


def exports(environment: Mapping[str, Any]) -> Quoted:
    """`export NAME='value'` lines; names checked by the one rule (protocol.environment), values quoted."""
    try:
        variables = task_environment.checked(environment)
    except task_environment.NameRefused as error:
        raise Unsafe(str(error)) from None
    lines = [
        f"export {name}={shlex.quote(one_line(value, f'The value of {name}'))}"
        for name, value in sorted(variables.items())
    ]
    return Quoted("\n".join(lines))


def quote_command(words: Sequence[Any]) -> Quoted:
    if not isinstance(words, list | tuple) or not words or not all(isinstance(word, str) for word in words):
        raise Unsafe('The task has no command: its spec needs "command": ["program", "argument", ...].')
    return Quoted(" ".join(shlex.quote(one_line(word, "An argument of the command")) for word in words))


def job_name(task_id: str, name: str) -> str:
    """klique-<first 8 of the id>-<the task's name in safe characters>, at most 64 characters."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")
    return f"klique-{task_id[:8]}" + (f"-{cleaned}" if cleaned else "")[:50]


def sample_context(scheduler: str) -> dict[str, Any]:
    """A made-up task for validation and previews."""
    return {
        "task_id": "00000000-0000-0000-0000-000000000000",
        "job_name": "klique-00000000-sample",
        "user": "someone",
        "nodes": 2,
        "gpus_per_node": 4,
        "gpus": 8,
        "gpu_type": "",
        "time_limit_minutes": 60,
        "partition": "gpu",
        "account": "research",
        "directives": [],
        "workdir": "/cluster/klique/jobs/00000000-0000-0000-0000-000000000000",
        "output": "/cluster/klique/jobs/00000000-0000-0000-0000-000000000000/output.log",
        "environment": Quoted("export EXAMPLE=value"),
        "run": Quoted(f"# ({scheduler}) the task's command runs here under klique's node reporter"),
    }
