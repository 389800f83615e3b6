#!/usr/bin/env bash
# Start JupyterLab on the course. HEADLESS=1 for a server: no browser, listens on
# all interfaces (reach it through an SSH tunnel: ssh -L 8888:localhost:8888 host).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
ARGS=(--notebook-dir=. --ServerApp.open_browser=True)
if [ "${HEADLESS:-0}" = "1" ]; then
  ARGS=(--notebook-dir=. --no-browser --ip="${LAB_IP:-0.0.0.0}" --port="${LAB_PORT:-8888}")
fi
exec .venv/bin/jupyter lab "${ARGS[@]}" "$@" chapters/00_orientation.ipynb
