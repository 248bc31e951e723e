"""The Prefect UI works wherever the product starts a server: the UI is told its own API's
URL (by default it calls port 4200, whatever port the server listens on) and the link printed
is the one that works. The browser checks are in test_e2e.py (runs page after a pipeline) and
test_stack.py (deployments page)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, ui_settings

SHOW = """
import json, os, urllib.request
ui = os.environ["PREFECT_API_URL"].removesuffix("/api")
print("api_url seen by the UI:", json.load(urllib.request.urlopen(ui + "/ui-settings"))["api_url"])
"""


def test_with_prefect_server_tells_the_ui_its_port(tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") or k == "PREFECT_HOME"
    }
    env.update(
        PREFECT_HOME=str(tmp_path / "home"),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    r = subprocess.run(
        [str(ROOT / "infra/with-prefect-server.sh"), sys.executable, "-c", SHOW],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    link = re.search(r"Prefect UI for this run: (http://127\.0\.0\.1:\d+)\n", r.stdout)
    assert link, r.stdout
    assert f"api_url seen by the UI: {link.group(1)}/api" in r.stdout
    assert ":4200" not in link.group(1)


def test_the_test_server_ui_reaches_its_own_api(prefect_server: dict[str, str]) -> None:
    assert (
        ui_settings(prefect_server["PREFECT_UI_URL"])["api_url"]
        == (prefect_server["PREFECT_API_URL"])
    )
