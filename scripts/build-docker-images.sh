#!/usr/bin/env bash
# Builds the Docker images the Docker provider's tests and benchmark use, without any registry:
# each is a tarball made from this machine's own files, loaded with `docker import`.
#   sandbox-middleware/busybox:test  Debian's busybox-static (/bin/busybox) with its applets, an
#                                    /etc/passwd with a non-root user `sandbox` (uid 1000), USER unset
#   sandbox-middleware/python:test   the same, plus this machine's /usr/bin/python3 and its standard
#                                    library and shared libraries; USER sandbox
# Arguments name the images to build (busybox, python; default both). An image that already exists
# is kept (FORCE=1 rebuilds). DOCKER_HOST is honoured, so a private daemon can be given them too. Needs the docker CLI and busybox-static (apt-get install
# docker.io busybox-static).
set -euo pipefail
docker=(docker)
busybox="${BUSYBOX:-/bin/busybox}"
python="${IMAGE_PYTHON:-/usr/bin/python3}"
exists() { [ -z "${FORCE:-}" ] && "${docker[@]}" image inspect "$1" >/dev/null 2>&1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
wanted=" ${*:-busybox python} "

base() {  # $1: root directory to fill with busybox and a minimal /etc
  local root="$1"
  mkdir -p "$root"/{bin,etc,tmp,workspace,home/sandbox,proc,sys,dev}
  chmod 1777 "$root/tmp"
  cp "$busybox" "$root/bin/busybox"
  local applets
  applets="$("$busybox" --list)"  # a busybox that cannot run fails the build here (set -e), not an image later
  for applet in $applets; do
    [ -e "$root/bin/$applet" ] || ln -s busybox "$root/bin/$applet"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/home/sandbox:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$root/etc/passwd"
  printf 'root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n' >"$root/etc/group"
  chown 1000:1000 "$root/home/sandbox"
}

if [[ "$wanted" == *" busybox "* ]] && ! exists sandbox-middleware/busybox:test; then
  base "$work/busybox"
  tar -C "$work/busybox" -c . | "${docker[@]}" import --change 'CMD ["/bin/sh"]' - sandbox-middleware/busybox:test >/dev/null
  echo "built sandbox-middleware/busybox:test" >&2
fi

if [[ "$wanted" == *" python "* ]] && ! exists sandbox-middleware/python:test; then
  root="$work/python"
  base "$root"
  real="$(readlink -f "$python")"
  version="$("$real" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
  stdlib="$("$real" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')"
  mkdir -p "$root$(dirname "$real")" "$root$stdlib"
  cp "$real" "$root$real"
  ln -sf "$real" "$root/bin/python3"
  # the standard library without tests, caches and site-packages
  tar -C "$stdlib" --exclude=test --exclude=__pycache__ --exclude=site-packages --exclude=dist-packages \
    --exclude=idlelib --exclude=tkinter --exclude=ensurepip -c . | tar -C "$root$stdlib" -x
  # the shared libraries of the interpreter and of its extension modules
  { ldd "$real"; find "$stdlib/lib-dynload" -name '*.so' -exec ldd {} \; 2>/dev/null; } \
    | grep -o '/[^ ]*' | sort -u | while read -r lib; do
      [ -e "$lib" ] || continue
      mkdir -p "$root$(dirname "$lib")"
      cp -L "$lib" "$root$lib"
    done
  tar -C "$root" -c . | "${docker[@]}" import --change 'USER sandbox' --change 'CMD ["/bin/python3"]' \
    - sandbox-middleware/python:test >/dev/null
  echo "built sandbox-middleware/python:test (Python $version)" >&2
fi
