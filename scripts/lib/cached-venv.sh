# Sourced by the scripts that build a peer's venv outside the repository (scripts/vllm-venv.sh,
# scripts/aiperf-venv.sh): the cache location, the up-to-date check, uv inside the venv, the stamp.
#
#   . "$(dirname "$0")/lib/cached-venv.sh"
#   cached_venv_open <label> <venv dir> <file that must exist in it>   # exits 0 when up to date
#   "${venv_uv[@]}" <package>...                                        # installs into the venv
#   cached_venv_close                                                   # stamps it, prints its path
#
# A venv is up to date when its stamp holds the hash of the calling script and of this file and
# the given file exists; otherwise it is (re)built in place, from the shared uv cache
# ($BATON_CACHE/uv unless UV_CACHE_DIR is set). The caller's last output line is the venv's path.

BATON_UV_VERSION=0.13.8
cache=${BATON_CACHE:-$HOME/.cache/baton}
export UV_CACHE_DIR=${UV_CACHE_DIR:-$cache/uv}

cached_venv_open() {
  venv_label=$1
  venv_dir=$2
  local must_exist=$3
  local py=${PYTHON:-python3}
  venv_stamp=$venv_dir/.baton-installed
  venv_want=$(cat "$0" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)
  if [ -f "$venv_stamp" ] && [ "$(cat "$venv_stamp")" = "$venv_want" ] && [ -e "$venv_dir/$must_exist" ]; then
    echo "$venv_dir"
    exit 0
  fi
  venv_started=$SECONDS
  if [ ! -x "$venv_dir/bin/python" ]; then
    echo "$venv_label: creating $venv_dir with $($py --version)" >&2
    "$py" -m venv "$venv_dir"
  fi
  if ! "$venv_dir/bin/python" -m uv --version 2>/dev/null | grep -q "$BATON_UV_VERSION"; then
    "$venv_dir/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$BATON_UV_VERSION"
  fi
  venv_uv=("$venv_dir/bin/python" -m uv pip install --quiet -p "$venv_dir/bin/python")
}

cached_venv_close() {
  echo "$venv_want" > "$venv_stamp"
  echo "$venv_label: done in $((SECONDS - venv_started)) s" >&2
  echo "$venv_dir"
}
