"""Configuration of the GRPO algorithm: advantages, filtering, policy loss and its extra terms.

Every choice of the Skywork-OR1 / DAPO recipe is one field here; the defaults are the recipe's
(token-level aggregation, clip-higher 0.2 / 0.28, no truncation mask, no KL, on-policy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from megatron_rl.config.base import ConfigBase, ranged

TruncationMask = Literal["none", "before", "after"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
EntropyMode = Literal["off", "fixed", "adaptive"]
EntropyEstimator = Literal["full", "sampled"]
KLEstimator = Literal["k1", "k2", "k3_unclamped", "low_var_kl"]
MismatchMode = Literal["none", "tis_token", "tis_seq", "icepop"]
RoutingReplayMode = Literal["off", "r2", "r3"]
OverCap = Literal["truncate", "mask"]
DistillMode = Literal["add", "replace"]
# Policy losses whose ratio is one per sequence: a per-token mismatch weight does not apply to them.
SEQUENCE_RATIO_LOSSES = ("gspo",)
# Policy losses that clip the PPO surrogate (the only ones dual clip acts on).
PPO_SURROGATE_LOSSES = ("ppo_clip", "decoupled_ppo")


def check_choice(cfg: ConfigBase, name: str, choices: tuple) -> None:
    """Fail naming ``cfg.<name>`` unless its value is one of ``choices``."""
    value = getattr(cfg, name)
    if value not in choices:
        cfg.fail(name, f"must be one of {list(choices)}, got {value!r}")


@dataclass(kw_only=True)
class ClipConfig(ConfigBase):
    # PPO ratio clip below 1: the ratio of a token with negative advantage is clipped at 1 - eps_low.
    eps_low: float = ranged(0.2, ge=0.0, le=1.0)
    # PPO ratio clip above 1 ("clip-higher", DAPO): positive-advantage tokens clipped at 1 + eps_high.
    # The seed warns 0.28 can be too high (data dependent); must be >= eps_low.
    eps_high: float = ranged(0.28, ge=0.0)
    # Dual clip: for negative advantages the per-token loss is capped at -c * A. None = off; c > 1.
    dual_clip_c: float | None = ranged(None, gt=1.0)

    def validate(self) -> None:
        super().validate()
        if self.eps_high < self.eps_low:
            self.fail("eps_high", f"must be >= eps_low ({self.eps_low}), got {self.eps_high}")


@dataclass(kw_only=True)
class EntropyConfig(ConfigBase):
    # "off": no entropy term; "fixed": loss -= coef * H always; "adaptive": the Skywork-OR1
    # controller (c += delta while H < target, else c -= delta, clamped to [coef_min, coef_max];
    # the term applies only at steps whose entropy is <= target).
    mode: EntropyMode = "off"
    # Fixed mode: the coefficient. Adaptive mode: the controller's starting value c_0 (the report: 0).
    coef: float = ranged(0.0, ge=0.0)
    # Adaptive mode: the entropy the controller holds the policy at (nats per token).
    target: float = ranged(0.2, ge=0.0)
    # Adaptive mode: the step by which the coefficient moves after every training step.
    delta: float = ranged(0.005, ge=0.0)
    # Adaptive mode: the coefficient is clamped to [coef_min, coef_max].
    coef_min: float = ranged(0.0, ge=0.0)
    coef_max: float = ranged(0.05, ge=0.0)
    # "full": entropy of the whole vocabulary distribution (given by the model forward);
    # "sampled": the sampled-token estimate -log pi(a), with an unbiased gradient surrogate.
    estimator: EntropyEstimator = "full"

    def validate(self) -> None:
        super().validate()
        check_choice(self, "mode", get_args(EntropyMode))
        check_choice(self, "estimator", get_args(EntropyEstimator))
        if self.coef_max < self.coef_min:
            self.fail("coef_max", f"must be >= coef_min ({self.coef_min}), got {self.coef_max}")
        if self.mode == "adaptive" and not self.coef_min <= self.coef <= self.coef_max:
            self.fail("coef", f"adaptive start must lie in [coef_min, coef_max] = "
                              f"[{self.coef_min}, {self.coef_max}], got {self.coef}")


@dataclass(kw_only=True)
class KLConfig(ConfigBase):
    # KL to the reference policy; off in the recipe (the report: it pins the policy late in training).
    enabled: bool = False
    # Per-token estimator of KL(pi || ref), log r = log pi - log ref: "k1" = log r; "k2" =
    # (log r)^2 / 2; "k3_unclamped" = 1/r - 1 + log r (Schulman's unbiased low-variance estimator);
    # "low_var_kl" = that, clamped to [-10, 10]. A bare "k3" is refused: verl's k3 IS low_var_kl
    # (clamped), elsewhere k3 is the unclamped one, so the name does not say which is meant.
    estimator: str = "low_var_kl"
    # Weight of the KL term (loss) or of the per-sequence KL penalty subtracted from the reward.
    coef: float = ranged(0.001, ge=0.0)
    # True: KL is a reward penalty (see algo.kl.kl_reward_penalty), not a loss term.
    as_reward: bool = False

    def validate(self) -> None:
        super().validate()
        if self.estimator == "k3":
            self.fail("estimator", "'k3' is ambiguous: verl's k3 is clamped to [-10, 10] (here "
                                   "'low_var_kl'); the plain estimator is 'k3_unclamped'")
        check_choice(self, "estimator", get_args(KLEstimator))


@dataclass(kw_only=True)
class MismatchConfig(ConfigBase):
    # Train-inference mismatch correction with the rollout engine's sampled log-probs:
    # "tis_token": per-token weight min(pi_old / pi_rollout, tis_cap);
    # "tis_seq": one weight per sequence, min(prod_t pi_old / pi_rollout, tis_cap);
    # "icepop": per-token weight pi_old / pi_rollout inside [icepop_low, icepop_high], 0 outside.
    mode: MismatchMode = "none"
    # TIS truncation C.
    tis_cap: float = ranged(2.0, gt=0.0)
    # IcePop band [a, b] of the train/rollout probability ratio; tokens outside are masked.
    icepop_low: float = ranged(0.5, ge=0.0)
    icepop_high: float = ranged(5.0, gt=0.0)

    def validate(self) -> None:
        super().validate()
        check_choice(self, "mode", get_args(MismatchMode))
        if self.icepop_high <= self.icepop_low:
            self.fail("icepop_high", f"must be > icepop_low ({self.icepop_low}), "
                                     f"got {self.icepop_high}")


@dataclass(kw_only=True)
class DecoupledConfig(ConfigBase):
    # policy_loss "decoupled_ppo" (AReaL's decoupled PPO): each token's clipped surrogate against the
    # recomputed old (proximal) policy is weighted by pi_prox / pi_behav, the engine that sampled it.
    # The weight's cap.
    cap: float = ranged(2.0, gt=0.0)
    # Above the cap: "truncate" (weight = cap) or "mask" (weight 0: AReaL's choice, the token is out).
    over_cap: OverCap = "truncate"

    def validate(self) -> None:
        super().validate()
        check_choice(self, "over_cap", get_args(OverCap))


@dataclass(kw_only=True)
class PassKConfig(ConfigBase):
    # k of the pass@k-aware variants: adv_estimator "passk" (the analytic pass@k advantage) and
    # the reward shaper "passk" (each response scored as the best of its subgroup of k).
    # Must be <= rollout.group_size (the shaper: divide it).
    k: int = ranged(4, ge=1)


@dataclass(kw_only=True)
class ShapingConfig(ConfigBase):
    # Reward shapers applied in order to the verifier's rewards before the advantages, by registered
    # name (algo.REWARD_SHAPERS): "overlong" (DAPO's soft overlong punishment), "length_penalty"
    # (Kimi k1.5's group length reward), "passk" (best of a subgroup of algo.passk.k). The test-case
    # pass rate is a reward (reward.code.mode=pass_rate), not a shaper.
    shapers: list[str] = field(default_factory=list)
    # "overlong": the last overlong_buffer tokens before the stage's max_response_len are the soft
    # zone: a response L tokens long gets min(0, (max_len - buffer - L) / buffer) * overlong_penalty
    # added (0 up to max_len - buffer, -overlong_penalty at max_len). Must be < every stage's length.
    overlong_buffer: int = ranged(4, ge=1)
    overlong_penalty: float = ranged(1.0, ge=0.0)
    # "length_penalty": coef * lambda added, lambda = 0.5 - (L - min L) / (max L - min L) over the
    # group (0 when all lengths are equal); a wrong response (reward < correct_reward) gets min(0,
    # lambda): shorter correct answers are preferred, long wrong ones punished.
    length_coef: float = ranged(0.1, ge=0.0)

    def validate(self) -> None:
        super().validate()
        from megatron_rl.algo.registry import REWARD_SHAPERS

        for name in self.shapers:
            if name not in REWARD_SHAPERS:
                self.fail("shapers", REWARD_SHAPERS.unknown_message(name))
        if len(set(self.shapers)) != len(self.shapers):
            self.fail("shapers", f"names a shaper twice: {self.shapers}")


@dataclass(kw_only=True)
class TokenMaskConfig(ConfigBase):
    # Which response tokens the policy loss trains, by registered name (algo.TOKEN_MASKS), chosen
    # from the old policy's token entropy over the whole rollout batch (it forces the old-log-prob
    # pass): "none" every token; "high_entropy" the top `frac` (the high-entropy minority, "Beyond
    # the 80/20 rule": 0.2); "low_entropy" the bottom `frac`. The loss keeps its denominators (all
    # valid tokens), so masked tokens contribute 0; entropy and KL terms see every token.
    mode: str = "none"
    # Fraction of the batch's valid tokens kept (ties at the threshold are kept too).
    frac: float = ranged(0.2, gt=0.0, le=1.0)

    def validate(self) -> None:
        super().validate()
        from megatron_rl.algo.registry import TOKEN_MASKS

        if self.mode != "none" and self.mode not in TOKEN_MASKS:
            self.fail("mode", TOKEN_MASKS.unknown_message(self.mode) + " (or 'none')")


@dataclass(kw_only=True)
class DistillConfig(ConfigBase):
    # On-policy distillation: a teacher scores the policy's own sampled tokens; the per-token
    # reverse-KL estimate k_t = log pi_old(y_t) - log pi_teacher(y_t) enters the advantage as
    # -coef * k_t. 0 = off. Needs `teacher`.
    coef: float = ranged(0.0, ge=0.0)
    # "add": A_t = A_reward + coef * (log pi_teacher - log pi_old); "replace": the reward advantage
    # is dropped, A_t = coef * (log pi_teacher - log pi_old) (pure distillation; rewards are still
    # scored and logged).
    mode: DistillMode = "add"
    # Hugging Face checkpoint of the teacher: any architecture whose tokenizer is the policy's (same
    # vocabulary); built on the policy's layout (forward only, like the reference policy) and
    # scoring at the sampling temperature.
    teacher: str = ""
    # GPUs: keep the teacher's weights in host memory between uses. Refused on CPU-only runs.
    offload: bool = False

    def validate(self) -> None:
        super().validate()
        check_choice(self, "mode", get_args(DistillMode))
        if self.coef > 0 and not self.teacher:
            self.fail("teacher", f"coef is {self.coef}: a teacher checkpoint is needed")
        if self.coef == 0:
            for name, value in (("teacher", self.teacher), ("offload", self.offload),
                                ("mode", self.mode != "add" and self.mode)):
                if value:
                    self.fail(name, f"is set ({getattr(self, name)!r}) but algo.distill.coef is 0: "
                                    f"distillation is off")

    @property
    def enabled(self) -> bool:
        return self.coef > 0


@dataclass(kw_only=True)
class AlgoConfig(ConfigBase):
    # Advantage estimator, by registered name (algo.ADV_ESTIMATORS): "grpo", "dr_grpo" (group mean
    # only), "rloo" (leave-one-out mean), "reinforce_plus_plus" (the reward whitened over the batch's
    # tokens), "reinforce_plus_plus_baseline" (group mean removed, then whitened), "grpo_passk" (only
    # the best of a group gets r_max - r_second, over the group std), "passk" (the analytic pass@k
    # advantage for k = algo.passk.k, binary rewards at correct_reward).
    adv_estimator: str = "grpo"
    # GRPO: divide by the group's unbiased std (+ adv_eps). False is Dr.GRPO's mean-only advantage.
    norm_adv_by_std: bool = True
    # Added to the group std before dividing (verl's epsilon).
    adv_eps: float = ranged(1e-6, ge=0.0)
    # Truncated responses (hit max length): "none" no mask (the report's choice); "before" left out
    # of the group mean/std and given advantage 0; "after" kept in the statistics, advantage then 0.
    truncation_mask: TruncationMask = "none"
    # Drop groups whose rewards all equal each other (all-correct, all-wrong, or equal fractional).
    # With algo.distill no group is dropped: every one carries the teacher's per-token signal.
    filter_zero_variance_groups: bool = True
    # Reward at or above which a response counts as correct (all-correct group counting only).
    correct_reward: float = ranged(1.0)
    # Reward at or below which a response counts as wrong (all-wrong group counting only).
    wrong_reward: float = ranged(0.0)
    # Per-token policy loss, by registered name (algo.POLICY_LOSSES): "ppo_clip", "reinforce",
    # "gspo" (one ratio per sequence, the geometric mean of its tokens', clipped; the paper's clip
    # range is ~3e-4 / 4e-4), "cispo" (the clipped ratio as a weight without gradient: every token
    # keeps its gradient), "decoupled_ppo" (AReaL: PPO against the recomputed proximal policy, each
    # token weighted by pi_prox / pi_behav; see algo.decoupled).
    policy_loss: str = "ppo_clip"
    # The ratio's clip range (ppo_clip, decoupled_ppo, gspo: the surrogate's; cispo: the weight's).
    clip: ClipConfig = field(default_factory=ClipConfig)
    decoupled: DecoupledConfig = field(default_factory=DecoupledConfig)
    passk: PassKConfig = field(default_factory=PassKConfig)
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    token_mask: TokenMaskConfig = field(default_factory=TokenMaskConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    # "token-mean": sum over all tokens of the mini-batch / their count (DAPO, Skywork-OR1);
    # "seq-mean-token-mean": mean over tokens per sequence, then over sequences (original GRPO);
    # "seq-mean-token-sum-norm": per-sequence token sum / max_response_len, mean over sequences
    # (Dr.GRPO).
    loss_agg: LossAgg = "token-mean"
    entropy: EntropyConfig = field(default_factory=EntropyConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    # Passes over each rollout batch (> 1 goes off-policy; the report: entropy then collapses fast).
    n_sgd: int = ranged(1, ge=1)
    # Optimizer steps per pass (mini-batches the rollout batch is split into). 1 = on-policy.
    mini_batches: int = ranged(1, ge=1)
    # MoE routing replay: which experts each token goes through in the trainer's passes. "off": the
    # trainer's routers choose; "r2": the update (every mini-batch and n_sgd pass) replays the routes
    # of the old-policy log-prob pass; "r3": the old-log-prob pass and the update replay the routes
    # the rollout engine chose when it sampled (the engines return them). Refused for dense models.
    routing_replay: RoutingReplayMode = "off"
    # MoE: the engines return their routes and each step logs moe/router_agreement (the share of
    # (token, layer) top-k sets the trainer's own routers choose as the engine did, over the model's
    # response tokens: a multi-turn trajectory's tool observations excepted) and
    # moe/train_infer_logp_gap_free (the log-prob gap without replay); with routing_replay r3 that
    # takes one more forward pass over the batch. Refused for dense models.
    router_agreement: bool = False

    def validate(self) -> None:
        super().validate()
        from megatron_rl.algo.registry import ADV_ESTIMATORS, POLICY_LOSSES

        if self.adv_estimator not in ADV_ESTIMATORS:
            self.fail("adv_estimator", ADV_ESTIMATORS.unknown_message(self.adv_estimator))
        if self.policy_loss not in POLICY_LOSSES:
            self.fail("policy_loss", POLICY_LOSSES.unknown_message(self.policy_loss))
        check_choice(self, "truncation_mask", get_args(TruncationMask))
        check_choice(self, "routing_replay", get_args(RoutingReplayMode))
        check_choice(self, "loss_agg", get_args(LossAgg))
        if self.wrong_reward >= self.correct_reward:
            self.fail("wrong_reward", f"must be < correct_reward ({self.correct_reward}), "
                                      f"got {self.wrong_reward}")
        self._refuse_combinations()

    def _refuse_combinations(self) -> None:
        """Choices that validate alone but do not work together."""
        loss, mismatch = self.policy_loss, self.mismatch.mode
        if loss in SEQUENCE_RATIO_LOSSES and mismatch in ("tis_token", "icepop"):
            self.fail("mismatch.mode", f"{mismatch!r} weighs single tokens, but policy_loss "
                                       f"{loss!r} has one ratio per sequence: use 'tis_seq' or 'none'")
        if loss == "decoupled_ppo" and mismatch != "none":
            self.fail("mismatch.mode", f"{mismatch!r} would weigh the tokens a second time: "
                                       f"policy_loss 'decoupled_ppo' already weighs each by "
                                       f"pi_prox / pi_behav (algo.decoupled)")
        if self.clip.dual_clip_c is not None and loss not in PPO_SURROGATE_LOSSES:
            self.fail("clip.dual_clip_c", f"dual clip caps the PPO surrogate of "
                                          f"{list(PPO_SURROGATE_LOSSES)}; policy_loss {loss!r} has none")

    @property
    def engine_routes(self) -> bool:
        """The engines must return each token's MoE routes (r3 replays them; the agreement metric
        compares with them)."""
        return self.routing_replay == "r3" or self.router_agreement
