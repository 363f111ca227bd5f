#!/bin/sh
# Turn on etcd's auth for KDN, once: a root user, a role `kdn` that may read and
# write KDN's key prefix and nothing else, and a user `kdn` with that role. Run by
# compose's `etcd-init` service before any KDN node starts; safe to run again (with
# auth already on it only checks the root password). Passwords come from files and
# reach etcdctl on stdin or in its environment, never on a command line.
#
#   ETCDCTL_ENDPOINTS=http://etcd:2379 ETCD_ROOT_PASSWORD_FILE=... KDN_ETCD_PASSWORD_FILE=... \
#       [KDN_ETCD_PREFIX=/kdn/] sh deploy/etcd-init.sh
#
# Nodes then use --registry etcd://kdn@etcd:2379/kdn/?password_file=FILE (docs/operations.md).
set -eu
: "${ETCDCTL_ENDPOINTS:?set ETCDCTL_ENDPOINTS}"
prefix=${KDN_ETCD_PREFIX:-/kdn/}
root_pw=$(cat "${ETCD_ROOT_PASSWORD_FILE:?set ETCD_ROOT_PASSWORD_FILE}")
kdn_pw=$(cat "${KDN_ETCD_PASSWORD_FILE:?set KDN_ETCD_PASSWORD_FILE}")
[ -n "$root_pw" ] && [ -n "$kdn_pw" ] || { echo "etcd-init: a password file is empty" >&2; exit 1; }
export ETCDCTL_API=3
unset ETCDCTL_USER

tries=0
# (`endpoint status`, not `endpoint health`: health reads a key, which fails anonymously once auth is on)
until etcdctl endpoint status >/dev/null 2>&1; do
    tries=$((tries + 1))
    [ "$tries" -lt 60 ] || { echo "etcd-init: etcd at $ETCDCTL_ENDPOINTS does not answer after 60 s" >&2; exit 1; }
    sleep 1
done

if ! etcdctl user list >/dev/null 2>&1; then  # anonymous requests refused: auth is on
    if ETCDCTL_USER="root:$root_pw" etcdctl user get kdn >/dev/null 2>&1; then
        echo "etcd-init: auth already on, user kdn present"
        exit 0
    fi
    echo "etcd-init: auth is on, but root with this password cannot see user kdn" >&2
    exit 1
fi

exists() { etcdctl "$1" get "$2" >/dev/null 2>&1; }
exists user root || printf '%s\n' "$root_pw" | etcdctl user add root --interactive=false >/dev/null
etcdctl user grant-role root root >/dev/null 2>&1 || true  # already granted on a re-run
exists role kdn || etcdctl role add kdn >/dev/null
etcdctl role grant-permission kdn readwrite "$prefix" --prefix=true >/dev/null
exists user kdn || printf '%s\n' "$kdn_pw" | etcdctl user add kdn --interactive=false >/dev/null
etcdctl user grant-role kdn kdn >/dev/null 2>&1 || true
etcdctl auth enable >/dev/null
echo "etcd-init: auth on; user kdn may read and write $prefix"
