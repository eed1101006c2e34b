"""Independent NumPy (float64) references for the loss and advantage formulas.

Each function is transcribed from the reference library source (not from rljax), with the source
cited. "TRL" is Hugging Face TRL 1.16.0 as installed in this venv (``trl/trainer/*.py``, line
numbers of that release); "verl" is ``verl/trainer/ppo/core_algos.py`` and
``verl/utils/torch_functional.py`` of volcengine/verl (commit 012be9d); the rest cite the paper.
Torch operations are rewritten with their NumPy equivalents; nothing here imports rljax.
"""

from __future__ import annotations

import itertools

import numpy as np


def f64(*xs):
    out = tuple(np.asarray(x, dtype=np.float64) for x in xs)
    return out if len(out) > 1 else out[0]


def log_sigmoid(z):
    # F.logsigmoid, computed stably in float64.
    z = np.asarray(z, np.float64)
    return -np.logaddexp(0.0, -z)


# --------------------------------------------------------------------------------------------
# Reductions — TRL grpo_trainer.py `_compute_loss`, lines 3154 (grpo), 3159 (bnpo), 3164 (dr_grpo),
# 3173 (dapo: Σ / num_items_in_batch); verl core_algos.py `agg_loss` ("seq-mean-token-sum").
# --------------------------------------------------------------------------------------------
def reduce_ref(loss, mask, mode, *, num_sequences=None, num_tokens=None, max_length=None):
    loss, mask = f64(loss, mask)
    if mode == "seq_mean_token_mean":  # TRL L3154
        per_seq = (loss * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)
        return per_seq.sum() / (num_sequences if num_sequences is not None else per_seq.shape[0])
    if mode == "token_mean":  # TRL L3159 / L3173
        n = num_tokens if num_tokens is not None else max(mask.sum(), 1.0)
        return (loss * mask).sum() / n
    if mode == "seq_mean_token_sum":  # verl agg_loss: torch.mean(torch.sum(loss_mat * mask, -1))
        s = num_sequences if num_sequences is not None else loss.shape[0]
        return (loss * mask).sum(-1).sum() / s
    if mode == "seq_mean_token_sum_norm":  # TRL L3164: Σ / (B · max_completion_length)
        s = num_sequences if num_sequences is not None else loss.shape[0]
        length = max_length if max_length is not None else loss.shape[1]
        return (loss * mask).sum() / (s * length)
    raise ValueError(mode)


# --------------------------------------------------------------------------------------------
# KL estimators — verl core_algos.py `kl_penalty` ("k1", "k2"/"mse", "k3"/"low_var_kl", without
# its ±20/±10 clamps); TRL grpo_trainer.py L3100-3105 (k3 and `use_bias_correction_kl`).
# --------------------------------------------------------------------------------------------
def kl_ref(logprob, ref_logprob, estimator, old_logprob=None):
    logprob, ref_logprob = f64(logprob, ref_logprob)
    if estimator == "k1":
        return logprob - ref_logprob
    if estimator == "k2":
        return 0.5 * np.square(logprob - ref_logprob)
    kl = ref_logprob - logprob
    k3 = np.exp(kl) - kl - 1
    if estimator == "k3":
        return k3
    if estimator == "k3_unbiased":  # TRL L3104-3105: per_token_kl * coef_1, coef_1 = exp(logp - old)
        return k3 * np.exp(logprob - f64(old_logprob))
    raise ValueError(estimator)


# --------------------------------------------------------------------------------------------
# Clipped surrogate — TRL grpo_trainer.py `_compute_loss`: log-ratio L3083-3095 (token /
# sequence importance_sampling_level), clipping L3113-3120, vLLM IS correction L3147, KL L3150,
# clip metrics L3274-3275. Dual clip: verl core_algos.py `compute_policy_loss_vanilla`
# (pg_losses3 = -advantages * clip_ratio_c; torch.min; torch.where(advantages < 0, ...)).
# Entropy bonus per token as TRL and verl add it ("ℓ −= c_H · H_t").
# --------------------------------------------------------------------------------------------
def policy_loss_ref(logp, old, adv, mask, *, level="token", eps_low=0.2, eps_high=0.2,
                    dual_clip=None, is_ratio=None, ref=None, beta=0.0, kl_estimator="k3",
                    entropy=None, entropy_coef=0.0, mode="seq_mean_token_mean",
                    num_sequences=None, num_tokens=None, max_length=None):
    logp, old, adv, mask = f64(logp, old, adv, mask)
    log_ratio = logp - old
    if level == "token":
        log_w = log_ratio
    else:  # TRL L3087
        log_w = ((log_ratio * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0))[:, None]
    coef_1 = np.exp(log_w)
    coef_1 = np.broadcast_to(coef_1, logp.shape)
    coef_2 = np.clip(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -np.minimum(coef_1 * adv, coef_2 * adv)
    if dual_clip is not None:
        pg_losses3 = -adv * dual_clip
        per_token_loss = np.where(adv < 0, np.minimum(pg_losses3, per_token_loss), per_token_loss)
    if is_ratio is not None:
        per_token_loss = per_token_loss * f64(is_ratio)
    if entropy is not None:
        per_token_loss = per_token_loss - entropy_coef * f64(entropy)
    if ref is not None:
        per_token_loss = per_token_loss + beta * kl_ref(logp, ref, kl_estimator, old)
    loss = reduce_ref(per_token_loss, mask, mode, num_sequences=num_sequences,
                      num_tokens=num_tokens, max_length=max_length)
    valid = mask > 0
    low = ((coef_1 < 1 - eps_low) & (adv < 0))[valid].mean()
    high = ((coef_1 > 1 + eps_high) & (adv > 0))[valid].mean()
    return loss, {"clip_frac_low": low, "clip_frac_high": high,
                  "ratio_mean": coef_1[valid].mean(), "ratio_min": coef_1[valid].min(),
                  "ratio_max": coef_1[valid].max()}


def vllm_is_ratio_ref(old, sampling, cap):
    """TRL grpo_trainer.py L2674-2685 ("token_truncate"): clamp(exp(old - sampling), max=cap)."""
    old, sampling = f64(old, sampling)
    return np.minimum(np.exp(old - sampling), cap)


def reinforce_ref(logp, adv, mask, mode="seq_mean_token_sum"):
    """verl core_algos.py `compute_policy_loss_gpg`: pg_losses = -log_prob * advantages; agg_loss."""
    logp, adv = f64(logp, adv)
    return reduce_ref(-logp * adv, mask, mode)


# --------------------------------------------------------------------------------------------
# Value loss — verl core_algos.py `compute_value_loss` (copied there from TRL ppo_trainer):
# vpredclipped = clip(vpreds, values - c, values + c); 0.5 * agg_loss(max(l1, l2)); clipfrac gt.
# Explained variance — cleanrl ppo.py: 1 - np.var(y_true - y_pred) / var_y.
# --------------------------------------------------------------------------------------------
def value_loss_ref(vpreds, returns, values, mask, cliprange_value):
    vpreds, returns, values, mask = f64(vpreds, returns, values, mask)
    vpredclipped = np.clip(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped = np.maximum(vf_losses1, vf_losses2)
    vf_loss = 0.5 * (clipped * mask).sum() / mask.sum()
    clipfrac = ((vf_losses2 > vf_losses1) * mask).sum() / mask.sum()
    return vf_loss, clipfrac


def explained_variance_ref(y_pred, y_true):
    y_pred, y_true = f64(y_pred, y_true)
    var_y = np.var(y_true)
    return np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y


# --------------------------------------------------------------------------------------------
# Advantages.
# --------------------------------------------------------------------------------------------
def nanstd_ref(x, axis=None):
    """TRL utils.py `nanstd` L1037-1046: Bessel-corrected, NaN-ignoring, NaN for count <= 1."""
    mean = np.nanmean(x, axis=axis, keepdims=True)
    variance = np.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
    count = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        correction = np.where(count > 1, count / (count - 1), np.nan)
    std = np.sqrt(variance * correction)
    return std if axis is None else np.squeeze(std, axis=axis)


def grpo_advantages_ref(rewards, group_size, scale="group", eps=1e-4):
    """TRL grpo_trainer.py L2763-2799 ("sum_then_normalize"); missing rewards are NaN."""
    rewards = f64(rewards)
    grouped = rewards.reshape(-1, group_size)
    with np.errstate(invalid="ignore"):
        mean_grouped = np.repeat(np.nanmean(grouped, axis=1), group_size)
        if scale in ("group", "none"):
            std = np.repeat(nanstd_ref(grouped, axis=1), group_size)
        else:  # "batch", L2777
            std = np.broadcast_to(nanstd_ref(rewards), rewards.shape)
        advantages = rewards - mean_grouped  # L2785
        if scale != "none":
            advantages = advantages / (std + eps)  # L2787
    return np.nan_to_num(advantages, nan=0.0)  # unscorable -> 0


def grpo_advantages_verl_ref(rewards, group_size, eps=1e-6):
    """verl core_algos.py `compute_grpo_outcome_advantage` (torch.std is Bessel-corrected)."""
    grouped = f64(rewards).reshape(-1, group_size)
    mean = grouped.mean(1, keepdims=True)
    std = grouped.std(1, ddof=1, keepdims=True)
    return ((grouped - mean) / (std + eps)).reshape(-1)


def rloo_advantages_ref(rewards, group_size):
    """TRL rloo_trainer.py L1674-1699: nan-aware leave-one-out baseline; NaN -> 0."""
    rewards = f64(rewards)
    grouped = rewards.reshape(-1, group_size)
    scorable_counts = (~np.isnan(grouped)).sum(1, keepdims=True)  # L1685
    grouped_sum = np.nansum(grouped, axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        baselines = (grouped_sum - grouped) / (scorable_counts - 1)  # L1688
        advantages = rewards - baselines.reshape(-1)
    return np.nan_to_num(advantages, nan=0.0, posinf=0.0, neginf=0.0)


def masked_whiten_ref(values, mask, shift_mean=True):
    """verl torch_functional.py `masked_whiten` / `masked_var(unbiased=True)`."""
    values, mask = f64(values, mask)
    mean = (values * mask).sum() / mask.sum()
    variance = (((values - mean) ** 2) * mask).sum() / mask.sum()
    variance = variance * mask.sum() / (mask.sum() - 1)
    whitened = (values - mean) / np.sqrt(variance + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def gae_verl_ref(token_level_rewards, values, response_mask, gamma, lam):
    """verl core_algos.py `compute_gae_advantage_return`, before its masked_whiten: a plain
    Python loop; masked positions hold the carried value (callers compare on valid tokens)."""
    token_level_rewards, values, response_mask = f64(token_level_rewards, values, response_mask)
    nextvalues = 0.0
    lastgaelam = 0.0
    advantages_reversed = []
    gen_len = token_level_rewards.shape[-1]
    for t in reversed(range(gen_len)):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = np.stack(advantages_reversed[::-1], axis=1)
    return advantages, advantages + values


def gae_scalar_loop_ref(rewards, values, mask, gamma, lam):
    """GAE (arXiv:1506.02438) one row and one token at a time, over the valid tokens only."""
    rewards, values, mask = f64(rewards, values, mask)
    adv = np.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[i, t] > 0]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[i, t] + gamma * next_value - values[i, t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[i, t]
            adv[i, t] = next_adv
    return adv, np.where(mask > 0, adv + values, 0.0)


def reinforce_pp_ref(token_level_rewards, response_mask, gamma):
    """verl core_algos.py `compute_reinforce_plus_plus_outcome_advantage`."""
    token_level_rewards, response_mask = f64(token_level_rewards, response_mask)
    returns = np.zeros_like(token_level_rewards)
    running_return = 0.0
    for t in reversed(range(token_level_rewards.shape[1])):
        running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = running_return
        running_return = running_return * response_mask[:, t]
    advantages = masked_whiten_ref(returns, response_mask) * response_mask
    return advantages, returns


def kl_shaped_rewards_ref(scores, logprobs, ref_logprobs, mask, kl_coef, estimator="k1",
                          eos_found=None, missing_eos_penalty=None):
    """Ziegler et al. 2019 / InstructGPT as in verl `compute_rewards` (token_level_scores -
    kl * kl_ratio) with the score on the last real token (index loop) and TRL PPOTrainer's
    `scores[~contain_eos_token] -= missing_eos_penalty`."""
    scores, logprobs, ref_logprobs, mask = f64(scores, logprobs, ref_logprobs, mask)
    scores = scores.copy()
    if missing_eos_penalty is not None:
        scores[~np.asarray(eos_found, bool)] -= missing_eos_penalty
    token_level_scores = np.zeros_like(logprobs)
    for i in range(logprobs.shape[0]):
        valid = np.nonzero(mask[i] > 0)[0]
        if len(valid):
            token_level_scores[i, valid[-1]] = scores[i]
    kl = kl_ref(logprobs, ref_logprobs, estimator)
    return (token_level_scores - kl * kl_coef) * mask


def soft_overlong_ref(length, max_length, cache_length):
    """DAPO (arXiv:2503.14476) eq. 13, one length at a time."""
    if length <= max_length - cache_length:
        return 0.0
    if length <= max_length:
        return ((max_length - cache_length) - length) / cache_length
    return -1.0


# --------------------------------------------------------------------------------------------
# Preference losses — TRL dpo_trainer.py L1386-1431 (sigmoid L1388, hinge L1391, ipo L1393-1404,
# robust L1428-1431), metrics L1582-1597; TRL < 0.20 "sigmoid" with label smoothing = cDPO;
# SimPO: TRL experimental/cpo/cpo_trainer.py L715-721 (logits = Δavg − γ/β; smoothed logistic).
# --------------------------------------------------------------------------------------------
def preference_ref(pc, pr, rc, rr, loss_type, beta, label_smoothing=0.0, gamma=0.5,
                   len_c=None, len_r=None):
    pc, pr, rc, rr = f64(pc, pr, rc, rr)
    chosen_logratios, rejected_logratios = pc - rc, pr - rr
    delta_score = chosen_logratios - rejected_logratios
    eps = label_smoothing
    if loss_type in ("sigmoid", "cdpo"):
        losses = (-log_sigmoid(beta * delta_score) * (1 - eps)
                  - log_sigmoid(-beta * delta_score) * eps)
    elif loss_type == "hinge":
        losses = np.maximum(1 - beta * delta_score, 0.0)
    elif loss_type == "ipo":
        ipo_delta = chosen_logratios / np.maximum(len_c, 1.0) - rejected_logratios / np.maximum(len_r, 1.0)
        losses = (ipo_delta - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        clean_loss_term = -(1 - eps) * log_sigmoid(beta * delta_score)
        flipped_loss_term = -eps * log_sigmoid(-beta * delta_score)
        losses = (clean_loss_term - flipped_loss_term) / (1 - 2 * eps)
    elif loss_type == "simpo":
        logits = pc / len_c - pr / len_r - gamma / beta
        losses = -log_sigmoid(beta * logits) * (1 - eps) - log_sigmoid(-beta * logits) * eps
    else:
        raise ValueError(loss_type)
    if loss_type == "simpo":  # cpo_trainer.py L746-747 (on the averaged log-probs)
        chosen_rewards, rejected_rewards = beta * pc / len_c, beta * pr / len_r
    else:  # dpo_trainer.py L1582-1583
        chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).mean(),
    }
    return losses.mean(), metrics


# --------------------------------------------------------------------------------------------
# Reward model — TRL reward_trainer.py L788-795; InstructGPT (arXiv:2203.02155) eq. 1 for K-wise.
# --------------------------------------------------------------------------------------------
def bradley_terry_ref(rewards_chosen, rewards_rejected, margin=None, center_coef=None):
    rewards_chosen, rewards_rejected = f64(rewards_chosen, rewards_rejected)
    if margin is not None:
        loss = -log_sigmoid(rewards_chosen - rewards_rejected - f64(margin)).mean()
    else:
        loss = -log_sigmoid(rewards_chosen - rewards_rejected).mean()
    if center_coef is not None:
        loss += center_coef * np.mean((rewards_chosen + rewards_rejected) ** 2)
    return loss


def kwise_ref(rewards, mask=None):
    """-1/C(K,2) Σ_{(w,l)} log σ(r_w − r_l) per prompt, averaged over prompts with a pair."""
    rewards = f64(rewards)
    if mask is None:
        mask = np.ones_like(rewards)
    per_prompt = []
    for r, m in zip(rewards, mask):
        answers = [a for a in range(len(r)) if m[a] > 0]  # still ranked best-first
        pairs = list(itertools.combinations(answers, 2))
        if pairs:
            per_prompt.append(np.mean([-log_sigmoid(r[w] - r[l]) for w, l in pairs]))
    return float(np.mean(per_prompt))
