#!/usr/bin/env bash
# Create the unprivileged user every Baton image runs as (uid/gid 10001, the builders'
# RUN_AS_USER), with writable /tmp-backed home and cache directories.
# Usage: create-user.sh [--dry-run] [--uid N]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"

uid=10001
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --uid) uid=${2:?--uid needs a value}; shift ;;
    *) die "unknown argument: $1" ;;
  esac
  shift
done
case "$uid" in ''|*[!0-9]*) die "--uid must be numeric, got '$uid'" ;; esac
[ "$uid" -ge 1000 ] || die "--uid must be >= 1000 (non-root, outside system ranges), got $uid"

if getent passwd baton >/dev/null 2>&1 && [ "$DRY_RUN" != 1 ]; then
  echo "user baton exists"; exit 0
fi
run groupadd --system --gid "$uid" baton
run useradd --system --uid "$uid" --gid "$uid" --home-dir /tmp --no-create-home --shell /usr/sbin/nologin baton
run install -d -o "$uid" -g "$uid" -m 0755 /var/cache/baton
