#!/bin/sh
# `make image`: build the container image with podman on a machine without a Docker engine, then
# smoke-test it. Needs root, podman and debootstrap (Debian: apt-get install podman debootstrap).
#   deploy/image.sh IMAGE PYTHON
# 1. a local Debian base (deploy/image_base.sh; registry images cannot be pulled here);
# 2. this machine's CPU torch wheel into deploy/wheels/ (PyPI's Linux torch is the CUDA build);
# 3. podman build --isolation=chroot --format docker (OCI images drop HEALTHCHECK), timed;
# 4. the image's own command run from its mounted rootfs (podman image mount + chroot, as uid 1000,
#    with the image's environment), then the page and one /step_trace call (deploy/smoke.py).
set -eu
IMAGE=${1:?usage: deploy/image.sh IMAGE PYTHON}
PY=${2:?usage: deploy/image.sh IMAGE PYTHON}
BASE_IMAGE=${BASE_IMAGE:-localhost/dp-debian-python:bookworm}
TORCH_WHEEL=${TORCH_WHEEL:-torch==2.13.0+cpu}
cd "$(dirname "$0")/.."

sh deploy/image_base.sh "$BASE_IMAGE"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d deploy/wheels "$TORCH_WHEEL"
start=$(date +%s)
# The host's CA store is mounted for the build steps only (this network inspects TLS with its own CA).
podman build --isolation=chroot --format docker --volume /etc/ssl/certs:/etc/ssl/certs:ro --build-arg BASE="$BASE_IMAGE" \
  --build-arg TORCH_SPEC="$TORCH_WHEEL --find-links /wheels" -t "$IMAGE" .
echo "build: $(( $(date +%s) - start )) s"
podman image inspect --format 'size: {{.Size}} bytes' "$IMAGE"

sh deploy/image_smoke.sh "$IMAGE" "$PY"
