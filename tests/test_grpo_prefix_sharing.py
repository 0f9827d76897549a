"""GRPO's shared-prompt forward (``prefix_sharing``): a group's prompt runs once, its keys and values serve every
completion, and the run trains what running every completion in full trains.

``auto`` (the default) must give the losses, LoRA weights and every policy-audit field of ``off`` to fp32 rounding
at micro-batch 1, 4 and 16, with ECHO, an EMA reference and the entropy mask; resume exactly; and say in the receipt
which forwards shared and, where one did not, why."""

from __future__ import annotations

import threading

import pytest
import torch
from _runs import adapter_weights, assert_same_adapter, grpo_run

from kiln import contracts
from kiln.trainers import _forwards
from kiln.trainers.grpo import admit_grpo, run_grpo

PROMPT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Is the sky blue today?"}]
ANSWERS = [
    "yes", "no, it is not blue at all", "maybe", "Yes, it is blue on a clear day.", "no", "grey", "It depends.",
    "blue", "Yes!", "not today", "I think so, yes.", "cloudy", "ok", "Absolutely not.", "sure", "The sky is blue.",
]  # fmt: skip
GROUP16 = {
    "messages": PROMPT,
    "completions": [{"text": text, "reward": (i * 7 % 16) / 15} for i, text in enumerate(ANSWERS)],
}
GROUP8 = {"messages": PROMPT, "completions": GROUP16["completions"][:8]}
# completions that share their first trajectory turns: the shared prompt then holds observation tokens ECHO reads
STEPS = [
    {"role": "assistant", "content": "Let me look outside.", "kind": "action"},
    {
        "role": "tool",
        "content": "WARNING: dusk\nThe sky is dark blue.",
        "kind": "observation",
        "warning_prefix_len": 14,
    },
]
ECHO_GROUP = {
    "messages": PROMPT,
    "completions": [
        {"text": "", "reward": r, "trajectory": [*STEPS, {"role": "assistant", "content": answer, "kind": "action"}]}
        for answer, r in (("Yes.", 1.0), ("Dark blue, so yes.", 0.5), ("No.", 0.0), ("It is night.", 0.25))
    ],
}
SGD = {"seed": 5, "learning_rate": 0.05, "optimizer": {"kind": "sgd"}}


def _assert_same_training(shared, full):
    assert shared.status == full.status == "success", shared.receipt.get("failure_message")
    torch.testing.assert_close(torch.tensor(shared.losses), torch.tensor(full.losses), rtol=1e-5, atol=1e-6)
    a, b = adapter_weights(full), adapter_weights(shared)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6, msg=name)
    audit_full = full.receipt["grpo"].get("policy_audit", {})
    audit_shared = shared.receipt["grpo"].get("policy_audit", {})
    assert audit_full.keys() == audit_shared.keys()
    for block in ("importance_sampling", "kl_reference"):
        for key, value in audit_full.get(block, {}).items():
            if isinstance(value, float):
                assert audit_shared[block][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (block, key)
            else:
                assert audit_shared[block][key] == value, (block, key)
    echo_full, echo_shared = full.receipt["echo"], shared.receipt["echo"]
    for key, value in echo_full.items():
        if isinstance(value, float):
            assert echo_shared[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert contracts.validate_path(shared.receipt_path).valid


ECHO = ([GROUP16, ECHO_GROUP], {"loss": {"echo": {"lambda": 0.1}}})
EMA = ([GROUP16] * 2, {"kl_reference_policy": {"kind": "ema", "decay": 0.5, "refresh_every": 1}})
ENTROPY = ([GROUP16] * 2, {"entropy_aware_kl_quantile": 0.5, "is_level": "sequence", "kl_estimator": "k3"})


@pytest.mark.parametrize(
    ("width", "groups", "config"),
    [(1, *ECHO), (4, *EMA), (16, *ENTROPY), (16, *ECHO)],
    ids=["1-echo", "4-ema", "16-entropy-mask-gspo-k3", "16-echo"],
)
def test_a_shared_prompt_trains_what_every_completion_run_in_full_trains(
    tmp_path, tiny_model_dir, groups, config, width
):
    base = {**SGD, "micro_batch_size": width, **config}
    full = grpo_run(tmp_path, tiny_model_dir, "full", groups, {**base, "prefix_sharing": "off"})
    shared = grpo_run(tmp_path, tiny_model_dir, "shared", groups, base)
    _assert_same_training(shared, full)
    block = shared.receipt["grpo"]["prefix_sharing"]
    lengths = [
        _forwards.shared_length([c.input_ids for c in g.completions]) for g in _groups(tmp_path, groups, tiny_model_dir)
    ]
    assert (block["mode"], block["policy"], block["reference"], block["reason"]) == ("auto", True, True, None)
    assert (block["shared_groups"], block["shared_prompt_tokens"]) == (2, sum(lengths))
    assert min(lengths) > 10
    assert full.receipt["grpo"]["prefix_sharing"] == {
        "mode": "off", "policy": False, "reference": False, "shared_groups": 0, "shared_prompt_tokens": 0,
        "reason": "prefix_sharing is off",
    }  # fmt: skip


def _groups(tmp_path, groups, tiny_model_dir):
    job = admit_grpo(
        adapter_name="read", registry=tmp_path / "read", request={"groups": groups}, model_path=str(tiny_model_dir)
    )
    return job.ingestion.groups


def test_the_echo_group_s_shared_prompt_holds_the_observation_tokens_echo_reads(tmp_path, tiny_model_dir):
    group = _groups(tmp_path, [ECHO_GROUP], tiny_model_dir)[0]
    shared = _forwards.shared_length([c.input_ids for c in group.completions])
    assert all(any(c.observation_mask[: shared - 1]) for c in group.completions)


def test_off_never_runs_a_prompt_on_its_own(tmp_path, tiny_model_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("prefix_sharing off ran a prompt forward")

    monkeypatch.setattr(_forwards, "run_prefix", refuse)
    for width in (1, 4):
        result = grpo_run(
            tmp_path,
            tiny_model_dir,
            f"off{width}",
            [GROUP16],
            {**SGD, "micro_batch_size": width, "prefix_sharing": "off"},
        )
        assert result.status == "success", result.receipt.get("failure_message")


def test_the_shared_prompt_runs_once_per_group_and_forward(tmp_path, tiny_model_dir, monkeypatch):
    calls = []
    real = _forwards.run_prefix

    def counted(model, ids):
        calls.append(len(ids))
        return real(model, ids)

    job = admit_grpo(  # admission's probe runs a prompt of its own: count from the run on
        adapter_name="counted",
        registry=tmp_path / "adapters",
        request={"groups": [GROUP8] * 3, "config": {**SGD, "micro_batch_size": 4}},
        model_path=str(tiny_model_dir),
    )
    monkeypatch.setattr(_forwards, "run_prefix", counted)
    result = run_grpo(job)
    assert result.status == "success"
    assert len(calls) == 6  # 3 groups x (one reference forward + one policy forward)
    assert result.receipt["grpo"]["prefix_sharing"]["shared_prompt_tokens"] == sum(calls) // 2
    assert result.receipt["phase_timings"]["reference_forward_ms"] > 0


@pytest.mark.parametrize(
    ("config", "policy", "reference", "reason"),
    [
        ({"loss_aggregation": "per_sample"}, False, True, "per_sample aggregation"),
        ({"gradient_checkpointing": "on"}, False, True, "gradient_checkpointing recomputes"),
        ({"kl_coeff": 0}, True, False, None),
    ],
    ids=["per-sample", "checkpointing", "no-kl"],
)
def test_auto_shares_where_it_computes_the_same_thing_and_says_why_not_elsewhere(
    tmp_path, tiny_model_dir, config, policy, reference, reason
):
    base = {**SGD, "micro_batch_size": 4, **config}
    shared = grpo_run(tmp_path, tiny_model_dir, "auto", [GROUP8], base)
    full = grpo_run(tmp_path, tiny_model_dir, "off", [GROUP8], {**base, "prefix_sharing": "off"})
    _assert_same_training(shared, full)
    block = shared.receipt["grpo"]["prefix_sharing"]
    assert (block["policy"], block["reference"]) == (policy, reference)
    assert block["reason"] is None if reason is None else reason in block["reason"]


def test_a_model_that_fails_the_cached_prefix_probe_trains_every_completion_in_full(
    tmp_path, tiny_model_dir, monkeypatch
):
    monkeypatch.setattr(_forwards, "prefix_problem", lambda model: "ProbeModel: a forward from a cached prefix moved")
    monkeypatch.setattr(
        _forwards, "run_prefix", lambda *a, **k: (_ for _ in ()).throw(AssertionError("shared a refused model"))
    )
    result = grpo_run(tmp_path, tiny_model_dir, "refused", [GROUP8], {**SGD, "micro_batch_size": 4})
    assert result.status == "success"
    block = result.receipt["grpo"]["prefix_sharing"]
    assert (block["policy"], block["reference"], block["shared_groups"]) == (False, False, 0)
    assert block["reason"] == "ProbeModel: a forward from a cached prefix moved"


def test_the_probe_passes_the_decoders_kiln_trains():
    import transformers

    configs = [
        transformers.Qwen2Config(
            vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        ),
        transformers.LlamaConfig(
            vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        ),
        transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=1),
    ]  # fmt: skip
    for config in configs:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        assert _forwards.prefix_problem(model) is None, type(model).__name__


def test_the_probe_names_a_decoder_that_ignores_its_cache():
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    body = model.get_decoder()
    forward = body.forward

    def forgetful(*args, past_key_values=None, **kwargs):  # a decoder that drops the cache it is given
        return forward(*args, **kwargs)

    body.forward = forgetful
    problem = _forwards.prefix_problem(model)
    assert str(problem).startswith("Qwen2ForCausalLM: a forward from a cached prefix moved")


def test_a_shared_run_resumes_to_the_bytes_of_an_uninterrupted_one(tmp_path, tiny_model_dir):
    config = {"seed": 3, "checkpoint_interval": 1, "micro_batch_size": 4, "loss": {"echo": {"lambda": 0.1}}}
    groups = [GROUP8, ECHO_GROUP, GROUP8]
    straight = grpo_run(tmp_path, tiny_model_dir, "straight", groups, config)
    assert straight.receipt["grpo"]["prefix_sharing"]["policy"]
    stop = threading.Event()
    cut = grpo_run(
        tmp_path,
        tiny_model_dir,
        "cut",
        groups,
        config,
        progress=lambda event: stop.set() if event["step"] == 1 else None,
        cancel=stop,
    )
    assert cut.cancelled
    resumed = grpo_run(
        tmp_path, tiny_model_dir, "cut", groups, {**config, "resume_checkpoint": cut.checkpoints[-1].name}
    )
    assert resumed.status == "success", resumed.receipt.get("failure_message")
    assert_same_adapter(straight, resumed)
    assert resumed.receipt["grpo"]["prefix_sharing"] == straight.receipt["grpo"]["prefix_sharing"]


def test_kiln_train_grpo_prefix_sharing_is_a_config_field_and_bound_by_the_resume_command(tmp_path):
    import shlex

    from kiln.cli import build_parser
    from kiln.cli._requests import build_request, resume_command, training_config

    data = tmp_path / "groups.json"
    data.write_text("[]")
    argv = ["train", "grpo", "-f", str(data), "--adapter", "g", "--prefix-sharing", "off"]
    args = build_parser().parse_args(argv)
    assert training_config(args)["prefix_sharing"] == "off"
    assert contracts.problems("GrpoConfig", build_request(args, data)["config"]) == []
    again = build_parser().parse_args(
        shlex.split(resume_command(args, "g-checkpoint-step-00000001.kiln-checkpoint", None))[1:]
    )
    assert training_config(again)["prefix_sharing"] == "off"
    assert "prefix_sharing" not in training_config(build_parser().parse_args(argv[:6]))
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv[:6], "--prefix-sharing", "always"])
