"""The dashboard in a real headless browser (Chromium from the system's packages, driven
by Selenium; `.ci/run` installs both): a real `pd proxy` process in front of fake
servers, the page opened with the key in its query, every instance shown, a request's
id shown as text (not HTML), and an instance shown down once its server stops."""

from __future__ import annotations

import contextlib
import shutil
import uuid

import pytest

from launch import http_client
from tests.support.proxy_fakes import fake
from tests.support.server_harness import running_proxy, wait_until

pytestmark = pytest.mark.slow
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install '.[test]')")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)",
                allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

KEY = f"key-{uuid.uuid4().hex}"
ADMIN = f"admin-{uuid.uuid4().hex}"
WAIT_S = 30  # a bound on waiting for the page (it polls every second), not a measurement
INJECTED = '<img id="injected" src="x">'


@pytest.fixture
def browser():
    """Headless Chromium; the driver is the system's, so Selenium downloads nothing."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


# The page redraws its tables every second: each is read in one script call, never element by
# element (an element found before a redraw is stale after it).
def health_shown(driver) -> dict[str, str]:
    """Each instance row's URL and the health it shows."""
    rows = driver.execute_script("return Array.from(document.querySelectorAll('#instances tbody tr'))"
                                 ".map(row => [row.dataset.url, row.cells[3].innerText]);")  # role, URL, fleet, health
    return dict(map(tuple, rows))


def table_cells(driver, table: str) -> list[str]:
    """The text of every cell of a table's body (`table`: its id)."""
    return driver.execute_script(f"return Array.from(document.querySelectorAll('#{table} tbody td'))"
                                 ".map(cell => cell.innerText);")


def request_cells(driver) -> list[str]:
    """The text of every cell of the last requests' table."""
    return table_cells(driver, "requests")


def test_the_page_shows_every_instance_and_one_going_down(browser, tmp_path) -> None:
    with contextlib.ExitStack() as stack, contextlib.ExitStack() as stopping:
        p = stack.enter_context(fake("prefill"))
        d1 = stack.enter_context(fake("decode"))
        d2 = stopping.enter_context(fake("decode"))  # the one stopped below
        proxy = stack.enter_context(running_proxy(
            tmp_path / "proxy.log", "--prefill", p.url, "--decode", d1.url, d2.url, "--api-key", KEY,
            "--admin-key", ADMIN, "--probe-interval", "0.2", "--breaker-cooldown", "600", "--log-level", "info"))
        wait = WebDriverWait(browser, WAIT_S)
        browser.get(f"{proxy.url}/dashboard?key={KEY}")
        every = {p.url: "up", d1.url: "up", d2.url: "up"}
        wait.until(lambda driver: health_shown(driver) == every)

        sent = http_client().post(f"{proxy.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30,
                                  headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": INJECTED})
        assert sent.status_code == 200
        wait.until(lambda driver: INJECTED in request_cells(driver))
        assert browser.find_elements(By.ID, "injected") == []  # shown as text, never made an element
        assert "disaggregated" in request_cells(browser) and p.url in request_cells(browser)

        drained = http_client().post(f"{proxy.url}/admin/instances/drain", timeout=10, json={
            "url": d1.url, "reason": "<b id='reason'>maintenance</b>"}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert drained.status_code == 200
        wait.until(lambda driver: "<b id='reason'>maintenance</b>" in table_cells(driver, "changes"))
        assert "static, draining" in table_cells(browser, "instances")  # its fleet column
        assert browser.find_elements(By.ID, "reason") == []  # the reason shown as text, never made an element

        stopping.close()  # d2's server stops: the prober finds it gone, its breaker opens
        wait.until(lambda driver: health_shown(driver) == every | {d2.url: "down"})
        assert browser.find_element(By.ID, "status").text.startswith("live")
        assert wait_until(lambda: "/dashboard?*** HTTP" in proxy.log_path.read_text(), WAIT_S)
        assert KEY not in proxy.log_path.read_text()  # the page's query, redacted from the access log
