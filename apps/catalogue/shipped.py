"""The entries shipped with Klique: templates every tenant's catalogue lists beside its own entries.

Their images are the host's (or its agent's image archives'): no registry is reachable from most
environments, so each entry names the image an operator builds or loads. deploy/apps/images.sh builds
JupyterLab's, the agent sandbox's, code-server's and Slurm's from Debian's packages, PyPI and npm.
"""

from __future__ import annotations

from typing import Any

from protocol.apps import Template

SHIPPED_BY = "klique"

DOCUMENTS: tuple[dict[str, Any], ...] = (
    {
        "name": "jupyterlab",
        "version": "4",
        "title": "JupyterLab",
        "kind": "ide",
        "description": "Notebooks, a terminal and a file browser; the project's shared files at their usual "
        "path, your vault secrets in the environment.",
        "image": "localhost/klique-jupyter:4",
        "command": [
            "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", "--port={port}", "--ServerApp.token=",
            "--ServerApp.password=", "--ServerApp.disable_check_xsrf=False", "--ServerApp.root_dir=/work",
            "--ServerApp.trust_xheaders=True", "--ServerApp.allow_remote_access=True", "--allow-root",
        ],
        "health": {"path": "/api", "startup_seconds": 300},
        "gpus": "0",
        "idle_timeout_seconds": 3600,
    },
    {
        "name": "agent-sandbox",
        "version": "1",
        "title": "Agent sandbox",
        "kind": "agent",
        "description": "A sandbox for a coding agent (Codex CLI, aider, OpenHands, ...): JupyterLab's "
        "terminal and files in a container, the project's shared files at their usual path, your vault "
        "secrets in the environment, and OPENAI_BASE_URL and OPENAI_API_KEY set to the tenant's gateway "
        "with a key of the session's own: it spends at most its quota and dies when the session stops.",
        "image": "localhost/klique-agent-sandbox:1",
        "command": [
            "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", "--port={port}", "--ServerApp.token=",
            "--ServerApp.password=", "--ServerApp.root_dir=/work", "--ServerApp.trust_xheaders=True",
            "--ServerApp.allow_remote_access=True", "--allow-root",
        ],
        "health": {"path": "/api", "startup_seconds": 300},
        "gpus": "0",
        "gateway_session": {"tokens": 2000000},
        "idle_timeout_seconds": 3600,
    },
    {
        "name": "code-server",
        "version": "4",
        "title": "VS Code in the browser",
        "kind": "ide",
        "description": "code-server: VS Code in the browser, on the project's shared files.",
        "image": "localhost/klique-code-server:4",
        "command": [
            "code-server", "--bind-addr=127.0.0.1:{port}", "--auth=none", "--disable-telemetry", "/work",
        ],
        "health": {"path": "/healthz", "startup_seconds": 300},
        "gpus": "0",
        "idle_timeout_seconds": 3600,
    },
    {
        "name": "vllm",
        "version": "0.6",
        "title": "vLLM model endpoint",
        "kind": "model",
        "description": "An OpenAI-compatible endpoint for a model, served by vLLM on the app's GPUs.",
        "image": "localhost/klique-vllm:0.6",
        "command": [
            "sh", "-c",
            'exec vllm serve "$MODEL" --host 127.0.0.1 --port "$PORT" --served-model-name "$SERVED_NAME" '
            "--enable-sleep-mode",
        ],
        "health": {"path": "/health", "startup_seconds": 1800},
        "gpus": "1",
        "variables": [
            {"name": "MODEL", "description": "The model to serve: a path on the shared files, or a Hugging "
             "Face id the host can reach.", "required": True},
            {"name": "SERVED_NAME", "description": "The model's name in the API.", "default": "model"},
        ],
        "idle_timeout_seconds": 1800,
        "serves": {"model_variable": "SERVED_NAME", "mode": "chat", "when_idle": "scale_to_zero"},
    },
    {
        "name": "sglang",
        "version": "0.3",
        "title": "SGLang model endpoint",
        "kind": "model",
        "description": "An OpenAI-compatible endpoint for a model, served by SGLang on the app's GPUs.",
        "image": "localhost/klique-sglang:0.3",
        "command": [
            "sh", "-c", 'exec python3 -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 '
            '--port "$PORT" --served-model-name "$SERVED_NAME"',
        ],
        "health": {"path": "/health", "startup_seconds": 1800},
        "gpus": "1",
        "variables": [
            {"name": "MODEL", "description": "The model to serve.", "required": True},
            {"name": "SERVED_NAME", "description": "The model's name in the API.", "default": "model"},
        ],
        "idle_timeout_seconds": 1800,
        "serves": {"model_variable": "SERVED_NAME", "mode": "chat", "when_idle": "scale_to_zero"},
    },
    {
        "name": "llama-cpp",
        "version": "b3600",
        "title": "llama.cpp model endpoint",
        "kind": "model",
        "description": "llama.cpp's OpenAI-compatible server for a GGUF model; runs on CPUs or GPUs.",
        "image": "localhost/klique-llama-cpp:b3600",
        "command": [
            "sh", "-c",
            'exec llama-server -m "$MODEL" --host 127.0.0.1 --port "$PORT" --alias "$SERVED_NAME"',
        ],
        "health": {"path": "/health", "startup_seconds": 900},
        "gpus": "0",
        "variables": [
            {"name": "MODEL", "description": "The GGUF file, on the shared files.", "required": True},
            {"name": "SERVED_NAME", "description": "The model's name in the API.", "default": "model"},
        ],
        "idle_timeout_seconds": 1800,
        "serves": {"model_variable": "SERVED_NAME", "mode": "chat", "when_idle": "scale_to_zero"},
    },
    {
        "name": "k3k",
        "version": "1",
        "title": "Kubernetes cluster (K3k)",
        "kind": "cluster",
        "description": "A Kubernetes cluster of your own, made by K3k on a Kubernetes pool's nodes (its "
        "servers and workers are pods there; its workers share the app's GPUs). Its API is at the app's "
        "address: point kubectl at it with a Klique token of yours. Its state goes when it stops.",
        "image": "registry.k8s.io/kubectl:v1.34.1",
        "command": [
            "kubectl", "proxy", "--address=127.0.0.1", "--port={port}", "--disable-filter=true",
        ],
        "health": {"path": "/version", "startup_seconds": 1800},
        "gpus": "1",
        "cluster": {"service": "k3k", "servers": 1, "agents": 1},
    },
    {
        "name": "slurm",
        "version": "22.05",
        "title": "Slurm cluster",
        "kind": "cluster",
        "description": "A Slurm cluster of your own on a Kubernetes pool: its controller, and JupyterLab "
        "at the app's address as its login, where your sbatch scripts run unchanged in the terminal. Its "
        "nodes are Klique tasks of 1 GPU each, up to 4, started as jobs wait for them and given back after "
        "5 idle minutes; they count against your policies like any task.",
        "image": "localhost/klique-slurm:22.05",
        "command": [
            "sh", "/var/run/klique/slurm/start", "controller", "--",
            "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", "--port={port}", "--ServerApp.token=",
            "--ServerApp.password=", "--ServerApp.trust_xheaders=True",
            "--ServerApp.allow_remote_access=True", "--allow-root",
        ],  # in its task's folder, which its worker nodes mount at the same path: jobs run where submitted
        "health": {"path": "/api", "startup_seconds": 300},
        "gpus": "0",
        "cluster": {
            "service": "slurm", "workers": 4, "worker_gpus": 1, "worker_cpus": 4, "idle_seconds": 300,
        },
    },
)  # fmt: skip

TEMPLATES: dict[str, Template] = {document["name"]: Template.parse(document) for document in DOCUMENTS}
