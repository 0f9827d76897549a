"""Online GRPO: each step's groups are sampled from the policy as it is at the step's start (the one batched
decoder), scored, and trained with their recorded log-probabilities -- every importance ratio exactly 1 before the
update, a gap of 0.0 -- and a run cancelled or failed at any step resumes to the same adapter bytes and the same
rollout log."""

from __future__ import annotations

import hashlib
import json
import stat
import sys
import threading

import pytest

from kiln.trainers.grpo import admit_grpo, run_grpo

TASKS = [
    {"id": "vowel", "prompt": "Say something with a vowel.", "pattern": "[aeiou]"},
    {"id": "digit", "messages": [{"role": "user", "content": "Write a digit."}], "pattern": "[0-9]"},
    {"id": "space", "prompt": "Two words, please.", "pattern": " "},
]
SAMPLING = {"temperature": 1.0, "max_tokens": 6}


def _request(scorer="builtin:regex", **config):
    online = {"tasks": TASKS, "scorer": scorer, "group_size": 4, "passes": 2, "sampling": SAMPLING}
    return {"online": online, "config": {"seed": 5, "learning_rate": 0.05, **config}}


def _run(registry, model_dir, request, *, cancel_at=None, name="online", on_step=None):
    job = admit_grpo(adapter_name=name, registry=registry, request=request, model_path=str(model_dir))
    event = threading.Event()

    def progress(e):
        if on_step is not None:
            on_step(e["step"])
        if cancel_at is not None and e["step"] == cancel_at:
            event.set()

    return run_grpo(job, progress=progress, cancel=event)


@pytest.fixture(scope="module")
def whole(tmp_path_factory, tiny_model_dir):
    """One uninterrupted online run (6 task visits, a step each)."""
    registry = tmp_path_factory.mktemp("whole") / "adapters"
    result = _run(registry, tiny_model_dir, _request())
    assert result.status == "success", result.receipt.get("failure_message")
    return result


def test_online_steps_train_on_policy_with_every_ratio_exactly_one(whole):
    receipt = whole.receipt
    online = receipt["grpo"]["online"]
    assert online["task_visits"] == 6
    assert [s["step"] for s in online["steps"]] == [1, 2, 3, 4, 5, 6]
    assert online["generation_backend"].startswith("kiln.invariant-forward")
    ratios = receipt["grpo"]["policy_audit"]["importance_sampling"]
    assert ratios["ratio_observations"] > 0
    # every ratio, taken at its step's start after the previous steps' updates, is exactly 1: the sampler's
    # recorded log-probabilities are the trainer's to the bit
    assert ratios["min_ratio"] == ratios["max_ratio"] == 1.0
    assert online["max_behavior_logprob_gap"] == 0.0
    assert receipt["grpo"]["behavior_policy"] == "recorded"
    assert online["scorer"] == {
        "kind": "builtin",
        "name": "builtin:regex",
        "kiln_version": online["scorer"]["kiln_version"],
    }
    assert whole.losses
    assert len(whole.losses) == sum(s["groups_trained"] > 0 for s in online["steps"])


def test_the_rollout_log_is_published_beside_the_adapter_and_bound_by_the_receipt(whole):
    log = (whole.adapter_dir / "rollouts.jsonl").read_bytes()
    online = whole.receipt["grpo"]["online"]
    assert online["rollout_log_sha256"] == "sha256:" + hashlib.sha256(log).hexdigest()
    groups = [json.loads(line) for line in log.splitlines()]
    assert [g["task_id"] for g in groups] == ["vowel", "digit", "space"] * 2
    rewards = [c["reward"] for g in groups for c in g["completions"]]
    assert set(rewards) <= {0.0, 1.0}
    for g, step in zip(groups, online["steps"], strict=True):
        assert step["reward_mean"] == sum(c["reward"] for c in g["completions"]) / 4
        for c in g["completions"]:
            tokens = c["provenance"]["action_tokens"]
            assert tokens
            assert all(isinstance(t["behavior_logprob"], float) for t in tokens)
    recorded = whole.receipt["grpo"]["policy_audit"]["recorded_provenance"]
    trained = sum(s["groups_trained"] for s in online["steps"])
    assert recorded["completion_count"] == 4 * trained
    assert recorded["unique_behavior_sources"] == 1


def test_a_run_whose_every_group_has_equal_rewards_fails_zero_groups(tmp_path, tiny_model_dir):
    request = _request()
    request["online"]["tasks"] = [{"id": "any", "prompt": "Hi", "pattern": ""}]  # every completion matches
    result = _run(tmp_path / "adapters", tiny_model_dir, request)
    assert result.status == "failed"
    assert result.receipt["failure_reason"] == "zero_groups"
    assert result.losses == []
    assert result.receipt["grpo"]["dynamic_groups_filtered"] == 2
    assert [s["groups_trained"] for s in result.receipt["grpo"]["online"]["steps"]] == [0, 0]


@pytest.mark.parametrize("cancel_at", [2, 5])
def test_cancel_then_resume_gives_the_same_adapter_and_rollouts(cancel_at, whole, tmp_path, tiny_model_dir):
    registry = tmp_path / "adapters"
    request = _request(checkpoint_interval=1)
    cut = _run(registry, tiny_model_dir, request, cancel_at=cancel_at)
    assert cut.cancelled
    assert cut.checkpoints
    resumed = _run(
        registry, tiny_model_dir, _request(checkpoint_interval=1, resume_checkpoint=cut.checkpoints[-1].name)
    )
    assert resumed.status == "success", resumed.receipt.get("failure_message")
    assert resumed.losses == whole.losses
    assert (resumed.adapter_dir / "adapter_model.safetensors").read_bytes() == (
        whole.adapter_dir / "adapter_model.safetensors"
    ).read_bytes()
    assert (resumed.adapter_dir / "rollouts.jsonl").read_bytes() == (whole.adapter_dir / "rollouts.jsonl").read_bytes()


SCORER = """#!{python}
import json, os, re, sys
here = os.path.dirname(os.path.abspath(__file__))
if os.path.exists(os.path.join(here, "fail")):
    sys.stderr.write("the grader lost its answer key\\n")
    sys.exit(3)
for line in sys.stdin:
    item = json.loads(line)
    hit = re.search(item["task"]["pattern"], item["completion"]) is not None
    print(json.dumps({{"reward": 1.0 if hit else 0.0, "matched": hit}}))
"""


@pytest.fixture
def scorer_script(tmp_path):
    path = tmp_path / "scorer" / "grade.py"
    path.parent.mkdir()
    path.write_text(SCORER.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_failing_scorer_fails_the_step_naming_the_task_and_its_stderr_and_the_run_resumes(
    scorer_script, tmp_path, tiny_model_dir
):
    whole = _run(tmp_path / "whole", tiny_model_dir, _request(scorer=str(scorer_script)))
    assert whole.status == "success", whole.receipt.get("failure_message")
    registry = tmp_path / "adapters"
    flag = scorer_script.parent / "fail"

    def after(step):
        if step == 3:
            flag.write_text("")  # step 4's scoring fails

    failed = _run(registry, tiny_model_dir, _request(scorer=str(scorer_script), checkpoint_interval=1), on_step=after)
    assert failed.status == "failed"
    message = failed.receipt["failure_message"]
    assert "task 'vowel'" in message
    assert str(scorer_script) in message
    assert "exited with status 3" in message
    assert "the grader lost its answer key" in message
    checkpoint = failed.checkpoints[-1]
    flag.unlink()
    request = _request(scorer=str(scorer_script), checkpoint_interval=1, resume_checkpoint=checkpoint.name)
    resumed = _run(registry, tiny_model_dir, request)
    assert resumed.status == "success", resumed.receipt.get("failure_message")
    assert resumed.losses == whole.losses
    assert (resumed.adapter_dir / "adapter_model.safetensors").read_bytes() == (
        whole.adapter_dir / "adapter_model.safetensors"
    ).read_bytes()
    log = [json.loads(line) for line in (resumed.adapter_dir / "rollouts.jsonl").read_bytes().splitlines()]
    assert all("matched" in c["scorer"] for g in log for c in g["completions"])  # the scorer's other fields kept


def test_resume_refuses_a_changed_task_list_naming_the_data(tmp_path, tiny_model_dir):
    registry = tmp_path / "adapters"
    cut = _run(registry, tiny_model_dir, _request(checkpoint_interval=1), cancel_at=2)
    request = _request(checkpoint_interval=1, resume_checkpoint=cut.checkpoints[-1].name)
    request["online"]["tasks"] = [*TASKS[:2], {**TASKS[2], "pattern": "x"}]
    from kiln.errors import CheckpointError

    with pytest.raises(CheckpointError) as refused:
        admit_grpo(adapter_name="online", registry=registry, request=request, model_path=str(tiny_model_dir))
    assert "data.content_sha256 differs" in refused.value.message  # the online definition is the run's data


def test_kiln_audit_reexecutes_an_online_run_from_its_recorded_rollouts(tmp_path, tiny_model_dir):
    from kiln.audit import AuditSources, audit

    registry = tmp_path / "adapters"
    run = _run(registry, tiny_model_dir, _request(checkpoint_interval=2))
    assert run.status == "success"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    sources = AuditSources(data_file=tasks, model=str(tiny_model_dir))
    record = audit(run.adapter_dir, sources=sources)
    assert record["verdict"] == "reproduced", record.get("first_difference") or record.get("cannot_audit")
    rescored = audit(run.adapter_dir, sources=AuditSources(data_file=tasks, model=str(tiny_model_dir), rescore=True))
    assert rescored["verdict"] == "reproduced"
    # a recorded reward changed (and its digest rebound) is a different run: its adapter is not reproduced
    log = run.adapter_dir / "rollouts.jsonl"
    groups = [json.loads(line) for line in log.read_text().splitlines()]
    completions = groups[0]["completions"]
    completions[0]["reward"] = 1.0 - completions[0]["reward"]
    from kiln.data import rollout_log_lines

    forged = b"".join(rollout_log_lines(groups))
    log.write_bytes(forged)
    receipt_path = run.adapter_dir / "train_receipt.json"
    receipt = json.loads(receipt_path.read_text())
    receipt["grpo"]["online"]["rollout_log_sha256"] = "sha256:" + hashlib.sha256(forged).hexdigest()
    receipt_path.write_text(json.dumps(receipt))
    forged_record = audit(run.adapter_dir, sources=sources)
    assert forged_record["verdict"] != "reproduced"


HANGING = """#!{python}
import json, os, re, sys, time
here = os.path.dirname(os.path.abspath(__file__))
calls = os.path.join(here, "calls")
count = int(open(calls).read()) + 1 if os.path.exists(calls) else 1
open(calls, "w").write(str(count))
if count == {hang_at} and os.path.exists(os.path.join(here, "hang")):
    open(os.path.join(here, "scoring"), "w").write(str(os.getpid()))
    time.sleep(600)  # killed here, mid-scoring
for line in sys.stdin:
    item = json.loads(line)
    print(json.dumps({{"reward": 1.0 if re.search(item["task"]["pattern"], item["completion"]) else 0.0}}))
"""


@pytest.mark.slow
def test_sigkill_while_scoring_then_resume_gives_the_same_adapter_and_rollouts(tmp_path, tiny_model_dir):
    """``kiln train grpo --local`` killed with SIGKILL while its scorer runs (step 4 of 6): the resume from the last
    checkpoint samples the lost step again -- same policy, same counter-based draws -- and ends with the bytes of
    an uninterrupted run."""
    import os
    import signal
    import subprocess
    import time

    script = tmp_path / "scorer" / "grade.py"
    script.parent.mkdir()
    script.write_text(HANGING.format(python=sys.executable, hang_at=4))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    request = _request(scorer=str(script), checkpoint_interval=1)
    request_file = tmp_path / "online.json"
    request_file.write_text(json.dumps(request))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env["KILN_HOME"] = str(tmp_path / "home")

    def kiln(registry: str, *extra: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "kiln.cli", "train", "grpo", "--local", "-f", str(request_file), "--adapter",
                "online", "--model", str(tiny_model_dir), "--adapter-dir", str(tmp_path / registry), *extra]  # fmt: skip
        with (tmp_path / f"{registry}.log").open("a") as log:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log)

    def log(registry: str) -> str:
        return (tmp_path / f"{registry}.log").read_text()[-4000:]

    whole = kiln("whole")
    assert whole.wait(timeout=600) == 0, log("whole")
    (script.parent / "calls").unlink()
    (script.parent / "hang").write_text("")
    killed = kiln("killed")
    deadline = time.monotonic() + 600
    while not (script.parent / "scoring").exists():
        assert killed.poll() is None, log("killed")
        assert time.monotonic() < deadline
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    os.kill(int((script.parent / "scoring").read_text()), signal.SIGKILL)  # the orphaned scorer, still asleep
    (script.parent / "hang").unlink()
    checkpoints = sorted((tmp_path / "killed").glob("online-checkpoint-step-*.kiln-checkpoint"))
    assert checkpoints, "the steps before the kill published their checkpoints"
    resumed = kiln("killed", "--resume-checkpoint", checkpoints[-1].name)
    assert resumed.wait(timeout=600) == 0, log("killed")
    for name in ("adapter_model.safetensors", "rollouts.jsonl"):
        assert (tmp_path / "killed" / "online" / name).read_bytes() == (
            tmp_path / "whole" / "online" / name
        ).read_bytes()
