#!/usr/bin/env bash
# Podman for the bare-metal backend's container mode, on one machine (root, no systemd, no registry).
#   deploy/containers/podman.sh setup DIR [IMAGE]
#       install podman, runc and catatonit if needed (Debian's packages); write DIR/containers.conf, the
#       engine settings these machines need; build IMAGE (default localhost/klique-busybox:1), a tiny
#       image from Debian's static busybox, unless the engine holds it already.
# Idempotent. Prints the containers.conf path last: give it to podman as CONTAINERS_CONF.
#
# Why the settings: crun, podman's default runtime, refuses these machines' hybrid cgroup layout, and the
# default container rlimits cannot be set inside this sandbox; runc with cgroupfs and no default ulimits
# runs containers. A host with its own working podman needs none of this: Klique uses the engine as it is
# configured there.
set -euo pipefail
action=${1:?setup}
dir=$(realpath -m "${2:?a folder for the engine settings}")
image=${3:-localhost/klique-busybox:1}
[ "$action" = setup ] || { echo "unknown action $action: setup" >&2; exit 2; }

if ! command -v podman >/dev/null || ! command -v runc >/dev/null \
   || ! dpkg -s busybox-static >/dev/null 2>&1 \
   || { [ ! -x /usr/libexec/podman/catatonit ] && ! command -v catatonit >/dev/null; }; then
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc catatonit busybox-static >/dev/null
fi

mkdir -p "$dir"
conf="$dir/containers.conf"
cat > "$conf.tmp" <<'EOF'
[containers]
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[engine.runtimes]
runc = ["/usr/sbin/runc", "/usr/bin/runc"]
EOF
mv "$conf.tmp" "$conf"
export CONTAINERS_CONF="$conf"

if ! podman image exists "$image"; then
  root=$(mktemp -d "$dir/rootfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  mkdir -p "$root/bin" "$root/tmp" "$root/work"
  cp /bin/busybox "$root/bin/busybox"  # busybox-static's: it needs no library in the image
  for applet in sh echo cat env ls true false sleep id printf test wc head tail mkdir touch kill; do
    ln -s busybox "$root/bin/$applet"
  done
  tar -C "$root" -c . | podman import --quiet --change 'ENV PATH=/bin' - "$image" >/dev/null
fi
echo "$conf"
