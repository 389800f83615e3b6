#!/usr/bin/env bash
# Start JupyterLab on the course: it opens on your copy of chapter 00, work/chapters/00_orientation.ipynb
# (launch/jupyter_server_config.py).
# HEADLESS=1 for a server: no browser, prints the URL to open. It listens on 127.0.0.1 only
# (LAB_PORT, default 8888): reach it through an SSH tunnel, ssh -L 8888:localhost:8888 host,
# so that no one else on the network can reach it. LAB_IP=0.0.0.0 listens on all interfaces.
# Extra arguments go to `jupyter lab`.
set -euo pipefail
cd "$(dirname "$0")/.."
# Install (or update) .venv only when it is missing or older than what it is built from:
# the same rule as `make setup`, so a lab on an installed machine starts offline, at once.
# LAB_SETUP=0 skips this check (tests/test_lab.py).
STAMP=.venv/.ultrascale-installed
if [ "${LAB_SETUP:-1}" != "0" ] && { [ ! -x .venv/bin/jupyter ] || [ ! -f "$STAMP" ] || [ -n "$(find \
    requirements.txt requirements-dev.txt pyproject.toml launch/setup.sh -newer "$STAMP")" ]; }; then
  bash launch/setup.sh
  touch "$STAMP"
fi
# The learner works in copies: work/chapters and work/exercises (git-ignored), made on the first
# start and refreshed on every start where the course changed and the copy was not edited
# (lib/ultrascale/workspace.py), so the lab never changes a tracked notebook and `git pull` never
# conflicts. LAB_COPIES=0 skips this.
if [ "${LAB_COPIES:-1}" != "0" ]; then
  .venv/bin/python -m ultrascale.workspace --root . --quiet | sed 's/^/[lab] /'
fi
# The notebooks use the kernel "python3": let .venv's kernelspecs (the course's Python,
# registered by setup.sh) win over any python3 kernel in ~/.local/share/jupyter.
export JUPYTER_PREFER_ENV_PATH=1
ARGS=(--config=launch/jupyter_server_config.py --ServerApp.root_dir=.)
if [ "${HEADLESS:-0}" = "1" ]; then
  LAB_IP="${LAB_IP:-127.0.0.1}"
  if [ "$LAB_IP" = "127.0.0.1" ] || [ "$LAB_IP" = "localhost" ]; then
    echo "[lab] listening on $LAB_IP only: from another machine, tunnel with ssh -L ${LAB_PORT:-8888}:localhost:${LAB_PORT:-8888} $(hostname)"
  else
    echo "[lab] listening on $LAB_IP (LAB_IP): reachable from the network, by anyone who has the token"
  fi
  ARGS+=(--no-browser --ip="$LAB_IP" --port="${LAB_PORT:-8888}")
else
  ARGS+=(--ServerApp.open_browser=True)
fi
if [ "$(id -u)" = "0" ]; then
  echo "[lab] running as root (a container?): passing --allow-root, which Jupyter refuses to start without"
  ARGS+=(--allow-root)
fi
exec .venv/bin/jupyter lab "${ARGS[@]}" "$@"
