#!/usr/bin/env bash
# The GPU tier in one command: the NCCL tests, then the benchmark comparison on NCCL (one rank per GPU),
# the small preset too. Needs the test environment (the README's second command) and CUDA, or an existing
# CUDA torch: PYTHON=python3 PYTHONPATH=. bash tests/gpu/run.sh (as on the lent H100: one rank per GPU).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m pytest -q -s tests/gpu
"$PY" benchmarks/rtp/compare.py --device cuda --strategies dp fsdp rtp --chart "${OUT:-/tmp}/compare_cuda.png"
"$PY" benchmarks/rtp/compare.py --device cuda --preset small --strategies dp fsdp rtp --chart "${OUT:-/tmp}/compare_cuda_small.png"
