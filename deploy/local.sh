#!/usr/bin/env bash
# One prefill server, one decode server and the proxy on this machine (1P1D).
#
#   deploy/local.sh [--model DIR|FILE.gguf] [--port 8000] [--dtype D] [--detach] [-- EXTRA pd serve FLAGS]
#   deploy/local.sh stop
#
# Without --model it makes a tiny Bamba with `pd make-model`. Waits for health, prints
# the URLs, and stops everything it started on Ctrl-C or `deploy/local.sh stop`. Every
# flag of deploy/xpyd.sh is accepted; this is `deploy/xpyd.sh --prefill 1 --decode 1`.
set -euo pipefail
here="$(dirname "${BASH_SOURCE[0]}")"
case "${1:-}" in
    stop) exec "$here/xpyd.sh" stop ;;
    -h|--help) sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
exec "$here/xpyd.sh" --prefill 1 --decode 1 "$@"
