"""The OPD teacher registry: registration by kind, immutable aliases, strict records, the pinned
identity and its re-probe, pre-scored fixture files, the student check and the scorers.

Everything lives under ``tmp_path``; the teacher is a tiny model with the student's tokenizer
and other weights (``create_tiny(seed=2)``). Remote probes run against a small in-test HTTP
server (the live ``kiln serve`` protocol is covered in ``test_teacher_protocol.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import shutil
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

from kiln import contracts
from kiln.artifacts.base_weights import build_base_weight_manifest
from kiln.documents.digests import json_sha256, prefixed, teacher_identity_revision
from kiln.errors import ConflictError, ContractError, IntegrityError, NotFoundError, RequestError, UpstreamError
from kiln.model import create_tiny, load_base_model, sequence_logprobs
from kiln.teachers import (
    MAX_TOP_K,
    LocalScorer,
    PinnedTeacher,
    TeacherRegistry,
    credential_env,
    open_scorer,
    reprobe,
    teacher_identity_for,
    teachers_root,
    top_k_logprobs,
)
from kiln.teachers._scoring import ranks_of, stable_top_k


def _valid(definition, doc):
    assert contracts.problems(definition, doc) == [], definition
    return doc


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny teacher: the default tokenizer, weights from seed 2 (read-only; copy before changing)."""
    return create_tiny(tmp_path_factory.mktemp("teacher") / "tiny-teacher", seed=2)


@pytest.fixture
def registry(tmp_path):
    return TeacherRegistry(teachers_root(tmp_path / "kiln-home"), adapter_registry=tmp_path / "adapters")


def _local(alias, model_dir, **extra):
    return {"alias": alias, "kind": "local", "model_id": str(model_dir), **extra}


# --- pre-scored files ------------------------------------------------------------------------


def _row(top=((52, -0.1), (53, -2.4)), token=52):
    return {
        "messages": [{"role": "user", "content": "2+2?"}],
        "response": "4",
        "teacher_tokens": [
            {"token_id": token, "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in top]},
            {"token_id": 3, "top_logprobs": [{"token_id": 3, "logprob": -0.02}, {"token_id": 10, "logprob": -4.6}]},
        ],
    }


def _scored_file(path, model_dir, rows, *, row_count=None, fixture_id="arith-v1"):
    manifest = {
        "schema": "kiln.off-policy-distillation-manifest.v1",
        "fixture_id": fixture_id,
        "tokenizer_vocab_sha256": hashlib.sha256((model_dir / "tokenizer.json").read_bytes()).hexdigest(),
        "vocab_size": json.loads((model_dir / "config.json").read_text())["vocab_size"],
        "top_k": 2,
        "row_count": len(rows) if row_count is None else row_count,
    }
    path.write_text("".join(json.dumps(line) + "\n" for line in [manifest, *rows]), encoding="utf-8")
    return path, manifest


# --- registry ----------------------------------------------------------------------------------


def test_a_local_teacher_is_registered_verified_listed_got_and_removed(registry, teacher_dir):
    entry = _valid("TeacherEntry", registry.add(_local("tutor", teacher_dir, notes="seed 2")))
    assert entry["status"] == "verified"
    assert entry["usable"] is True
    spec = entry["spec"]
    assert spec["model_id"] == str(teacher_dir)
    assert spec["max_top_k"] == MAX_TOP_K == entry["capabilities"]["max_top_k"]
    assert spec["tokenizer_hash"] == prefixed(spec["identity"]["tokenizer_vocab_sha256"])
    assert entry["identity_revision"] == prefixed(teacher_identity_revision(spec["identity"]))
    registry.add(_local("apprentice", teacher_dir))
    assert [e["spec"]["alias"] for e in registry.list()] == ["apprentice", "tutor"]

    record = _valid("TeacherRegistryRecord", json.loads(registry.path("tutor").read_text()))
    assert record["entry"] == entry
    assert record["content_revision"] == "sha256:" + spec["identity"]["base_model_sha256"]
    assert record["fixture"] is None

    pinned = registry.get("tutor")
    assert isinstance(pinned, PinnedTeacher)
    assert (pinned.alias, pinned.kind, pinned.model_id, pinned.url, pinned.adapter) == (
        "tutor",
        "local",
        str(teacher_dir),
        None,
        None,
    )
    assert pinned.identity == spec["identity"]
    assert pinned.identity_revision == entry["identity_revision"].removeprefix("sha256:")
    assert pinned.content_revision == record["content_revision"]
    assert pinned.entry == entry
    with pytest.raises(dataclasses.FrozenInstanceError):
        pinned.alias = "other"  # type: ignore[misc]

    assert _valid("DeleteTeacherResponse", registry.remove("tutor")) == {"status": "deleted", "alias": "tutor"}
    for action in (registry.get, registry.remove):
        with pytest.raises(NotFoundError) as caught:
            action("tutor")
        assert caught.value.code == "teacher_not_found"
    assert [e["spec"]["alias"] for e in registry.list()] == ["apprentice"]


def test_an_alias_is_immutable_and_a_second_registration_changes_nothing(registry, teacher_dir, tiny_model_dir):
    registry.add(_local("tutor", teacher_dir))
    before = registry.path("tutor").read_bytes()
    with pytest.raises(ConflictError) as caught:
        registry.add(_local("tutor", tiny_model_dir))
    assert caught.value.code == "teacher_conflict"
    assert "immutable" in caught.value.message
    assert registry.path("tutor").read_bytes() == before
    assert sorted(p.name for p in registry.root.iterdir()) == ["tutor.json"]  # no temp file left behind


@pytest.mark.parametrize("alias", ["../escape", ".hidden", "a/b", "a\\b", "x" * 256, "nul\x00byte", "..", "tab\tname"])
def test_an_alias_that_is_not_path_safe_is_refused(registry, tmp_path, teacher_dir, alias):
    with pytest.raises(ContractError) as caught:
        registry.add(_local(alias, teacher_dir))
    assert caught.value.code in ("unsafe_path", "invalid_length")
    assert caught.value.pointer == "/alias"
    assert not registry.root.exists()
    with pytest.raises(NotFoundError):
        registry.get(alias)
    with pytest.raises(NotFoundError):
        registry.remove(alias)


def test_a_tampered_record_is_refused(registry, teacher_dir):
    registry.add(_local("tutor", teacher_dir))
    path = registry.path("tutor")
    record = json.loads(path.read_text())
    record["entry"]["spec"]["identity"]["max_model_len"] = 8
    path.write_text(json.dumps(record))
    with pytest.raises(IntegrityError) as caught:
        registry.get("tutor")
    assert caught.value.code == "digest_mismatch"
    assert "identity_revision" in caught.value.message
    with pytest.raises(IntegrityError):
        registry.list()

    record = json.loads(registry.path("tutor").read_text())
    record["entry"]["spec"]["identity"]["max_model_len"] = 4096
    record["content_revision"] = "sha256:" + "0" * 64
    path.write_text(json.dumps(record))
    with pytest.raises(IntegrityError, match="content_revision"):
        registry.get("tutor")

    shutil.copy(path, registry.path("impostor"))  # a record filed under another alias
    with pytest.raises(ContractError, match="names alias 'tutor'"):
        registry.get("impostor")


def test_the_identity_recomputes_equal_and_pins_the_files_it_names(registry, teacher_dir):
    first = teacher_identity_for(teacher_dir, served_model_id="tiny-teacher")
    assert first == teacher_identity_for(teacher_dir, served_model_id="tiny-teacher")
    _valid("TeacherIdentityV1", first)
    assert first["base_model_sha256"] == build_base_weight_manifest(teacher_dir)["aggregate_sha256"].removeprefix(
        "sha256:"
    )
    for key, name in (
        ("tokenizer_vocab_sha256", "tokenizer.json"),
        ("tokenizer_config_sha256", "tokenizer_config.json"),
    ):
        assert first[key] == hashlib.sha256((teacher_dir / name).read_bytes()).hexdigest()
    config = json.loads((teacher_dir / "config.json").read_text())
    assert (first["vocab_size"], first["max_model_len"]) == (config["vocab_size"], config["max_position_embeddings"])
    assert first["max_top_k"] == first["max_prompt_logprob_candidates"] == MAX_TOP_K
    assert first["adapter"] is None
    assert first["implementation"].startswith("kiln ")

    entry = registry.add(_local("tutor", teacher_dir))
    assert entry["spec"]["identity"] == first  # served_model_id is the directory name
    reprobe(registry.get("tutor"))  # nothing changed: no error


def test_reprobe_names_every_member_that_changed(registry, tmp_path, teacher_dir):
    model = shutil.copytree(teacher_dir, tmp_path / "mutable-teacher")
    registry.add(_local("tutor", model))
    pinned = registry.get("tutor")
    create_tiny(model, seed=3, overwrite=True)  # same tokenizer, other weights
    with pytest.raises(ConflictError) as caught:
        reprobe(pinned)
    assert caught.value.code == "teacher_identity_mismatch"
    old, new = pinned.identity["base_model_sha256"], teacher_identity_for(model, served_model_id=model.name)
    assert f"base_model_sha256 changed: {old} (registered) != {new['base_model_sha256']} (probed now)" in str(
        caught.value
    )
    assert "tokenizer_vocab_sha256" not in caught.value.message

    shutil.rmtree(model)
    with pytest.raises(ConflictError, match="cannot be re-probed") as caught:
        reprobe(pinned)
    assert caught.value.code == "teacher_identity_mismatch"


def test_a_local_teacher_needs_an_absolute_model_directory_and_an_existing_adapter(registry, teacher_dir, tmp_path):
    with pytest.raises(ContractError, match="absolute path"):  # the schema states it
        registry.add(_local("tutor", "relative/dir"))
    with pytest.raises(RequestError, match=r"no config\.json"):
        registry.add(_local("tutor", tmp_path))
    with pytest.raises(RequestError, match="not in the adapter registry"):
        registry.add(_local("tutor", teacher_dir, adapter="missing"))
    assert registry.list() == []


def test_a_local_teacher_with_an_adapter_pins_it_and_scores_with_it(registry, tmp_path, teacher_dir, trained_adapter):
    from peft import PeftModel

    adapters = tmp_path / "adapters"
    shutil.copytree(trained_adapter, adapters / "bot")
    entry = registry.add(_local("tutor-bot", teacher_dir, adapter="bot"))
    adapter = entry["spec"]["identity"]["adapter"]
    assert adapter == {
        "name": "bot",
        "weights_sha256": hashlib.sha256((adapters / "bot" / "adapter_model.safetensors").read_bytes()).hexdigest(),
        "config_sha256": hashlib.sha256((adapters / "bot" / "adapter_config.json").read_bytes()).hexdigest(),
    }
    pinned = registry.get("tutor-bot")
    assert pinned.adapter_dir == adapters / "bot"
    reprobe(pinned)
    scorer = open_scorer(pinned, registry_dir=adapters)
    ids = [1, 40, 41, 42, 43, 3]
    got = scorer.score(ids[:2], ids[2:], 4)
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5 for a renamed attribute
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        reference = PeftModel.from_pretrained(load_base_model(teacher_dir).model, adapters / "bot").eval()
    want = top_k_logprobs(reference, ids, 2, 4)
    assert got[0].equal(want[0])
    assert got[1].equal(want[1])
    base = top_k_logprobs(load_base_model(teacher_dir).model, ids, 2, 4)
    assert not base[1].equal(got[1])  # the adapter is applied
    scorer.close()

    weights = adapters / "bot" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")
    with pytest.raises(ConflictError, match="adapter changed") as caught:
        reprobe(pinned)
    assert "weights_sha256" in caught.value.message
    with pytest.raises(ConflictError):
        open_scorer(pinned, registry_dir=adapters)


# --- fixtures -----------------------------------------------------------------------------------


def test_a_fixture_without_a_file_is_configured_without_identity(registry):
    entry = _valid("TeacherEntry", registry.add({"alias": "arith", "kind": "fixture", "model_id": "arith-v1"}))
    assert entry["status"] == "configured"
    assert "identity" not in entry["spec"]
    assert "identity_revision" not in entry
    assert entry["capabilities"] is None
    pinned = registry.get("arith")
    assert (pinned.identity, pinned.identity_revision, pinned.content_revision, pinned.fixture) == (
        None,
        None,
        None,
        None,
    )
    reprobe(pinned)  # nothing to probe
    with pytest.raises(RequestError, match="pre-scored file"):
        open_scorer(pinned, registry_dir=Path("unused"))


def test_a_fixture_file_is_read_strictly_and_pinned(registry, tmp_path, teacher_dir):
    path, manifest = _scored_file(tmp_path / "scored.jsonl", teacher_dir, [_row(), _row()])
    entry = _valid(
        "TeacherEntry", registry.add({"alias": "arith", "kind": "fixture"}, fixture_file=tmp_path / "scored.jsonl")
    )
    assert entry["spec"]["model_id"] == "arith-v1"  # the manifest's fixture_id
    assert entry["off_policy_manifest"] == "kiln.off-policy-distillation-manifest.v1"
    assert entry["capabilities"]["max_top_k"] == 2
    assert entry["spec"]["vocab_size"] == manifest["vocab_size"]
    assert entry["spec"]["tokenizer_hash"] == "sha256:" + manifest["tokenizer_vocab_sha256"]
    pinned = registry.get("arith")
    digest = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert pinned.fixture == {"path": str(path), "sha256": digest, "manifest_sha256": json_sha256(manifest)}
    assert pinned.content_revision == digest
    assert registry.add({"alias": "arith-2", "kind": "fixture", "model_id": "arith-v1"}, fixture_file=path)


@pytest.mark.parametrize(
    ("rows", "row_count", "line", "code"),
    [
        ([_row(), _row(top=((52, -0.1),))], None, 3, "inconsistent_fields"),  # one top entry, top_k is 2
        ([_row(top=((52, -2.0), (53, -0.1)))], None, 2, "inconsistent_fields"),  # not most likely first
        ([_row(), _row(token=9999)], None, 3, "out_of_range"),  # beyond the vocabulary
        ([_row(), {"messages": [], "response": "x", "teacher_tokens": []}], None, 3, "invalid_length"),
        ([_row()], 2, 1, "inconsistent_fields"),  # the manifest announces two rows
    ],
)
def test_a_bad_fixture_row_refuses_the_registration_naming_its_line(
    registry, tmp_path, teacher_dir, rows, row_count, line, code
):
    path, _ = _scored_file(tmp_path / "scored.jsonl", teacher_dir, rows, row_count=row_count)
    with pytest.raises(ContractError) as caught:
        registry.add({"alias": "arith", "kind": "fixture"}, fixture_file=path)
    assert f"{path} line {line}: " in caught.value.message
    assert caught.value.code == code
    assert registry.list() == []


def test_a_fixture_file_must_carry_the_given_model_id_and_belongs_to_fixtures_only(registry, tmp_path, teacher_dir):
    path, _ = _scored_file(tmp_path / "scored.jsonl", teacher_dir, [_row()])
    with pytest.raises(RequestError, match="fixture_id 'arith-v1'"):
        registry.add({"alias": "arith", "kind": "fixture", "model_id": "other"}, fixture_file=path)
    with pytest.raises(RequestError, match="belongs to a fixture teacher"):
        registry.add(_local("tutor", teacher_dir), fixture_file=path)
    path.write_text("not json\n")
    with pytest.raises(ContractError, match="line 1"):
        registry.add({"alias": "arith", "kind": "fixture"}, fixture_file=path)


# --- the student check --------------------------------------------------------------------------


def test_a_teacher_with_another_vocabulary_than_the_student_is_refused(registry, tmp_path, teacher_dir, tiny_model_dir):
    student = load_base_model(tiny_model_dir)
    assert registry.add(_local("same-tokenizer", teacher_dir), student=student)["status"] == "verified"

    wide = SimpleNamespace(path=tiny_model_dir, model=SimpleNamespace(config=SimpleNamespace(vocab_size=4096)))
    with pytest.raises(RequestError, match="vocab_size is 627 but the student's is 4096"):
        registry.add(_local("wide", teacher_dir), student=wide)
    other = tmp_path / "other-tokenizer"
    other.mkdir()
    (other / "tokenizer.json").write_text("{}")
    retokenized = SimpleNamespace(path=other, model=student.model)
    with pytest.raises(RequestError, match="tokenizer vocabulary"):
        registry.add(_local("retokenized", teacher_dir), student=retokenized)
    path, _ = _scored_file(tmp_path / "scored.jsonl", teacher_dir, [_row()])
    with pytest.raises(RequestError, match="vocab_size"):
        registry.add({"alias": "fixture-wide", "kind": "fixture"}, fixture_file=path, student=wide)
    assert [e["spec"]["alias"] for e in registry.list()] == ["same-tokenizer"]


# --- scoring ------------------------------------------------------------------------------------


def test_stable_top_k_breaks_ties_by_the_lower_id_and_ranks_agree():
    import torch

    rows = torch.tensor([[-1.0, -0.5, -0.5, -3.0, -0.5], [-2.0, -2.0, -2.0, -2.0, -1.0]])
    ids, values = stable_top_k(rows, 3)
    assert ids.tolist() == [[1, 2, 4], [4, 0, 1]]
    assert values.tolist() == [[-0.5, -0.5, -0.5], [-1.0, -2.0, -2.0]]
    assert ranks_of(rows, torch.tensor([4, 3])).tolist() == [3, 5]
    assert ranks_of(rows, torch.tensor([0, 4])).tolist() == [4, 1]


def test_local_scores_are_the_top_k_of_the_causal_log_softmax(registry, teacher_dir):
    import torch

    registry.add(_local("tutor", teacher_dir))
    scorer = open_scorer(registry.get("tutor"), registry_dir=Path("unused"))
    assert isinstance(scorer, LocalScorer)
    assert scorer.max_top_k == MAX_TOP_K
    prefix, action = [1, 30, 31, 32], [33, 34, 3]
    ids, logprobs = scorer.score(prefix, action, 8)
    assert ids.dtype == torch.long
    assert logprobs.dtype == torch.float32
    assert ids.shape == logprobs.shape == (3, 8)

    model = load_base_model(teacher_dir).model
    with torch.no_grad():  # the invariant forward's log-softmax (what a server scoring the same model answers)
        full = sequence_logprobs(model, prefix + action)[len(prefix) - 1 : -1]
        own = torch.log_softmax(model(input_ids=torch.tensor([prefix + action])).logits[0].float(), dim=-1)
    assert torch.equal(logprobs, full.gather(1, ids))
    assert torch.equal(logprobs, full.sort(dim=-1, descending=True).values[:, :8])
    torch.testing.assert_close(full, own[len(prefix) - 1 : -1], rtol=0, atol=1e-5)  # the model's own, to rounding
    assert (logprobs[:, :-1] >= logprobs[:, 1:]).all()
    assert scorer.score(prefix, [], 8)[0].shape == (0, 8)
    with pytest.raises(RequestError, match="outside"):
        scorer.score(prefix, action, MAX_TOP_K + 1)
    with pytest.raises(RequestError, match="prefix_ids"):
        scorer.score([], action, 8)
    scorer.close()


# --- remote probes (a stand-in HTTP server) -------------------------------------------------------


class _Models(http.server.BaseHTTPRequestHandler):
    cards: ClassVar[list] = []
    seen: ClassVar[list] = []

    def do_GET(self):
        type(self).seen.append(self.headers.get("Authorization"))
        data = json.dumps({"object": "list", "data": type(self).cards}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def models_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Models.cards, _Models.seen = [], []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _remote(alias, url, model_id="teacher", **extra):
    return {"alias": alias, "kind": "remote", "provider": "vllm", "url": url, "model_id": model_id, **extra}


def test_an_unreachable_teacher_is_an_upstream_failure_and_an_unset_credential_is_not_found(registry, monkeypatch):
    """Neither is a malformed request: the upstream failed (502 teacher_unreachable), or the server has no such
    credential (404 not_found)."""
    with pytest.raises(UpstreamError, match="cannot reach the teacher") as caught:
        registry.add(_remote("far", "http://127.0.0.1:9"))
    assert caught.value.code == "teacher_unreachable"
    monkeypatch.delenv("KILN_CREDENTIAL_NOWHERE", raising=False)
    with pytest.raises(NotFoundError, match="credential 'nowhere' is not set") as missing:
        registry.add(_remote("far", "http://127.0.0.1:9", credential_id="nowhere"))
    assert missing.value.code == "not_found"


def test_a_remote_teacher_without_a_published_identity_cannot_be_registered(registry, models_server):
    _Models.cards = [{"id": "teacher", "object": "model", "created": 0, "owned_by": "vllm", "max_model_len": 4096}]
    with pytest.raises(RequestError, match="cannot pin an identity"):
        registry.add(_remote("far", models_server))
    with pytest.raises(RequestError, match="serves no model 'absent'"):
        registry.add(_remote("far", models_server, model_id="absent"))
    with pytest.raises(ContractError, match="http\\(s\\) `url`"):  # the schema states it
        registry.add(_remote("far", "ftp://example"))
    assert registry.list() == []


def test_a_remote_teacher_pins_the_published_identity_and_sends_its_credential(
    registry, models_server, teacher_dir, monkeypatch
):
    identity = teacher_identity_for(teacher_dir, served_model_id="teacher")
    _Models.cards = [{"id": "teacher", "object": "model", "teacher_identity": identity}]
    assert credential_env("vllm-lab.1") == "KILN_CREDENTIAL_VLLM_LAB_1"
    with pytest.raises(NotFoundError, match="KILN_CREDENTIAL_VLLM_LAB_1"):  # the server has no such credential
        registry.add(_remote("far", models_server, credential_id="vllm-lab.1"))
    monkeypatch.setenv("KILN_CREDENTIAL_VLLM_LAB_1", "s3cret")
    entry = _valid("TeacherEntry", registry.add(_remote("far", models_server + "/", credential_id="vllm-lab.1")))
    assert _Models.seen[-1] == "Bearer s3cret"
    assert entry["spec"]["identity"] == identity
    assert entry["spec"]["url"] == models_server
    assert entry["spec"]["credential_id"] == "vllm-lab.1"
    assert "s3cret" not in registry.path("far").read_text()
    pinned = registry.get("far")
    assert pinned.content_revision == "sha256:" + identity["base_model_sha256"]
    reprobe(pinned)

    _Models.cards = [{"id": "teacher", "teacher_identity": {**identity, "vocab_size": 700, "max_model_len": 8}}]
    with pytest.raises(ConflictError) as caught:
        reprobe(pinned)
    assert "max_model_len changed: 4096 (registered) != 8 (probed now)" in caught.value.message
    assert "vocab_size changed: 627 (registered) != 700 (probed now)" in caught.value.message
    unreachable = dataclasses.replace(pinned, url="http://127.0.0.1:9")
    with pytest.raises(ConflictError, match="cannot reach") as caught:
        reprobe(unreachable)
    assert caught.value.code == "teacher_identity_mismatch"


def test_a_remote_identity_spelt_with_integral_floats_is_pinned_and_hashed_in_its_canonical_form(
    registry, models_server, teacher_dir
):
    identity = teacher_identity_for(teacher_dir, served_model_id="teacher")
    spelt = {**identity, **{k: float(identity[k]) for k in ("vocab_size", "max_top_k", "max_model_len")}}
    _Models.cards = [{"id": "teacher", "teacher_identity": spelt}]
    entry = _valid("TeacherEntry", registry.add(_remote("far", models_server)))
    assert json.dumps(entry["spec"]["identity"], sort_keys=True) == json.dumps(identity, sort_keys=True)
    assert entry["identity_revision"] == prefixed(teacher_identity_revision(identity))
    reprobe(registry.get("far"))  # the same identity, whatever its spelling


def test_stable_top_k_equals_the_first_k_of_a_full_stable_sort_ties_included():
    import torch

    from kiln.teachers._scoring import stable_top_k

    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        vocab = int(torch.randint(2, 3000, (1,), generator=generator))
        rows = torch.randn(int(torch.randint(1, 12, (1,), generator=generator)), vocab, generator=generator)
        if trial % 2:
            rows = torch.round(rows * 2) / 2  # many ties, also at the k-th place
        k = int(torch.randint(0, min(vocab, 40) + 1, (1,), generator=generator))
        values, order = torch.sort(rows, dim=-1, descending=True, stable=True)
        ids, top = stable_top_k(rows, k)
        assert torch.equal(ids, order[:, :k]), trial
        assert torch.equal(top, values[:, :k]), trial
