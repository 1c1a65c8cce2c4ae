#!/usr/bin/env bash
# code-server (VS Code in the browser) for a bare-metal pool's host (apps run the host's programs where
# their entry names no image):
#   deploy/apps/code-server.sh DIR    npm's code-server in DIR, built for this host's Node.js
# Idempotent: an install that already answers `code-server --version` is kept. Prints the path of its
# `code-server` program, for the command of a catalogue entry.
#
# What the build needs beyond Node.js 20 and npm: a C++ toolchain and Kerberos headers for its native
# modules, and ripgrep. code-server's own install fetches ripgrep from GitHub, which these machines do
# not reach; Debian's ripgrep is put where that install looks first (its download cache), so nothing is
# fetched from outside the npm registry.
set -euo pipefail
dir=$(realpath -m "${1:?usage: code-server.sh DIR}")
version=${CODE_SERVER_VERSION:-4.100.3}  # the last releases for Node.js 20 (later ones ask for 22 or 24)
program="$dir/node_modules/.bin/code-server"
if "$program" --version >/dev/null 2>&1; then
  echo "$program"
  exit 0
fi

if ! command -v rg >/dev/null || ! command -v g++ >/dev/null || ! command -v make >/dev/null \
   || [ ! -e /usr/include/gssapi/gssapi.h ]; then
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ripgrep g++ make libkrb5-dev pkg-config >/dev/null
fi

# The ripgrep release code-server 4.100's @vscode/ripgrep (1.15.11) asks for, from Debian's rg, in the
# cache it reads before it downloads. (Another code-server version may ask for another: its install then
# fails saying which release it could not fetch.)
cache="${TMPDIR:-/tmp}/vscode-ripgrep-cache-1.15.11"
archive="$cache/ripgrep-v13.0.0-10-$(uname -m)-unknown-linux-musl.tar.gz"
if [ ! -s "$archive" ]; then
  mkdir -p "$cache"
  staging=$(mktemp -d)
  cp "$(command -v rg)" "$staging/rg"
  tar czf "$archive.tmp" -C "$staging" rg
  mv "$archive.tmp" "$archive"
  rm -rf "$staging"
fi

mkdir -p "$dir"
cd "$dir"
[ -f package.json ] || echo '{"private": true}' > package.json
# code-server's postinstall refuses to run without unsafe-perm (as root), and node-pty's runs `npx node-gyp`.
npm_config_unsafe_perm=true npm_config_yes=true \
  npm install --no-audit --no-fund --loglevel=error "code-server@$version" >/dev/null
"$program" --version >/dev/null
echo "$program"
