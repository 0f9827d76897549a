"""Hostile names, prefix deletes and leftovers of killed publications (issue 19, items 1, 3 and part of 8).

Unit tests pin the rules (``kiln.host.fs.name_problem``, the strict checkpoint-name parse, exact-name deletion, the
per-adapter view of unfinished publications and ``kiln checkpoints clean``); the ``live`` tests at the end replay
the reported cases against a real ``kiln serve`` on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from _server import ServerProcess, wait_for
from conftest import ADAPTER_CONVERSATIONS

from kiln.adapters import delete_adapter, list_adapters, verify_adapter
from kiln.checkpoints import (
    checkpoint_name,
    clean_unfinished_publications,
    list_checkpoints,
    orphaned_staging_dirs,
    parse_checkpoint_name,
    parse_checkpoint_staging_name,
)
from kiln.cli import main
from kiln.errors import NotFoundError, RequestError
from kiln.host.fs import name_problem

HOUR = 3600.0


def _tree(root: Path) -> list[str]:
    """Every entry below ``root`` (hidden ones too), as sorted relative paths."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _dir(path: Path, *files: str) -> Path:
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_bytes(b"x")
    return path


def _checkpoint(registry: Path, adapter: str, step: int) -> Path:
    return _dir(registry / checkpoint_name(adapter, step), "checkpoint_manifest.json")


def _staging(registry: Path, adapter: str, step: int, *, suffix: str = "abcd_123", sentinel: bool = True) -> Path:
    """A hidden staging directory as ``publish_checkpoint`` leaves it when killed (``kiln.host.fs.staging_dir``)."""
    files = (".incomplete", "adapter_model.safetensors") if sentinel else ("adapter_model.safetensors",)
    return _dir(registry / f".{checkpoint_name(adapter, step)}.incomplete-{suffix}", *files)


def _age(path: Path, seconds: float) -> None:
    """Make ``path`` and everything below it look untouched for ``seconds``."""
    stamp = time.time() - seconds
    for item in [path, *path.rglob("*")]:
        os.utime(item, (stamp, stamp), follow_symlinks=False)


# --- the name rule ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "why"),
    [
        pytest.param(" ", "blank", id="space"),
        pytest.param("\u3000\u00a0", "blank", id="unicode-whitespace"),
        pytest.param(" bot", "whitespace", id="leading-space"),
        pytest.param("bot ", "whitespace", id="trailing-space"),
        pytest.param("x-checkpoint-step-00000001.kiln-checkpoint", "-checkpoint-step-", id="a-checkpoint-name"),
        pytest.param("a-checkpoint-step-b", "-checkpoint-step-", id="the-checkpoint-mark"),
        pytest.param("etc.kiln-checkpoint", "'.kiln-checkpoint'", id="checkpoint-suffix"),
        pytest.param("bot.failed", "'.failed'", id="demoted-suffix"),
        pytest.param("bot.failed-2", "'.failed'", id="second-demoted-suffix"),
        pytest.param("bot.incomplete", "'.incomplete'", id="staging-suffix"),
        pytest.param("bot.incomplete-abcd1234", "'.incomplete'", id="staging-suffix-with-random-part"),
        pytest.param("bot.restore", "'.restore'", id="restore-suffix"),
        pytest.param("bot.replaced-x", "'.replaced'", id="replaced-suffix"),
        pytest.param("bot.deleting-0123abcd", "'.deleting'", id="deleting-suffix"),
    ],
)
def test_an_adapter_name_that_is_blank_padded_or_reads_as_something_kiln_derives_is_refused(name, why):
    problem = name_problem(name, kind="adapter")
    assert problem is not None, name
    assert problem.startswith("it ")
    assert why in problem


@pytest.mark.parametrize(
    "name", ["victim-checkpoint-keep", "bot-checkpoint", "checkpoint-step-bot", "bot.failedx", "bot.kiln", "x.y"]
)
def test_an_adapter_name_that_merely_resembles_a_derived_name_is_accepted(name):
    assert name_problem(name, kind="adapter") is None


@pytest.mark.parametrize("kind", ["teacher", "suite", "checkpoint", "file"])
@pytest.mark.parametrize("name", [" ", "\u2003", " tutor", "tutor\u00a0"])
def test_a_blank_or_whitespace_padded_name_is_refused_for_every_kind(kind, name):
    assert name_problem(name, kind=kind)


@pytest.mark.parametrize("kind", ["teacher", "suite"])
def test_teacher_and_suite_names_may_end_in_what_adapters_may_not(kind):
    assert name_problem("tutor.failed", kind=kind) is None  # no checkpoint, staging or demotion is derived from them


# --- strict checkpoint names --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("victim-checkpoint-keep", id="no-step"),
        pytest.param("bot-checkpoint-step-1.kiln-checkpoint", id="one-digit"),
        pytest.param("bot-checkpoint-step-0000001.kiln-checkpoint", id="seven-digits"),
        pytest.param("bot-checkpoint-step-000000001.kiln-checkpoint", id="nine-digits-with-a-leading-zero"),
        pytest.param("bot-checkpoint-step-00000001.kiln-checkpoint.x", id="suffix-after"),
        pytest.param(" -checkpoint-step-00000001.kiln-checkpoint", id="blank-adapter"),
        pytest.param("bot.failed-checkpoint-step-00000001.kiln-checkpoint", id="reserved-adapter"),
        pytest.param(
            "a-checkpoint-step-00000001.kiln-checkpoint-checkpoint-step-00000002.kiln-checkpoint", id="nested-mark"
        ),
        pytest.param("bad\udcff-checkpoint-step-00000001.kiln-checkpoint", id="not-utf8"),
    ],
)
def test_a_name_that_is_not_exactly_a_checkpoint_of_a_valid_adapter_does_not_parse(name):
    assert parse_checkpoint_name(name) is None


def test_a_checkpoint_name_parses_back_to_its_adapter_and_step():
    for adapter, step in (("bot", 0), ("victim-checkpoint-keep", 24), ("é", 99_999_999), ("bot", 123_456_789)):
        assert parse_checkpoint_name(checkpoint_name(adapter, step)) == (adapter, step)


def test_a_staging_name_parses_to_the_checkpoint_it_was_publishing():
    name = checkpoint_name("k3", 350)
    assert parse_checkpoint_staging_name(f".{name}.incomplete-ab_d1234") == ("k3", 350, "incomplete")
    assert parse_checkpoint_staging_name(f".{name}.deleting-0123abcd") == ("k3", 350, "deleting")
    for other in (f"{name}.incomplete-abcd1234", f".{name}.incomplete-abc", ".k3.incomplete-abcd1234", f".{name}"):
        assert parse_checkpoint_staging_name(other) is None, other


# --- deletion owns exactly the adapter's checkpoints ----------------------------------------------------------


def test_deleting_a_name_that_only_prefixes_another_adapter_is_404_and_touches_nothing(tmp_path):
    registry = tmp_path / "adapters"
    _dir(registry / "victim-checkpoint-keep", "adapter_config.json", "adapter_model.safetensors")
    _checkpoint(registry, "victim-checkpoint-keep", 2)
    before = _tree(registry)
    with pytest.raises(NotFoundError) as caught:
        delete_adapter(registry, "victim")
    assert caught.value.code == "adapter_not_found"
    with pytest.raises(NotFoundError):
        delete_adapter(registry, "victim", dry_run=True)
    assert _tree(registry) == before


def test_deleting_an_adapter_removes_it_and_exactly_its_own_checkpoints_and_leftovers(tmp_path):
    registry = tmp_path / "adapters"
    mine = [
        _dir(registry / "bot", "adapter_config.json"),
        _checkpoint(registry, "bot", 2),
        _checkpoint(registry, "bot", 4),
        _staging(registry, "bot", 6),
        _dir(registry / f".{checkpoint_name('bot', 8)}.deleting-0123abcd", "x"),
    ]
    theirs = [
        _dir(registry / "bot-checkpoint-x", "adapter_config.json"),
        _checkpoint(registry, "bot-checkpoint-x", 2),  # bot-checkpoint-x-checkpoint-step-...: the old prefix matched it
        _staging(registry, "bot-checkpoint-x", 4),
        _checkpoint(registry, "bot-2", 2),
        _dir(registry / "bot-checkpoint-step-1.kiln-checkpoint", "x"),  # not canonical: nobody's checkpoint
        _dir(registry / ".bot.incomplete-abcd1234", "x"),  # the adapter's own publication staging: not a checkpoint
    ]
    assert sorted(delete_adapter(registry, "bot", dry_run=True)) == sorted(mine)
    assert all(p.exists() for p in mine)
    assert sorted(delete_adapter(registry, "bot")) == sorted(mine)
    assert not any(p.exists() for p in mine)
    assert all(p.exists() for p in theirs)
    assert not [p for p in registry.iterdir() if ".deleting-" in p.name and "bot-checkpoint-x" not in p.name]


def test_a_listed_directory_whose_name_the_rule_now_refuses_can_still_be_deleted_alone(tmp_path):
    registry = tmp_path / "adapters"
    demoted = _dir(registry / "bot.failed", "adapter_config.json", "adapter_model.safetensors")
    kept = _checkpoint(registry, "bot", 2)  # the demoted adapter's checkpoints belong to `bot`, not to `bot.failed`
    assert "bot.failed" in [e["name"] for e in list_adapters(registry)["available"]]
    assert delete_adapter(registry, "bot.failed") == [demoted]
    assert not demoted.exists()
    assert kept.exists()


def test_a_refused_name_that_names_no_directory_is_refused_with_the_rule_not_404(tmp_path):
    registry = tmp_path / "adapters"
    _checkpoint(registry, "x", 1)
    with pytest.raises(RequestError) as caught:
        delete_adapter(registry, "x-checkpoint-step-00000001.kiln-checkpoint")
    assert caught.value.code == "training_invalid_request"
    assert "-checkpoint-step-" in caught.value.message
    assert (registry / checkpoint_name("x", 1)).is_dir()


# --- unfinished publications: listing per adapter, cleaning ---------------------------------------------------


def test_the_unfinished_publications_of_one_adapter_never_include_another_adapters(tmp_path):
    registry = tmp_path / "adapters"
    k3 = _staging(registry, "k3", 350)
    k5 = _staging(registry, "k5", 10)
    _staging(registry, "k5-checkpoint-keep", 10)  # k5 is a prefix of this adapter's name
    assert orphaned_staging_dirs(registry, "k5") == [k5]
    assert orphaned_staging_dirs(registry, "k3") == [k3]
    assert len(orphaned_staging_dirs(registry)) == 3


def test_kiln_checkpoints_list_for_one_adapter_reports_only_its_own_unfinished_publications(tmp_path, capsys):
    registry = tmp_path / "adapters"
    _staging(registry, "k3", 350)
    k5 = _staging(registry, "k5", 10)
    assert main(["checkpoints", "list", "--adapter", "k5", "--adapter-dir", str(registry)]) == 0
    out = capsys.readouterr().out
    assert str(k5) in out
    assert "k3" not in out
    assert "1 unfinished publication" in out


def test_clean_removes_idle_unfinished_publications_and_keeps_everything_else(tmp_path):
    registry = tmp_path / "adapters"
    idle = _staging(registry, "bot", 6)
    idle_complete = _staging(registry, "bot", 8, suffix="zzzz9999", sentinel=False)  # killed before its rename
    _age(idle, 2 * HOUR)
    _age(idle_complete, 2 * HOUR)
    young = _staging(registry, "bot", 10)  # a publication may still be writing it
    superseded = _staging(registry, "bot", 4, suffix="old_0001")  # its name was published since: it can never land
    published = _checkpoint(registry, "bot", 4)
    adapter = _dir(registry / "bot", "adapter_config.json")
    adapter_staging = _dir(registry / ".bot.incomplete-abcd1234", "x")
    _age(adapter_staging, 2 * HOUR)
    link = registry / f".{checkpoint_name('bot', 12)}.incomplete-link0001"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep").write_bytes(b"x")

    planned = clean_unfinished_publications(registry, dry_run=True)
    assert sorted(p.path for p in planned.removed) == sorted([idle, idle_complete, superseded])
    assert [p.path for p in planned.kept] == [young]
    assert idle.exists()
    assert superseded.exists()

    done = clean_unfinished_publications(registry)
    assert sorted(p.path for p in done.removed) == sorted([idle, idle_complete, superseded])
    assert done.errors == []
    assert not idle.exists()
    assert not idle_complete.exists()
    assert not superseded.exists()
    for untouched in (young, published, adapter, adapter_staging):
        assert untouched.is_dir()
    assert link.is_symlink()
    assert (tmp_path / "elsewhere" / "keep").is_file()
    assert [c.path for c in list_checkpoints(registry)] == [published]

    assert [p.path for p in clean_unfinished_publications(registry, older_than=0).removed] == [young]


def test_clean_for_one_adapter_leaves_other_adapters_publications(tmp_path):
    registry = tmp_path / "adapters"
    mine, theirs = _staging(registry, "k5", 1), _staging(registry, "k5-checkpoint-keep", 1)
    _age(mine, 2 * HOUR)
    _age(theirs, 2 * HOUR)
    assert [p.path for p in clean_unfinished_publications(registry, "k5").removed] == [mine]
    assert theirs.is_dir()


def test_kiln_checkpoints_clean_prints_what_it_removed_and_what_it_kept(tmp_path, capsys):
    registry = tmp_path / "adapters"
    idle, young = _staging(registry, "bot", 6), _staging(registry, "bot", 10)
    _age(idle, 2 * HOUR)
    assert main(["checkpoints", "clean", "--adapter-dir", str(registry), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would remove {idle}" in out
    assert f"kept {young}" in out
    assert idle.exists()
    assert main(["checkpoints", "clean", "--adapter-dir", str(registry), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in body["removed"]] == [str(idle)]
    assert body["removed"][0]["checkpoint"] == checkpoint_name("bot", 6)
    assert [k["path"] for k in body["kept"]] == [str(young)]
    assert not idle.exists()
    assert young.exists()
    assert main(["checkpoints", "clean", "--adapter-dir", str(registry), "--older-than", "0"]) == 0
    assert f"removed {young}" in capsys.readouterr().out
    assert main(["checkpoints", "clean", "--adapter-dir", str(registry)]) == 0
    assert "no unfinished publications" in capsys.readouterr().out


# --- listing is metadata only ----------------------------------------------------------------------------------


def test_a_tampered_adapter_lists_available_and_the_listing_says_it_hashed_nothing(tmp_path, trained_adapter, capsys):
    import shutil

    registry = tmp_path / "adapters"
    shutil.copytree(trained_adapter, registry / "bot")
    weights = registry / "bot" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # same size, one bit of one tensor value
    weights.write_bytes(bytes(data))
    (entry,) = list_adapters(registry)["available"]
    assert entry["status"] == "available"  # listing reads metadata: sizes, config, the manifest's own validity
    assert main(["adapters", "list", "--adapter-dir", str(registry)]) == 0
    out = capsys.readouterr().out
    assert "metadata only" in out
    assert "kiln adapters verify" in out
    assert verify_adapter("bot", registry)["status"] != "ok"


# --- against a live server ------------------------------------------------------------------------------------

HOSTILE = [
    pytest.param("é" * 128, "256 bytes in UTF-8", id="256-bytes"),
    pytest.param("é" * 97, "194 bytes in UTF-8", id="194-bytes"),
    pytest.param("nul\x00byte", "control characters", id="nul"),
    pytest.param(" ", "blank", id="blank"),
    pytest.param(" bot", "whitespace", id="leading-space"),
    pytest.param("x-checkpoint-step-00000001.kiln-checkpoint", "-checkpoint-step-", id="checkpoint-name"),
    pytest.param("etc.kiln-checkpoint", "'.kiln-checkpoint'", id="checkpoint-suffix"),
    pytest.param("bot.failed", "'.failed'", id="demoted-suffix"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    with ServerProcess(tmp_path_factory.mktemp("hostile") / "home", tiny_model_dir) as proc:
        yield proc


def _registry(server: ServerProcess) -> Path:
    return server.home / "adapters"


def _train(http, name: str, **config):
    answer = http.post(
        "/v1/train/sft",
        json={"examples": ADAPTER_CONVERSATIONS * 2, "config": {"epochs": 1, "seed": 3, "output_name": name, **config}},
    )
    assert answer.status_code == 200, answer.text
    job_id = answer.json()["job_id"]
    detail = wait_for(
        lambda: (d := http.get(f"/v1/train/jobs/{job_id}").json())["state"] in ("completed", "failed") and d,
        timeout=300,
    )
    assert detail["state"] == "completed", detail
    return detail


@pytest.mark.slow
def test_live_each_hostile_output_name_is_refused_with_400_and_its_rule_before_anything_is_queued(server):
    seen, expected = {}, {}
    with server.client() as http:
        for param in HOSTILE:
            name, why = param.values
            answer = http.post(
                "/v1/train/sft", json={"examples": ADAPTER_CONVERSATIONS, "config": {"epochs": 1, "output_name": name}}
            )
            error = answer.json().get("error") or {}
            message = error.get("message", "")
            seen[param.id] = (answer.status_code, error.get("code"), why in message, "registry name rule" in message)
            # the AdapterName schema states every part of the rule but the UTF-8 byte bound (its characters fit)
            code = "training_invalid_request" if param.id.endswith("-bytes") else "pattern_mismatch"
            expected[param.id] = (400, code, True, True)
        assert seen == expected
        assert http.get("/v1/train/status").json() == [], "nothing was queued"
        assert http.get("/health").status_code == 200
    registry = _registry(server)
    assert not registry.exists() or _tree(registry) == []


@pytest.mark.slow
def test_live_blank_teacher_aliases_and_suite_names_are_refused_with_400(server):
    suite = json.loads(Path(__file__).resolve().parent.parent.joinpath("examples", "eval_suite.json").read_text())
    with server.client() as http:
        for name in (" ", "\u3000", " padded"):
            answer = http.post("/v1/teachers", json={"alias": name, "kind": "local", "model_id": str(server.model)})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["code"] == "unsafe_path"
            assert "whitespace" in answer.text or "blank" in answer.text
            answer = http.post("/v1/eval/suites", json={**suite, "name": name})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["code"] == "unsafe_path"
            assert "whitespace" in answer.text or "blank" in answer.text
        assert http.get("/v1/teachers").json()["teachers"] == []
        assert http.get("/v1/eval/suites").json()["suites"] == []


@pytest.mark.slow
def test_live_a_delete_never_reaches_an_adapter_its_name_only_prefixes(server):
    registry = _registry(server)
    with server.client() as http:
        _train(http, "victim-checkpoint-keep", checkpoint_interval=2)
        wait_for(lambda: http.get("/v1/adapters").json()["active_adapter"] == "victim-checkpoint-keep", timeout=120)
        keep = [p.name for p in registry.iterdir() if p.name.startswith("victim-checkpoint-keep")]
        assert len(keep) >= 2, keep  # the adapter and at least one of its checkpoints
        before = _tree(registry)

        answer = http.delete("/v1/adapters/victim")
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["code"] == "adapter_not_found"
        assert _tree(registry) == before, "a delete of a missing name touches nothing"

        answer = http.delete("/v1/adapters/victim-checkpoint-keep")
        assert answer.status_code == 409
        assert answer.json()["error"]["code"] == "adapter_active"

        _train(http, "victim", checkpoint_interval=2, auto_load=False)
        assert [c.adapter for c in list_checkpoints(registry, "victim")], "victim has checkpoints of its own"
        answer = http.delete("/v1/adapters/victim")
        assert answer.status_code == 200, answer.text
        assert list_checkpoints(registry, "victim") == []
        assert not (registry / "victim").exists()
        assert sorted(p.name for p in registry.iterdir() if p.name.startswith("victim-checkpoint-keep")) == sorted(keep)
        listing = http.get("/v1/adapters").json()
        assert listing["active_adapter"] == "victim-checkpoint-keep"
        assert [e["name"] for e in listing["available"]] == ["victim-checkpoint-keep"]
        assert listing["available"][0]["status"] == "loaded"
