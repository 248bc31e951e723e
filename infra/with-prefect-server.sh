#!/usr/bin/env bash
# Run a command with one local Prefect server for all its stages, unless PREFECT_API_URL is
# already set. Without it every `moe-pipeline stage` process starts its own ephemeral server
# (~10 s each); with it the runs also appear in the Prefect UI while the command runs, and stay
# in Prefect's database (~/.prefect) for a later `prefect server start`.
set -euo pipefail
if [ -n "${PREFECT_API_URL:-}" ]; then
  exec "$@"
fi
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
# The UI is told the API's address: by default it calls port 4200, whatever --port says.
PREFECT_UI_API_URL="http://127.0.0.1:$port/api" \
  prefect server start --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -f "$log"' EXIT
python3 - "$port" "$pid" "$log" <<'PY'
import os, sys, time, urllib.request
port, pid, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
deadline = time.time() + 120
while True:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
        break
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            sys.exit("prefect server exited:\n" + open(log).read()[-3000:])
        if time.time() > deadline:
            sys.exit("prefect server did not become healthy in 120 s:\n" + open(log).read()[-3000:])
        time.sleep(0.5)
PY
export PREFECT_API_URL="http://127.0.0.1:$port/api"
echo "Prefect UI for this run: http://127.0.0.1:$port"
"$@"
