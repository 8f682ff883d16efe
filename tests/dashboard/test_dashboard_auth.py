"""With GRADWATCH_AUTH=on the dashboard needs a login and shows only the signed-in project."""
from __future__ import annotations

import pytest

from tests.conftest import LiveServer, create_token, free_port, wait_until
from tests.dashboard.conftest import WAIT, SERVER_START_TIMEOUT, severe_console_entries, texts
from tests.dashboard.runs_feed import make_steps

pytestmark = pytest.mark.browser


@pytest.fixture
def auth_server(tmp_path):
    data_dir = tmp_path / "auth-server"
    data_dir.mkdir()
    srv = LiveServer(db_url=f"sqlite:///{data_dir / 'gradwatch.db'}", data_dir=data_dir, port=free_port(),
                     env={"GRADWATCH_AUTH": "on"})
    srv.migrate()
    srv.start(timeout=SERVER_START_TIMEOUT)
    try:
        yield srv
    finally:
        srv.stop()


def _token(srv: LiveServer, project: str) -> str:
    # made in this process by the function `gradwatch token create` calls (tests/conftest.py
    # create_token); the command itself is tested in tests/cli/test_cli_token.py
    return create_token(srv.db_url, project)


def _ingest(srv: LiveServer, token: str, project: str, run: str) -> int:
    body = {"batch_id": f"{project}-{run}", "project": project, "run": run, "steps": make_steps(20)}
    code, answer = srv.post("/api/v1/ingest", body, headers={"Authorization": f"Bearer {token}"})
    assert code == 200, answer
    return answer["run_id"]


def test_login_required_and_only_the_signed_in_project_is_shown(auth_server, browser):
    vision, nlp = _token(auth_server, "vision"), _token(auth_server, "nlp")
    _ingest(auth_server, vision, "vision", "resnet")
    nlp_run = _ingest(auth_server, nlp, "nlp", "gpt")

    browser.get(auth_server.url + "/")
    wait_until(lambda: "/login" in browser.current_url, timeout=WAIT, what="redirect to the login page")
    browser.find_element("css selector", "input[name=token]").send_keys(vision)
    browser.find_element("css selector", "form button, form input[type=submit]").click()

    def run_names():
        return browser.execute_script(
            "return Array.from(document.querySelectorAll('#runs-table tr.gw-run-row td:first-child'),"
            " (c) => c.innerText.trim());")
    wait_until(lambda: run_names() == ["resnet"], timeout=WAIT, what="only the vision run listed")
    assert texts(browser, "#nav-project") == ["project vision"]
    assert texts(browser, "#nav-logout") == ["log out"]

    browser.get(f"{auth_server.url}/runs/{nlp_run}")
    wait_until(lambda: "Run not found" in " ".join(texts(browser, "h1")), timeout=WAIT,
               what="another project's run is not shown")
    assert severe_console_entries(browser) == []

    browser.find_element("id", "nav-logout").click()
    wait_until(lambda: "/login" in browser.current_url, timeout=WAIT, what="logged out")
    browser.get(auth_server.url + "/")
    wait_until(lambda: "/login" in browser.current_url, timeout=WAIT, what="login required again")
