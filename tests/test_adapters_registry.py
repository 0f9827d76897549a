"""``kiln adapters list`` and ``kiln adapters delete`` on a local registry."""

from __future__ import annotations

import json
import shutil

import pytest

from kiln import contracts
from kiln.adapters import delete_adapter, list_adapters
from kiln.cli import main
from kiln.errors import NotFoundError, RequestError
from kiln.trainers.sft import admit_sft, run_sft

ROWS = [
    {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello, how can I help?"}]},
    {"messages": [{"role": "user", "content": "Bye!"}, {"role": "assistant", "content": "Goodbye, take care."}]},
]


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_model_dir):
    """A registry with a Kiln adapter 'bot' and its checkpoint at step 1."""
    root = tmp_path_factory.mktemp("registry-src")
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    registry = root / "adapters"
    job = admit_sft(
        adapter_name="bot",
        registry=registry,
        config={"epochs": 1, "seed": 5, "checkpoint_interval": 1},
        dataset_path=data,
        model_path=str(tiny_model_dir),
    )
    assert run_sft(job).status == "success"
    return registry


@pytest.fixture
def registry(source, tmp_path):
    target = tmp_path / "adapters"
    shutil.copytree(source, target)
    return target


def _peft_adapter(tiny_model_dir, target):
    """A plain peft adapter (no Kiln files)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    peft.save_pretrained(target)
    return target


def _entry(listing, name):
    return next(e for e in listing["available"] if e["name"] == name)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft 0.21 asks transformers 5 for a renamed attribute
def test_list_reports_kiln_peft_failed_and_broken_adapters(registry, tiny_model_dir):
    _peft_adapter(tiny_model_dir, registry / "plain-peft")
    failed = registry / "failed-run"
    failed.mkdir()
    shutil.copy(registry / "bot" / "train_receipt.json", failed / "train_receipt.json")
    broken = registry / "broken-manifest"
    shutil.copytree(registry / "bot", broken)
    manifest = json.loads((broken / "adapter_manifest.json").read_text(encoding="utf-8"))
    manifest["surprise"] = True
    (broken / "adapter_manifest.json").write_text(json.dumps(manifest), encoding="utf-8")

    listing = list_adapters(registry)
    assert contracts.problems("AdaptersResponse", listing) == []
    assert [e["name"] for e in listing["available"]] == ["bot", "broken-manifest", "failed-run", "plain-peft"]

    bot = _entry(listing, "bot")
    assert bot["status"] == "available"
    assert bot["rank"] == 16
    assert bot["alpha"] == 32.0
    assert bot["adapter_manifest"]["adapter_name"] == "bot"
    assert bot["adapter_model_sha256"] == bot["adapter_manifest"]["safetensors_hash"].removeprefix("sha256:")
    assert bot["adapter_manifest_error"] is None

    plain = _entry(listing, "plain-peft")
    assert plain["status"] == "available"
    assert (plain["rank"], plain["alpha"], plain["target_modules"]) == (4, 8.0, ["q_proj", "v_proj"])
    assert plain["adapter_manifest"] is None
    assert plain["adapter_manifest_path"] is None

    assert _entry(listing, "failed-run")["status"] == "invalid"
    assert "missing adapter_config.json and adapter_model.safetensors" in _entry(listing, "failed-run")["error"]

    bad = _entry(listing, "broken-manifest")
    assert bad["adapter_manifest"] is None
    assert "surprise" in bad["adapter_manifest_error"]
    assert bad["status"] == "available"  # the serving files are fine; the manifest problem is surfaced


def test_checkpoints_and_hidden_directories_are_not_adapters(registry):
    (registry / ".bot.incomplete-abc").mkdir()
    assert any(p.name.endswith(".kiln-checkpoint") for p in registry.iterdir())
    assert [e["name"] for e in list_adapters(registry)["available"]] == ["bot"]


def test_an_unreadable_canary_quarantines(registry):
    (registry / "bot" / "adapter_canary_status.json").write_text("{}", encoding="utf-8")
    entry = _entry(list_adapters(registry), "bot")
    assert entry["status"] == "quarantined"
    assert entry["canary_status"] == "quarantined"
    assert "never promotes" in entry["canary_failure_reason"]


def test_delete_removes_the_adapter_and_its_checkpoints_only(registry):
    shutil.copytree(registry / "bot", registry / "bot2")
    (registry / ".bot-checkpoint-step-00000009.kiln-checkpoint.incomplete-x1y2z3w4").mkdir()
    planned = delete_adapter(registry, "bot", dry_run=True)
    assert {p.name for p in planned} == {
        "bot",
        "bot-checkpoint-step-00000001.kiln-checkpoint",
        ".bot-checkpoint-step-00000009.kiln-checkpoint.incomplete-x1y2z3w4",
    }
    assert (registry / "bot").is_dir()  # a dry run removes nothing
    removed = delete_adapter(registry, "bot")
    assert {p.name for p in removed} == {p.name for p in planned}
    assert sorted(p.name for p in registry.iterdir()) == ["bot2"]
    with pytest.raises(NotFoundError) as missing:
        delete_adapter(registry, "bot")
    assert missing.value.code == "adapter_not_found"
    with pytest.raises(RequestError):
        delete_adapter(registry, "../bot2")


def test_cli_list_and_delete(registry, capsys):
    assert main(["adapters", "list", "--adapter-dir", str(registry)]) == 0
    out = capsys.readouterr().out
    header, row = out.splitlines()[:2]
    assert header.split() == ["NAME", "STATUS", "RANK", "ALPHA", "SIZE", "WEIGHTS", "MANIFEST"]
    weights = list_adapters(registry)["available"][0]["adapter_model_sha256"]
    assert row.split()[:2] == ["bot", "available"]
    assert f"sha256:{weights[:12]}…" in row  # the weights digest, in its own column
    assert row.endswith("ok (3 files bound)")  # the manifest's state, not a digest
    assert main(["adapters", "list", "--adapter-dir", str(registry), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["available"][0]["name"] == "bot"
    assert main(["adapters", "delete", "bot", "--adapter-dir", str(registry)]) == 0
    assert "removed" in capsys.readouterr().out
    assert main(["adapters", "delete", "bot", "--adapter-dir", str(registry)]) == 1
    assert "adapter_not_found" in capsys.readouterr().err


def test_cli_moves_an_adapter_to_another_registry_with_restore_and_verify(registry, tmp_path, capsys):
    incoming = tmp_path / "incoming" / "bot"
    shutil.copytree(registry / "bot", incoming)  # what arrives on the other machine
    other = tmp_path / "machine-b" / "adapters"
    assert main(["adapters", "restore", str(incoming / "adapter_manifest.json"), "--adapter-dir", str(other)]) == 0
    receipt = json.loads(capsys.readouterr().out)
    assert receipt["status"] == "ok"
    assert contracts.problems("AdapterRestoreReceipt", receipt) == []
    assert main(["adapters", "verify", "bot", "--adapter-dir", str(other), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "ok"
    assert (other / "bot" / "adapter_model.safetensors").read_bytes() == (
        registry / "bot" / "adapter_model.safetensors"
    ).read_bytes()

    weights = incoming / "adapter_model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0x01
    weights.write_bytes(bytes(blob))
    args = ["adapters", "restore", str(incoming / "adapter_manifest.json"), "--adapter-dir", str(other)]
    assert main([*args, "--name", "bot-copy"]) == 1
    assert "safetensors_hash mismatch" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["bot"]  # nothing left behind
    assert main(["adapters", "verify", str(incoming)]) == 1
    assert "manifest_hashes" in capsys.readouterr().out


def test_a_listing_cache_reuses_unchanged_entries_and_sees_every_change(tmp_path, trained_adapter):
    import shutil

    from kiln.adapters._registry import list_adapters

    registry = tmp_path / "adapters"
    registry.mkdir()
    for name in ("a", "b"):
        shutil.copytree(trained_adapter, registry / name)
    cache: dict = {}
    first = list_adapters(registry, cache=cache)
    assert list_adapters(registry) == first  # the cache changes nothing
    again = list_adapters(registry, cache=cache)
    assert again["available"][0] is first["available"][0]  # reused, not re-read
    config = registry / "b" / "adapter_config.json"
    config.chmod(0o644)
    config.write_text("{not json", encoding="utf-8")  # an in-place edit: same directory mtime granularity
    changed = list_adapters(registry, cache=cache)
    assert changed["available"][1]["status"] == "invalid"
    assert changed == list_adapters(registry)
    shutil.rmtree(registry / "a")
    assert [e["name"] for e in list_adapters(registry, cache=cache)["available"]] == ["b"]
    assert set(cache) == {"b"}


def test_the_adapter_exists_hint_is_a_command_that_works_on_this_machine(registry, tmp_path, tiny_model_dir, capsys):
    import re
    import shlex

    from kiln.errors import ConflictError

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    with pytest.raises(ConflictError) as info:
        admit_sft(adapter_name="bot", registry=registry, config={"epochs": 1}, dataset_path=data,
                  model_path=str(tiny_model_dir))  # fmt: skip
    assert info.value.code == "adapter_exists"
    command = re.search(r"on this machine `([^`]+)`", info.value.hint)[1]
    argv = shlex.split(command)
    assert argv[0] == "kiln"
    assert main(argv[1:]) == 0, capsys.readouterr().err
    assert not (registry / "bot").exists()
    admit_sft(
        adapter_name="bot", registry=registry, config={"epochs": 1}, dataset_path=data, model_path=str(tiny_model_dir)
    )  # fmt: skip  (admitted now)
