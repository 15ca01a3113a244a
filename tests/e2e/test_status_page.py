"""The status page (``GET /ui``, master/http/ui.py) of a real master, in a real headless browser (Debian's
chromium driven by selenium through Debian's chromedriver), and its access rules over plain HTTP.

The browser logs in with the job token, sees the nodes of a running job and the round's reason, sees a node
that joins later appear without a reload, and shows a hostile leave reason as text (no script runs).
Without a session (or with a forged one) the page is a redirect to the login form, its data a 401; the
session cookie opens nothing under ``/v1``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e import launch, wait_until  # noqa: F401 - launch is a fixture
from fake_nodes import RealMaster, start_master
from tools import require_tool

from master.http.ui import CSRF_COOKIE, SECURITY_HEADERS, SESSION_COOKIE

HOSTILE = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'


def login(master: RealMaster, client: httpx.Client, token: str) -> httpx.Response:
    form = client.get(master.url("/ui/login"))
    csrf = client.cookies.get(CSRF_COOKIE)
    assert csrf and f'value="{csrf}"' in form.text
    return client.post(master.url("/ui/login"), data={"csrf": csrf, "token": token})


@pytest.mark.timeout(90)
def test_the_page_and_its_data_need_a_session_that_only_the_token_gives(launch, tmp_path: Path):  # noqa: F811
    master = start_master(launch, tmp_path, f"ui-{uuid.uuid4().hex[:6]}", "1:2")
    master.join("alpha", (1, 2))
    with httpx.Client(follow_redirects=False, timeout=10) as client:
        page = client.get(master.url("/ui"))
        assert page.status_code == 303 and page.headers["location"] == "/ui/login"
        assert client.get(master.url("/ui/status")).status_code == 401
        client.cookies.set(SESSION_COOKIE, "99999999999.forged", path="/ui")
        assert client.get(master.url("/ui/status")).status_code == 401
        assert client.get(master.url("/ui")).status_code == 303
        client.cookies.clear()

        wrong = login(master, client, "not-the-token")
        assert wrong.status_code == 401 and "Wrong token." in wrong.text
        assert "alpha" not in wrong.text
        assert SESSION_COOKIE not in client.cookies

        no_csrf = client.post(master.url("/ui/login"), data={"csrf": "guess", "token": master.token})
        assert no_csrf.status_code == 403 and SESSION_COOKIE not in client.cookies
        assert client.post(master.url("/ui/login"), content=b"token=" + b"x" * 5000).status_code == 413

        ok = login(master, client, master.token)
        assert ok.status_code == 303 and ok.headers["location"] == "/ui"
        cookie = ok.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
        session = client.cookies.get(SESSION_COOKIE)
        data = client.get(master.url("/ui/status"))
        assert data.status_code == 200 and [n["node_id"] for n in data.json()["nodes"]] == ["alpha"]
        page = client.get(master.url("/ui"))
        assert page.status_code == 200 and "alpha" not in page.text, "the page holds no data, its script does"
        for name, value in SECURITY_HEADERS.items():
            assert page.headers[name] == value
        assert "script-src 'self';" in page.headers["content-security-policy"]
        assert client.get(master.url("/ui/app.js")).headers["content-type"].startswith("text/javascript")

    # The session cookie is no credential for the node API: only the bearer token is.
    v1 = httpx.get(master.url("/v1/status"), cookies={SESSION_COOKIE: session}, timeout=10)
    assert v1.status_code == 401


@contextlib.contextmanager
def chrome(tmp_path: Path) -> Iterator:
    """A headless chromium under chromedriver; its profile and temp files are removed at the end."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = require_tool("chromium"), require_tool("chromedriver")
    # Chromium's singleton socket lives in TMPDIR and must fit a Unix socket path: a short folder of our own.
    scratch = Path(tempfile.mkdtemp(prefix="elastic-ui-"))
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",  # tests run as root in containers
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--user-data-dir={scratch / 'profile'}",
    ):
        options.add_argument(arg)
    env = {**os.environ, "TMPDIR": str(scratch), "HOME": str(scratch)}
    service = Service(executable_path=driver, env=env, log_output=str(tmp_path / "chromedriver.log"))
    try:
        browser = webdriver.Chrome(options=options, service=service)
        try:
            yield browser
        finally:
            browser.quit()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def row_ids(browser) -> list[str]:
    """Node ids of the table's rows, read in one script call (the page replaces its rows every second)."""
    return browser.execute_script(
        "return [...document.querySelectorAll('#nodes tr')].map(r => r.dataset.node)"
    )


def event_texts(browser) -> list[str]:
    return browser.execute_script(
        "return [...document.querySelectorAll('#events td')].map(c => c.textContent)"
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_page_in_a_browser_follows_the_job_without_a_reload(launch, tmp_path: Path):  # noqa: F811
    from selenium.webdriver.common.by import By

    master = start_master(launch, tmp_path, f"ui-{uuid.uuid4().hex[:6]}", "2:3")
    master.join("alpha", (2, 3))
    master.join("beta", (2, 3))
    wait_until(lambda: master.status()["phase"] == "training", 30, "the first round to close")
    with chrome(tmp_path) as browser:
        browser.get(master.url("/ui"))
        assert browser.current_url.endswith("/ui/login")
        browser.find_element(By.NAME, "token").send_keys("wrong")
        browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait_until(lambda: "Wrong token." in browser.page_source, 30, "the form to say: wrong token")
        assert "alpha" not in browser.page_source and "beta" not in browser.page_source

        browser.find_element(By.NAME, "token").send_keys(master.token)
        browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait_until(lambda: row_ids(browser) == ["alpha", "beta"], 30, "the page to show alpha and beta")
        job = browser.find_element(By.ID, "job").text
        assert "round 1, 2 node(s), world size 4" in job
        assert browser.find_element(By.ID, "reason").text.startswith("round 1: closed: 2 nodes, world size 4")

        browser.execute_script("window.sameDocument = true")  # gone if the page reloaded
        master.join("gamma", (2, 3))
        wait_until(lambda: "gamma" in row_ids(browser), 30, "gamma to appear without a reload")
        wait_until(lambda: master.status()["round"] == 2, 30, "the larger round to open")
        master.join("alpha", (2, 3))  # the members' agents rejoin, as they do when a round opens
        master.join("beta", (2, 3))
        wait_until(lambda: "world size 6" in browser.find_element(By.ID, "job").text, 30, "world size 6")
        assert browser.execute_script("return window.sameDocument") is True

        master.leave("gamma", HOSTILE)
        wait_until(lambda: any(HOSTILE in m for m in event_texts(browser)), 30, "the leave reason as text")
        assert browser.execute_script("return window.pwned === undefined")
        assert not browser.find_elements(By.CSS_SELECTOR, "#events img, #events script")
        assert browser.execute_script("return window.sameDocument") is True
