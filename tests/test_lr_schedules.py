"""Learning-rate schedules: the Hugging Face factors step by step, the rates a run really uses, the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.errors import RequestError
from kiln.trainers.sft import admit_sft, run_sft
from kiln.training import Schedule

ROWS = [
    {"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}
    for i in range(4)
]


def effective_schedule(spec):
    """The schedule of an ``lr_scheduler`` object (None: omitted, the schema's default)."""
    from kiln_contracts.models.kiln_control_plane_v1_schema import LrScheduler, SftConfig

    return Schedule.resolve(SftConfig().lr_scheduler if spec is None else LrScheduler.model_validate(spec))


def scheduled_rate(schedule, base, step, total):
    return schedule.rate(base, step, total)


def _hf_rates(kind, base, warmup, total, min_ratio):
    from transformers.optimization import (
        get_constant_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    if kind == "constant":
        scheduler = get_constant_schedule_with_warmup(optimizer, warmup)
    elif kind == "linear":
        scheduler = get_linear_schedule_with_warmup(optimizer, warmup, total)
    else:
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total, min_lr_rate=min_ratio)
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize(
    ("kind", "warmup", "min_ratio"),
    [("constant", 0, 0.0), ("constant", 4, 0.0), ("linear", 0, 0.0), ("linear", 5, 0.0), ("cosine", 0, 0.0),
     ("cosine", 3, 0.0), ("cosine", 3, 0.2)],
)  # fmt: skip
def test_every_step_gets_the_rate_the_hugging_face_schedule_gives(kind, warmup, min_ratio):
    total, base = 17, 3e-4
    schedule = effective_schedule({"kind": kind, "warmup_steps": warmup, "min_lr_ratio": min_ratio})
    ours = [scheduled_rate(schedule, base, k, total) for k in range(total)]
    if kind != "linear" or min_ratio == 0:
        assert ours == pytest.approx(_hf_rates(kind, base, warmup, total, min_ratio), rel=1e-12, abs=1e-18)
    if kind != "constant":
        assert ours[-1] < base  # it decays: the check can fail


def test_warmup_ratio_rounds_up_like_the_hugging_face_trainer():
    schedule = effective_schedule({"kind": "linear", "warmup_ratio": 0.1})
    rates = [scheduled_rate(schedule, 1.0, k, 25) for k in range(4)]
    assert rates == [0.0, 1 / 3, 2 / 3, 1.0]  # ceil(0.1 x 25) = 3 warmup steps


def test_a_constant_schedule_without_warmup_is_the_base_rate_itself():
    schedule = effective_schedule(None)
    assert schedule.to_json() == {"kind": "constant", "warmup_steps": None, "warmup_ratio": None, "min_lr_ratio": 0.0}
    assert all(scheduled_rate(schedule, 1e-3, k, 10) == 1e-3 for k in range(10))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"kind": "linear", "warmup_steps": 2, "warmup_ratio": 0.1}, "warmup_steps or warmup_ratio, not both"),
        ({"kind": "constant", "min_lr_ratio": 0.5}, "min_lr_ratio 0.5 applies to the linear and cosine"),
    ],
)
def test_contradictory_schedules_are_refused(spec, match):
    with pytest.raises(RequestError, match=match):
        effective_schedule(spec)


def test_an_sft_run_steps_at_the_scheduled_rates_and_records_the_schedule(tmp_path, tiny_model_dir, monkeypatch):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    seen = []
    real = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    schedule = {"kind": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}
    job = admit_sft(
        adapter_name="scheduled",
        registry=tmp_path / "adapters",
        config={
            "epochs": 2,
            "seed": 1,
            "learning_rate": 1e-3,
            "optimizer": {"kind": "adam_w"},
            "lr_scheduler": schedule,
        },
        dataset_path=data,
        model_path=str(tiny_model_dir),
    )
    result = run_sft(job)
    assert result.status == "success"
    effective = effective_schedule(schedule)
    assert seen == [scheduled_rate(effective, 1e-3, k, 8) for k in range(8)]
    assert seen[0] == 0.0
    assert seen[-1] < seen[2]
    receipt = json.loads(result.receipt_path.read_text())
    assert receipt["config"]["lr_scheduler"] == effective.to_json()
