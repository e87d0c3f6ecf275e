#!/usr/bin/env bash
# One entry point for a fresh Debian 12 machine, as root:
#   ./run.sh install   install the toolkit alone (your control machine: no lab, no test tools)
#   ./run.sh main   bring up the local lab, deploy to it, verify it
#   ./run.sh test   run the whole test suite (unit tests and the lab tests)
#   ./run.sh docs   serve the documentation site on http://127.0.0.1:8001 (mkdocs.yml, docs/)
set -euo pipefail
cd "$(dirname "$0")"

setup() {
  if ! python3 -c 'import venv, ensurepip' 2>/dev/null || ! command -v git >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3 python3-venv python3-pip git
  fi
  # the tests evaluate the NixOS modules with Debian's Nix (nix-instantiate), run the front door's
  # and the gateway's configuration in HAProxy 3.0 LTS (Debian 13's package, unpacked with its own
  # loader and libraries by `invoke lab.haproxy`: the lab's image has the same), and check the monitoring
  # configuration and rules with Debian's promtool and amtool (the lab's images run the same versions),
  # and watch `invoke top` in tmux; the programs the roles run on hosts pass shellcheck; Open WebUI
  # is driven in Debian's Chromium (Playwright cannot download a browser here)
  if [ "${1:-}" = test ] && { ! command -v nix-instantiate >/dev/null \
                              || ! command -v promtool >/dev/null || ! command -v amtool >/dev/null \
                              || ! command -v tmux >/dev/null || ! command -v shellcheck >/dev/null \
                              || ! command -v chromium >/dev/null; }; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nix-bin prometheus \
      prometheus-alertmanager tmux shellcheck chromium
  fi
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
  fi
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
  if [ "${1:-}" = test ]; then
    .venv/bin/invoke lab.haproxy
  fi
}

case "${1:-}" in
  install)
    # the toolkit and its dependencies (pyproject's), in .venv; nothing of the lab or the tests
    if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
      if [ "$(id -u)" = 0 ]; then
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3 python3-venv python3-pip
      else
        echo "./run.sh install: Python's venv is missing: sudo apt-get install python3-venv, then run this again" >&2
        exit 1
      fi
    fi
    [ -x .venv/bin/python ] || python3 -m venv .venv
    .venv/bin/python -m pip install -q --disable-pip-version-check -e .
    echo "./run.sh install: the toolkit is installed in $PWD/.venv:"
    echo "  . $PWD/.venv/bin/activate"
    echo "  export DGEMMA_INVENTORY=/path/to/your/inventory    # once, instead of --inventory after every task"
    echo "  invoke inventory.check"
    ;;
  main)
    setup
    export DGEMMA_INVENTORY=/var/lib/dgemma-lab/inventory
    # each step's failure ends the run with one line that names it; the exit code says whether the lab serves
    step() {
      local what=$1; shift
      if ! "$@"; then
        echo "./run.sh main: the lab does not serve: '$what' failed (its output above says where and why);" \
             "fix that and run ./run.sh main again (it picks up where it stopped)" >&2
        exit 1
      fi
    }
    step "invoke lab.up" .venv/bin/invoke lab.up
    step "invoke deploy" .venv/bin/invoke deploy
    step "invoke verify" .venv/bin/invoke verify
    # where to look: the gateway's address, Open WebUI's lines, Prometheus and Alertmanager, invoke top
    step "invoke endpoints" .venv/bin/invoke endpoints
    # as a user reaches it: a chat through the gateways' shared address
    step "invoke lab.serves" .venv/bin/invoke lab.serves
    echo "./run.sh main: the lab serves: every host deployed, verify passed, a chat answered through the shared address"
    ;;
  test)
    setup test
    shift
    # two workers: the lab tests, in their order, on one (they share one deployed lab), the unit
    # tests on the other meanwhile (tests/conftest.py says so); `-n 0` runs all in one process
    exec .venv/bin/python -m pytest -n 2 "$@"
    ;;
  docs)
    setup docs
    NO_MKDOCS_2_WARNING=1 exec .venv/bin/mkdocs serve -a 127.0.0.1:8001
    ;;
  *)
    echo "usage: $0 install|main|test|docs [pytest args]" >&2
    exit 2
    ;;
esac
