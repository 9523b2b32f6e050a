#!/usr/bin/env bash
# The oldest supported torch: scripts/check_torch.sh with VERSION defaulting to 2.11.0.
#   bash scripts/check_oldest_torch.sh [VERSION [PYTEST_ARGS...]]
exec bash "$(dirname "$0")/check_torch.sh" "${1:-2.11.0}" "${@:2}"
