"""``kiln teachers add|list|remove``: the local registry under KILN_HOME by default, a Kiln server
with ``--url``/``--server``/``KILN_URL``. Commands run in-process through ``kiln.cli.main``; every
``--json`` form validates against its schema definition, every error is one clear line.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from _server import ServerProcess

from kiln import contracts
from kiln.cli import main


def _valid(definition, body):
    assert contracts.problems(definition, body) == [], definition
    return body


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _no_server_url(monkeypatch):
    monkeypatch.delenv("KILN_URL", raising=False)
    monkeypatch.delenv("KILN_API_KEY", raising=False)


def _scored_file(path, model_dir, *, top_k=2):
    manifest = {
        "schema": "kiln.off-policy-distillation-manifest.v1",
        "fixture_id": "arith-v1",
        "tokenizer_vocab_sha256": hashlib.sha256((model_dir / "tokenizer.json").read_bytes()).hexdigest(),
        "vocab_size": 627,
        "top_k": top_k,
        "row_count": 1,
    }
    row = {
        "messages": [{"role": "user", "content": "2+2?"}],
        "response": "4",
        "teacher_tokens": [
            {"token_id": 52, "top_logprobs": [{"token_id": 52, "logprob": -0.1}, {"token_id": 53, "logprob": -2.4}]}
        ],
    }
    path.write_text(json.dumps(manifest) + "\n" + json.dumps(row) + "\n", encoding="utf-8")
    return path


def test_the_local_registry_adds_lists_and_removes(capsys, tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tiny_model_dir.parent)
    code, out, err = _run(capsys, "teachers", "add", "tutor", "--kind", "local", "--model", tiny_model_dir.name)
    assert code == 0, err
    assert out.startswith("✓ registered teacher tutor (local, verified; identity sha256:")
    record = json.loads((tmp_path / "kiln-home" / "teachers" / "tutor.json").read_text())
    assert record["entry"]["spec"]["model_id"] == str(tiny_model_dir.resolve())  # made absolute

    code, out, err = _run(capsys, "teachers", "list", "--json")
    assert code == 0, err
    listing = _valid("TeachersListResponse", json.loads(out))
    assert [e["spec"]["alias"] for e in listing["teachers"]] == ["tutor"]
    code, out, _ = _run(capsys, "teachers", "list")
    assert code == 0
    assert out.splitlines()[0].split()[:3] == ["ALIAS", "KIND", "STATUS"]
    assert out.splitlines()[1].split()[:4] == ["tutor", "local", "verified", "64"]

    code, _, err = _run(capsys, "teachers", "add", "tutor", "--kind", "fixture", "--model-id", "x")
    assert code == 1
    assert err.startswith("error [teacher_conflict]: teacher alias 'tutor' is already registered")
    code, out, err = _run(capsys, "teachers", "remove", "tutor")
    assert (code, out) == (0, "✓ removed teacher tutor\n"), err
    code, _, err = _run(capsys, "teachers", "remove", "tutor")
    assert code == 1
    assert err.startswith("error [teacher_not_found]")
    code, out, _ = _run(capsys, "teachers", "list")
    assert code == 0
    assert out.startswith("no teachers registered")


def test_a_fixture_file_is_pinned_locally_and_a_bad_one_is_refused_by_line(capsys, tmp_path, tiny_model_dir):
    scored = _scored_file(tmp_path / "scored.jsonl", tiny_model_dir)
    code, out, err = _run(capsys, "teachers", "add", "arith", "--kind", "fixture", "--file", scored, "--json")
    assert code == 0, err
    entry = _valid("TeacherEntry", json.loads(out))
    assert entry["spec"]["model_id"] == "arith-v1"
    assert entry["status"] == "configured"

    bad = _scored_file(tmp_path / "bad.jsonl", tiny_model_dir, top_k=3)
    code, _, err = _run(capsys, "teachers", "add", "arith-bad", "--kind", "fixture", "--file", bad)
    assert code == 1
    assert err.startswith(f"error [inconsistent_fields]: {bad} line 2: ")
    assert "top_k is 3" in err
    code, out, _ = _run(capsys, "teachers", "list", "--json")
    assert [e["spec"]["alias"] for e in json.loads(out)["teachers"]] == ["arith"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kind", "local"], "a local teacher needs --model PATH"),
        (["--kind", "remote", "--url", "http://x"], "needs --url URL and --model-id ID"),
        (["--kind", "remote", "--url", "http://x", "--model-id", "m", "--model", "/m"], "--model do(es) not apply"),
        (["--kind", "fixture"], "needs --file F"),
        (["--kind", "local", "--model", "/nowhere"], "not a Hugging Face model directory"),
    ],
)
def test_add_refuses_flags_that_do_not_describe_a_teacher(capsys, argv, message):
    code, _, err = _run(capsys, "teachers", "add", "t", *argv)
    assert code == 2
    assert message in err


def test_a_fixture_file_cannot_be_sent_to_a_server(capsys, tmp_path, monkeypatch, tiny_model_dir):
    scored = _scored_file(tmp_path / "scored.jsonl", tiny_model_dir)
    monkeypatch.setenv("KILN_URL", "http://127.0.0.1:9")
    code, _, err = _run(capsys, "teachers", "add", "arith", "--kind", "fixture", "--file", scored)
    assert code == 2
    assert "the request body carries no file" in err
    code, out, err = _run(capsys, "teachers", "add", "arith", "--kind", "fixture", "--file", scored, "--local")
    assert code == 0, err
    assert out.startswith("✓ registered teacher arith (fixture, configured)")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    with ServerProcess(tmp_path_factory.mktemp("serve") / "home", tiny_model_dir) as proc:
        yield proc


def test_over_http_the_server_registers_lists_and_removes(capsys, monkeypatch, server, tiny_model_dir):
    url = server.url
    code, out, err = _run(
        capsys, "teachers", "add", "tutor", "--kind", "local", "--model", tiny_model_dir, "--server", url, "--json"
    )
    assert code == 0, err
    assert _valid("TeacherEntry", json.loads(out))["status"] == "verified"
    code, out, err = _run(
        capsys, "teachers", "add", "peer", "--kind", "remote", "--url", url, "--model-id", "kiln-tiny", "--server", url
    )
    assert code == 0, err
    assert out.startswith("✓ registered teacher peer (remote, verified; identity sha256:")

    code, out, err = _run(capsys, "teachers", "list", "--url", url, "--json")
    assert code == 0, err
    listing = _valid("TeachersListResponse", json.loads(out))
    assert [e["spec"]["alias"] for e in listing["teachers"]] == ["peer", "tutor"]
    assert listing["teachers"][0]["spec"]["identity"] == listing["teachers"][1]["spec"]["identity"]

    monkeypatch.setenv("KILN_URL", url)
    code, out, _ = _run(capsys, "teachers", "list")
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["peer", "tutor"]
    code, out, _ = _run(capsys, "teachers", "list", "--local")  # this machine's registry is another one
    assert out.startswith("no teachers registered")

    code, out, err = _run(capsys, "teachers", "remove", "peer", "--json")
    assert code == 0, err
    assert _valid("DeleteTeacherResponse", json.loads(out)) == {"status": "deleted", "alias": "peer"}
    code, out, _ = _run(capsys, "teachers", "remove", "peer", "--json")
    assert code == 1
    assert _valid("ErrorEnvelope", json.loads(out))["error"]["code"] == "teacher_not_found"
    code, _, err = _run(capsys, "teachers", "add", "tutor", "--kind", "fixture", "--model-id", "x")
    assert code == 1
    assert err.startswith("error [teacher_conflict]")
    assert _run(capsys, "teachers", "remove", "tutor")[0] == 0
    assert os.listdir(server.home / "teachers") == []


def test_an_unreachable_server_is_one_clear_line(capsys):
    code, _, err = _run(capsys, "teachers", "list", "--url", "http://127.0.0.1:9")
    assert code == 1
    assert err.startswith("error: cannot reach the Kiln server at http://127.0.0.1:9")
