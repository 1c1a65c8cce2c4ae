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

import functools
import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import SandboxedEnvironment

from protocol import environment as task_environment

SCHEDULERS = ("slurm", "pbs", "lsf")

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


# Limits of a template's rendering. A template may come from a member (a batch preview) and renders in
# the web process's checks and the agent; these keep any template from taking the process's time or
# memory: every operator and call that can make a large value is bounded before it runs, and the plane
# renders templates it was handed in a process of its own under a time and memory limit (render_isolated).
MAX_TEXT = 256 * 1024  # characters of any value a template makes, and of the script
MAX_NUMBER_BITS = 256  # a number a template computes
MAX_ARGUMENT = 10_000  # a number given to a filter or method (widths, counts)
MAX_RANGE = 10_000  # items of range()
TIME_LIMIT_SECONDS = 0.5  # rendering in the isolated process
MEMORY_LIMIT_BYTES = 512 * 1024 * 1024  # the isolated process's address space
PERCENT_SPEC = re.compile(r"%[#0 +\-]*(\d*)(?:\.(\d*))?")


def _limit(what: str) -> TemplateInvalid:
    return TemplateInvalid(f"{what}; templates are rendered within limits (docs/hpc.md).")


def _sized(value: Any) -> Any:
    """A value a template made, if it is within the limits."""
    if isinstance(value, str | list | tuple | dict) and len(value) > MAX_TEXT:
        raise _limit(f"the template made a value of {len(value)} items or characters, above {MAX_TEXT}")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_NUMBER_BITS:
        raise _limit(f"the template made a number above {MAX_NUMBER_BITS} bits")
    return value


def _arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int | float) and not isinstance(value, bool) and abs(value) > MAX_ARGUMENT:
            raise _limit(f"the template passed {value} to a filter or method, above {MAX_ARGUMENT}")


def _bounded_filter(function: Any) -> Any:
    @functools.wraps(function)  # keeps jinja's pass_context and pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _arguments(args[1:], kwargs)  # the first is the value filtered
        return _sized(function(*args, **kwargs))

    return bounded


def _bounded_range(*args: int) -> range:
    found = range(*args)
    if len(found) > MAX_RANGE:
        raise _limit(f"range() of {len(found)} items, above {MAX_RANGE}")
    return found


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would pass the limits, before it is computed."""
    sequences = (str, list, tuple)
    if operator == "**" and _is_number(left) and _is_number(right):
        if abs(right) * math.log2(abs(left) + 1) > MAX_NUMBER_BITS:
            raise _limit(f"{left} ** {right} is above {MAX_NUMBER_BITS} bits")
    elif operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if (
                isinstance(sequence, sequences)
                and isinstance(count, int)
                and len(sequence) * count > MAX_TEXT
            ):
                raise _limit(f"repeating a value {count} times makes more than {MAX_TEXT} items")
    elif operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        if len(left) + len(right) > MAX_TEXT:
            raise _limit(f"joining two values makes more than {MAX_TEXT} items")
    elif operator == "%" and isinstance(left, str):
        for width, precision in PERCENT_SPEC.findall(left):
            if max(int(width or 0), int(precision or 0)) > MAX_ARGUMENT:
                raise _limit(f"a % format asks for a width above {MAX_ARGUMENT}")


class BoundedSandbox(SandboxedEnvironment):
    """Jinja2's sandbox, with every operator, filter and call that can make a large value bounded."""

    intercepted_binops = frozenset({"**", "*", "+", "%", "//"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filters = {name: _bounded_filter(function) for name, function in self.filters.items()}
        self.globals["range"] = _bounded_range

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _sized(super().call_binop(context, operator, left, right))

    def call(self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _arguments(args, kwargs)
        if getattr(__obj, "__name__", "") == "format" and isinstance(getattr(__obj, "__self__", None), str):
            for spec in re.findall(r"\{[^{}]*:([^{}]*)\}", __obj.__self__):
                if any(int(number) > MAX_ARGUMENT for number in re.findall(r"\d+", spec)):
                    raise _limit(f"a format asks for a width above {MAX_ARGUMENT}")
        return _sized(super().call(__context, __obj, *args, **kwargs))


def _environment() -> SandboxedEnvironment:
    return BoundedSandbox(
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
    script = render_isolated(text, sample_context(scheduler))
    if not script.startswith("#!"):
        raise TemplateInvalid("A batch script must start with #! (for example #!/bin/bash).")


def render(text: str, context: Mapping[str, Any]) -> str:
    """The script, or TemplateInvalid / Unsafe saying what is wrong (in this process: for templates
    already checked by the plane; the plane itself renders what it is handed with render_isolated)."""
    try:
        script = ENVIRONMENT.from_string(text).render(**context)
    except jinja2.TemplateSyntaxError as error:
        raise TemplateInvalid(f"line {error.lineno}: {error.message}") from None
    except jinja2.UndefinedError as error:
        raise TemplateInvalid(f"{error.message}; the names a template may use are in docs/hpc.md.") from None
    except jinja2.exceptions.SecurityError as error:
        raise TemplateInvalid(f"the sandbox refused: {error}") from None
    except RecursionError:
        raise _limit("the template calls itself too deeply") from None
    except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as error:
        if isinstance(error, Unsafe | TemplateInvalid):
            raise
        raise TemplateInvalid(f"the template failed: {type(error).__name__}: {str(error)[:300]}") from None
    if len(script) > MAX_TEXT:
        raise _limit(f"the script is {len(script)} characters, above {MAX_TEXT}")
    return script


def _encoded(value: Any) -> Any:
    if isinstance(value, Quoted):
        return {"quoted": str(value)}
    if isinstance(value, list | tuple):
        return [_encoded(item) for item in value]
    return value


def _decoded(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"quoted"}:
        return Quoted(value["quoted"])
    if isinstance(value, list):
        return [_decoded(item) for item in value]
    return value


def render_isolated(text: str, context: Mapping[str, Any]) -> str:
    """render() in a process of its own, killed past its limits: what the plane does with a template it was
    handed (a member's preview, an admin's draft), so that no template can hold the web process's time
    or memory. The answer comes within about a second whatever the template does."""
    request = json.dumps({"text": text, "context": {key: _encoded(value) for key, value in context.items()}})
    try:
        finished = subprocess.run(
            [sys.executable, "-I", "-m", "protocol.template_worker"],
            input=request.encode(),
            capture_output=True,
            timeout=TIME_LIMIT_SECONDS + 3,  # the worker stops itself at the limit; this is the backstop
            env={"PATH": os.defpath, "LANG": "C.UTF-8"},
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise _limit(f"the template took longer than {TIME_LIMIT_SECONDS} s to render") from None
    try:
        answer = json.loads(finished.stdout)
    except ValueError:
        if finished.returncode < 0 or b"MemoryError" in finished.stderr:
            raise _limit(f"the template used more than {MEMORY_LIMIT_BYTES // 2**20} MB") from None
        raise TemplateInvalid("the template could not be rendered; see the plane's log") from None
    if "script" in answer:
        return str(answer["script"])
    if "unsafe" in answer:
        raise Unsafe(str(answer["unsafe"]))
    raise TemplateInvalid(str(answer.get("invalid", "the template could not be rendered")))


def render_in_worker(request: Mapping[str, Any]) -> dict[str, str]:
    """The isolated process's side of render_isolated: one rendering, its answer as JSON-able data."""
    context = {key: _decoded(value) for key, value in request["context"].items()}
    try:
        return {"script": render(str(request["text"]), context)}
    except Unsafe as error:
        return {"unsafe": str(error)}
    except TemplateInvalid as error:
        return {"invalid": str(error)}
    except MemoryError:
        return {"invalid": str(_limit(f"the template used more than {MEMORY_LIMIT_BYTES // 2**20} MB"))}


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
