"""The example web app, driven end to end in headless Chromium (Debian's chromium + chromedriver)."""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DOCS = ROOT / "turborag_integrations" / "data" / "sample_docs"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not (CHROMIUM and DRIVER),
                       reason="needs Debian's chromium and chromium-driver (apt-get install "
                              "chromium chromium-driver); .ci/run installs them"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from turborag_integrations.workspace import Workspace

    ws_dir = tmp_path_factory.mktemp("ws")
    Workspace(ws_dir, chunk_tokens=160).ingest([SAMPLE_DOCS])
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "webapp" / "app.py"), "--workspace", str(ws_dir),
         "--port", str(port), "--max-new-tokens", "24"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail("web app exited: " + proc.stdout.read().decode()[-2000:])
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("web app did not start within 120 s")
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def ask(driver, url: str, question: str) -> str:
    """Submit a question on a fresh page; the state it ends in ("done" or "failed")."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    box = driver.find_element(By.ID, "question")
    # set, not typed: a long question would take thousands of key events
    driver.execute_script("arguments[0].value = arguments[1]", box, question)
    driver.find_element(By.ID, "send").click()
    WebDriverWait(driver, 180).until(lambda d: d.find_element(By.TAG_NAME, "body")
                                     .get_attribute("data-state") in ("done", "failed"))
    return driver.find_element(By.TAG_NAME, "body").get_attribute("data-state")


def test_page_streams_answer_sources_and_both_ttfts(server, browser):
    from selenium.webdriver.common.by import By

    state = ask(browser, server, "How high is the Tall Widow lighthouse?")
    error = browser.find_element(By.ID, "error")
    assert state == "done", error.text
    assert not error.is_displayed()
    assert browser.find_element(By.ID, "answer").text.strip()
    sources = browser.find_elements(By.CSS_SELECTOR, "#sources li")
    assert sources and any("harbor_town_of_velmora.md" in s.text for s in sources)
    for figure in ("ttft-turbo", "ttft-full"):
        assert browser.find_element(By.ID, figure).text.endswith(" ms")
    reused, total = browser.find_element(By.ID, "reused").text.split(" / ")
    assert 0 < int(reused) <= int(total)
    full = browser.find_element(By.ID, "full-answer")  # the full prefill's answer beside it
    assert full.is_displayed() and full.text.strip()
    about = browser.find_element(By.ID, "about").text  # the model and the documents named
    assert "over 3 document(s)" in about and "harbor_town_of_velmora.md" in about


def test_page_shows_the_servers_refusal(server, browser):
    from selenium.webdriver.common.by import By

    assert ask(browser, server, "why " * 600) == "failed"  # 2400 characters: over the limit
    error = browser.find_element(By.ID, "error")
    assert error.is_displayed() and "longer than 2000 characters" in error.text
    assert browser.find_element(By.ID, "send").is_enabled()
