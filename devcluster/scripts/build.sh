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
command -v go >/dev/null || { echo "build.sh: Go is not installed (need go >= 1.26; see README)" >&2; exit 2; }
if [ "${1:-}" = "--print-bin" ]; then echo "$bin"; exit 0; fi
mkdir -p "$bin"
need=()
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm; do
  [ -x "$bin/$b" ] || need+=("$b")
done
if [ ${#need[@]} -eq 0 ]; then echo "devcluster: all binaries present in $bin"; exit 0; fi
echo "devcluster: building ${need[*]} into $bin (cold builds take many minutes on 2 cores)"
step() { local t0=$SECONDS; echo "devcluster: [$(date +%T)] building $1 ..."; shift; "$@"; echo "devcluster: [$(date +%T)] done in $((SECONDS-t0)) s"; }
probe_proxy() {
  (cd "$here/gobuild/k8s" && go mod download k8s.io/kubernetes) >/dev/null 2>&1 || {
    echo "build.sh: cannot download Go modules (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))" >&2; exit 3; }
}
probe_proxy
K=k8s.io/component-base/version C=k8s.io/client-go/pkg/version
LDF="-s -w"
for p in $K $C; do
  LDF="$LDF -X $p.gitVersion=v$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=${K8S_VERSION#1.}"
  LDF="$LDF -X $p.gitTreeState=clean -X $p.buildDate=2026-01-01T00:00:00Z"
done
LDF="${LDF/gitMinor=36.3/gitMinor=36}"
LDF="${LDF/gitMinor=36.3/gitMinor=36}"
H=helm.sh/helm/v3
HLDF="-s -w -X $H/internal/version.version=v$HELM_VERSION -X $H/internal/version.gitTreeState=clean"
HLDF="$HLDF -X $H/pkg/chart/v2/util.k8sVersionMajor=1 -X $H/pkg/chart/v2/util.k8sVersionMinor=36"
HLDF="$HLDF -X $H/pkg/chartutil.k8sVersionMajor=1 -X $H/pkg/chartutil.k8sVersionMinor=36"
HLDF="$HLDF -X $H/pkg/lint/rules.k8sVersionMajor=1 -X $H/pkg/lint/rules.k8sVersionMinor=36"
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
cp "$kw/kustomize/stage/node/fast/node-initialize.yaml" "$kw/kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
   "$kw/kustomize/stage/pod/fast/pod-ready.yaml" "$kw/kustomize/stage/pod/fast/pod-complete.yaml" \
   "$kw/kustomize/stage/pod/fast/pod-delete.yaml" "$bin/kwok-stages/"
echo "devcluster: all binaries present in $bin"
