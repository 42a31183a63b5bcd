#!/bin/bash
# Run torchrl's own weight-sync tests with zmqsync's schemes substituted (see
# zmqsync_subst.py). Usage, from anywhere:
#   tests/torchrl_upstream/run.sh RL_CHECKOUT MODE
# RL_CHECKOUT: a checkout of github.com/pytorch/rl at the installed torchrl's release
# (its test/ directory and pytest.ini); MODE: none | zmq | pipe | ray. zmq, pipe and
# none run the selection from test/test_collectors.py below; ray (and none-ray, the
# baseline) run test/test_distributed.py's TestRayCollector. Four of torchrl's tests
# need gymnasium (`pip install gymnasium`); without it they are skipped.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
rl=$(cd "$1" && pwd)
mode=$2
python=${PYTHON:-$here/../../.venv/bin/python}
keywords="weight or sync_scheme or scheme or policy_version or PolicyVersion or PolicyFactory"
keywords="$keywords or update_policy or param_sync or update_weights or per_worker or from_backend"
case "$mode" in
  ray) selection=(test/test_distributed.py -k TestRayCollector) ;;
  none-ray) mode=none; selection=(test/test_distributed.py -k TestRayCollector) ;;
  *) selection=(test/test_collectors.py -k "$keywords") ;;
esac
cd "$rl"
ZMQSYNC_SUBST=$mode PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" \
  timeout 3000 "$python" -m pytest -p zmqsync_subst -p no:cacheprovider -q \
  --timeout 300 --runslow -rfEs "${selection[@]}"
