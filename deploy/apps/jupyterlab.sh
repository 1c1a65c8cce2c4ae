#!/usr/bin/env bash
# JupyterLab for a bare-metal pool's host (apps run the host's programs where their entry names no image):
#   deploy/apps/jupyterlab.sh DIR    a virtual environment in DIR with PyPI's jupyterlab and ipykernel
# Idempotent: an environment that already answers `jupyter lab --version` is kept. Prints the path of its
# `jupyter` program, for the command of a catalogue entry.
set -euo pipefail
dir="${1:?usage: jupyterlab.sh DIR}"
python="${PYTHON:-python3}"
if ! "$dir/bin/jupyter" lab --version >/dev/null 2>&1; then
  "$python" -m venv "$dir"
  "$dir/bin/pip" install --quiet --disable-pip-version-check "jupyterlab>=4,<5" ipykernel
fi
echo "$dir/bin/jupyter"
