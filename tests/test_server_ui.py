"""The ``/ui`` dashboard in a real headless chromium against a real ``kiln serve`` process.

Debian's ``/usr/bin/chromium`` is driven by the ``playwright`` package (never a downloaded
browser). The page lists jobs and follows their progress, draws the loss curve of the
selected job as SVG, cancels it and shows the cancelled error and the checkpoint to
resume from, lists adapters with their manifest and canary state, and asks for the API
key when the server wants one. Screenshots land in ``tmp_path`` and, when
``KILN_TEST_ARTIFACTS`` names a directory, are copied there too.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from _server import ServerProcess, wait_for
from conftest import ADAPTER_CONVERSATIONS

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.is_file():
    pytest.skip(f"{CHROMIUM} is not installed", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
expect = sync_api.expect

pytestmark = pytest.mark.slow

PAGE = Path(__file__).resolve().parents[1] / "kiln" / "server" / "static" / "dashboard.html"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
HOSTILE_NAME = "<img src=x onerror=\"document.title='pwned'\">"  # a registry directory whose name is markup
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


class Tab:
    """One page in a fresh browser context, with every request, console error and page error recorded."""

    def __init__(self, browser, tmp_path: Path, prefix: str):
        self.context = browser.new_context(viewport={"width": 1360, "height": 900})
        self.context.set_default_timeout(TIMEOUT_MS)
        self.page = self.context.new_page()
        self.tmp_path, self.prefix = tmp_path, prefix
        self.requests: list[str] = []
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("console", lambda msg: msg.type == "error" and self.console_errors.append(msg.text))
        self.page.on("pageerror", lambda exc: self.page_errors.append(str(exc)))

    def shot(self, name: str) -> Path:
        path = self.tmp_path / f"{self.prefix}-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        target = os.environ.get("KILN_TEST_ARTIFACTS")
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, Path(target) / path.name)
        return path

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser, tmp_path):
    opened = Tab(browser, tmp_path, "kiln-ui")  # kiln-ui-<name>.png; names are unique across the module
    try:
        yield opened
    finally:
        opened.close()


def _submit(http, config) -> dict:
    answer = http.post("/v1/train/sft", json={"examples": ADAPTER_CONVERSATIONS, "config": config})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _progress(row) -> float:
    return float(row.get_attribute("data-progress") or 0)


def test_the_page_is_one_self_contained_file_that_never_parses_server_text_as_html():
    text = PAGE.read_text(encoding="utf-8")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in text, sink
    assert not re.search(r"""(?:src|href|action)\s*=\s*["']?(?:https?:)?//""", text)
    assert not re.search(r"url\(\s*['\"]?(?:https?:)?//|@import", text)
    assert "<script src" not in text
    assert 'rel="stylesheet"' not in text


def test_the_dashboard_follows_a_job_from_progress_to_cancel_and_lists_the_next_jobs_adapter(
    tab, tmp_path, tiny_model_dir
):
    home = tmp_path / "home"
    (home / "adapters" / HOSTILE_NAME).mkdir(parents=True)
    page = tab.page
    with ServerProcess(home, tiny_model_dir) as server, server.client() as http:
        long = _submit(
            http, {"epochs": 1000, "seed": 5, "checkpoint_interval": 5, "output_name": "ui-job", "auto_load": False}
        )
        job_id = long["job_id"]
        page.goto(f"{server.url}/ui")

        expect(page.locator("#health")).to_have_attribute("data-status", "ok")
        expect(page.locator("#health-model")).to_have_text(tiny_model_dir.name)
        expect(page.locator("#health-queue")).to_have_text(re.compile(r"^\d+/32$"))
        row = page.locator(f'#jobs tbody tr[data-job-id="{job_id}"]')
        expect(row).to_be_visible()
        expect(row.locator("td").nth(4)).to_have_text("5")  # the effective seed
        expect(row.locator("td").nth(5)).to_have_text("ui-job")

        # the list refreshes on its own: two different progress readings, no reload
        first = wait_for(lambda: (p := _progress(row)) > 0 and p, timeout=30)
        second = wait_for(lambda: (p := _progress(row)) != first and p, timeout=30)
        assert 0 < first < second < 1
        expect(row.locator(".pct")).to_have_text(re.compile(r"^\d+\.\d%$"))
        assert page.evaluate("performance.getEntriesByType('navigation').length") == 1

        row.click()
        detail = page.locator("#job-detail")
        expect(detail).to_have_attribute("data-job-id", job_id)
        expect(row).to_have_class(re.compile(r"\bselected\b"))
        expect(page.locator("#detail-seed")).to_have_text("5")
        assert page.eval_on_selector("#loss-plot", "e => e.namespaceURI") == "http://www.w3.org/2000/svg"
        line = page.locator("#loss-plot polyline#loss-line")
        wait_for(lambda: line.count() and int(line.get_attribute("data-count") or 0) >= 5, timeout=30)
        points = [tuple(map(float, pair.split(","))) for pair in line.get_attribute("points").split()]
        assert len(points) >= 5
        assert all(0 <= x <= 560 and 0 <= y <= 240 for x, y in points)
        assert [x for x, _ in points] == sorted(x for x, _ in points)  # x is the job's progress
        expect(page.locator("#loss-plot-x-label")).to_have_text("progress of the run")
        expect(page.locator("#loss-plot-y-label")).to_have_text("loss")
        wait_for(lambda: page.locator("#job-checkpoint").get_attribute("data-checkpoint"), timeout=30)
        cancel = page.locator("#cancel-job")
        expect(cancel).to_be_visible()
        tab.shot("job-running")

        cancel.click()
        expect(page.locator("#cancel-message")).to_have_attribute("data-status", re.compile(r"^cancell(ing|ed)$"))
        expect(row).to_have_attribute("data-state", "failed", timeout=60_000)
        expect(detail).to_have_attribute("data-state", "failed")
        expect(page.locator("#job-error")).to_contain_text("cancelled")
        expect(cancel).to_be_hidden()
        served = http.get(f"/v1/train/jobs/{job_id}").json()
        checkpoint = served["latest_checkpoint"]
        assert served["error"].startswith("cancelled")
        expect(page.locator("#job-checkpoint")).to_have_attribute("data-checkpoint", checkpoint["resume_checkpoint"])
        assert checkpoint["resume_checkpoint"].startswith("ui-job-checkpoint-step-")
        expect(page.locator("#checkpoint-step")).to_contain_text(
            f"step {checkpoint['global_step']}/{checkpoint['total_steps']}"
        )
        assert 0 < checkpoint["global_step"] < checkpoint["total_steps"] == 2000
        tab.shot("job-cancelled")

        short = _submit(http, {"epochs": 2, "seed": 7, "output_name": "ui-done"})  # auto_load: becomes active
        expect(page.locator(f'#jobs tbody tr[data-job-id="{short["job_id"]}"]')).to_have_attribute(
            "data-state", "completed", timeout=60_000
        )
        adapter = page.locator('#adapters tbody tr[data-adapter="ui-done"]')
        expect(adapter).to_have_attribute("data-active", "true")
        expect(adapter).to_have_attribute("data-manifest", "present")
        expect(adapter).to_have_attribute("data-status", "loaded")
        expect(adapter.locator(".badge.active")).to_be_visible()
        listed = {a["name"]: a for a in http.get("/v1/adapters").json()["available"]}
        rank, alpha = listed["ui-done"]["rank"], listed["ui-done"]["alpha"]
        expect(adapter.locator("td").nth(2)).to_have_text(f"{rank} / {alpha:g}")
        expect(page.locator("#health-adapter")).to_have_text("ui-done")
        expect(page.locator("#adapters tbody tr[data-active='true']")).to_have_count(1)

        # a directory named like markup is shown as text, never run
        hostile = page.locator("#adapters tbody tr").filter(has_text=HOSTILE_NAME)
        expect(hostile).to_have_count(1)
        expect(hostile).to_have_attribute("data-status", "invalid")
        assert page.locator("#adapters img").count() == 0
        assert page.title() != "pwned"
        tab.shot("adapter-active")

    assert tab.page_errors == []
    assert tab.console_errors == []
    assert all(url.startswith((f"{server.url}/", "data:")) for url in tab.requests), tab.requests


def test_the_dashboard_asks_for_the_api_key_and_then_lists_jobs_with_it(tab, tmp_path, tiny_model_dir):
    page = tab.page
    env = {"KILN_API_KEY": "secret-key"}
    with (
        ServerProcess(tmp_path / "home", tiny_model_dir, env=env) as server,
        server.client(headers={"Authorization": "Bearer secret-key"}) as http,
    ):
        job_id = _submit(http, {"epochs": 1, "seed": 3, "output_name": "keyed", "auto_load": False})["job_id"]
        page.goto(f"{server.url}/ui")
        expect(page.locator("#auth")).to_be_visible()
        expect(page.locator("#health-model")).to_have_text(tiny_model_dir.name)  # /health needs no key
        expect(page.locator("#jobs")).to_have_attribute("data-loaded", "false")
        tab.shot("key-prompt")

        page.fill("#api-key", "wrong-key")
        page.click("#api-key-save")
        expect(page.locator("#auth-message")).to_contain_text("refused")
        expect(page.locator("#auth")).to_be_visible()
        expect(page.locator("#jobs")).to_have_attribute("data-loaded", "false")

        page.fill("#api-key", "secret-key")
        page.click("#api-key-save")
        expect(page.locator(f'#jobs tbody tr[data-job-id="{job_id}"]')).to_be_visible()
        expect(page.locator("#auth")).to_be_hidden()
        assert page.evaluate("localStorage.getItem('kiln.apiKey')") == "secret-key"

        with page.expect_request(lambda r: r.url.endswith("/v1/train/status")) as sent:
            page.reload()
        assert sent.value.all_headers().get("authorization") == "Bearer secret-key"
        expect(page.locator(f'#jobs tbody tr[data-job-id="{job_id}"]')).to_be_visible()
        expect(page.locator("#auth")).to_be_hidden()
        tab.shot("key-accepted")

    assert tab.page_errors == []
