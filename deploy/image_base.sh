#!/bin/sh
# A local base image for `make image`: registry images cannot be pulled on the build machine, so
# debootstrap a Debian bookworm rootfs (python3 + venv, CA certificates) from Debian's mirror and
# `podman import` it as $BASE_IMAGE. Skipped when the image already exists. Needs root.
#   deploy/image_base.sh [BASE_IMAGE]
set -eu
BASE_IMAGE=${1:-localhost/dp-debian-python:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if podman image exists "$BASE_IMAGE"; then
  echo "base image $BASE_IMAGE exists"
  exit 0
fi
ROOTFS=$(mktemp -d /var/tmp/dp-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$ROOTFS" "$MIRROR"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE"
