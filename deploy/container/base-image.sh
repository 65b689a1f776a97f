#!/usr/bin/env bash
# Makes the base image the Containerfile names (docker.io/library/debian:bookworm-slim) from
# Debian's packages, for machines that reach a Debian mirror but no container registry: a
# minimal bookworm root filesystem made with debootstrap from the mirror apt already uses,
# imported into podman under the public image's name. Elsewhere the public image is pulled and
# this script is not needed. Nothing is done when the image is already there.
set -euo pipefail

image="${1:-docker.io/library/debian:bookworm-slim}"
if podman image exists "$image"; then
  echo "Base image $image is already there."
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }

# The mirror is apt's own (deb822 .sources files or one-line .list files), never a host name
# written here: the first Debian archive that is not the security one.
mirror=$(
  {
    grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}'
    grep -hE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
      | sed -E 's/^deb (\[[^]]*\] )?//' | awk '{print $1}'
  } | grep -v -- '-security' | grep -m1 -E '/debian/?$' || true
)
[[ -n "$mirror" ]] || { echo "No Debian mirror found in apt's sources." >&2; exit 1; }

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "Building $image with debootstrap from $mirror (a few minutes, once)…"
debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 \
  || { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
# As in the public slim image: no package lists or caches kept, the mirror as apt's source.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
  "$root"/var/log/*.log "$root"/var/log/apt/* "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" -c . | podman import --change 'CMD ["bash"]' - "$image" >/dev/null
echo "Base image $image is ready."
