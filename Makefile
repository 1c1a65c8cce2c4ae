# Klique's commands. `make demo` runs it, `make test` tests it; both install what they need first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS := server,embedded,agent,kubernetes,cloud,dev

.PHONY: demo test lint bench install lock clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements/constraints.txt frontend/package-lock.json tools/mcp-conformance/package-lock.json
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c requirements/constraints.txt -e '.[$(EXTRAS)]'
	@command -v npm >/dev/null || { echo "npm is needed for the portal's front-end packages: install Node.js 20 (with npm)"; exit 1; }
	cd frontend && npm ci --no-audit --no-fund --loglevel=error
	cd tools/mcp-conformance && npm ci --no-audit --no-fund --loglevel=error  # the MCP conformance suite (on Node 22)
	$(BIN)/python tools/kube_tools.py .tools  # the real helm and kubectl the charts are tested with
	touch $@

demo: install
	$(BIN)/klique up --demo

test: install
	$(BIN)/pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy .
	$(BIN)/lint-imports  # the layers of docs/architecture.md (contracts in pyproject.toml)

# Figures printed beside their baselines; each ends with a `ratio:` line. Needs PostgreSQL and Redis on
# 127.0.0.1 for request_path.py.
bench: install
	$(BIN)/python bench/scheduler_cycle.py
	$(BIN)/python bench/trace_replay.py
	$(BIN)/python bench/request_path.py
	$(BIN)/python bench/gateway_overhead.py
	$(BIN)/python bench/metering_ingest.py
	$(BIN)/python bench/idle_gpus.py
	$(BIN)/python bench/kubernetes_dispatch.py
	$(BIN)/python bench/mcp_calls.py
	$(BIN)/python bench/autoscale.py
	$(BIN)/python bench/drain.py
	$(BIN)/python bench/agents_connected.py
	$(BIN)/python bench/tenants_at_rest.py
	$(BIN)/python bench/app_route.py
	$(BIN)/python bench/app_relay.py
	$(BIN)/python bench/model_endpoint.py

lock:
	{ echo '# Pinned versions of everything Klique installs; `make lock` regenerates this from the virtual environment.'; \
	  $(BIN)/python -m pip freeze --exclude-editable | grep -v '^-e'; } > requirements/constraints.txt

clean:
	rm -rf $(VENV) .klique
