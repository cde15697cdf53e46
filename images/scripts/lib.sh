# Shared helpers of the image build scripts (sourced, not run).
# DRY_RUN=1 prints each command instead of running it; every other step (argument checks,
# computed constraints, verification logic) still runs, so tests exercise the scripts without
# Docker.

DRY_RUN=${DRY_RUN:-0}

run() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '+'
    printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}

die() {
  echo "error: $*" >&2
  exit 2
}
