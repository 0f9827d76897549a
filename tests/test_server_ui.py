"""The ``/ui`` dashboard in a real headless chromium against a real ``kiln serve`` process.

Debian's ``/usr/bin/chromium`` is driven by the ``playwright`` package (never a downloaded
browser). The page lists jobs and follows their progress, draws the loss curve of the
selected job as SVG, shows its checkpoint, receipt and effective configuration, cancels it,
prepares a resume request from it (clearing the inline data the checkpoint summary cannot
rebuild), shows a refused resume as drift naming the field, submits the restored request
and follows the resumed job to its adapter. It loads, unloads, views and deletes adapters
(with confirmation), shows the server's identity, queue and memory, and asks for the API
key when the server wants one. Screenshots land in ``tmp_path`` and, when
``KILN_TEST_ARTIFACTS`` names a directory, are copied there too; ``KILN_UI_SCREENSHOT=PATH``
also writes the README's screenshot of the resumed run to PATH.
"""

from __future__ import annotations

import json
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
# chromium logs every non-2xx fetch as a console error; the refusals a test provokes on purpose are expected
REFUSED = re.compile(r"^Failed to load resource: the server responded with a status of (400|404|409) ")


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

    def unexpected_console_errors(self) -> list[str]:
        return [text for text in self.console_errors if not REFUSED.match(text)]

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


def _edit_request(page, change) -> dict:
    """Parse the prepared request in the textarea, apply ``change`` and type the result back."""
    request = json.loads(page.locator("#resume-request").input_value())
    change(request)
    page.fill("#resume-request", json.dumps(request, indent=2))
    return request


def test_the_page_is_one_self_contained_file_that_never_parses_server_text_as_html():
    text = PAGE.read_text(encoding="utf-8")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in text, sink
    assert not re.search(r"""(?:src|href|action)\s*=\s*["']?(?:https?:)?//""", text)
    assert not re.search(r"url\(\s*['\"]?(?:https?:)?//|@import", text)
    assert "<script src" not in text
    assert 'rel="stylesheet"' not in text


def test_the_dashboard_follows_a_job_cancels_it_and_resumes_it_from_a_prepared_request(tab, tmp_path, tiny_model_dir):
    home = tmp_path / "home"
    page = tab.page
    with ServerProcess(home, tiny_model_dir) as server, server.client() as http:
        # 300 steps of ~30 ms: the page polls for ~3 s before it cancels, and the resumed rest takes seconds
        config = {"epochs": 150, "seed": 5, "checkpoint_interval": 5, "output_name": "ui-job"}
        job_id = _submit(http, config)["job_id"]
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
        expect(page.locator("#detail-kind")).to_contain_text("sft")
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
        # the effective configuration as admitted, and no receipt while the job runs
        admitted = http.get(f"/v1/train/jobs/{job_id}").json()["replay_request"]["config"]
        expect(page.locator('#config-table tr[data-key="learning_rate"] td').nth(1)).to_have_text(
            str(admitted["learning_rate"])
        )
        expect(page.locator('#config-table tr[data-key="checkpoint_interval"] td').nth(1)).to_have_text("5")
        expect(page.locator('#config-table tr[data-key="seed"] td').nth(1)).to_have_text("5")
        expect(page.locator("#receipt-summary")).to_have_attribute("data-status", "none")
        expect(page.locator("#prepare-resume")).to_be_hidden()
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
        assert 0 < checkpoint["global_step"] < checkpoint["total_steps"] == 300, "the job ended before the cancel"
        expect(page.locator("#job-checkpoint")).to_have_attribute("data-checkpoint", checkpoint["resume_checkpoint"])
        assert checkpoint["resume_checkpoint"].startswith("ui-job-checkpoint-step-")
        expect(page.locator("#checkpoint-step")).to_contain_text(
            f"step {checkpoint['global_step']}/{checkpoint['total_steps']}"
        )
        expect(page.locator("#checkpoint-cursor")).to_contain_text(
            f"epoch index {checkpoint['next_epoch_index']}, item {checkpoint['next_cursor_in_epoch']} of 2"
        )
        expect(page.locator("#checkpoint-created")).to_have_text(checkpoint["created_at"])
        receipt = served["train_receipt"]
        expect(page.locator("#receipt-summary")).to_have_attribute("data-status", "failed")
        expect(page.locator("#receipt-failure")).to_have_attribute("data-reason", "cancelled")
        expect(page.locator("#receipt-failure")).to_contain_text(receipt["failure_message"])
        expect(page.locator("#receipt-digest")).to_have_attribute("data-sha256", receipt["training_data"]["sha256"])
        expect(page.locator("#receipt-loss-route")).to_contain_text(receipt["runtime"]["sft_loss_route"])
        expect(page.locator("#loss-plot-checkpoint")).to_have_count(1)
        expect(page.locator("#detail-gate")).to_be_hidden()  # Kiln runs no evaluation gate
        tab.shot("job-cancelled")

        # prepare a resume: same kind, adapter and configuration, the checkpoint set, inline data cleared
        page.click("#prepare-resume")
        panel = page.locator("#resume")
        expect(panel).to_be_visible()
        expect(panel).to_have_attribute("data-source-job", job_id)
        expect(page.locator("#resume-route")).to_have_text("POST /v1/train/sft")
        expect(page.locator("#resume-checkpoint")).to_have_text(checkpoint["resume_checkpoint"])
        prepared = json.loads(page.locator("#resume-request").input_value())
        assert prepared["examples"] == []
        assert prepared["config"] == {
            **served["replay_request"]["config"],
            "resume_checkpoint": checkpoint["resume_checkpoint"],
        }
        assert set(prepared) == {"examples", "config"}
        notice = page.locator('#resume-notices li[data-field="examples"]')
        expect(notice).to_be_visible()
        expect(notice).to_contain_text("examples was cleared")
        expect(notice).to_contain_text(checkpoint["data_content_sha256"])
        tab.shot("resume-prepared")

        # submitted without the data: the server's refusal is shown with its code and pointer
        jobs_before = len(http.get("/v1/train/status").json())
        page.click("#resume-submit")
        error = page.locator("#resume-error")
        expect(error).to_be_visible()
        expect(error).to_have_attribute("data-pointer", "/examples")
        expect(page.locator("#resume-drift")).to_be_hidden()

        # the data restored but the learning rate changed: drift, naming the field
        lr = prepared["config"]["learning_rate"]
        _edit_request(
            page, lambda r: (r.update(examples=ADAPTER_CONVERSATIONS), r["config"].update(learning_rate=lr * 2))
        )
        page.click("#resume-submit")
        drift = page.locator("#resume-drift")
        expect(drift).to_be_visible()
        expect(error).to_be_hidden()
        expect(drift).to_have_attribute("data-code", "checkpoint_incompatible")
        expect(drift).to_have_attribute("data-field", "effective_config.learning_rate")
        expect(drift).to_have_attribute("data-pointer", "/effective_config/learning_rate")
        expect(page.locator("#resume-drift-field")).to_have_text("effective_config.learning_rate")
        expect(page.locator("#resume-drift-message")).to_contain_text("effective_config.learning_rate differs")
        assert len(http.get("/v1/train/status").json()) == jobs_before  # nothing was queued
        tab.shot("resume-drift")

        # the identical source and settings: queued, resumed, completed, and its adapter appears
        _edit_request(page, lambda r: r["config"].update(learning_rate=lr))
        page.click("#resume-submit")
        queued = page.locator("#resume-queued")
        expect(queued).to_be_visible()
        expect(drift).to_be_hidden()
        resumed_id = queued.get_attribute("data-job-id")
        assert resumed_id
        assert resumed_id != job_id
        expect(detail).to_have_attribute("data-job-id", resumed_id)  # the page follows the resumed job
        resumed_row = page.locator(f'#jobs tbody tr[data-job-id="{resumed_id}"]')
        expect(resumed_row).to_have_attribute("data-state", "completed", timeout=120_000)
        expect(detail).to_have_attribute("data-state", "completed")
        done = http.get(f"/v1/train/jobs/{resumed_id}").json()
        assert done["replay_request"]["config"]["resume_checkpoint"] == checkpoint["resume_checkpoint"]
        expect(page.locator("#receipt-summary")).to_have_attribute("data-status", "success")
        expect(page.locator("#receipt-digest")).to_have_attribute("data-sha256", receipt["training_data"]["sha256"])
        adapter = page.locator('#adapters tbody tr[data-adapter="ui-job"]')
        expect(adapter).to_have_attribute("data-manifest", "present")
        expect(adapter).to_have_attribute("data-active", "true")  # auto_load: the canary passed
        expect(adapter).to_have_attribute("data-canary", "passed")
        expect(adapter.locator(".badge.active")).to_be_visible()
        listed = {a["name"]: a for a in http.get("/v1/adapters").json()["available"]}
        rank, alpha = listed["ui-job"]["rank"], listed["ui-job"]["alpha"]
        expect(adapter.locator("td").nth(2)).to_have_text(f"{rank} / {alpha:g}")
        expect(page.locator("#health-adapter")).to_have_text("ui-job")
        expect(page.locator("#adapters tbody tr[data-active='true']")).to_have_count(1)
        tab.shot("resumed-completed")
        readme = os.environ.get("KILN_UI_SCREENSHOT")
        if readme:
            Path(readme).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=readme, full_page=True)

        # a directory named like markup is shown as text, never run
        (home / "adapters" / HOSTILE_NAME).mkdir()
        hostile = page.locator("#adapters tbody tr").filter(has_text=HOSTILE_NAME)
        expect(hostile).to_have_count(1)
        expect(hostile).to_have_attribute("data-status", "invalid")
        assert page.locator("#adapters img").count() == 0
        assert page.title() != "pwned"

    assert tab.page_errors == []
    assert tab.unexpected_console_errors() == []
    assert all(url.startswith((f"{server.url}/", "data:")) for url in tab.requests), tab.requests


GRPO_GROUPS = [
    {"messages": [{"role": "user", "content": "Is the sky blue?"}],
     "completions": [{"text": "yes", "reward": 1.0}, {"text": f"no {i}", "reward": 0.0}]}
    for i in range(120)
]  # fmt: skip
OPD_PROMPTS = [
    {"messages": [{"role": "user", "content": "Describe a river."}]},
    {"messages": [{"role": "user", "content": "Describe a hill."}]},
]
OPD_CONFIG = {"samples_per_prompt": 2, "max_tokens": 8, "top_k": 16, "epochs": 30, "checkpoint_interval": 3}


def _finished(http, job_id) -> dict:
    return wait_for(
        lambda: (d := http.get(f"/v1/train/jobs/{job_id}").json())["state"] in ("completed", "failed") and d,
        timeout=300,
    )


def test_the_prepared_resume_continues_grpo_and_opd_jobs_to_the_bytes_of_uninterrupted_runs(
    tab, tmp_path, tiny_model_dir
):
    """GRPO from a dataset_path (kept in the prepared request) and OPD from inline prompts (cleared, pasted back)."""
    from kiln.model import create_tiny

    home = tmp_path / "home"
    page = tab.page
    groups = home / "data" / "groups.jsonl"  # inside the server's default data root
    groups.parent.mkdir(parents=True)
    groups.write_text("".join(json.dumps(g) + "\n" for g in GRPO_GROUPS), encoding="utf-8")
    teacher = create_tiny(home / "models" / "teacher-model", seed=2)  # where the server may read models
    runs = {
        "grpo": ({"dataset_path": str(groups)}, {"seed": 5, "checkpoint_interval": 4, "auto_load": False}),
        "opd": ({"teacher": "ui-tutor", "prompts": OPD_PROMPTS}, {"seed": 3, **OPD_CONFIG, "auto_load": False}),
    }
    with ServerProcess(home, tiny_model_dir) as server, server.client() as http:
        registered = http.post("/v1/teachers", json={"alias": "ui-tutor", "kind": "local", "model_id": str(teacher)})
        assert registered.status_code == 200, registered.text
        page.goto(f"{server.url}/ui")
        for kind, (source, config) in runs.items():
            name = f"ui-{kind}"
            answer = http.post(f"/v1/train/{kind}", json={**source, "config": {**config, "output_name": name}})
            assert answer.status_code == 200, answer.text
            job_id = answer.json()["job_id"]

            def checkpointed(job_id=job_id):
                detail = http.get(f"/v1/train/jobs/{job_id}").json()
                return detail["state"] == "running" and detail["latest_checkpoint"] is not None

            wait_for(checkpointed)
            assert http.delete(f"/v1/train/queue/{job_id}").status_code == 200
            served = _finished(http, job_id)
            assert served["error"].startswith("cancelled")
            checkpoint = served["latest_checkpoint"]
            assert checkpoint["training_kind"] == kind
            assert 0 < checkpoint["global_step"] < checkpoint["total_steps"]

            row = page.locator(f'#jobs tbody tr[data-job-id="{job_id}"]')
            expect(row).to_have_attribute("data-state", "failed")
            row.click()
            expect(page.locator("#job-detail")).to_have_attribute("data-job-id", job_id)
            expect(page.locator("#detail-kind")).to_contain_text(kind)
            page.click("#prepare-resume")
            expect(page.locator("#resume")).to_have_attribute("data-source-job", job_id)
            expect(page.locator("#resume-route")).to_have_text(f"POST /v1/train/{kind}")
            expect(page.locator("#resume-checkpoint")).to_have_text(checkpoint["resume_checkpoint"])
            prepared = json.loads(page.locator("#resume-request").input_value())
            assert prepared["config"] == {
                **served["replay_request"]["config"],
                "resume_checkpoint": checkpoint["resume_checkpoint"],
            }
            if kind == "grpo":
                assert {k: v for k, v in prepared.items() if k != "config"} == {"dataset_path": str(groups.resolve())}
                expect(page.locator('#resume-notices li[data-field="dataset_path"]')).to_contain_text("kept")
            else:
                assert prepared["prompts"] == []
                assert prepared["teacher"] == "ui-tutor"
                notice = page.locator('#resume-notices li[data-field="prompts"]')
                expect(notice).to_contain_text("prompts was cleared")
                expect(notice).to_contain_text(checkpoint["data_content_sha256"])
                _edit_request(page, lambda r: r.update(prompts=OPD_PROMPTS))
            tab.shot(f"{kind}-resume-prepared")

            page.click("#resume-submit")
            queued = page.locator("#resume-queued")
            expect(queued).to_be_visible()
            resumed_id = queued.get_attribute("data-job-id")
            assert resumed_id
            assert resumed_id != job_id
            expect(page.locator("#job-detail")).to_have_attribute("data-job-id", resumed_id)
            resumed_row = page.locator(f'#jobs tbody tr[data-job-id="{resumed_id}"]')
            expect(resumed_row).to_have_attribute("data-state", "completed", timeout=120_000)
            done = http.get(f"/v1/train/jobs/{resumed_id}").json()
            assert done["state"] == "completed", done.get("error")
            assert done["replay_request"]["config"]["resume_checkpoint"] == checkpoint["resume_checkpoint"]
            page.click("#resume-close")

            straight = http.post(
                f"/v1/train/{kind}", json={**source, "config": {**config, "output_name": f"{name}-straight"}}
            )
            assert straight.status_code == 200, straight.text
            assert _finished(http, straight.json()["job_id"])["state"] == "completed"
            a = (home / "adapters" / name / "adapter_model.safetensors").read_bytes()
            b = (home / "adapters" / f"{name}-straight" / "adapter_model.safetensors").read_bytes()
            assert a == b, kind

    assert tab.page_errors == []
    assert tab.unexpected_console_errors() == []


def test_the_dashboard_views_loads_unloads_and_deletes_an_adapter_and_shows_the_servers_identity(
    tab, tmp_path, tiny_model_dir, trained_adapter
):
    home = tmp_path / "home"
    shutil.copytree(trained_adapter, home / "adapters" / "bot")
    page = tab.page
    with ServerProcess(home, tiny_model_dir) as server, server.client() as http:
        page.goto(f"{server.url}/ui")
        health = http.get("/health").json()
        identity, weights = health["execution_identity"], health["base_weight_identity"]
        expect(page.locator("#health-backend")).to_have_text(identity["backend"])
        expect(page.locator("#health-device")).to_have_text(identity["device"])
        expect(page.locator("#health-provenance [data-sha256]")).to_have_attribute(
            "data-sha256", identity["provenance_sha256"]
        )
        expect(page.locator("#health-base-digest [data-sha256]")).to_have_attribute(
            "data-sha256", weights["aggregate_sha256"]
        )
        expect(page.locator("#health-shards")).to_have_text(str(weights["shard_count"]))
        expect(page.locator("#health-queue-depth")).to_have_attribute("data-queued", "0")
        expect(page.locator("#health-queue-depth")).to_have_text("0 of 32")
        expect(page.locator("#health-memory-rss")).to_contain_text("MiB")
        for check in health["checks"]:
            expect(page.locator(f'#health-checks dd[data-check="{check["name"]}"]')).to_have_attribute(
                "data-pass", "true"
            )

        row = page.locator('#adapters tbody tr[data-adapter="bot"]')
        expect(row).to_have_attribute("data-manifest", "present")
        expect(row).to_have_attribute("data-active", "false")
        expect(row).to_have_attribute("data-canary", "unknown")
        expect(row).to_have_attribute("data-audit", "none")
        # an audit job's verdict shows on the adapter's row, whatever it is
        audit = http.post("/v1/audits", json={"adapter": "bot"}).json()
        ended = wait_for(
            lambda: (d := http.get(f"/v1/audits/{audit['job_id']}").json())["state"] in ("completed", "failed") and d,
            timeout=300,
        )
        assert ended["state"] == "completed", ended.get("error")
        expect(row).to_have_attribute("data-audit", ended["record"]["verdict"])
        listed = {a["name"]: a for a in http.get("/v1/adapters").json()["available"]}["bot"]

        row.locator('button[data-action="receipt"]').click()
        view = page.locator("#adapter-view")
        expect(view).to_have_attribute("data-kind", "receipt")
        expect(view).to_have_attribute("data-loaded", "true")
        expect(page.locator("#adapter-view-status")).to_have_text("success")
        assert (
            json.loads(page.locator("#adapter-view-json").text_content()) == http.get("/v1/adapters/bot/receipt").json()
        )

        row.locator('button[data-action="manifest"]').click()
        expect(view).to_have_attribute("data-kind", "manifest")
        expect(view).to_have_attribute("data-loaded", "true")
        expect(page.locator("#adapter-view-safetensors")).to_have_attribute(
            "data-sha256", listed["adapter_manifest"]["safetensors_hash"]
        )
        assert json.loads(page.locator("#adapter-view-json").text_content()) == listed["adapter_manifest"]
        tab.shot("adapter-manifest")

        row.locator('button[data-action="load"]').click()
        expect(row).to_have_attribute("data-active", "true")
        expect(page.locator("#adapter-message")).to_have_attribute("data-status", "ok")
        expect(page.locator("#health-adapter")).to_have_text("bot")

        # deleting the served adapter asks first, then shows the server's refusal
        row.locator('button[data-action="delete"]').click()
        expect(row.locator(".confirm")).to_have_text("Delete bot and its checkpoints?")
        row.locator('button[data-action="confirm"]').click()
        expect(page.locator("#adapter-message")).to_have_attribute("data-code", "adapter_active")
        expect(row).to_be_visible()

        row.locator('button[data-action="unload"]').click()
        expect(row).to_have_attribute("data-active", "false")
        expect(page.locator("#health-adapter")).to_have_text("none")

        row.locator('button[data-action="delete"]').click()
        expect(row.locator(".confirm")).to_be_visible()
        row.locator('button[data-action="keep"]').click()  # changed my mind: nothing happens
        expect(row.locator(".confirm")).to_be_hidden()
        expect(row.locator('button[data-action="delete"]')).to_be_visible()
        assert (home / "adapters" / "bot").is_dir()
        tab.shot("adapter-confirm")

        row.locator('button[data-action="delete"]').click()
        row.locator('button[data-action="confirm"]').click()
        expect(row).to_have_count(0)
        expect(page.locator("#adapters-empty")).to_be_visible()
        expect(page.locator("#adapter-message")).to_have_attribute("data-status", "ok")
        expect(view).to_be_hidden()
        assert not (home / "adapters" / "bot").exists()

    assert tab.page_errors == []
    assert tab.unexpected_console_errors() == []


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


def test_an_online_grpo_job_plots_its_reward_beside_its_loss(tab, tmp_path, tiny_model_dir):
    page = tab.page
    body = {
        "online": {
            "tasks": [{"id": f"t{i}", "prompt": f"A digit, please ({i}).", "pattern": "[0-9]"} for i in range(6)],
            "scorer": "builtin:regex",
            "group_size": 4,
            "sampling": {"temperature": 1.0, "top_k": 30, "max_tokens": 6},
        },
        "config": {"output_name": "ui-online", "seed": 2, "dynamic_sampling": False, "auto_load": False},
    }
    with ServerProcess(tmp_path / "home", tiny_model_dir) as server, server.client() as http:
        answer = http.post("/v1/train/grpo", json=body)
        assert answer.status_code == 200, answer.text
        job_id = answer.json()["job_id"]
        wait_for(lambda: http.get(f"/v1/train/jobs/{job_id}").json()["state"] in ("completed", "failed"), timeout=300)
        detail = http.get(f"/v1/train/jobs/{job_id}").json()
        assert detail["state"] == "completed", detail.get("error")
        rewards = [point["reward"] for point in detail["loss_history"]]
        assert len(rewards) == 6
        assert all(0.0 <= r <= 1.0 for r in rewards)
        page.goto(f"{server.url}/ui")
        page.locator(f'#jobs tbody tr[data-job-id="{job_id}"]').click()
        reward = page.locator("#loss-plot polyline#reward-line")
        expect(reward).to_have_attribute("data-count", "6")
        expect(page.locator("#loss-plot polyline#loss-line")).to_have_attribute("data-count", "6")
        points = [tuple(map(float, pair.split(","))) for pair in reward.get_attribute("points").split()]
        assert all(0 <= x <= 560 and 0 <= y <= 240 for x, y in points)
        expect(page.locator("#loss-plot .reward-tick").first).to_contain_text("reward")
        tab.shot("online-reward")
