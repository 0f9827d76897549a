"""The architecture matrix: every family Kiln claims to train, as a tiny random model built at test time.

For each family (``tests/_architectures.py``: two layers, 64 wide, weights scaled so the logits are large, Gemma's
soft-cap, Granite's and Cohere's logit scales at non-default values, Phi's biased head):

* every SFT loss route gives the model's own loss, ``model(ids, labels=...).loss``, and the same LoRA gradients
  (fp32, tight tolerance) -- the objective Kiln optimises is the one the model defines (the Triton route runs on
  CUDA, or in triton's interpreter, too slow for these models: tests/test_triton_ce.py checks it against the same
  definition, for every kind of post-processing);
* GRPO's log-probabilities are the model's own (their mean over a sequence is minus the model's loss);
* a one-epoch SFT run publishes a receipt that validates and records the post-processing it applied, and its
  adapter loads in plain peft and changes the model's logits;
* a GRPO step and an OPD step run and publish valid receipts.

And what Kiln cannot reproduce is refused at admission naming the architecture, never trained approximately.
"""

from __future__ import annotations

import json
import warnings

import _architectures as arch
import pytest
import torch

from kiln import contracts
from kiln.errors import RequestError
from kiln.kernels import LOSS_ROUTES, TRITON_FUSED_LINEAR_CE, LogitMap, sft_loss
from kiln.model import load_base_model, sequence_logprobs
from kiln.teachers import TeacherRegistry
from kiln.trainers.grpo import admit_grpo, run_grpo
from kiln.trainers.opd import admit_opd, run_opd
from kiln.trainers.sft import admit_sft, run_sft
from kiln.training import attach_lora, decoder_of, lora_parameters, model_head

CONVERSATIONS = [
    {
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "How many days are in a week?"},
            {"role": "assistant", "content": "There are seven days in a week."},
        ]
    },
]
GROUP = {
    "messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
    "completions": [{"text": "yes", "reward": 1.0}, {"text": "no", "reward": 0.0}],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's model directory, built once per module (about 30 ms each)."""
    root = tmp_path_factory.mktemp("architectures")
    return {family: arch.build(family, root / family) for family in arch.FAMILIES}


def _peft(loaded, seed=3):
    """The model with LoRA on its default targets, B drawn non-zero so every LoRA tensor has a gradient."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = attach_lora(loaded.model, rank=4, alpha=8.0, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in lora_parameters(model).items():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def _ids_and_labels(tokenizer):
    encoded = tokenizer.apply_chat_template(CONVERSATIONS[0]["messages"], tokenize=True)
    ids = torch.tensor([encoded["input_ids"] if hasattr(encoded, "keys") else encoded])
    labels = ids.clone()
    labels[0, : ids.shape[1] // 2] = -100  # the second half supervised
    return ids, labels


@pytest.mark.parametrize("family", arch.FAMILIES)
def test_the_discovered_post_processing_is_the_familys(models, family):
    head = model_head(load_base_model(models[family]).model)
    steps = arch.post_processing(family)
    assert head.logit_map == LogitMap(scale=steps.get("scale", 1.0), softcap=steps.get("softcap"))
    assert head.has_bias == (family == "phi")
    assert head.probe_error < 1e-5


@pytest.mark.parametrize("family", arch.FAMILIES)
def test_every_loss_route_gives_the_models_own_loss_and_lora_gradients(models, family):
    loaded = load_base_model(models[family])
    head = model_head(loaded.model)
    model = _peft(loaded)
    params = lora_parameters(model)
    ids, labels = _ids_and_labels(loaded.tokenizer)

    reference = model(input_ids=ids, labels=labels).loss
    want = torch.autograd.grad(reference, list(params.values()))
    causal = model.get_base_model()
    body, out = decoder_of(causal), causal.get_output_embeddings()
    for route in (route for route in LOSS_ROUTES if route != TRITON_FUSED_LINEAR_CE):
        hidden = body(input_ids=ids).last_hidden_state[0, :-1]
        loss = sft_loss(route, hidden, out.weight, labels[0, 1:], bias=out.bias, logit_map=head.logit_map)
        got = torch.autograd.grad(loss, list(params.values()))
        torch.testing.assert_close(loss, reference, rtol=2e-6, atol=2e-6, msg=f"{family} {route}: loss")
        for name, g, w in zip(params, got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=f"{family} {route}: d/d {name}")
    if not head.logit_map.is_identity:  # without the post-processing the loss is another one: the check can fail
        hidden = body(input_ids=ids).last_hidden_state[0, :-1]
        plain = sft_loss(LOSS_ROUTES[0], hidden, out.weight, labels[0, 1:], bias=out.bias)
        assert abs(float(plain.detach()) - float(reference.detach())) > 1e-3


@pytest.mark.parametrize("family", arch.FAMILIES)
def test_grpo_log_probabilities_are_the_models_own(models, family):
    from kiln.trainers._forwards import logprobs

    loaded = load_base_model(models[family])
    ids, _ = _ids_and_labels(loaded.tokenizer)
    with torch.no_grad():
        _, taken = logprobs(loaded.model, ids[0])
        loss = loaded.model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(-taken.mean(), loss, rtol=1e-6, atol=1e-6)


def _sft(tmp_path, model_dir, name, **config):
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in CONVERSATIONS))
    job = admit_sft(
        adapter_name=name,
        registry=tmp_path / "adapters",
        config={"epochs": 1, "seed": 5, "learning_rate": 0.01, "optimizer": {"kind": "adam_w"}, **config},
        dataset_path=data,
        model_path=str(model_dir),
    )
    return job, run_sft(job)


@pytest.mark.parametrize("family", arch.FAMILIES)
def test_one_sft_epoch_publishes_a_valid_receipt_and_an_adapter_plain_peft_loads(tmp_path, models, family):
    from peft import PeftModel

    job, result = _sft(tmp_path, models[family], f"{family.replace('_', '-')}-sft")
    assert result.status == "success", result.receipt.get("failure_message")
    contracts.load("TrainReceipt", result.receipt_path)
    contracts.load("AdapterManifest", result.manifest_path)
    receipt = json.loads(result.receipt_path.read_text())
    steps = arch.post_processing(family)
    assert receipt["runtime"]["sft_logits"] == {
        "architecture": type(job.loaded.model).__name__,
        "head_bias": family == "phi",
        "scale": steps.get("scale", 1.0),
        "softcap": steps.get("softcap"),
    }
    assert receipt["config"]["lora_target_modules"] == job.config.to_json()["lora_target_modules"]
    adapter_config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert adapter_config["target_modules"] == job.config.to_json()["lora_target_modules"]

    base = load_base_model(models[family])
    ids, _ = _ids_and_labels(base.tokenizer)
    with torch.no_grad():
        before = base.model(input_ids=ids).logits
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        tuned = PeftModel.from_pretrained(base.model, str(result.adapter_dir))
    with torch.no_grad():
        after = tuned(input_ids=ids).logits
    assert float((after - before).abs().max()) > 1e-4


@pytest.mark.parametrize("family", arch.FAMILIES)
def test_a_grpo_step_and_an_opd_step_run(tmp_path, models, family):
    grpo = admit_grpo(
        adapter_name="policy",
        registry=tmp_path / "adapters",
        request={"groups": [GROUP], "config": {"seed": 3, "learning_rate": 0.01}},
        model_path=str(models[family]),
    )
    result = run_grpo(grpo)
    assert result.status == "success", result.receipt.get("failure_message")
    contracts.load("TrainReceipt", result.receipt_path)
    assert len(result.losses) == 1

    teachers = tmp_path / "teachers"
    TeacherRegistry(teachers).add({"alias": "tutor", "kind": "local", "model_id": str(models[family])})
    opd = admit_opd(
        adapter_name="student",
        registry=tmp_path / "adapters",
        request={
            "teacher": "tutor",
            "prompts": [{"messages": [{"role": "user", "content": "Tell me about rain."}]}],
            "config": {"seed": 3, "max_tokens": 6, "top_k": 16, "samples_per_prompt": 1},
        },
        teachers_root=teachers,
        model_path=str(models[family]),
    )
    result = run_opd(opd)
    assert result.status == "success", result.receipt.get("failure_message")
    contracts.load("TrainReceipt", result.receipt_path)


def test_target_modules_can_be_chosen_and_a_name_the_model_lacks_is_refused(tmp_path, models):
    _job, result = _sft(tmp_path, models["gpt2"], "attention-only", lora_target_modules=["c_attn"])
    assert result.status == "success"
    assert json.loads((result.adapter_dir / "adapter_config.json").read_text())["target_modules"] == ["c_attn"]
    from safetensors.torch import load_file

    tensors = load_file(result.adapter_dir / "adapter_model.safetensors")
    assert {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors} == {"c_attn"}
    assert len(tensors) == 2 * 2  # A and B in each of the two layers
    with pytest.raises(RequestError, match=r"'q_proj' matches no linear projection .* it has c_attn, c_proj, c_fc"):
        _sft(tmp_path, models["gpt2"], "wrong", lora_target_modules=["c_attn", "q_proj"])
    with pytest.raises(RequestError, match=r"'lm_head' matches no linear projection"):
        _sft(tmp_path, models["llama"], "head", lora_target_modules=["lm_head"])


def test_a_model_whose_logits_kiln_cannot_reproduce_is_refused_naming_it(tmp_path, models, monkeypatch):
    """A forward that does something after the head the config does not declare (here: an extra scale)."""
    from transformers import LlamaForCausalLM

    real = LlamaForCausalLM.forward

    def forward(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        out.logits = out.logits * 1.5
        return out

    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
    with pytest.raises(RequestError, match=r"LlamaForCausalLM: Kiln cannot reproduce this model's logits") as caught:
        _sft(tmp_path, models["llama"], "approximate")
    assert caught.value.code == "training_backend_unsupported"
    assert not (tmp_path / "adapters" / "approximate").exists()


def test_kiln_serve_applies_a_gpt2_conv1d_adapter_exactly_as_peft_does(tmp_path, models):
    from peft import PeftModel

    from kiln.server._generation import Generator

    _job, result = _sft(tmp_path, models["gpt2"], "gpt2-served")
    assert json.loads((result.adapter_dir / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    gen = Generator(load_base_model(models["gpt2"]), tmp_path / "adapters", "gpt2")
    gen.load("gpt2-served")
    prompt = gen._encode_prompt([{"role": "user", "content": "Say hello."}])
    served = gen.logprobs(prompt, gen._active)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        reference = PeftModel.from_pretrained(load_base_model(models["gpt2"]).model, str(result.adapter_dir))
    with torch.inference_mode():  # peft's model through the same invariant forward: the same bits
        assert torch.equal(served, sequence_logprobs(reference, prompt))
        own = torch.log_softmax(reference(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
    torch.testing.assert_close(served, own, rtol=1e-5, atol=1e-5)  # peft's own forward, to rounding
    assert float((gen.logprobs(prompt, None) - served).abs().max()) > 1e-4
