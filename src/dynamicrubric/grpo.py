"""GRPO math shared by both trainers (policy and rubric generator), as small pure torch functions.

GRPO (Shao et al., 2024) replaces a learned value baseline with the statistics of a *group* of
samples drawn for the same input: a prompt's K responses when training the policy, a candidate set's
G rubric samples when training the generator. Each sample's advantage is its reward relative to its
group, and the update is PPO's clipped surrogate plus a KL penalty to a frozen reference policy:

    A_i        = (r_i - mean(r_group)) / (std(r_group) + eps)        (Dr. GRPO: no std division)
    ratio_t    = exp(logp_t - old_logp_t)                            old = the sampling policy
    surrogate  = min(ratio_t * A, clip(ratio_t, 1 - clip_eps, 1 + clip_eps) * A)
    kl_t       = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          k3 estimator, always >= 0
    loss_t     = -(surrogate - beta * kl_t)

Per-token losses are averaged either over all completion tokens of the batch ("token", as in DAPO /
Dr. GRPO: long sequences weigh more) or first within each sequence and then over sequences
("sequence", the original GRPO). Both accept an explicit denominator so that a batch split into
micro-batches (gradient accumulation, several ranks) gives exactly the full batch's loss.

Tensors follow one layout: per-token values are [batch, tokens] with a 0/1 `mask` of the same shape
marking real completion tokens; per-sequence values are [batch].
"""

from __future__ import annotations

from typing import Literal

import torch

Averaging = Literal["token", "sequence"]


def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, *, scale: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Advantage of each sample relative to the samples sharing its group id.

    `rewards` [n] float, `groups` [n] integer group ids (any values, any order). With `scale` the
    centred reward is divided by the group's population standard deviation (+ `eps`); without it
    (Dr. GRPO) it is only centred, which keeps low-variance groups from being blown up. A group whose
    rewards are all equal (including a group of one) carries no preference and gets exactly zero.
    """
    if rewards.ndim != 1 or groups.shape != rewards.shape:
        raise ValueError(
            f"rewards and groups must be 1-D of equal length, got {tuple(rewards.shape)} and {tuple(groups.shape)}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or infinity")
    rewards = rewards.to(torch.float64)  # exact enough that hand-computed values compare tightly
    _, inverse = torch.unique(groups, return_inverse=True)
    out = torch.zeros_like(rewards)
    for g in range(int(inverse.max()) + 1 if len(inverse) else 0):
        idx = (inverse == g).nonzero(as_tuple=True)[0]
        r = rewards[idx]
        if bool((r == r[0]).all()):
            continue  # all-equal group: zero, not 0/eps noise
        centred = r - r.mean()
        out[idx] = centred / (r.std(unbiased=False) + eps) if scale else centred
    return out


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target_t) from next-token `logits` [b, t, vocab] and `targets` [b, t], in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(d) - d - 1 with d = ref - logp.

    Unbiased for the KL under samples from the policy, never negative, and zero (with zero gradient)
    where the policy equals the reference (Schulman, "Approximating KL divergence", 2020).
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def masked_average(
    values: torch.Tensor, mask: torch.Tensor, averaging: Averaging, denominator: float | None = None
) -> torch.Tensor:
    """Average per-token `values` over real tokens.

    token:    sum(values * mask) / denominator, denominator defaulting to the number of real tokens;
    sequence: sum over sequences of (per-sequence token mean) / denominator, defaulting to the number
              of sequences. Sequences with no tokens contribute zero.
    """
    mask = mask.to(values.dtype)
    if averaging == "token":
        total = (values * mask).sum()
        denom = mask.sum() if denominator is None else denominator
    elif averaging == "sequence":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        total = per_seq.sum()
        denom = values.shape[0] if denominator is None else denominator
    else:
        raise ValueError(f"averaging must be 'token' or 'sequence', got {averaging!r}")
    return total / max(float(denom), 1.0)


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO surrogate min(ratio·A, clip(ratio)·A) and a 0/1 tensor of where clipping bit.

    `advantages` is per sequence [b] (broadcast over tokens) or per token [b, t]. Clipping only ever
    removes incentive: above 1+eps for a positive advantage, below 1-eps for a negative one.
    """
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    return surrogate, (clipped < unclipped).to(logp.dtype)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    beta: float = 0.01,
    averaging: Averaging = "token",
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss to minimise, and detached statistics averaged the same way (kl, clip_frac).

    `denominator` is the number of tokens ("token") or sequences ("sequence") of the whole batch this
    micro-batch belongs to; summing the returned losses over the micro-batches then equals the loss
    of the whole batch computed at once.
    """
    surrogate, clipped = clipped_surrogate(logp, old_logp, advantages, clip_eps)
    kl = kl_k3(logp, ref_logp)
    per_token = -(surrogate - beta * kl) if beta else -surrogate
    loss = masked_average(per_token, mask, averaging, denominator)
    with torch.no_grad():
        stats = {
            "kl": masked_average(kl.detach(), mask, averaging, denominator),
            "clip_frac": masked_average(clipped, mask, averaging, denominator),
        }
    return loss, stats
