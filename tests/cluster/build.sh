#!/usr/bin/env bash
# Build a real Kubernetes test control plane from the Go module proxy:
#   kube-apiserver kube-controller-manager kube-scheduler kubectl  (k8s.io/kubernetes)
#   etcd                                                           (go.etcd.io/etcd/server/v3)
#   kwok kwokctl                                                   (sigs.k8s.io/kwok, ./kwok module)
#   kubelet                                                        (k8s.io/kubernetes: the real test node)
#   gpuplugin pause                                                (./gpuplugin, ./pause: the test node's
#                                                                   GPU device plugin and sandbox image)
#
# Binaries go to a cache directory outside the repository:
#   ${DEVBOX_CLUSTER_BIN:-$HOME/.cache/devbox/cluster-bin/<k8s>_etcd-<v>_kwok-<v>}
# A stamp file there records the pinned versions and a hash of go.mod/go.sum;
# when it matches and every binary exists the build is skipped (idempotent).
#
# Prints the binary directory on the last line of stdout, so callers can do
#   BIN=$(tests/cluster/build.sh | tail -n1)
#
# Environment:
#   DEVBOX_CLUSTER_BIN         target directory (default above)
#   DEVBOX_CLUSTER_BUILD_JOBS  go build -p value (default 1; 2 on a dedicated CI box)
#   DEVBOX_CLUSTER_NICE        nice level for go commands (default 10)
#   DEVBOX_CLUSTER_FORCE=1     rebuild even if the stamp matches
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
JOBS="${DEVBOX_CLUSTER_BUILD_JOBS:-1}"
NICE="${DEVBOX_CLUSTER_NICE:-10}"

export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export CGO_ENABLED=0
export GOFLAGS="-buildvcs=false -mod=readonly"

log() { printf '[cluster-build] %s\n' "$*" >&2; }
die() { printf '[cluster-build] ERROR: %s\n' "$*" >&2; exit 1; }

command -v go >/dev/null 2>&1 || die "go not found in PATH (need Go >= 1.26)"

# Required version of a module, read from go.mod text (no go command, no network).
modver() { # dir module
  local v
  v="$(awk -v m="$2" '$1 == m && $2 ~ /^v/ { print $2; exit }
                      $1 == "require" && $2 == m { print $3; exit }' "$1/go.mod")"
  [ -n "$v" ] || die "$2 is not required in $1/go.mod"
  printf '%s' "$v"
}

K8S_VERSION="$(modver "$HERE" k8s.io/kubernetes)"
ETCD_VERSION="$(modver "$HERE" go.etcd.io/etcd/server/v3)"
KWOK_VERSION="$(modver "$HERE/kwok" sigs.k8s.io/kwok)"
KEY="${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}"
BIN="${DEVBOX_CLUSTER_BIN:-$HOME/.cache/devbox/cluster-bin/$KEY}"
STAMP="$BIN/.stamp"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet etcd kwok kwokctl gpuplugin pause)

want_stamp() {
  printf 'key=%s\n' "$KEY"
  printf 'go=%s\n' "$(go env GOVERSION)"
  cat "$HERE/go.mod" "$HERE/go.sum" "$HERE/kwok/go.mod" "$HERE/kwok/go.sum" \
    "$HERE"/gpuplugin/*.go "$HERE"/pause/*.go | sha256sum | cut -d' ' -f1
}

up_to_date() {
  [ "${DEVBOX_CLUSTER_FORCE:-0}" = 1 ] && return 1
  [ -f "$STAMP" ] || return 1
  local b
  for b in "${BINARIES[@]}"; do [ -x "$BIN/$b" ] || return 1; done
  [ "$(cat "$STAMP")" = "$(want_stamp)" ]
}

if up_to_date; then
  log "up to date: $BIN ($KEY)"
  echo "$BIN"
  exit 0
fi

mkdir -p "$BIN"
rm -f "$STAMP"
TMP="$(mktemp -d "$BIN/.build.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

gocmd() { nice -n "$NICE" go "$@"; }

# step NAME MODULE@VERSION DIR -- go args...
step() {
  local name="$1" what="$2" dir="$3"; shift 4
  local t0 t1 logf="$TMP/$name.log"
  if [ "$1" = mod ]; then log "$name: go mod $2 ($what) ..."; else log "$name: go $1 ($what) ..."; fi
  t0=$(date +%s)
  if ! (cd "$dir" && gocmd "$@") >"$logf" 2>&1; then
    tail -n 40 "$logf" >&2
    die "step '$name' failed for module $what (in $dir): see the last 40 lines above"
  fi
  t1=$(date +%s)
  log "$name done in $((t1 - t0))s"
}

T_START=$(date +%s)

# Fetch modules first so that an unserved module is reported as such.
step download-k8s "k8s.io/kubernetes@$K8S_VERSION + go.etcd.io/etcd/server/v3@$ETCD_VERSION" "$HERE" -- mod download
step download-kwok "sigs.k8s.io/kwok@$KWOK_VERSION" "$HERE/kwok" -- mod download

# Version stamping as Kubernetes' hack/lib/version.sh does; without it the
# binaries report v0.0.0-master.
kv="${K8S_VERSION#v}"; kmaj="${kv%%.*}"; kmin="${kv#*.}"; kmin="${kmin%%.*}"
K8S_LDFLAGS="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  K8S_LDFLAGS+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=$kmaj -X $p.gitMinor=$kmin"
  K8S_LDFLAGS+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done

step kube "k8s.io/kubernetes@$K8S_VERSION" "$HERE" -- \
  build -p "$JOBS" -trimpath -pgo=off -ldflags "$K8S_LDFLAGS" -o "$TMP/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl \
  k8s.io/kubernetes/cmd/kubelet

step etcd "go.etcd.io/etcd/server/v3@$ETCD_VERSION" "$HERE" -- \
  build -p "$JOBS" -trimpath -ldflags "-s -w" -o "$TMP/etcd" go.etcd.io/etcd/server/v3

step node-tools "devbox.local/testcluster (gpuplugin, pause)" "$HERE" -- \
  build -p "$JOBS" -trimpath -ldflags "-s -w" -o "$TMP/" ./gpuplugin ./pause

step kwok "sigs.k8s.io/kwok@$KWOK_VERSION" "$HERE/kwok" -- \
  build -p "$JOBS" -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v} -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=$kv" \
  -o "$TMP/" sigs.k8s.io/kwok/cmd/kwok sigs.k8s.io/kwok/cmd/kwokctl

# Sanity check: every binary starts.
for b in "${BINARIES[@]}"; do
  [ -x "$TMP/$b" ] || die "binary $b missing after build"
  case "$b" in
    kubectl) args=(version --client) ;;
    gpuplugin | pause) continue ;; # no --version; built from this folder's own source
    *) args=(--version) ;;
  esac
  out="$("$TMP/$b" "${args[@]}" 2>&1)" || die "$b does not start (exit $?): $out"
  log "$b: $(printf '%s\n' "$out" | head -n 3 | tr '\n' ' ')"
done

for b in "${BINARIES[@]}"; do mv -f "$TMP/$b" "$BIN/$b"; done
want_stamp >"$STAMP"
log "done in $(( $(date +%s) - T_START ))s: $BIN"
echo "$BIN"
