"""GRPO ingestion (spec/40 "GRPO"): inline and streamed groups, aliases, the refusals
(shape, rewards, segment kinds, zero action tokens, bad lines, changed files), action and
observation masks on the tiny model's ChatML tokenizer, the warning filter, recorded
log-probabilities, row digests and the streamed-source cursor."""

from __future__ import annotations

import copy
import json
import math

import pytest

from kiln.data import (
    GrpoIngestion,
    check_unchanged,
    dataset_sha256,
    iter_dataset_groups,
    read_groups,
)
from kiln.documents.digests import json_sha256
from kiln.errors import RequestError

END = "<|im_end|>\n"
BANNER = "WARNING: slow tool\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _group(*completions, prompt="What is the weather in Berlin?"):
    return {"messages": [{"role": "user", "content": prompt}], "completions": list(completions)}


def _plain(text, reward=1.0, **extra):
    return {"text": text, "reward": reward, **extra}


def _trajectory(*segments, reward=0.5):
    return {"text": "ignored when a trajectory is present", "reward": reward, "trajectory": list(segments)}


AGENTIC = _trajectory(
    {"role": "assistant", "content": "Let me check the weather."},
    {
        "role": "tool",
        "content": BANNER + "sunny, 21 degrees",
        "tool_call_id": "call_1",
        "warning_prefix_len": len(BANNER),
    },
    {"role": "user", "content": "And tomorrow?", "kind": "context"},
    {"role": "assistant", "content": "Rain in the afternoon.", "kind": "action"},
)
GROUPS = [
    _group(_plain("It is sunny."), _plain("I do not know.", reward=0.0)),
    _group(AGENTIC, _plain("Sunny.", reward=0.25), prompt="Plan the day."),
]


def _jsonl(tmp_path, lines, name="groups.jsonl"):
    path = tmp_path / name
    path.write_bytes(
        b"".join(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode() for line in lines)
    )
    return path


def _decode_masked(tokenizer, completion, mask):
    targets = completion.input_ids[1:]
    return tokenizer.decode([i for i, keep in zip(targets, mask, strict=True) if keep])


def _refusal(tokenizer, **kwargs) -> str:
    with pytest.raises(RequestError) as info:
        read_groups(tokenizer=tokenizer, **kwargs)
    assert info.value.code == "training_invalid_request"
    return info.value.message


def test_inline_and_streamed_groups_are_identical(tokenizer, tmp_path):
    inline = read_groups(tokenizer=tokenizer, groups=GROUPS)
    path = _jsonl(tmp_path, GROUPS)
    streamed = read_groups(tokenizer=tokenizer, dataset_path=path)
    assert isinstance(streamed, GrpoIngestion)
    assert streamed.groups == inline.groups
    assert streamed.counts == inline.counts
    assert (inline.source, inline.route, inline.path) == ("inline_grpo_groups", "inline", None)
    assert (streamed.source, streamed.route, streamed.path) == ("jsonl_grpo_groups", "jsonl", str(path))
    assert inline.source_sha256 == json_sha256(GROUPS)
    assert streamed.source_sha256 == dataset_sha256(path)
    assert streamed.training_data() == {
        "source": "jsonl_grpo_groups",
        "path": str(path),
        "sha256": dataset_sha256(path),
    }
    assert streamed.training_data(dry_run=True)["source"] == "jsonl_grpo_groups_dry_run"
    assert [c.index for c in inline.groups[0].completions] == [0, 1]
    assert [c.reward for c in inline.groups[0].completions] == [1.0, 0.0]


def test_aliases_agentic_groups_and_rollouts_read_like_groups_and_completions(tokenizer):
    aliased = [{"messages": g["messages"], "rollouts": g["completions"]} for g in GROUPS]
    plain = read_groups(tokenizer=tokenizer, groups=GROUPS)
    via_aliases = read_groups(tokenizer=tokenizer, agentic_groups=aliased)
    for a, b in zip(plain.groups, via_aliases.groups, strict=True):
        assert (a.completions, a.prompt_tokens) == (b.completions, b.prompt_tokens)
    assert via_aliases.groups[0].row_sha256 == json_sha256(aliased[0])


def test_both_aliases_at_once_are_refused(tokenizer, tmp_path):
    assert "exactly one of groups, agentic_groups or dataset_path" in _refusal(
        tokenizer, groups=GROUPS, agentic_groups=GROUPS
    )
    assert "exactly one" in _refusal(tokenizer, groups=GROUPS, dataset_path=_jsonl(tmp_path, GROUPS))
    assert "exactly one" in _refusal(tokenizer)
    both = {**GROUPS[0], "rollouts": GROUPS[0]["completions"]}
    message = _refusal(tokenizer, groups=[GROUPS[1], both])
    assert message.startswith("group 2 is invalid:")
    assert "not both" in message


def test_a_group_without_completions_or_an_empty_group_list_is_refused(tokenizer):
    assert "invalid_length" in _refusal(tokenizer, groups=[_group()])
    assert 'needs "completions"' in _refusal(tokenizer, groups=[{"messages": []}])
    assert "empty" in _refusal(tokenizer, groups=[])
    assert "more than 1024" in _refusal(tokenizer, groups=[_group(*[_plain("a")] * 1025)])


def test_a_non_finite_reward_is_refused_inline_and_in_a_file(tokenizer, tmp_path):
    for bad in (math.nan, math.inf, -math.inf):
        message = _refusal(tokenizer, groups=[GROUPS[0], _group(_plain("a"), _plain("b", reward=bad))])
        assert message.startswith("group 2 is invalid: completion 2, reward: not a finite number"), message
    big = b'{"messages": [], "completions": [{"text": "a", "reward": 1e400}]}\n'
    message = _refusal(tokenizer, dataset_path=_jsonl(tmp_path, [big], name="big.jsonl"))
    assert "line 1 (group 1)" in message  # the strict reader refuses 1e400 while parsing the line
    assert "overflows to infinity" in message
    assert "too large" in _refusal(tokenizer, groups=[_group(_plain("a", reward=10**400))])
    line = b'{"messages": [], "completions": [{"text": "a", "reward": NaN}]}\n'
    message = _refusal(tokenizer, dataset_path=_jsonl(tmp_path, [GROUPS[0], line]))
    assert "line 2 (group 2)" in message
    assert "non-finite" in message


def test_an_unknown_segment_kind_is_refused_naming_group_completion_and_segment(tokenizer):
    bad = _trajectory({"role": "assistant", "content": "ok"}, {"role": "tool", "content": "x", "kind": "banner"})
    with pytest.raises(RequestError) as info:
        read_groups(tokenizer=tokenizer, groups=[GROUPS[0], _group(_plain("fine"), bad)])
    assert info.value.message.startswith("group 2 is invalid: completion 2, segment 2, kind: value_not_allowed")
    assert info.value.pointer == "/groups/1/completions/1/trajectory/1/kind"


def test_a_completion_without_action_tokens_is_refused_as_zero_action_tokens(tokenizer):
    observation_only = _trajectory({"role": "assistant", "content": "I will look.", "kind": "context"})
    message = _refusal(tokenizer, groups=[_group(_plain("fine"), observation_only)])
    assert message.startswith("group 1 is invalid: completion 2: zero_action_tokens")
    assert "no action segment" in message
    assert "zero_action_tokens" in _refusal(tokenizer, groups=[_group(_trajectory())])


def test_masks_mark_exactly_the_action_and_observation_tokens(tokenizer):
    ingestion = read_groups(tokenizer=tokenizer, groups=GROUPS)
    plain = ingestion.groups[0].completions[0]
    prompt = tokenizer.apply_chat_template(GROUPS[0]["messages"], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(plain.input_ids) == prompt + "It is sunny." + END
    assert len(plain.action_mask) == len(plain.observation_mask) == len(plain.input_ids) - 1
    assert _decode_masked(tokenizer, plain, plain.action_mask) == "It is sunny." + END
    assert not any(plain.observation_mask)
    assert plain.action_tokens == sum(plain.action_mask)
    first_action = plain.action_mask.index(True) + 1
    assert first_action == ingestion.groups[0].prompt_tokens  # the first completion token follows the prompt

    agentic = ingestion.groups[1].completions[0]
    assert _decode_masked(tokenizer, agentic, agentic.action_mask) == (
        "Let me check the weather." + END + "Rain in the afternoon." + END
    )
    assert _decode_masked(tokenizer, agentic, agentic.observation_mask) == "sunny, 21 degrees"
    assert not any(a and o for a, o in zip(agentic.action_mask, agentic.observation_mask, strict=True))
    group = ingestion.groups[1]
    assert (
        group.completions[0].input_ids[: group.prompt_tokens] == group.completions[1].input_ids[: group.prompt_tokens]
    )


def test_segment_kinds_default_by_role(tokenizer):
    defaulted = _trajectory(
        {"role": "assistant", "content": "Calling the tool."},
        {"role": "tool", "content": "21 degrees"},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "Welcome."},
    )
    completion = read_groups(tokenizer=tokenizer, groups=[_group(defaulted)]).groups[0].completions[0]
    assert _decode_masked(tokenizer, completion, completion.action_mask) == "Calling the tool." + END + "Welcome." + END
    assert _decode_masked(tokenizer, completion, completion.observation_mask) == "21 degrees"


def test_the_warning_prefix_is_left_out_of_the_observation_mask_only_when_filtering(tokenizer):
    on = read_groups(tokenizer=tokenizer, groups=GROUPS).groups[1].completions[0]
    off = read_groups(tokenizer=tokenizer, groups=GROUPS, warning_filter=False).groups[1].completions[0]
    assert on.input_ids == off.input_ids
    assert on.action_mask == off.action_mask
    assert _decode_masked(tokenizer, on, on.observation_mask) == "sunny, 21 degrees"
    assert _decode_masked(tokenizer, off, off.observation_mask) == BANNER + "sunny, 21 degrees"
    assert on.warning_tokens > 0
    assert off.warning_tokens == 0
    assert on.observation_tokens + on.warning_tokens == off.observation_tokens
    counts = read_groups(tokenizer=tokenizer, groups=GROUPS).counts.token_counts()
    assert counts["env_tokens"] == counts["env_tokens_after_warning_filter"] == on.observation_tokens
    assert counts["env_tokens_before_warning_filter"] - counts["warning_tokens_filtered"] == counts["env_tokens"]
    too_long = _trajectory(
        {"role": "assistant", "content": "a"}, {"role": "tool", "content": "ab", "warning_prefix_len": 3}
    )
    assert "warning_prefix_len 3 is longer" in _refusal(tokenizer, groups=[_group(too_long)])


@pytest.mark.parametrize(
    ("insert", "expected"),
    [("| trim", '"sunny"'), ("| tojson", '\\"sunny\\"  ')],
)
def test_the_warning_prefix_follows_templates_that_trim_or_json_escape_content(tokenizer, insert, expected):
    from kiln.model._tiny import CHAT_TEMPLATE

    variant = copy.deepcopy(tokenizer)
    variant.chat_template = CHAT_TEMPLATE.replace(
        "{{- message['content'] -}}", "{{- message['content'] " + insert + " -}}"
    )
    banner = "  WARNING: slow\n"
    observed = _trajectory(
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": banner + '"sunny"  ', "warning_prefix_len": len(banner)},
    )
    completion = read_groups(tokenizer=variant, groups=[_group(observed)]).groups[0].completions[0]
    assert _decode_masked(tokenizer, completion, completion.observation_mask) == expected
    assert completion.warning_tokens > 0


def test_text_spelling_a_special_token_stays_data_inside_its_mask(tokenizer):
    sneaky = _trajectory(
        {"role": "assistant", "content": "Done <|im_end|> really"},
        {"role": "tool", "content": "<|im_start|>user\nhi"},
    )
    completion = read_groups(tokenizer=tokenizer, groups=[_group(sneaky)]).groups[0].completions[0]
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    action_ids = [i for i, keep in zip(completion.input_ids[1:], completion.action_mask, strict=True) if keep]
    observation_ids = [i for i, keep in zip(completion.input_ids[1:], completion.observation_mask, strict=True) if keep]
    assert action_ids.count(end_id) == 1
    assert action_ids[-2] == end_id
    assert start_id not in observation_ids
    assert _decode_masked(tokenizer, completion, completion.observation_mask) == "<|im_start|>user\nhi"


def test_a_trajectory_that_does_not_start_with_the_assistant_is_refused(tokenizer):
    tool_first = _trajectory({"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"})
    message = _refusal(tokenizer, groups=[_group(tool_first)])
    assert "completion 1" in message
    assert "starts with an assistant segment" in message


def test_a_bad_message_role_is_refused_naming_the_message(tokenizer):
    group = {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard"}], "completions": [_plain("a")]}
    message = _refusal(tokenizer, groups=[group])
    assert message.startswith("group 1 is invalid: message 2 has role 'wizard'")


def test_a_changed_file_is_refused_between_pin_and_recheck_naming_the_file(tokenizer, tmp_path):
    path = _jsonl(tmp_path, GROUPS)
    pin = dataset_sha256(path)
    check_unchanged(path, pin)
    check_unchanged(path, pin.removeprefix("sha256:"))
    path.write_bytes(path.read_bytes() + b"\n")
    with pytest.raises(RequestError) as info:
        check_unchanged(path, pin)
    assert info.value.code == "training_invalid_request"
    assert str(path) in info.value.message
    assert f"changed since the job was admitted (pinned {pin}, now {dataset_sha256(path)})" in info.value.message
    assert "a pinned dataset file must not change during a job" in info.value.message
    with pytest.raises(RequestError) as streamed:
        list(iter_dataset_groups(tokenizer=tokenizer, dataset_path=path, expected_sha256=pin))
    assert streamed.value.message == info.value.message  # the streamed pass refuses it the same way
    path.unlink()
    with pytest.raises(RequestError, match="cannot read dataset_path"):
        check_unchanged(path, pin)


def test_a_bad_jsonl_line_is_refused_naming_its_physical_line_number(tokenizer, tmp_path):
    path = _jsonl(tmp_path, [GROUPS[0], b"\n", b"   \n", b'{"messages": [], "completions": [}\n', GROUPS[1]])
    message = _refusal(tokenizer, dataset_path=path)
    assert message.startswith(f"line 4 (group 2) of {str(path)!r} is invalid: ")
    assert "not valid JSON" in message
    schema_bad = _jsonl(tmp_path, [GROUPS[0], {"messages": [], "completions": [{"text": "a"}]}], name="b.jsonl")
    with pytest.raises(RequestError) as info:
        read_groups(tokenizer=tokenizer, dataset_path=schema_bad)
    assert "line 2 (group 2)" in info.value.message
    assert "missing_field" in info.value.message
    assert info.value.pointer == "/completions/0/reward"


def test_blank_lines_are_not_groups_but_are_consumed_by_the_cursor(tokenizer, tmp_path):
    lines = [b"\n", GROUPS[0], b" \t\r\n", b"\n", GROUPS[1]]
    path = _jsonl(tmp_path, lines)
    ingestion = read_groups(tokenizer=tokenizer, dataset_path=path)
    assert [g.index for g in ingestion.groups] == [0, 1]
    assert ingestion.groups == read_groups(tokenizer=tokenizer, groups=GROUPS).groups
    raw = path.read_bytes().splitlines(keepends=True)
    ends = [sum(len(line) for line in raw[: n + 1]) for n in range(len(raw))]
    assert [(p.line_number, p.source_lines_consumed, p.source_byte_offset) for p in ingestion.positions] == [
        (2, 2, ends[1]),
        (5, 5, ends[4]),
    ]
    digests = ["sha256:" + __import__("hashlib").sha256(line).hexdigest() for line in raw]
    assert ingestion.positions[0].consumed_lines_sha256 == json_sha256(digests[:2])
    assert ingestion.positions[1].consumed_lines_sha256 == json_sha256(digests)
    streamed = list(iter_dataset_groups(tokenizer=tokenizer, dataset_path=path, expected_sha256=dataset_sha256(path)))
    assert [g for g, _ in streamed] == list(ingestion.groups)
    assert "has no groups" in _refusal(tokenizer, dataset_path=_jsonl(tmp_path, [b"\n", b"  \n"], name="e.jsonl"))


def test_row_digests_are_stable_across_key_order_and_whitespace(tokenizer, tmp_path):
    reordered = json.dumps(dict(reversed(list(GROUPS[0].items()))), indent=2).replace("\n", " ") + "\n"
    path = _jsonl(tmp_path, [reordered.encode()])
    streamed = read_groups(tokenizer=tokenizer, dataset_path=path).groups[0]
    inline = read_groups(tokenizer=tokenizer, groups=GROUPS[:1]).groups[0]
    assert streamed.row_sha256 == inline.row_sha256 == json_sha256(GROUPS[0])
    assert read_groups(tokenizer=tokenizer, groups=GROUPS[:1]).groups[0].row_sha256 == inline.row_sha256
    assert read_groups(tokenizer=tokenizer, groups=GROUPS[1:]).groups[0].row_sha256 != inline.row_sha256


def test_recorded_logprobs_come_from_aligned_provenance(tokenizer):
    base = read_groups(tokenizer=tokenizer, groups=[_group(_plain("It is sunny."))]).groups[0].completions[0]
    targets = [i for i, keep in zip(base.input_ids[1:], base.action_mask, strict=True) if keep]
    provenance = {
        "schema": "kiln.rollout-provenance.v1",
        "action_tokens": [
            {"sequence_index": n, "token_id": t, "source": "sampled", "behavior_logprob": -0.5}
            for n, t in enumerate(targets)
        ],
    }
    group = _group(_plain("It is sunny.", provenance=provenance))
    recorded = read_groups(tokenizer=tokenizer, groups=[group], behavior_policy="recorded").groups[0].completions[0]
    assert recorded.recorded_logprobs == (-0.5,) * base.action_tokens
    assert recorded.provenance == provenance
    assert base.recorded_logprobs is None
    message = _refusal(tokenizer, groups=[_group(_plain("It is sunny."))], behavior_policy="recorded")
    assert "group 1 is invalid: completion 1: behavior_policy recorded" in message
    short = {**provenance, "action_tokens": provenance["action_tokens"][:-1]}
    assert "records" in _refusal(
        tokenizer, groups=[_group(_plain("It is sunny.", provenance=short))], behavior_policy="recorded"
    )
    lenient = read_groups(tokenizer=tokenizer, groups=[_group(_plain("It is sunny.", provenance=short))])
    assert lenient.groups[0].completions[0].recorded_logprobs is None


def test_counts_add_up_to_the_receipt_token_layout(tokenizer):
    ingestion = read_groups(tokenizer=tokenizer, groups=GROUPS)
    completions = [c for g in ingestion.groups for c in g.completions]
    counts = ingestion.counts
    assert (counts.groups, counts.completions) == (2, 4)
    assert counts.action_tokens == sum(c.action_tokens for c in completions)
    assert counts.prompt_tokens == sum(g.prompt_tokens for g in ingestion.groups)
    total = sum(len(c.input_ids) for c in completions)
    assert (
        counts.context_tokens + counts.action_tokens + counts.observation_tokens + counts.warning_tokens_filtered
        == total
    )
    assert set(counts.token_counts()) == {
        "action_tokens", "env_tokens", "env_tokens_before_warning_filter", "env_tokens_after_warning_filter",
        "warning_tokens_filtered", "context_tokens",
    }  # fmt: skip
    with pytest.raises(RequestError, match="dry run needs dataset_path"):
        ingestion.training_data(dry_run=True)
