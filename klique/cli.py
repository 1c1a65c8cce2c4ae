"""The `klique` command: the control plane's processes (web, worker, beat, up) and the provider's tools.

The server subcommands start Django in child processes; this module itself imports no Django, so the
same command works where only the SDK and agent are installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from klique.commands import HANDLERS, add_commands, run
from klique.embedded import EmbeddedServiceError, ensure_services
from klique.preflight import PreflightError, check_database, check_redis

DEFAULT_SETTINGS = "config.settings.local"


class ProcessSet:
    """Child processes started in their own sessions, so that this process alone decides how they stop.
    One that ends by itself may be started again (`restart`), a few times in a while at most."""

    RESTARTS = 5  # at most this many starts again of one child ...
    RESTART_WINDOW_SECONDS = 300.0  # ... within this long; more means it cannot run, and `up` stops

    def __init__(self) -> None:
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self._how: dict[str, tuple[list[str], dict[str, str] | None, Path | None]] = {}
        self._restarts: dict[str, list[float]] = {}

    def start(
        self, name: str, argv: Sequence[str], env: dict[str, str] | None = None, log: Path | None = None
    ) -> None:
        """Start a child; its output goes to this process's, or to `log` (a stand-in's chatter)."""
        self._how[name] = (list(argv), env, log)
        if log is None:
            self.children[name] = subprocess.Popen(list(argv), start_new_session=True, env=env)
            return
        with open(log, "ab") as output:
            self.children[name] = subprocess.Popen(
                list(argv), start_new_session=True, env=env, stdout=output, stderr=subprocess.STDOUT
            )

    def first_exited(self) -> str | None:
        return next((name for name, child in self.children.items() if child.poll() is not None), None)

    def restart(self, name: str) -> bool:
        """Start an ended child again as it was first started; False when it has ended too often lately."""
        now = time.monotonic()
        recent = [at for at in self._restarts.get(name, []) if now - at < self.RESTART_WINDOW_SECONDS]
        if len(recent) >= self.RESTARTS:
            return False
        self._restarts[name] = [*recent, now]
        argv, env, log = self._how[name]
        self.start(name, argv, env, log)
        return True

    def stop(self, grace_seconds: float = 20) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for child in self.children.values():
            remaining = max(0.1, deadline - time.monotonic())
            try:
                child.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


# Started again when they end by themselves: their work is in the database and the broker, so a new one
# picks up where the old one was (a worker that ended itself, stalled after a Redis restart, comes back);
# an agent's is in its state, and a new one takes its runs back (one whose state could not be written
# ends itself: agents.main.STATE_LOST_EXIT).
RESTARTED = frozenset({"web", "worker", "beat", "agent", "autoscaler"})


def _server_environment() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", DEFAULT_SETTINGS)


def _manage_argv(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "django", *arguments]


WEB_POOL_SIZE = "10"  # PostgreSQL connections shared by one web process's request threads


def _web_argv(host: str, port: int, workers: int = 1) -> list[str]:
    os.environ.setdefault("KLIQUE_DB_POOL_SIZE", WEB_POOL_SIZE)
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "config.asgi:application",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--no-access-log",
        "--lifespan",
        "off",
        "--proxy-headers",
        # A stop (a deploy, Ctrl-C) waits this long for open requests and websockets, then ends them.
        "--timeout-graceful-shutdown",
        "30",
        # uvicorn's own lines propagate to the root logger that Django configures (JSON in production).
        "--log-config",
        str(Path(__file__).resolve().parent / "uvicorn_logging.json"),
    ]


def _celery_argv(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "config", *arguments, "--loglevel", "INFO"]


def _worker_argv(concurrency: int) -> list[str]:
    # No gossip, mingle or worker heartbeats: they are broadcasts over Redis pub/sub that Klique does not
    # use, and a Redis restart under them can end the worker (see CELERY_WORKER_ENABLE_REMOTE_CONTROL).
    return _celery_argv(
        "worker", "--concurrency", str(concurrency), "--hostname", "klique@%h",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    )  # fmt: skip


def _beat_argv(data_dir: Path) -> list[str]:
    return _celery_argv("beat", "--schedule", str(data_dir / "celerybeat-schedule"))


def _agent_argv(demo: dict[str, Any], port: int, data_dir: Path) -> list[str]:
    """The demo's bare-metal agent for lab-h100, with a configured inventory (no GPU needed); its token in
    a file only this account reads, never on the command line."""
    token_file = _secret_file(data_dir / "agent.token", demo["agent_token"])
    return [
        sys.executable,
        "-m",
        "agents.main",
        "--url",
        f"http://{demo['tenant_address']}:{port}",
        "--token-file",
        str(token_file),
        "--gpus",
        "8",
        "--agent-id",
        "demo-lab-h100",
        "--work-dir",
        str(data_dir / "agent"),
        "--grace-seconds",
        "5",
    ]


DEMO_CLOUD_REGION = "eu-west-1"
DEMO_AUTOSCALER = "demo-cloud-a100"


def _secret_file(path: Path, secret: str) -> Path:
    """A file only this account reads, holding `secret`."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secret)
    return path


def _start_demo_cloud(demo: dict[str, Any], port: int, data_dir: Path, children: ProcessSet) -> bool:
    """The demo's cloud pool, cloud-a100: moto's EC2 as the cloud (no cloud is reachable from a laptop's
    demo), the pool's real autoscaler, and this host as its instances' machines (agents.cloud.local runs
    each instance's user data). Left out, with a note, where moto is not installed."""
    import importlib.util

    if os.environ.get("KLIQUE_DEMO_CLOUD", "1") == "0":
        print("The demo's cloud pool stays offline (KLIQUE_DEMO_CLOUD=0).", flush=True)
        return False
    moto_server = Path(sys.executable).parent / "moto_server"
    if importlib.util.find_spec("boto3") is None or not moto_server.exists():
        print(
            "The demo's cloud pool stays offline: install moto[server] and boto3 to autoscale it.", flush=True
        )
        return False
    import boto3

    endpoint_port = _free_port()
    keys = {
        "AWS_ACCESS_KEY_ID": "demo",
        "AWS_SECRET_ACCESS_KEY": "demo",
        "AWS_DEFAULT_REGION": DEMO_CLOUD_REGION,
    }
    environment = {**os.environ, **keys}
    children.start(
        "cloud",
        [str(moto_server), "-H", "127.0.0.1", "-p", str(endpoint_port)],
        env=environment,
        log=data_dir / "cloud-endpoint.log",
    )
    endpoint = f"http://127.0.0.1:{endpoint_port}"
    client = boto3.client(
        "ec2", region_name=DEMO_CLOUD_REGION, endpoint_url=endpoint,
        aws_access_key_id=keys["AWS_ACCESS_KEY_ID"], aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            image = client.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
            break
        except Exception:
            if time.monotonic() > deadline:
                raise PreflightError("The demo's EC2 stand-in (moto) did not start within 30 s.") from None
            time.sleep(0.3)
    agent = f"{shlex.quote(sys.executable)} -m agents.main"
    config = data_dir / "cloud-a100.toml"
    config.write_text(
        "[agent.cloud]\n"
        f'region = "{DEMO_CLOUD_REGION}"\nendpoint_url = "{endpoint}"\nimage = "{image}"\n'
        'instance_type = "p4d.24xlarge"\nmax_instances = 2\nidle_timeout_seconds = 60\n'
        "boot_timeout_seconds = 120\ntick_seconds = 2\n"
        "[agent.cloud.bootstrap]\n"
        f'install = ""\nagent_command = {json.dumps(agent)}\n'
        f"work_dir = {json.dumps(str(data_dir / 'cloud' / '{name}'))}\n"
        'agent_args = ["--gpus", "8", "--grace-seconds", "5"]\n'
    )
    token_file = _secret_file(data_dir / "cloud-a100.token", demo["cloud_token"])
    children.start(
        "cloud-machines",
        [sys.executable, "-m", "agents.cloud.local", "--endpoint", endpoint, "--region", DEMO_CLOUD_REGION,
         "--tag", f"klique:autoscaler={DEMO_AUTOSCALER}", "--root", str(data_dir / "cloud")],
        env=environment,
    )  # fmt: skip
    children.start(
        "autoscaler",
        [sys.executable, "-m", "agents.main", "--url", f"http://{demo['tenant_address']}:{port}",
         "--token-file", str(token_file), "--backend", "cloud", "--config", str(config),
         "--agent-id", DEMO_AUTOSCALER, "--work-dir", str(data_dir / "autoscaler")],
        env=environment,
    )  # fmt: skip
    return True


def _start_demo_agents(
    demo: dict[str, Any], port: int, data_dir: Path, children: ProcessSet
) -> frozenset[str]:
    """The demo's agents; the pools they bring online."""
    children.start("agent", _agent_argv(demo, port, data_dir))
    if _start_demo_cloud(demo, port, data_dir, children):
        return frozenset({"lab-h100", "cloud-a100"})
    return frozenset({"lab-h100"})


def _preflight() -> None:
    check_database()
    check_redis()


def _exec(argv: list[str]) -> int:
    _server_environment()
    _preflight()
    os.execv(argv[0], argv)
    return 0  # not reached


def _wait_until_ready(url: str, children: ProcessSet, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (exited := children.first_exited()) is not None:
            raise PreflightError(f"The {exited} process exited while starting; its output above says why.")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise PreflightError(f"The web process did not become ready at {url} within {timeout:.0f} s.")


def _wait_for_demo_agent(
    demo: dict[str, Any], port: int, children: ProcessSet, pools: frozenset[str], timeout: float = 60
) -> None:
    """The sample tasks go in once the demo's agents have brought its pools online, so they run there."""
    headers = {"Host": f"{demo['tenant_address']}:{port}", "Authorization": f"Bearer {demo['admin_token']}"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (exited := children.first_exited()) is not None:
            raise PreflightError(f"The {exited} process exited while starting; its output above says why.")
        try:
            listed = httpx.get(f"http://127.0.0.1:{port}/api/v1/pools/", headers=headers, timeout=5).json()
            online = {pool["name"] for pool in listed.get("results", []) if pool["online"]}
            if pools <= online:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    raise PreflightError(
        f"The demo's agents did not bring pools {', '.join(sorted(pools))} online within a minute; see their "
        "output."
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _banner(demo: dict[str, Any] | None, port: int) -> str:
    lines = ["", "Klique is up. Press Ctrl-C to stop.", ""]
    base = f"http://localhost:{port}"
    lines.append(f"  Provider API:  {base}/api/v1/provider/tenants/   docs: {base}/api/docs/")
    if demo:
        tenant_url = f"http://{demo['tenant_address']}:{port}"
        lines += [
            f"  Demo tenant:   {tenant_url}/api/v1/   (admin: {demo['admin']})",
            f"  Admin token:   {demo['admin_token']}",
            f"  Provider token: {demo['provider_token']}",
            "",
            f"  Portal:        {tenant_url}/portal/   (sign in: {demo['admin']} / {demo['admin_password']})",
            f"  Platform Management Center: {base}/portal/   "
            f"(sign in: {demo['provider']} / {demo['provider_password']})",
            "",
            "  Try:",
            f"    curl -H 'Authorization: Bearer {demo['admin_token']}' {tenant_url}/api/v1/tenant/",
            f"    export KLIQUE_URL={tenant_url} KLIQUE_TOKEN={demo['admin_token']}",
            "    klique queues; klique tasks",
            "",
            "  The LLM gateway (OpenAI's API; your token is the key):",
            f"    curl -H 'Authorization: Bearer {demo['admin_token']}' \\",
            f"      -H 'Content-Type: application/json' {tenant_url}/v1/chat/completions \\",
            """      -d '{"model": "demo-echo", "messages": [{"role": "user", "content": "hello"}]}'""",
        ]
    return "\n".join(lines) + "\n"


def supervise(children: ProcessSet, stopping: Callable[[], bool]) -> bool:
    """Watch the children until asked to stop (False), starting an ended web, worker, beat or agent again;
    True when one ended that cannot be started again (the others are then stopped)."""
    while not stopping():
        if (exited := children.first_exited()) is not None:
            code = children.children[exited].returncode
            if exited in RESTARTED and children.restart(exited):
                print(f"The {exited} process ended (exit code {code}); starting it again.", file=sys.stderr)
                continue
            print(f"The {exited} process stopped (exit code {code}); stopping the others.", file=sys.stderr)
            return True
        time.sleep(0.2)
    return False


def command_up(args: argparse.Namespace) -> int:
    """Run everything on one machine: embedded services where none is configured, then web, worker, beat."""
    _server_environment()
    data_dir = Path(args.data_dir or os.environ.get("KLIQUE_DATA_DIR", ".klique")).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    os.environ["KLIQUE_DATA_DIR"] = str(data_dir)
    services = ensure_services(data_dir, prefer_local=False)
    children = ProcessSet()
    stopping = False

    def request_stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        if services.started:
            print(f"Started embedded {' and '.join(services.started)} in {data_dir}", flush=True)
        _preflight()
        subprocess.run(_manage_argv("migrate_schemas", "--noinput", "-v", "0"), check=True)
        demo = None
        if args.demo:
            # The demo gateway's model: a local OpenAI-compatible server (gateway.echo).
            model_port = _free_port()
            children.start("model", [sys.executable, "-m", "gateway.echo", "--port", str(model_port)])
            model_url = f"http://127.0.0.1:{model_port}/v1"
            output = subprocess.run(
                _manage_argv("demo_setup", "--model-url", model_url),
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            demo = json.loads(output.strip().splitlines()[-1])
        children.start("web", _web_argv(args.host, args.port))
        children.start("worker", _worker_argv(args.concurrency))
        children.start("beat", _beat_argv(data_dir))
        pools = _start_demo_agents(demo, args.port, data_dir, children) if demo else frozenset()
        _wait_until_ready(f"http://127.0.0.1:{args.port}/readyz", children)
        if demo:
            _wait_for_demo_agent(demo, args.port, children, pools)
            subprocess.run(_manage_argv("demo_setup", "--tasks"), check=True, capture_output=True, text=True)
        print(_banner(demo, args.port), flush=True)
        if supervise(children, lambda: stopping):
            return 1
        print("Stopping Klique...", flush=True)
        return 0
    except (PreflightError, EmbeddedServiceError) as error:
        print(f"klique up: {error}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as error:
        detail = (error.stderr or "").strip().splitlines()[-1:] if isinstance(error.stderr, str) else []
        print(
            f"klique up: setting up failed ({' '.join(map(str, error.cmd[3:]))}). {' '.join(detail)}",
            file=sys.stderr,
        )
        return 2
    finally:
        children.stop()
        services.stop()


def command_manage(arguments: list[str]) -> int:
    _server_environment()
    try:
        _preflight()
    except PreflightError as error:
        print(f"klique: {error}", file=sys.stderr)
        return 2
    return subprocess.call(_manage_argv(*arguments))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="klique", description="Klique: one queue model over every GPU.")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="run the whole control plane on this machine")
    up.add_argument("--demo", action="store_true", help="also create the demo tenant and print a token")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--concurrency", type=int, default=2, help="Celery worker processes")
    up.add_argument("--data-dir", default=None, help="where embedded services keep data (default .klique)")
    web = commands.add_parser("web", help="serve HTTP and websockets (ASGI)")
    web.add_argument("--host", default="127.0.0.1")
    web.add_argument("--port", type=int, default=8000)
    web.add_argument("--workers", type=int, default=1)
    worker = commands.add_parser("worker", help="run a Celery worker")
    worker.add_argument("--concurrency", type=int, default=2)
    commands.add_parser("beat", help="run Celery beat (periodic work)")
    migrate = commands.add_parser(
        "migrate", help="migrate the public schema, then every tenant schema in parallel (resumable)"
    )
    migrate.add_argument("--processes", type=int, default=None, help="tenant schemas migrated at once")
    add_commands(commands)
    for name, help_text in (
        ("tenant", "create, list, suspend, resume, delete tenants"),
        ("provider-admin", "create a provider admin and print a token"),
        ("manage", "run any Django management command"),
    ):
        passthrough = commands.add_parser(name, help=help_text, add_help=False)
        passthrough.add_argument("arguments", nargs=argparse.REMAINDER)
    return parser


def _beat(args: argparse.Namespace) -> int:
    data_dir = Path(os.environ.get("KLIQUE_DATA_DIR", ".klique")).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    return _exec(_beat_argv(data_dir))


COMMANDS: dict[str, Any] = {
    "up": command_up,
    "web": lambda args: _exec(_web_argv(args.host, args.port, args.workers)),
    "worker": lambda args: _exec(_worker_argv(args.concurrency)),
    "beat": _beat,
    "migrate": lambda args: command_manage(
        ["migrate_tenants", *(["--processes", str(args.processes)] if args.processes is not None else [])]
    ),
    "tenant": lambda args: command_manage(["tenant", *args.arguments]),
    "provider-admin": lambda args: command_manage(["provider_admin", *args.arguments]),
    "manage": lambda args: command_manage(args.arguments),
    **dict.fromkeys(HANDLERS, run),
}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse the command line; whatever follows a bare `--` is the command a task runs, kept verbatim."""
    words = list(argv)
    tail: list[str] = []
    if "--" in words:
        cut = words.index("--")
        words, tail = words[:cut], words[cut + 1 :]
    args = build_parser().parse_args(words)
    if tail:
        if args.command != "submit":
            build_parser().error(
                f"only `klique submit` takes a command after --, not `klique {args.command}`"
            )
        args.argv = tail
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return int(COMMANDS[args.command](args))
    except PreflightError as error:
        print(f"klique: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
