#!/usr/bin/env bash
# Sets up the machine (scripts/setup.sh) and runs the Fashion-MNIST example; arguments go to
# examples/fashion_mnist.py (e.g. --help).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/fashion_mnist.py "$@"
