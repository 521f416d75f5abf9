"""Core's own components, registered through the same entry-point path as any plugin.

Factories are lazy ``"module:attr"`` strings so that listing plugins never imports torch.
"""

from __future__ import annotations

from unirl.kernel.hookspecs import hookimpl
from unirl.memory_plan.check import unirl_preflight  # noqa: F401 - core's memory check, registered with core


@hookimpl
def unirl_rollout_engines():
    return {"torch": "unirl.engine.torch_engine:TorchEngine"}


@hookimpl
def unirl_rollout_controllers():
    return {"batch": "unirl.rollout.batch:BatchController"}


@hookimpl
def unirl_actors():
    return {"torch": "unirl.actor.torch_actor:TorchActor"}


@hookimpl
def unirl_declarations():
    """The embedded actor's Config, capabilities and memory layout without torch (``unirl plan``)."""
    return {"actors.torch": "unirl.actor.declaration:TorchActorDeclaration"}


@hookimpl
def unirl_weight_syncs():
    return {"inprocess": "unirl.sync.inprocess:InProcessSync"}


@hookimpl
def unirl_advantage_estimators():
    return {
        "grpo": "unirl.algorithms.advantages:grpo",
        "dr_grpo": "unirl.algorithms.advantages:dr_grpo",
        "rloo": "unirl.algorithms.advantages:rloo",
        "reinforce_pp": "unirl.algorithms.advantages:reinforce_pp",
        "reinforce_pp_baseline": "unirl.algorithms.advantages:reinforce_pp_baseline",
        "gae": "unirl.algorithms.advantages:gae",
    }


@hookimpl
def unirl_policy_losses():
    return {
        "ppo_clip": "unirl.algorithms.losses:ppo_clip",
        "gspo": "unirl.algorithms.losses:gspo",
        "gspo_token": "unirl.algorithms.losses:gspo_token",
    }


@hookimpl
def unirl_rewards():
    return {
        "exact_int": "unirl.rewards.builtin:exact_int",
        "math_verify": "unirl.rewards.builtin:math_verify",
        "math_verify_boxed": "unirl.rewards.builtin:math_verify_boxed",
        "judge": "unirl.rewards.judge:JudgeReward",
        "reward_model": "unirl.rewards.reward_model:RewardModelReward",
        "weighted": "unirl.rewards.compose:WeightedSum",
    }


@hookimpl
def unirl_model_adapters():
    return {"qwen3": "unirl.models.qwen3:Qwen3Adapter", "qwen3_moe": "unirl.models.qwen3_moe:Qwen3MoeAdapter",
            "qwen2_5_vl": "unirl.models.qwen2_5_vl:Qwen2_5_VLAdapter"}


@hookimpl
def unirl_trackers():
    return {"tensorboard": "unirl.trainer.trackers:TensorBoardTracker"}


@hookimpl
def unirl_commands():
    return {"tiny-judge": "unirl.rewards.tiny_judge:main"}
