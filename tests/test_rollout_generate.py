"""``kiln rollout-generate``: tasks sampled with the batched generator, scored, and published as GRPO groups whose
completions carry ``kiln.rollout-provenance.v1``. Trained with ``behavior_policy: recorded``, the recorded
log-probabilities are the trainer's recomputation at step 0 exactly (every ratio 1), with the base model or a
registry adapter sampling -- and the token ids trained are the ids the policy sampled, even where re-tokenizing the
text would split it otherwise."""

from __future__ import annotations

import json
import shutil
import stat
import sys

import pytest

from kiln.cli import main
from kiln.trainers.grpo import admit_grpo, run_grpo

TASKS = [
    {"id": "a", "prompt": "Answer in JSON: what is 2+2?", "pattern": "[0-9]"},
    {"id": "b", "messages": [{"role": "user", "content": "Give a word with an e."}], "pattern": "e"},
]


@pytest.fixture
def inputs(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    template = tmp_path / "req.json"
    template.write_text(json.dumps({"temperature": 1.0, "top_k": 50, "max_tokens": 6}))
    return tasks, template


def _generate(tmp_path, model, inputs, *extra, seeds=4):
    tasks, template = inputs
    out = tmp_path / "out" / "rollouts.scored.jsonl"
    out.parent.mkdir(exist_ok=True)
    argv = ["rollout-generate", "--tasks", str(tasks), "--seeds", str(seeds), "--seed-start", "10",
            "--request-template", str(template), "--scorer", "builtin:regex", "--output", str(out),
            "--model", str(model), *extra]  # fmt: skip
    return main(argv), out, out.parent / "rollout_summary.json"


def _train_first_group(tmp_path, model, out, **config):
    """A GRPO run on the first group alone (one optimizer step) with the recorded behaviour policy."""
    first = tmp_path / "first.jsonl"
    first.write_bytes(out.read_bytes().splitlines(keepends=True)[0])
    job = admit_grpo(
        adapter_name="from-rollouts",
        registry=tmp_path / "registry",
        request={"dataset_path": str(first), "config": {"behavior_policy": "recorded", "seed": 1, **config}},
        model_path=str(model),
    )
    return job, run_grpo(job)


def test_rollouts_publish_groups_with_provenance_and_a_summary(tmp_path, tiny_model_dir, inputs, capsys):
    code, out, summary_path = _generate(tmp_path, tiny_model_dir, inputs)
    assert code == 0
    printed = capsys.readouterr().out
    assert "✓ rollout-generate completed: 2 group(s), 8 completion(s), mean reward" in printed
    assert f"summary: {summary_path}" in printed
    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["task_id"] for g in groups] == ["a", "b"]
    summary = json.loads(summary_path.read_text())
    assert summary["schema"] == "kiln.rollout-summary.v1"
    assert summary["completions"] == 8
    assert summary["scorer"] == {
        "kind": "builtin",
        "name": "builtin:regex",
        "kiln_version": summary["scorer"]["kiln_version"],
    }
    seeds = []
    for group in groups:
        for c in group["completions"]:
            p = c["provenance"]
            assert p["schema"] == "kiln.rollout-provenance.v1"
            assert p["generation_backend"].startswith("kiln.invariant-forward")
            assert p["behavior_policy"]["adapter"] is None
            assert p["behavior_policy"]["base_weights_sha256"]
            assert p["sampling"]["top_k"] == 50
            assert p["sampling"]["draw_rule"] == "kiln.counter-draws.splitmix64.v1"
            assert any(t["forced"] for t in p["action_tokens"])  # the template's closing tokens
            assert not p["action_tokens"][0]["forced"]
            seeds.append(p["seed"])
    assert seeds == [10, 11, 12, 13] * 2
    sampled = sum(not t["forced"] for g in groups for c in g["completions"] for t in c["provenance"]["action_tokens"])
    assert summary["sampled_action_tokens"] == sampled
    # the same command gives the same bytes (counter-based draws: nothing else decides a token)
    again = tmp_path / "again"
    again.mkdir()
    shutil.copy(inputs[0], again / "tasks.jsonl")
    shutil.copy(inputs[1], again / "req.json")
    code, out2, _ = _generate(again, tiny_model_dir, (again / "tasks.jsonl", again / "req.json"))
    assert code == 0
    assert out2.read_bytes() == out.read_bytes()


def test_recorded_rollouts_train_with_every_step_zero_ratio_exactly_one(tmp_path, tiny_model_dir, inputs):
    code, out, _summary_path = _generate(tmp_path, tiny_model_dir, inputs)
    assert code == 0
    job, result = _train_first_group(tmp_path, tiny_model_dir, out)
    assert result.status == "success", result.receipt.get("failure_message")
    audit = result.receipt["grpo"]["policy_audit"]
    ratios = audit["importance_sampling"]
    assert ratios["ratio_observations"] > 0
    assert ratios["min_ratio"] == ratios["max_ratio"] == 1.0  # recorded == recomputed, bit for bit
    recorded = audit["recorded_provenance"]
    group = json.loads(out.read_text().splitlines()[0])
    tokens = [t for c in group["completions"] for t in c["provenance"]["action_tokens"]]
    assert recorded["completion_count"] == 4
    assert recorded["sampled_action_tokens"] == sum(not t["forced"] for t in tokens)
    assert recorded["forced_action_tokens"] == sum(t["forced"] for t in tokens)
    assert recorded["unique_behavior_sources"] == 1
    source = recorded["behavior_sources"][0]
    assert source["generation_backend"] == group["completions"][0]["provenance"]["generation_backend"]
    # the ids trained are the ids sampled (prompt, then each completion's recorded action tokens)
    trained = job.ingestion.groups[0]
    for c, raw in zip(trained.completions, group["completions"], strict=True):
        ids = [t["token_id"] for t in raw["provenance"]["action_tokens"]]
        assert list(c.input_ids[trained.prompt_tokens :]) == ids


def test_an_adapter_samples_and_its_warm_started_run_recomputes_it_exactly(
    tmp_path, tiny_model_dir, inputs, trained_adapter
):
    registry = tmp_path / "registry"
    registry.mkdir()
    shutil.copytree(trained_adapter, registry / "bot")
    code, out, _ = _generate(tmp_path, tiny_model_dir, inputs, "--adapter", "bot", "--adapter-dir", str(registry))
    assert code == 0
    group = json.loads(out.read_text().splitlines()[0])
    behaviour = group["completions"][0]["provenance"]["behavior_policy"]
    assert behaviour["adapter"] == "bot"
    assert behaviour["adapter_weights_sha256"].startswith("sha256:")
    _, result = _train_first_group(tmp_path, tiny_model_dir, out, base_adapter="bot")
    assert result.status == "success", result.receipt.get("failure_message")
    ratios = result.receipt["grpo"]["policy_audit"]["importance_sampling"]
    assert ratios["min_ratio"] == ratios["max_ratio"] == 1.0


def test_an_existing_output_is_not_replaced_without_overwrite(tmp_path, tiny_model_dir, inputs, capsys):
    out = tmp_path / "out" / "rollouts.scored.jsonl"
    out.parent.mkdir()
    out.write_text("keep me\n")
    code, _, _ = _generate(tmp_path, tiny_model_dir, inputs)
    assert code == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_text() == "keep me\n"


def test_a_failing_scorer_writes_nothing_and_names_the_task(tmp_path, tiny_model_dir, inputs, capsys):
    script = tmp_path / "grade.py"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write('no key for this task\\n')\nsys.exit(1)\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    tasks, template = inputs
    out = tmp_path / "rollouts.jsonl"
    code = main(["rollout-generate", "--tasks", str(tasks), "--seeds", "2", "--scorer", str(script),
                 "--output", str(out), "--model", str(tiny_model_dir), "--request-template", str(template)])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "error [scorer_failed]" in err
    assert "task 'a'" in err
    assert "no key for this task" in err
    assert not out.exists()
    assert not (tmp_path / "rollout_summary.json").exists()


@pytest.mark.parametrize(
    ("template", "says"),
    [({"temperature": -1}, "temperature must be"), ({"best_of": 2}, "unknown field 'best_of'")],
)
def test_a_bad_request_template_is_refused_naming_the_field(tmp_path, tiny_model_dir, inputs, template, says, capsys):
    inputs[1].write_text(json.dumps(template))
    code, out, _ = _generate(tmp_path, tiny_model_dir, inputs)
    assert code == 2
    assert says in capsys.readouterr().err
    assert not out.exists()
