"""Training set-up of the policy's chunks: Megatron DDP, the (distributed) Adam optimizer and the
learning-rate schedule, configured so that losses and gradients are summed, never averaged."""

from __future__ import annotations

import torch

from megatron_rl.models.config import PolicyConfig


def wrap_for_training(chunks: list, cfg: PolicyConfig, dtype: torch.dtype):
    """Megatron DDP around each chunk, the (distributed) Adam optimizer and the LR schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    par, oc = cfg.parallel, cfg.optim
    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=par.use_distributed_optimizer, check_for_nan_in_grad=False)
    model = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
             for i, chunk in enumerate(chunks)]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=oc.lr, min_lr=oc.min_lr, weight_decay=oc.weight_decay,
        adam_beta1=oc.adam_beta1, adam_beta2=oc.adam_beta2, adam_eps=oc.adam_eps,
        clip_grad=oc.clip_grad, bf16=dtype == torch.bfloat16, fp16=False, params_dtype=dtype,
        use_distributed_optimizer=par.use_distributed_optimizer), model)
    decay_steps = oc.lr_decay_steps or oc.lr_warmup_steps + 1
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=oc.lr, min_lr=oc.min_lr,
        lr_warmup_steps=oc.lr_warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=oc.lr_decay_style, start_wd=oc.weight_decay, end_wd=oc.weight_decay,
        wd_incr_steps=decay_steps, wd_incr_style="constant",
        # A checkpoint brings back the step count, never the schedule's settings: the run's config
        # sets the peak / minimum lr, warm-up, decay and weight decay (Megatron's default keeps the
        # checkpoint's, so a new lr for a stage that starts from the previous stage's checkpoint or
        # from trainer.init_from was silently ignored).
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
    # Sum, never average: calculate_per_token_loss=True keeps Megatron from dividing the loss by
    # the micro-batch count and DDP from scaling by 1/DP; finalize without token scaling.
    config.finalize_model_grads_func = (
        lambda m, num_tokens, **kw: finalize_model_grads(m, None, **kw))
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, scheduler
