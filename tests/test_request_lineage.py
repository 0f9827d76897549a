"""The request lineage (replay.jsonl, lineage.json) every trainer publishes, and ``kiln replay verify|show``.

Histories come from real runs on the tiny model: through the trainers (an SFT run cancelled and resumed, a GRPO
child of it trained with ``kiln train grpo --local``, an OPD run) and through a server (a root and a child trained
on top of it). Tamper tests edit copies: each must make ``kiln replay verify`` exit 1 naming the entry."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from _server import ServerProcess, wait_for
from conftest import ADAPTER_CONVERSATIONS

from kiln.artifacts.lineage import build_lineage, load_lineage, verify_lineage, write_lineage
from kiln.artifacts.replay_log import load_replay_log, pending_log
from kiln.cli import main
from kiln.documents.digests import file_sha256
from kiln.documents.jsonio import canonical_json
from kiln.trainers.sft import admit_sft, run_sft

ROWS = ADAPTER_CONVERSATIONS * 2
GROUP = {
    "messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
    "completions": [{"text": "yes", "reward": 1.0}, {"text": "no", "reward": 0.0}],
}
NOTE = "no training or output replay was performed"


def _verify(capsys, directory):
    code = main(["replay", "verify", str(directory)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def history(tmp_path_factory, tiny_model_dir):
    """A registry with ``root`` (SFT: cancelled after step 2, resumed to the end) and ``leaf`` (GRPO, trained with
    ``kiln train grpo --local`` on top of ``root``). Read-only: tests copy it."""
    base = tmp_path_factory.mktemp("lineage")
    registry = base / "adapters"
    data = base / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    config = {"epochs": 2, "seed": 3, "checkpoint_interval": 2, "optimizer": {"kind": "adam_w"}}
    cancel = threading.Event()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_HOME", str(base / "home"))

        def admit(cfg):
            return admit_sft(
                adapter_name="root", registry=registry, config=cfg, dataset_path=data, model_path=str(tiny_model_dir)
            )

        first = run_sft(admit(config), cancel=cancel, progress=lambda e: e["step"] == 2 and cancel.set())
        assert first.status == "failed"
        assert first.cancelled
        resumed = run_sft(admit({**config, "resume_checkpoint": first.latest_checkpoint.name}))
        assert resumed.status == "success", resumed.receipt.get("failure_message")
        request = base / "grpo.json"
        request.write_text(json.dumps({"groups": [GROUP] * 2, "config": {"base_adapter": "root"}}), encoding="utf-8")
        argv = ["train", "grpo", "--local", "-f", str(request), "--model", str(tiny_model_dir), "--adapter-dir",
                str(registry), "--adapter", "leaf", "--seed", "5", "--json"]  # fmt: skip
        assert main(argv) == 0
    return registry


def test_a_resumed_run_keeps_the_cancelled_runs_request_and_adds_its_own(history):
    lines = load_replay_log(history / "root" / "replay.jsonl")
    kinds = [(line.record["record_type"], line.record.get("status")) for line in lines]
    assert kinds == [("request", None), ("outcome", "cancelled"), ("request", None), ("outcome", "completed")]
    first, _, second, done = (line.record for line in lines)
    assert first["resumed_from"] is None
    assert second["resumed_from"]["checkpoint"] == "root-checkpoint-step-00000002.kiln-checkpoint"
    assert second["resumed_from"]["global_step"] == 2
    assert done["request_id"] == second["request_id"] != first["request_id"]
    assert lines[1].record["failure_reason"] == "cancelled"
    assert first["request"]["config"]["seed"] == first["seed"] == 3
    assert first["request"]["data_sha256"].startswith("sha256:")
    assert not pending_log(history, "root").exists()  # published with the adapter, then removed


def test_the_manifest_binds_the_receipt_which_links_the_lineage_by_digest(history):
    lineage = load_lineage(history / "leaf" / "lineage.json").model_dump(mode="json")
    receipt = json.loads((history / "leaf" / "train_receipt.json").read_text(encoding="utf-8"))
    manifest = json.loads((history / "leaf" / "adapter_manifest.json").read_text(encoding="utf-8"))
    assert manifest["receipt_hash"] == "sha256:" + file_sha256(history / "leaf" / "train_receipt.json")[0]
    link = receipt["request_lineage"]
    assert link["replay_hash"] == lineage["replay_hash"]
    assert link["request_count"] == 1
    for name, field in (("replay.jsonl", "replay_log_sha256"), ("lineage.json", "lineage_sha256")):
        assert link[field] == "sha256:" + file_sha256(history / "leaf" / name)[0]
    root = load_lineage(history / "root" / "lineage.json")
    assert lineage["parent"]["adapter_name"] == "root"
    assert lineage["parent"]["replay_hash"] == root.replay_hash
    assert len(root.requests) == 2


def test_verify_walks_root_to_leaf_and_says_nothing_was_replayed(history, capsys):
    code, out, err = _verify(capsys, history / "leaf")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("✓ root (root): 2 request(s), 2 outcome(s)")
    assert lines[1].startswith("✓ leaf (parent root): 1 request(s), 1 outcome(s)")
    assert "request-lineage integrity verifies" in lines[-1]
    assert NOTE in lines[-1]
    assert main(["adapters", "verify", str(history / "leaf")]) == 0
    assert "request_lineage match" in capsys.readouterr().out


def test_show_prints_the_records_without_checking(history, capsys):
    assert main(["replay", "show", str(history / "root")]) == 0
    out = capsys.readouterr().out
    assert "resumed from root-checkpoint-step-00000002.kiln-checkpoint" in out
    assert "cancelled" in out
    assert "completed" in out
    assert main(["replay", "show", str(history / "root"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [r["line"] for r in shown["records"]] == [1, 2, 3, 4]


def _copy(history, tmp_path):
    target = tmp_path / "adapters"
    shutil.copytree(history, target)
    return target


def _rewrite(path, transform):
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(transform(lines)))


def _edit_record(line_index, **changes):
    def transform(lines):
        record = json.loads(lines[line_index])
        record.update(changes)
        lines[line_index] = canonical_json(record) + b"\n"
        return lines

    return transform


def _ids(history):
    return [line.request_id for line in load_replay_log(history / "root" / "replay.jsonl") if line.is_request]


@pytest.mark.parametrize(
    ("tamper", "expected"),
    [
        (_edit_record(2, submitted_at="2020-01-01T00:00:00.000Z"), ["replay.jsonl:3", "{second}", "edited"]),
        (_edit_record(0, seed=4), ["replay.jsonl:1", "{first}", "edited"]),
        (lambda lines: lines[:2], ["{second}", "is missing after line 1"]),  # the resumed run's records deleted
        (lambda lines: [lines[0], lines[1], lines[3]], ["{second}", "is missing after line 1"]),
        (lambda lines: [lines[2], lines[3], lines[0], lines[1]], ["replay.jsonl:1", "{second}", "reordered"]),
        (lambda lines: [lines[0], lines[2], lines[1], lines[3]], ["replay.jsonl:3", "{first}", "does not follow"]),
        (lambda lines: [lines[0], b" " + lines[1], *lines[2:]], ["replay.jsonl:2", "not the canonical JSON"]),
        (lambda lines: [*lines[:3], lines[3].rstrip(b"\n")], ["replay.jsonl:4", "not terminated"]),
        (_edit_record(3, finished_at="2020-01-01T00:00:00.000Z"), ["train_receipt.json", "replay.jsonl hashes"]),
    ],
    ids=[
        "edit-resumed",
        "edit-first",
        "delete-run",
        "delete-request",
        "reorder-runs",
        "swap-two",
        "not-canonical",
        "torn",
        "edit-outcome",
    ],
)
def test_a_tampered_log_fails_verify_naming_the_entry(history, tmp_path, capsys, tamper, expected):
    copy = _copy(history, tmp_path)
    first, second = _ids(history)
    _rewrite(copy / "root" / "replay.jsonl", tamper)
    code, _, err = _verify(capsys, copy / "leaf")
    assert code == 1
    for text in expected:
        assert text.format(first=first, second=second) in err, err


def test_a_broken_parent_link_fails_verify_naming_it(history, tmp_path, capsys):
    copy = _copy(history, tmp_path)
    (copy / "root").rename(copy / "renamed")
    code, _, err = _verify(capsys, copy / "leaf")
    assert code == 1
    assert "parent adapter 'root' is not a sibling directory" in err

    copy = _copy(history, tmp_path / "b")
    with (copy / "root" / "adapter_model.safetensors").open("ab") as fh:
        fh.write(b"\0")
    code, _, err = _verify(capsys, copy / "leaf")
    assert code == 1
    assert "parent 'root': adapter_model.safetensors hashes to" in err


def _root_lineage(copy):
    """The root adapter's lineage (as JSON) and its request records: what a forged lineage is rebuilt from."""
    root = load_lineage(copy / "root" / "lineage.json").model_dump(mode="json")
    requests = [line.record for line in load_replay_log(copy / "root" / "replay.jsonl") if line.is_request]
    return root, requests


def test_a_parent_cycle_fails_verify(history, tmp_path, capsys):
    copy = _copy(history, tmp_path)
    root, requests = _root_lineage(copy)
    weights = "sha256:" + file_sha256(copy / "leaf" / "adapter_model.safetensors")[0]
    parent = {"adapter_name": "leaf", "adapter_model_sha256": weights, "replay_hash": None}
    write_lineage(copy / "root" / "lineage.json", build_lineage("root", root["base_model"], parent, requests))
    code, _, err = _verify(capsys, copy / "leaf")
    assert code == 1
    assert "the parent links form a cycle: leaf -> root -> leaf" in err


def test_a_recomputed_but_altered_lineage_fails_on_the_manifest_binding(history, tmp_path, capsys):
    copy = _copy(history, tmp_path)
    root, requests = _root_lineage(copy)
    forged = {**root["base_model"], "weights_sha256": None}  # consistent with itself, not with what was published
    write_lineage(copy / "root" / "lineage.json", build_lineage("root", forged, None, requests))
    code, _, err = _verify(capsys, copy / "root")
    assert code == 1
    assert "lineage.json hashes to" in err
    assert main(["adapters", "verify", str(copy / "root")]) == 1


def test_the_request_record_is_on_disk_before_the_first_optimizer_step(tmp_path, tiny_model_dir, monkeypatch):
    from kiln.trainers import _kit

    registry = tmp_path / "adapters"
    seen = []
    original = _kit.Policy.apply

    def apply(self, *args, **kwargs):
        if not seen:
            lines = load_replay_log(pending_log(registry, "early"))
            seen.append([line.record["record_type"] for line in lines])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(_kit.Policy, "apply", apply)
    job = admit_sft(
        adapter_name="early", registry=registry, config={"epochs": 1, "seed": 1}, examples=ROWS[:1],
        model_path=str(tiny_model_dir),
    )  # fmt: skip
    assert run_sft(job).status == "success"
    assert seen == [["request"]]
    assert [a.name for a in verify_lineage(registry / "early")] == ["early"]


def test_a_failed_run_leaves_its_outcome_in_the_pending_log(tmp_path, tiny_model_dir):
    registry = tmp_path / "adapters"
    cancel = threading.Event()
    cancel.set()  # cancelled after the first step, with no checkpoint interval: one is published there
    job = admit_sft(
        adapter_name="stopped", registry=registry, config={"epochs": 2, "seed": 1}, examples=ROWS[:2],
        model_path=str(tiny_model_dir),
    )  # fmt: skip
    result = run_sft(job, cancel=cancel)
    assert result.status == "failed"
    lines = load_replay_log(pending_log(registry, "stopped"))
    assert [line.record["record_type"] for line in lines] == ["request", "outcome"]
    assert lines[1].record["status"] == "cancelled"
    assert lines[1].record["global_step"] == 1
    assert not (registry / "stopped" / "replay.jsonl").exists()  # nothing of it looks published
    shutil.rmtree(result.latest_checkpoint)  # a run from step 0 may not reach an existing checkpoint's name
    fresh = admit_sft(
        adapter_name="stopped", registry=registry, config={"epochs": 1, "seed": 2}, examples=ROWS[:2],
        model_path=str(tiny_model_dir),
    )  # fmt: skip
    assert run_sft(fresh).status == "success"  # a run from step 0 starts the history anew
    published = load_replay_log(registry / "stopped" / "replay.jsonl")
    assert [line.record["seed"] for line in published if line.is_request] == [2]


def test_an_opd_run_publishes_a_lineage_that_verifies(tmp_path, tiny_model_dir, teachers):
    from kiln.trainers.opd import admit_opd, run_opd

    prompts = [{"messages": [{"role": "user", "content": "Tell me one thing about cats."}]}]
    request = {"teacher": "tutor", "prompts": prompts, "config": {"seed": 2, "samples_per_prompt": 2, "max_tokens": 6}}
    job = admit_opd(
        adapter_name="student", registry=tmp_path / "adapters", request=request, teachers_root=teachers,
        model_path=str(tiny_model_dir),
    )  # fmt: skip
    result = run_opd(job)
    assert result.status == "success", result.receipt.get("failure_message")
    (verified,) = verify_lineage(tmp_path / "adapters" / "student")
    assert verified.requests == 1
    assert load_replay_log(result.adapter_dir / "replay.jsonl")[0].record["kind"] == "opd"


@pytest.mark.slow
def test_a_servers_history_verifies_and_its_load_checks_the_lineage(tmp_path, tiny_model_dir, capsys):
    roots = {"KILN_TRAINING_DATA_ROOTS": str(tmp_path)}
    with ServerProcess(tmp_path / "home", tiny_model_dir, env=roots) as server, server.client() as http:

        def train(config):
            answer = http.post("/v1/train/sft", json={"examples": ROWS, "config": {"auto_load": False, **config}})
            assert answer.status_code == 200, answer.text
            job = answer.json()["job_id"]
            done = wait_for(
                lambda: (d := http.get(f"/v1/train/jobs/{job}").json())["state"] in ("completed", "failed") and d,
                timeout=300,
            )
            assert done["state"] == "completed", done.get("error")
            return done

        train({"output_name": "srv-root", "epochs": 1, "seed": 1})
        train({"output_name": "srv-child", "epochs": 1, "seed": 2, "base_adapter": "srv-root"})
        registry = server.home / "adapters"
        code, out, err = _verify(capsys, registry / "srv-child")
        assert code == 0, err
        assert "✓ srv-root (root)" in out
        assert "✓ srv-child (parent srv-root)" in out
        assert NOTE in out
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
        answer = http.post("/v1/chat/completions", json={**chat, "adapter": "srv-child"})
        assert answer.status_code == 200, answer.text
        _rewrite(registry / "srv-root" / "replay.jsonl", _edit_record(0, seed=9))
        answer = http.post("/v1/chat/completions", json={**chat, "adapter": "srv-root"})
        assert answer.status_code != 200
        assert "replay.jsonl hashes to" in answer.text
        code, _, err = _verify(capsys, registry / "srv-child")
        assert code == 1
        assert "replay.jsonl:1" in err


def test_restore_copies_the_lineage_and_refuses_a_tampered_one(tmp_path, trained_adapter):
    from kiln.adapters._restore import restore_adapter
    from kiln.errors import AdapterError

    receipt = restore_adapter(trained_adapter / "adapter_manifest.json", tmp_path / "copy")
    assert {"replay.jsonl", "lineage.json"} <= set(receipt["copied_files"])
    assert [a.name for a in verify_lineage(tmp_path / "copy" / "bot")] == ["bot"]
    source = shutil.copytree(trained_adapter, tmp_path / "transfer" / "bot")
    _rewrite(source / "replay.jsonl", _edit_record(0, seed=99))
    with pytest.raises(AdapterError, match=r"request_lineage\.replay_log_sha256 mismatch"):
        restore_adapter(source / "adapter_manifest.json", tmp_path / "other")
    assert not (tmp_path / "other" / "bot").exists()
