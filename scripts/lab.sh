#!/bin/sh
# JupyterLab over notebooks/ on 127.0.0.1, no browser opened: the command `make lab` runs (the Makefile puts
# Jupyter's config, data and runtime dirs under .jupyter/ first). Arguments go on to `jupyter lab` (--port=N).
# --allow-root: JupyterLab refuses to start as root without it ("Running as root is not recommended"), and
# containers often run as root; for any other user it changes nothing (only that check reads it).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
exec "$root/.venv/bin/jupyter" lab --ip=127.0.0.1 --no-browser --allow-root "$@" "$root/notebooks"
