"""Kiln adapters are plain PEFT adapters, both ways: plain PEFT output verifies, Kiln output loads in PEFT."""

from __future__ import annotations

import json

import pytest

from kiln import contracts
from kiln.adapters._verify import verify_adapter
from kiln.artifacts.adapter_bodies import OFFLINE_CHECKS

PROMPT = "How do I reset my password?"

# peft 0.21 asks transformers 5 for a renamed attribute while wrapping a model; the deprecation
# is theirs (kiln.training.attach_lora silences the same warning).
PEFT_GRADIENT_CHECKPOINTING_WARNING = "ignore:.*is_gradient_checkpointing.*:FutureWarning"


def _plain_base(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from kiln.model._tiny import quiet_hub

    quiet_hub()
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _prompt_ids(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)(PROMPT, return_tensors="pt")["input_ids"]


@pytest.mark.filterwarnings(PEFT_GRADIENT_CHECKPOINTING_WARNING)
def test_an_adapter_saved_by_plain_peft_verifies_offline(tmp_path, tiny_model_dir):
    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _plain_base(tiny_model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:  # peft initialises B to zero: give the update a direction
                param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    model.save_pretrained(tmp_path / "plain")

    receipt = verify_adapter(str(tmp_path / "plain"), tmp_path)
    assert contracts.problems("AdapterVerifyReceipt", receipt) == []
    assert receipt["status"] == "ok", receipt["checks"]
    assert [c["name"] for c in receipt["checks"]] == list(OFFLINE_CHECKS)  # no manifest: no manifest check
    layers = model.config.num_hidden_layers
    assert receipt["lora"]["rank"] == 4
    assert receipt["lora"]["alpha_over_rank"] == 2.0
    assert receipt["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert receipt["tensor_summary"]["pair_count"] == 2 * layers
    assert receipt["tensor_summary"]["layer_count"] == layers
    assert receipt["tensor_summary"]["lora_update_l2_upper_bound"] > 0


@pytest.mark.filterwarnings(PEFT_GRADIENT_CHECKPOINTING_WARNING)
def test_a_kiln_adapter_loads_in_plain_peft_with_the_logits_kiln_computes(trained_adapter, tiny_model_dir):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

    from kiln.model import load_base_model
    from kiln.training import attach_lora, lora_parameters

    ids = _prompt_ids(tiny_model_dir)
    with torch.no_grad():
        base_logits = _plain_base(tiny_model_dir)(input_ids=ids).logits
        plain = PeftModel.from_pretrained(_plain_base(tiny_model_dir), trained_adapter).eval()
        plain_logits = plain(input_ids=ids).logits

    # Kiln's own route: its base loader, its LoRA attachment, the saved tensors by stable name.
    config = json.loads((trained_adapter / "adapter_config.json").read_text())
    kiln_model = attach_lora(
        load_base_model(tiny_model_dir).model, rank=config["r"], alpha=config["lora_alpha"], seed=0
    ).eval()
    saved = load_file(trained_adapter / "adapter_model.safetensors")
    params = lora_parameters(kiln_model)
    assert sorted(name.replace(".default.", ".") for name in params) == sorted(saved)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(saved[name.replace(".default.", ".")])
        kiln_logits = kiln_model(input_ids=ids).logits

    assert torch.equal(plain_logits, kiln_logits)
    assert not torch.allclose(plain_logits, base_logits), "the adapter must change the model"
