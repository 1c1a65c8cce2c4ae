"""Batch scripts as the agent submits them and the plane previews them: the values a task's template sees,
the line that runs the task under the node reporter, and the command each scheduler submits it with."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.batch import (
    DEFAULT_TEMPLATES,
    Quoted,
    Unsafe,
    batch_request,
    exports,
    job_name,
    one_line,
    quote_command,
    render,
    render_isolated,
    safe,
)
from protocol.units import UNITS_PER_GPU

SCRIPT_ON_STDIN = frozenset({"lsf"})  # bsub reads #BSUB lines only from a script on stdin
APP_KEY_FILE = "app-key"  # in the task's folder: the key of an app's relay (agents.hpc.apps)


@dataclass
class ScriptSettings:
    """What rendering a cluster's scripts needs to know of it (the agent's settings carry more)."""

    jobs_dir: Path
    node_python: str = "python3"  # on the compute nodes
    report_url: str = ""  # the plane's address as compute nodes reach it
    allowed_roots: list[Path] = field(default_factory=list)
    container_runtime: str = "apptainer"  # apptainer, singularity or pyxis (Slurm)


def node_script(settings: ScriptSettings) -> Path:
    """Where compute nodes find the node reporter: a copy in the jobs folder, which is on the cluster's
    shared file system, so compute nodes need no Klique installed."""
    return settings.jobs_dir / ".klique" / "node.py"


@dataclass(frozen=True)
class Scripts:
    """Renders a task's batch script for one scheduler: the agent before submitting, the plane for
    validation and previews."""

    scheduler: str
    settings: ScriptSettings
    url: str
    isolated: bool = False  # the plane renders what it is handed in a process of its own (render_isolated)

    def _inside_roots(self, path: str, what: str) -> str:
        resolved = Path(one_line(path, what)).resolve()
        if not any(resolved.is_relative_to(root) for root in self.settings.allowed_roots):
            roots = ", ".join(str(root) for root in self.settings.allowed_roots)
            raise Unsafe(f"{what} {path!r} is outside the folders this cluster allows ({roots}).")
        return str(resolved)

    def _app_options(self, spec: Mapping[str, Any], folder: Path, nodes: int) -> list[str]:
        """An app's run: the node reporter picks its port there (unless its template fixed one) and opens
        the relay the agent reaches it through (agents.hpc.apps), with the run's key."""
        if nodes != 1:
            raise Unsafe(f"An app runs on one node; this one asks for {nodes}.")
        app = spec["app"]
        port = app.get("port") if isinstance(app, Mapping) else None
        if port is not None and (type(port) is not int or not 1024 <= port <= 65535):
            raise Unsafe("The app's port is not a port from 1024 to 65535.")
        return ["--app-port", str(port or "auto"), "--app-key-file", str(folder / APP_KEY_FILE)]

    def _run_line(self, spec: Mapping[str, Any], folder: Path, nodes: int, task_id: str) -> Quoted:
        command = quote_command(spec.get("command") or [])
        reporter = [
            self.settings.node_python, str(node_script(self.settings)),
            "--url", self.settings.report_url or self.url, "--task", task_id,
            "--token-file", str(folder / "token"), "--workdir", str(folder),
        ]  # fmt: skip
        code = spec.get("code") or {}
        if isinstance(code, Mapping) and code.get("path"):
            reporter += ["--chdir", self._inside_roots(str(code["path"]), "The code path")]
        for pattern in spec.get("outputs") or []:
            reporter += ["--output", one_line(pattern, "An output pattern")]
        if "app" in spec:
            reporter += self._app_options(spec, folder, nodes)
        image = spec.get("image")
        prefix: list[str] = []
        if image:
            image = str(image)
            if image.startswith("/") or image.endswith(".sif"):
                image = self._inside_roots(image, "The image")
            else:
                image = safe(image, "The image")
            runtime = self.settings.container_runtime
            if runtime == "pyxis" and self.scheduler == "slurm":
                steps = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", f"--container-image={image}"]
                return Quoted(
                    " ".join(shlex.quote(word) for word in [*reporter, "--", *steps]) + " " + command
                )
            prefix = [runtime if runtime != "pyxis" else "apptainer", "exec", "--nv", image]
        inner = " ".join(shlex.quote(word) for word in [*reporter, "--", *prefix]) + " " + command
        if self.scheduler == "slurm":  # one reporter per node, each reporting its own output
            return Quoted(f"srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 {inner}")
        return Quoted(inner)

    def script(self, assignment: Mapping[str, Any], account: str, folder: Path) -> tuple[str, dict[str, Any]]:
        """The job's batch script and the values it was rendered with, or Unsafe / TemplateInvalid."""
        spec = assignment.get("spec") or {}
        if not isinstance(spec, Mapping):
            raise Unsafe("The task's spec must be an object.")
        nodes = max(1, int(assignment.get("nodes") or 1))
        units = int(assignment["size_units"])
        if units % (UNITS_PER_GPU * nodes):
            raise Unsafe(
                f"{self.scheduler} pools take whole GPUs on each node; this task asks for "
                f"{units / UNITS_PER_GPU:g} GPUs on {nodes} node(s)."
            )
        batch = (assignment.get("batch") or {}).get(self.scheduler) or {}
        allowed = list(batch.get("allowed_directives") or [])
        request = batch_request(spec, allowed, batch.get("defaults") or {})
        task_id = str(assignment["task_id"])
        context = {
            "task_id": task_id,
            "job_name": job_name(task_id, str(assignment.get("name") or "")),
            "user": safe(account, "The account"),
            "nodes": nodes,
            "gpus_per_node": units // (UNITS_PER_GPU * nodes),
            "gpus": units // UNITS_PER_GPU,
            "gpu_type": request.gpu_type or str(assignment.get("mig_profile") or ""),
            "time_limit_minutes": request.time_limit_minutes,
            "partition": request.partition,
            "account": request.account,
            "directives": [Quoted(directive) for directive in request.directives],
            "workdir": safe(folder, "The jobs folder"),
            "output": safe(folder / "output.log", "The jobs folder"),
            "environment": exports(spec.get("environment") or {}),
            "run": self._run_line(spec, folder, nodes, task_id),
        }
        text = batch.get("template") or DEFAULT_TEMPLATES[self.scheduler]
        return (render_isolated if self.isolated else render)(text, context), context


def submit_command(scheduler: str, script: Path, context: Mapping[str, Any]) -> list[str]:
    """How the scheduler is handed the script at `script` rendered with `context` (Scripts.script): an
    argument list, never a shell line. LSF's bsub takes the script on stdin (SCRIPT_ON_STDIN)."""
    if scheduler == "slurm":
        return ["sbatch", "--parsable", str(script)]
    if scheduler == "pbs":
        # The size also goes on the command line: qsub options win over #PBS lines, and Slurm's PBS
        # wrapper reads only its options. Every value here passed protocol.batch.safe already.
        resources = f"nodes={context['nodes']}:gpus={context['gpus_per_node']}"
        if context["time_limit_minutes"]:
            resources += f",walltime={context['time_limit_minutes']}:00"
        argv = ["qsub", "-N", context["job_name"], "-l", resources, "-o", context["output"], "-j", "oe"]
        if context["partition"]:
            argv += ["-q", context["partition"]]
        if context["account"]:
            argv += ["-A", context["account"]]
        return [*argv, str(script)]
    if scheduler == "lsf":
        return ["bsub"]
    raise ValueError(f"Unknown scheduler {scheduler!r}: one of slurm, pbs, lsf.")
