#!/usr/bin/env bash
# The whole default test suite on one torch release (CPU), in a venv of its own:
#   bash scripts/check_torch.sh VERSION [PYTEST_ARGS...]       # e.g. 2.11.0, 2.14.1, 2.15.0
# It installs torch==VERSION, then the project with its test extra and torchtitan as the README's
# test command does, then runs `python -m pytest -q` in the checkout this script lies in (after a
# line naming its torch and commit, for the record: docs/torch_versions.md). To test a
# fixed commit while the tree is being edited, run it from a worktree of that commit:
#   git worktree add /tmp/tp-2.15.0 HEAD && bash /tmp/tp-2.15.0/scripts/check_torch.sh 2.15.0
# VENV=/path picks the venv (default /tmp/venv-torch-VERSION; reused if it exists). The registry's
# wheels other than +cpu ones are CUDA builds (about 3 GB of nvidia-* libraries): they run on the
# CPU. Every pip command here runs under a constraint torch==VERSION, which keeps the resolver from
# swapping torch for another release and replaces a site-wide constraints file (one that caps torch
# below VERSION) for these commands only. Not part of CI: .ci/run stays on torch 2.13.0.
set -euo pipefail
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: bash scripts/check_torch.sh VERSION [PYTEST_ARGS...]   (e.g. 2.15.0)" >&2
    exit 2
fi
version="$1"
shift
cd "$(dirname "$0")/.."
venv="${VENV:-/tmp/venv-torch-$version}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
echo "torch==$version" >"$venv/torch-constraint.txt"
export PIP_CONSTRAINT="$venv/torch-constraint.txt"
py="$venv/bin/python"
"$py" -m pip install "torch==$version"
"$py" -m pip install -e ".[test]" && "$py" -m pip install --no-deps torchtitan==0.3.0
got="$("$py" -c 'import torch; print(torch.__version__)')"
case "$got" in
"$version" | "$version"+*) ;;
*)
    echo "asked for torch $version, the venv has torch $got" >&2
    exit 1
    ;;
esac
commit="$(git rev-parse --short HEAD 2>/dev/null || echo 'no git')"
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    commit="$commit with uncommitted changes"
fi
"$py" -c "import tile_pass, torch; print('torch', torch.__version__, '| tile_pass from', tile_pass.__file__)"
echo "at commit $commit"
"$py" -m pytest -q "$@"
