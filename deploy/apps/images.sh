#!/usr/bin/env bash
# The images the shipped catalogue entries name (apps/catalogue/shipped.py), built on this host for its
# container engine, since no registry is reachable from most environments:
#   deploy/apps/images.sh DIR [jupyterlab|agent-sandbox|code-server|slurm|all]
#       localhost/klique-debian-python:12   Debian 12 (bookworm) from Debian's packages: Python 3, venv, git
#       localhost/klique-jupyter:4          that, with PyPI's jupyterlab 4 and ipykernel in /opt/jupyter
#       localhost/klique-agent-sandbox:1    that, with PyPI's openai client and httpx, for the agent-sandbox
#                                           entry (the coding agent itself is its user's to install)
#       localhost/klique-code-server:4      the base, with this host's Node.js 20 and npm's code-server built
#                                           for it (deploy/apps/code-server.sh) in /opt/code-server
#       localhost/klique-slurm:22.05        JupyterLab's, with Debian's Slurm 22.05 (slurmctld, slurmd and
#                                           its clients), munge and curl: the slurm entry's controller,
#                                           its login (JupyterLab's terminal) and its workers
#                                           (protocol/clusters.py's start script)
# DIR keeps the engine's settings (deploy/containers/podman.sh) and the build's scratch. Idempotent: an
# image the engine holds already is kept. Prints the containers.conf path last: give it to podman (and to
# the bare-metal agent) as CONTAINERS_CONF.
#
# The base is made with debootstrap from the mirror this host's apt uses; the Python packages are installed
# in a container of the base on the host's network (podman's build needs a registry for nothing here).
# code-server 4.100 wants Node.js 20, which Debian 12 does not package: its image takes the host's (the
# same Debian, so the same libraries) with the code-server built for it. The model servers' images are not
# built here: they want CUDA (docs/apps.md).
set -euo pipefail
dir=$(realpath -m "${1:?usage: images.sh DIR [jupyterlab|agent-sandbox|code-server|slurm|all]}")
which=${2:-all}
case "$which" in jupyterlab|agent-sandbox|code-server|slurm|all) ;; *) echo "unknown image $which" >&2; exit 2 ;; esac
here=$(cd "$(dirname "$0")" && pwd)
conf=$(bash "$here/../containers/podman.sh" setup "$dir" | tail -n 1)
export CONTAINERS_CONF="$conf"

base=localhost/klique-debian-python:12
jupyter=localhost/klique-jupyter:4
sandbox=localhost/klique-agent-sandbox:1
code_server=localhost/klique-code-server:4
slurm=localhost/klique-slurm:22.05
path=/opt/jupyter/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

mirror() {
  local found
  found=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$found" ] || found=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  echo "${found:-http://deb.debian.org/debian}"
}

# A container of IMAGE on the host's network runs SCRIPT; what it leaves is committed as NEW. It trusts
# what the host trusts (a TLS-inspecting proxy's authority, where the host has one), for the build only.
derive() {
  local image=$1 new=$2 script=$3 name authorities
  name="klique-build-$$"
  authorities=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
  local trust=()
  [ -f "$authorities" ] && trust=(-v "$authorities:/run/klique-build-ca.crt:ro" --env PIP_CERT=/run/klique-build-ca.crt)
  podman rm --force "$name" >/dev/null 2>&1 || true
  podman run --name "$name" --network host --env PIP_DISABLE_PIP_VERSION_CHECK=1 "${trust[@]}" "$image" \
    sh -c "$script" || { podman rm --force "$name" >/dev/null; exit 1; }
  podman commit --quiet --change "ENV PATH=$path" --change 'WORKDIR /work' "$name" "$new" >/dev/null
  podman rm "$name" >/dev/null
}

if ! podman image exists "$base"; then
  command -v debootstrap >/dev/null || {
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  }
  root=$(mktemp -d "$dir/rootfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,git,ca-certificates,procps \
    bookworm "$root" "$(mirror)" >"$dir/debootstrap.log" 2>&1 \
    || { tail -n 20 "$dir/debootstrap.log" >&2; exit 1; }
  rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*
  mkdir -p "$root/work"
  tar -C "$root" -c . | podman import --quiet --change "ENV PATH=$path" --change 'WORKDIR /work' - "$base" >/dev/null
  rm -rf "$root"
  trap - EXIT
fi

if [ "$which" != code-server ] && ! podman image exists "$jupyter"; then  # the sandbox and Slurm are made from it
  derive "$base" "$jupyter" \
    'python3 -m venv /opt/jupyter && /opt/jupyter/bin/pip install --quiet --no-cache-dir "jupyterlab>=4,<5" ipykernel'
fi

if { [ "$which" = agent-sandbox ] || [ "$which" = all ]; } && ! podman image exists "$sandbox"; then
  derive "$jupyter" "$sandbox" '/opt/jupyter/bin/pip install --quiet --no-cache-dir "openai>=1,<3" httpx'
fi

if { [ "$which" = code-server ] || [ "$which" = all ]; } && ! podman image exists "$code_server"; then
  program=$(bash "$here/code-server.sh" "$dir/code-server" | tail -n 1)
  built=$(dirname "$(dirname "$(dirname "$program")")")  # DIR of DIR/node_modules/.bin/code-server
  name="klique-build-$$"
  podman rm --force "$name" >/dev/null 2>&1 || true
  podman create --name "$name" --network host "$base" sh -c \
    'export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq --no-install-recommends libgssapi-krb5-2 ripgrep >/dev/null 2>&1 && rm -rf /var/lib/apt/lists/*' \
    >/dev/null
  podman cp "$(readlink -f "$(command -v node)")" "$name:/usr/local/bin/node"
  podman cp "$built" "$name:/opt/code-server"
  podman start --attach "$name" || { podman rm --force "$name" >/dev/null; exit 1; }
  podman commit --quiet --change "ENV PATH=/opt/code-server/node_modules/.bin:$path" --change 'WORKDIR /work' \
    "$name" "$code_server" >/dev/null
  podman rm "$name" >/dev/null
fi
if { [ "$which" = slurm ] || [ "$which" = all ]; } && ! podman image exists "$slurm"; then
  derive "$jupyter" "$slurm" \
    'export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge curl ca-certificates >/dev/null && rm -rf /var/lib/apt/lists/* /etc/munge/munge.key'
fi
echo "$conf"
