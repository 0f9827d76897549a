"""The registry module owns the adapter directory: one LoRA config parser for verify and the server, the registry
name rule wherever an adapter is named, a crash-safe demotion, and the file names spelled in one place."""

from __future__ import annotations

import ast
import json
import os
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

import kiln
from kiln.adapters import (
    CONFIG_FILE,
    MANIFEST_FILE,
    RECEIPT_FILE,
    WEIGHTS_FILE,
    demote,
    list_adapters,
    verify_adapter,
)
from kiln.documents.digests import file_sha256, prefixed
from kiln.errors import AdapterError, NotFoundError
from kiln.model import load_base_model

PROMPT = [{"role": "user", "content": "How do I reset my password?"}]
# peft 0.21 asks transformers 5 for a renamed attribute while wrapping a model (kiln.training silences it too)
PEFT_WARNING = "ignore:.*is_gradient_checkpointing.*:FutureWarning"


def _generator(registry, tiny_model_dir):
    from kiln.server._generation import Generator

    return Generator(load_base_model(tiny_model_dir), registry, "kiln-tiny")


def _plain_peft(directory, tiny_model_dir, **lora):
    """A plain peft adapter of the tiny model with a non-zero update (peft starts B at zero)."""
    import torch
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(load_base_model(tiny_model_dir).model, LoraConfig(lora_alpha=8, **lora))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(directory)
    return directory


def _edit_config(directory, **changes):
    config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    config.update(changes)
    (directory / CONFIG_FILE).write_text(json.dumps(config), encoding="utf-8")


def _served_and_peft_logits(registry, name, tiny_model_dir):
    """The served model's log-probabilities with ``name`` applied by the generator, and plain peft's model through the
    same invariant forward (its live LoRA layers) on the same prompt; peft's own forward agrees to rounding."""
    import torch
    from peft import PeftModel

    from kiln.model import sequence_logprobs

    gen = _generator(registry, tiny_model_dir)
    gen.load(name)
    prompt = gen._encode_prompt(PROMPT)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        reference = PeftModel.from_pretrained(load_base_model(tiny_model_dir).model, registry / name).eval()
    served = gen.logprobs(prompt, gen._active)
    base = gen.logprobs(prompt, None)
    with torch.inference_mode():
        plain = sequence_logprobs(reference, prompt)
        own = torch.log_softmax(reference(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert not torch.equal(plain, base), "the adapter must change the model"
    torch.testing.assert_close(plain, own, rtol=0, atol=1e-5)
    return served, plain


# --- one LoRA config parser ------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_an_all_linear_adapter_that_verify_accepts_is_served_with_the_layers_peft_applies(tmp_path, tiny_model_dir):
    import torch

    registry = tmp_path / "adapters"
    adapter = _plain_peft(registry / "wide", tiny_model_dir, r=4, target_modules="all-linear")
    _edit_config(adapter, target_modules="all-linear")  # peft wrote the expanded names; the shorthand is as valid
    assert verify_adapter(str(adapter), registry)["status"] == "ok"
    served, plain = _served_and_peft_logits(registry, "wide", tiny_model_dir)
    assert torch.equal(served, plain)


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_a_rank_pattern_adapter_that_verify_accepts_is_served_as_peft_applies_it(tmp_path, tiny_model_dir):
    import torch

    registry = tmp_path / "adapters"
    adapter = _plain_peft(
        registry / "patterned", tiny_model_dir, r=4, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2}
    )
    assert verify_adapter(str(adapter), registry)["status"] == "ok"
    served, plain = _served_and_peft_logits(registry, "patterned", tiny_model_dir)
    assert torch.equal(served, plain)


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_a_rank_pattern_the_tensors_contradict_is_refused_by_verify_and_by_the_generator(tmp_path, tiny_model_dir):
    registry = tmp_path / "adapters"
    adapter = _plain_peft(
        registry / "patterned", tiny_model_dir, r=4, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2}
    )
    _edit_config(adapter, rank_pattern={"v_proj": 3})
    checks = verify_adapter(str(adapter), registry)["checks"]
    assert (checks[-1]["name"], checks[-1]["pass"]) == ("tensor_consistency", False)
    assert "r = 3" in checks[-1]["message"]
    with pytest.raises(AdapterError) as refused:
        _generator(registry, tiny_model_dir).load("patterned")
    assert refused.value.code == "adapter_invalid"
    assert "v_proj" in refused.value.message


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_a_target_regex_that_does_not_compile_is_refused_by_verify_and_the_generator_for_one_reason(
    tmp_path, tiny_model_dir
):
    registry = tmp_path / "adapters"
    adapter = _plain_peft(registry / "unclosed", tiny_model_dir, r=4, target_modules=["q_proj"])
    _edit_config(adapter, target_modules="(q_proj")
    check = verify_adapter(str(adapter), registry)["checks"][-1]
    assert (check["name"], check["pass"]) == ("target_modules_declared", False)
    assert "is not a valid regular expression" in check["message"]
    with pytest.raises(AdapterError) as refused:
        _generator(registry, tiny_model_dir).load("unclosed")
    assert refused.value.code == "adapter_invalid"
    assert check["message"] in refused.value.message


# --- the registry name rule ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bot.failed", "bot.failed-2", "bot-checkpoint-step-00000001.kiln-checkpoint"])
def test_the_generator_never_serves_a_directory_whose_name_the_registry_rule_refuses(
    tmp_path, trained_adapter, tiny_model_dir, name
):
    registry = tmp_path / "adapters"
    shutil.copytree(trained_adapter, registry / name)
    with pytest.raises(NotFoundError) as refused:
        _generator(registry, tiny_model_dir).load(name)
    assert refused.value.code == "adapter_not_found"


def test_an_evaluation_target_is_named_by_the_registry_rule(tmp_path, trained_adapter):
    from kiln.server import _evals

    registry = tmp_path / "adapters"
    shutil.copytree(trained_adapter, registry / "bot")
    shutil.copytree(trained_adapter, registry / "bot.failed")
    engine = SimpleNamespace(registry=registry, base_sha256="sha256:" + "0" * 64)
    target = _evals.target(engine, "bot")
    assert target["adapter_manifest_sha256"] == prefixed(file_sha256(registry / "bot" / MANIFEST_FILE)[0])
    for refused in ("bot.failed", "../adapters/bot"):
        with pytest.raises(NotFoundError) as caught:
            _evals.target(engine, refused)
        assert caught.value.code == "adapter_not_found"


# --- demotion --------------------------------------------------------------------------------------------------------


@pytest.fixture
def registry(tmp_path, trained_adapter):
    root = tmp_path / "adapters"
    shutil.copytree(trained_adapter, root / "bot")
    return root


def _serving_entries(registry):
    """Every listed registry entry that holds both serving files: what looks like an adapter."""
    return sorted(e["name"] for e in list_adapters(registry)["available"] if e["has_config"] and e["has_weights"])


def test_a_demoted_adapter_moves_to_name_failed_and_the_next_demotion_of_that_name_to_failed_2(
    registry, trained_adapter
):
    first = demote(registry, "bot")
    assert first == registry / "bot.failed"
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in trained_adapter.iterdir())
    shutil.copytree(trained_adapter, registry / "bot")
    assert demote(registry, "bot") == registry / "bot.failed-2"
    assert sorted(p.name for p in registry.iterdir()) == ["bot.failed", "bot.failed-2"]


def test_a_demotion_never_takes_a_name_another_demotion_claimed(registry):
    (registry / "bot.failed").mkdir()  # claimed by a demotion still under way (or one a crash cut short)
    assert demote(registry, "bot") == registry / "bot.failed-2"
    assert list((registry / "bot.failed").iterdir()) == []


def test_a_second_demotion_of_the_same_adapter_finds_nothing_to_demote(registry):
    demote(registry, "bot")
    with pytest.raises(NotFoundError) as caught:
        demote(registry, "bot")
    assert caught.value.code == "adapter_not_found"
    assert sorted(p.name for p in registry.iterdir()) == ["bot.failed"]


class _Crash(BaseException):
    """The process dies here: nothing after it runs, no handler cleans up."""


@pytest.mark.parametrize(("step", "listed"), [(1, []), (2, []), (3, []), (4, ["bot.failed"])])
def test_a_demotion_cut_short_after_any_step_never_leaves_a_directory_that_looks_like_a_valid_adapter(
    registry, monkeypatch, step, listed
):
    """Every file-system step of the demotion (hide the adapter, sync, claim the demoted name, move the adapter there,
    sync) is a point where the process may die. Cut short after any of them, the adapter has left its name at once,
    and no listed directory holds its files until the last move put them under the demoted name."""
    import kiln.adapters._directory as directory

    calls = {"n": 0}

    def step_then_crash(real):
        def run(*args, **kwargs):
            calls["n"] += 1
            result = real(*args, **kwargs)
            if calls["n"] == step:
                raise _Crash
            return result

        return run

    monkeypatch.setattr(directory.os, "rename", step_then_crash(os.rename))
    monkeypatch.setattr(directory.os, "mkdir", step_then_crash(os.mkdir))
    monkeypatch.setattr(directory, "fsync_dir", step_then_crash(directory.fsync_dir))
    with pytest.raises(_Crash):
        demote(registry, "bot")
    assert _serving_entries(registry) == listed, sorted(p.name for p in registry.iterdir())
    if not listed:  # the adapter's files are hidden, not lost
        hidden = [p for p in registry.iterdir() if p.name.startswith(".")]
        assert len(hidden) == 1
        assert (hidden[0] / WEIGHTS_FILE).is_file()


def test_the_gate_demotes_through_the_registry_module(registry):
    from kiln.server import _evals

    served = SimpleNamespace(active=lambda: None, unload=lambda: None)
    engine = SimpleNamespace(registry=registry, generator=served)
    verdict = _evals._act(engine, "bot", {"outcome": "demoted", "reason": "below the floor"})
    assert verdict["reason"] == "below the floor; renamed to bot.failed"
    assert sorted(p.name for p in registry.iterdir()) == ["bot.failed"]


# --- one owner of the file names -------------------------------------------------------------------------------------

FILE_NAMES = (CONFIG_FILE, WEIGHTS_FILE, MANIFEST_FILE, RECEIPT_FILE, "adapter_canary_status.json")
OWNER = Path("kiln/artifacts/adapter_files.py")
OUT_OF_SCOPE: tuple[Path, ...] = ()


def _spellings(path: Path) -> list[int]:
    """Line numbers of string literals (docstrings aside) that spell an adapter file name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and any(name in node.value for name in FILE_NAMES)
    ]


def test_only_the_layout_module_spells_the_adapter_directory_file_names():
    root = Path(kiln.__file__).parent.parent
    found = {}
    for path in sorted((root / "kiln").rglob("*.py")):
        relative = path.relative_to(root)
        if relative == OWNER or any(relative.is_relative_to(p) for p in OUT_OF_SCOPE):
            continue
        lines = _spellings(path)
        if lines:
            found[str(relative)] = lines
    assert found == {}, "import the names from kiln.adapters (or, below it, kiln.artifacts.adapter_files)"
    assert _spellings(root / OWNER), "the layout module spells every name"


def test_the_registry_module_exports_the_layout_names():
    import kiln.adapters
    from kiln.artifacts import adapter_files

    for name in ("CANARY_FILE", "CONFIG_FILE", "MANIFEST_FILE", "RECEIPT_FILE", "WEIGHTS_FILE"):
        assert getattr(kiln.adapters, name) == getattr(adapter_files, name)
