# Sourced (with $root set, cwd the repository root) by the scripts that run on the GPU machine:
# verify-engine.sh and bench-pd.sh. The image's python3 is itself a venv (torch lives there): a
# venv made from it would not see torch, so the carried wheels (.whl/) go to a target folder and
# the repository is put on PYTHONPATH. Sets $py.
py=python3
site=${BATON_VERIFY_SITE:-/tmp/baton-verify-site}
rm -rf "$site"
mkdir -p "$site"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$py" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
fi
export PYTHONPATH="$site:$root/engine:$root/operator:$root/devcluster:$root/support:$root"
