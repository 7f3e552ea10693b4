#!/bin/sh
# Smoke-test a built image without a container runtime: its own command, run from its mounted
# rootfs (podman image mount + chroot as uid 1000, with the image's environment), must answer the
# page and one /step_trace call (deploy/smoke.py). Needs root.
#   deploy/image_smoke.sh IMAGE PYTHON
set -eu
IMAGE=${1:?usage: deploy/image_smoke.sh IMAGE PYTHON}
PY=${2:?usage: deploy/image_smoke.sh IMAGE PYTHON}
PORT=${PORT:-7861}
cd "$(dirname "$0")/.."

# The image's environment and command, as a container runtime would apply them.
ENVS=$(podman image inspect --format '{{range .Config.Env}}{{.}} {{end}}' "$IMAGE")
CMD=$(podman image inspect --format '{{range .Config.Cmd}}{{.}} {{end}}' "$IMAGE")
WORKDIR=$(podman image inspect --format '{{.Config.WorkingDir}}' "$IMAGE")
ROOT=$(podman image mount "$IMAGE")
LOG=build/image-smoke.log
mkdir -p build
# A private mount namespace: /proc, /dev, /etc/hosts and writable tmpfs for /tmp and HOME vanish with it.
# shellcheck disable=SC2086
unshare --mount --propagation private sh -c '
  set -e
  mount -t proc proc "$1/proc"; mount --rbind /dev "$1/dev"
  mount --bind /etc/hosts "$1/etc/hosts"  # a container runtime writes this file; the image has it empty
  mount -t tmpfs tmpfs "$1/tmp"; mount -t tmpfs -o uid=1000,gid=1000 tmpfs "$1/home/app"
  cd "$1"
  exec chroot --userspec=1000:1000 "$1" env -i $2 GRADIO_SERVER_PORT="$3" HF_HUB_OFFLINE=1 \
    sh -c "cd $4 && exec $5"
' smoke "$ROOT" "$ENVS" "$PORT" "$WORKDIR" "$CMD" > "$LOG" 2>&1 &
APP=$!
status=0
"$PY" -m deploy.smoke "http://127.0.0.1:$PORT/" --wait 300 || status=$?
kill "$APP" 2>/dev/null || true
wait "$APP" 2>/dev/null || true
podman image unmount "$IMAGE" > /dev/null
tail -n 5 "$LOG"
[ "$status" -eq 0 ] && echo "smoke test: passed" || echo "smoke test: FAILED (log: $LOG)"
exit "$status"
