#!/usr/bin/env bash
# Build the local control plane's binaries from the Go modules in devcluster/gobuild into a
# version-keyed cache outside the repo. Skips binaries that are already built.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
K8S_VERSION=1.36.3; ETCD_VERSION=3.6.14; KWOK_VERSION=0.8.0; HELM_VERSION=3.21.4
cache=${BATON_CACHE:-$HOME/.cache/baton}
bin=${BATON_K8S_BIN:-$cache/k8s-bin/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION}
export GOMODCACHE=${GOMODCACHE_OVERRIDE:-$cache/gomod} GOCACHE=${GOCACHE_OVERRIDE:-$cache/gocache}
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
if [ "${1:-}" = "--print-bin" ]; then echo "$bin"; exit 0; fi
stages=(node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml
        pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml)
need=()
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm; do
  [ -x "$bin/$b" ] || need+=("$b")
done
need_stages=0
for s in "${stages[@]}"; do [ -f "$bin/kwok-stages/${s##*/}" ] || need_stages=1; done
if [ ${#need[@]} -eq 0 ] && [ $need_stages -eq 0 ]; then echo "devcluster: all binaries present in $bin"; exit 0; fi
command -v go >/dev/null || { echo "build.sh: Go is not installed (need go >= 1.26 on PATH to build ${need[*]:-kwok stages})" >&2; exit 2; }
mkdir -p "$bin"
echo "devcluster: building ${need[*]:-kwok stages} into $bin (cold builds take many minutes on 2 cores)"
# Per-binary build times are appended to build-times.tsv (bench/cluster.py reports them).
step() {
  local t0=$SECONDS name=$1; echo "devcluster: [$(date +%T)] building $name ..."; shift; "$@"
  echo "devcluster: [$(date +%T)] done in $((SECONDS-t0)) s"
  printf '%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$name" "$((SECONDS-t0))" >> "$bin/build-times.tsv"
}
probe_proxy() {
  (cd "$here/gobuild/k8s" && go mod download k8s.io/kubernetes) >/dev/null 2>&1 || {
    echo "build.sh: cannot download Go modules (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))" >&2; exit 3; }
}
probe_proxy
K=k8s.io/component-base/version C=k8s.io/client-go/pkg/version
K8S_MINOR=${K8S_VERSION#*.}; K8S_MINOR=${K8S_MINOR%%.*}
LDF="-s -w"
for p in $K $C; do
  LDF="$LDF -X $p.gitVersion=v$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$K8S_MINOR"
  LDF="$LDF -X $p.gitTreeState=clean -X $p.buildDate=2026-01-01T00:00:00Z"
done
H=helm.sh/helm/v3
HLDF="-s -w -X $H/internal/version.version=v$HELM_VERSION -X $H/internal/version.gitTreeState=clean"
# helm v3 keeps the default Kubernetes version (for template/lint) in these two packages.
HLDF="$HLDF -X $H/pkg/chartutil.k8sVersionMajor=1 -X $H/pkg/chartutil.k8sVersionMinor=$K8S_MINOR"
HLDF="$HLDF -X $H/pkg/lint/rules.k8sVersionMajor=1 -X $H/pkg/lint/rules.k8sVersionMinor=$K8S_MINOR"
KWLDF="-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=v$KWOK_VERSION"
build() { (cd "$here/gobuild/$1" && shift && go build -trimpath -pgo=off "$@"); }
for b in "${need[@]}"; do
  case $b in
    etcd) step etcd build etcd -ldflags "-s -w" -o "$bin/etcd.tmp" go.etcd.io/etcd/server/v3 ;;
    kube-*|kubectl) step "$b" build k8s -ldflags "$LDF" -o "$bin/$b.tmp" "k8s.io/kubernetes/cmd/$b" ;;
    kwok) step kwok build k8s -ldflags "$KWLDF" -o "$bin/kwok.tmp" sigs.k8s.io/kwok/cmd/kwok ;;
    helm) step helm build k8s -ldflags "$HLDF" -o "$bin/helm.tmp" $H/cmd/helm ;;
  esac
  mv "$bin/$b.tmp" "$bin/$b"
done
# kwok's stage definitions (the binary has none built in)
kw=$(cd "$here/gobuild/k8s" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
mkdir -p "$bin/kwok-stages"
for s in "${stages[@]}"; do install -m 0644 "$kw/kustomize/stage/$s" "$bin/kwok-stages/"; done
# The version strings are what kubectl skew checks and helm's kubeVersion checks read.
check() { local b=$1 want=$2 out; shift 2; out=$("$bin/$b" "$@" 2>&1) || true
  [[ $out == *"$want"* ]] || { echo "build.sh: \`$b $*\` does not report $want: $out" >&2; exit 4; }; }
check kubectl "v$K8S_VERSION" version --client
check kube-apiserver "v$K8S_VERSION" --version
check helm "v$HELM_VERSION" version --short
check kwok "v$KWOK_VERSION" --version
check etcd "$ETCD_VERSION" --version
echo "devcluster: all binaries present in $bin"
