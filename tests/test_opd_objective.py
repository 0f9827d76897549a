"""The OPD loss against hand-computed values, and the collapse diagnostics."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from kiln.training.opd_objective import CollapseAccumulator, compression_ratio, receipt_snapshot, top_k_reverse_kl


def _softmax(values):
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def test_top_k_reverse_kl_matches_the_hand_computed_value():
    # student logits over a 5-id vocabulary; the teacher's top-2 are ids 1 and 0
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0, 0.0]], requires_grad=True)
    ids = torch.tensor([[1, 0]])
    teacher = torch.tensor([[-0.2, -1.8]])
    loss, per_position = top_k_reverse_kl(logits, ids, teacher)
    p = _softmax([2.0, 1.0])  # the student restricted to ids 1, 0 and renormalised
    q = _softmax([-0.2, -1.8])  # the teacher renormalised over its top-K
    expected = sum(pk * (math.log(pk) - math.log(qk)) for pk, qk in zip(p, q, strict=True))
    # by hand: p = (0.7310586, 0.2689414), q = (0.8320184, 0.1679816);
    # 0.7310586 * ln(0.7310586 / 0.8320184) + 0.2689414 * ln(0.2689414 / 0.1679816) = 0.0320039
    assert expected == pytest.approx(0.0320039, abs=1e-6)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)  # float32
    assert per_position.shape == (1,)
    loss.backward()
    # only the teacher's K ids receive gradient; the rest of the vocabulary is outside the loss
    assert logits.grad[0, 2:].abs().sum() == 0
    assert logits.grad[0, :2].abs().sum() > 0


def test_the_loss_is_the_mean_over_positions_and_zero_when_the_student_matches():
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 0.5, 2.0]])
    ids = torch.tensor([[0, 1], [2, 1]])
    matched = torch.log_softmax(torch.tensor([[3.0, 1.0], [2.0, 0.5]]), -1) - 0.7  # shifts vanish in renormalisation
    loss, per_position = top_k_reverse_kl(logits, ids, matched)
    assert float(loss) == pytest.approx(0.0, abs=1e-6)
    other = torch.tensor([[-0.1, -2.5], [-1.0, -0.5]])
    loss, per_position = top_k_reverse_kl(logits, ids, other)
    assert float(loss) == pytest.approx(float(per_position.mean()))
    assert bool((per_position > 0).all())
    # logits outside the top-K ids do not change the loss
    moved = logits.clone()
    moved[0, 2] += 5.0
    assert float(top_k_reverse_kl(moved, ids, other)[0]) == pytest.approx(float(loss), rel=1e-7)


def test_collapse_accumulators_snapshot_and_round_trip():
    acc = CollapseAccumulator()
    acc.add(tokens=4, truncated=True, mean_kl=0.5, text="abababab")
    acc.add(tokens=0, truncated=False, mean_kl=None, text="")
    acc.add(tokens=2, truncated=False, mean_kl=0.25, text="hello there")
    snap = acc.snapshot(global_step=2)
    ratio = (8 / len(zlib.compress(b"abababab", 9)) + 11 / len(zlib.compress(b"hello there", 9))) / 2
    assert snap == {
        "global_step": 2,
        "candidates_consumed": 3,
        "mean_kl": pytest.approx(0.375),
        "truncation_rate": pytest.approx(1 / 3),
        "mean_compression_ratio": pytest.approx(ratio),
        "mean_response_tokens": pytest.approx(2.0),
    }
    again = CollapseAccumulator.from_state(acc.state(), nonempty_rollouts=2)
    assert again.snapshot(2) == acc.snapshot(2)
    assert receipt_snapshot(snap)["repetition_rate"] == snap["mean_compression_ratio"]
    assert compression_ratio("") is None
    assert CollapseAccumulator().snapshot(0)["mean_kl"] is None
