"""GRPO math on hand-computed inputs."""

from __future__ import annotations

import math

import pytest
import torch

from dynamicrubric.grpo import (
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    kl_k3,
    masked_average,
    token_logprobs,
)


def t(values, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def test_group_advantages_hand_computed():
    # Group 7: rewards 0, 1, 2 -> mean 1, population std sqrt(2/3). Group 3: 1, 0, 0, 1 -> mean .5, std .5.
    # Members are interleaved and ids arbitrary: grouping must follow the ids, not the order.
    rewards = t([0.0, 1.0, 1.0, 0.0, 2.0, 0.0, 1.0])
    groups = torch.tensor([7, 3, 7, 3, 7, 3, 3])
    adv = group_advantages(rewards, groups, eps=0.0)
    s = math.sqrt(2 / 3)
    expected = [-1 / s, 1.0, 0.0, -1.0, 1 / s, -1.0, 1.0]
    assert torch.allclose(adv, t(expected), atol=1e-12)
    # eps keeps the division finite; with the default it changes values only slightly
    assert torch.allclose(group_advantages(rewards, groups), t(expected), atol=1e-5)


def test_group_advantages_zero_variance_groups_are_exactly_zero():
    rewards = t([0.1, 0.1, 0.1, 0.3, 0.7, 0.5])  # 0.1 * 3 / 3 is not exactly 0.1 in floating point
    groups = torch.tensor([0, 0, 0, 1, 1, 2])  # group 2 has one member
    adv = group_advantages(rewards, groups)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[5].item() == 0.0
    assert adv[3].item() < 0 < adv[4].item()


def test_dr_grpo_only_centres():
    rewards = t([0.0, 0.2, 0.4, 5.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, scale=False)
    assert torch.allclose(adv, t([-0.2, 0.0, 0.2, 2.0, -2.0]), atol=1e-12)
    # with scaling both groups end at unit scale although their spreads differ 10x
    scaled = group_advantages(rewards, groups)
    assert torch.allclose(scaled[3:], t([1.0, -1.0]), atol=1e-5)


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="equal length"):
        group_advantages(t([1.0, 2.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(t([1.0, float("nan")]), torch.tensor([0, 0]))


@pytest.mark.parametrize(
    ("ratio", "adv", "surrogate", "clipped"),
    [
        (1.5, 1.0, 1.2, True),  # positive advantage, ratio above 1+eps: capped at 1.2
        (1.5, -1.0, -1.5, False),  # negative advantage, ratio above: the unclipped term is smaller
        (0.5, 1.0, 0.5, False),  # positive advantage, ratio below: unclipped is smaller
        (0.5, -1.0, -0.8, True),  # negative advantage, ratio below 1-eps: capped at -0.8
        (1.1, 2.0, 2.2, False),  # inside the trust region
    ],
)
def test_clipped_surrogate(ratio, adv, surrogate, clipped):
    old = t([[0.0]])
    logp = torch.log(t([[ratio]])).requires_grad_(True)
    value, was_clipped = clipped_surrogate(logp, old, t([adv]), clip_eps=0.2)
    assert value.item() == pytest.approx(surrogate)
    assert bool(was_clipped.item()) is clipped
    value.sum().backward()
    # a clipped token gives no gradient; an unclipped one gives d(ratio*A)/dlogp = ratio*A
    assert logp.grad.item() == pytest.approx(0.0 if clipped else ratio * adv)


def test_kl_k3_values():
    logp = torch.log(t([0.5, 0.25, 0.9]))
    ref = torch.log(t([0.25, 0.5, 0.9]))
    kl = kl_k3(logp, ref)
    # d = ref - logp: log(1/2) -> 0.5 + ln 2 - 1; log(2) -> 2 - ln 2 - 1; 0 -> 0
    assert kl.tolist() == pytest.approx([0.5 + math.log(2) - 1, 1 - math.log(2), 0.0])
    assert (kl_k3(torch.randn(100, dtype=torch.float64), torch.randn(100, dtype=torch.float64)) >= 0).all()


def test_token_vs_sequence_averaging_and_split_denominators():
    values = t([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    assert masked_average(values, mask, "token").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert masked_average(values, mask, "sequence").item() == pytest.approx((2 + 4) / 2)
    # micro-batches with the whole batch's denominator sum to the whole batch's average
    for averaging, denom in (("token", 4), ("sequence", 2)):
        parts = sum(masked_average(values[i : i + 1], mask[i : i + 1], averaging, denom) for i in range(2))
        assert parts.item() == pytest.approx(masked_average(values, mask, averaging).item())
    with pytest.raises(ValueError, match="averaging"):
        masked_average(values, mask, "batch")


def test_grpo_loss_first_epoch_and_kl_term():
    # ratio 1 and policy == reference: loss is minus the mean advantage per token, KL is zero
    logp = torch.log(t([[0.5, 0.5, 0.5], [0.2, 0.2, 0.2]]))
    mask = t([[1, 1, 0], [1, 1, 1]])
    adv = t([1.0, -0.5])
    loss, stats = grpo_loss(logp, logp, logp, adv, mask, beta=0.5, averaging="token")
    assert loss.item() == pytest.approx(-(2 * 1.0 + 3 * -0.5) / 5)
    assert stats["kl"].item() == 0.0 and stats["clip_frac"].item() == 0.0
    loss_seq, _ = grpo_loss(logp, logp, logp, adv, mask, beta=0.5, averaging="sequence")
    assert loss_seq.item() == pytest.approx(-(1.0 - 0.5) / 2)
    # moving away from the reference adds beta * k3
    ref = logp + math.log(2)  # d = ln 2 everywhere: k3 = 2 - ln 2 - 1
    loss_kl, stats = grpo_loss(logp, logp, ref, adv, mask, beta=0.5, averaging="token")
    k3 = 1 - math.log(2)
    assert stats["kl"].item() == pytest.approx(k3)
    assert loss_kl.item() == pytest.approx(loss.item() + 0.5 * k3)


def test_token_logprobs_matches_log_softmax():
    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 2.0]]])
    targets = torch.tensor([[1, 0]])
    assert token_logprobs(logits, targets).tolist()[0] == pytest.approx([math.log(0.75), math.log(0.5)])
