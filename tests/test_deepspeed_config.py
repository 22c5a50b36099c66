"""from_deepspeed_config: every covered key's mapping, "auto" as Hugging Face resolves it,
DeepSpeed's batch rule, the diagnostics, and DeepSpeed's schedulers against its own values
(tests/data/deepspeed/schedulers.json, from tools/deepspeed_reference.py)."""
from __future__ import annotations

import json
import math
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import zerofn as zf
from support.plans import plan_of
from zerofn.deepspeed import DeepSpeedConfigWarning, checkpointing, from_deepspeed_config
from zerofn.deepspeed.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR

pytestmark = pytest.mark.deepspeed

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepspeed")
BATCH = {"train_micro_batch_size_per_gpu": 2}


def read(config, world_size=1, model=None):
    """Settings, with no warning allowed."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepSpeedConfigWarning)
        return from_deepspeed_config(config, world_size=world_size, model=model)


def read_warned(config, world_size=1, model=None):
    """Settings and the DeepSpeedConfigWarnings raised reading them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = from_deepspeed_config(config, world_size=world_size, model=model)
    return settings, [str(w.message) for w in caught if w.category is DeepSpeedConfigWarning]


def zero(**section):
    return {**BATCH, "zero_optimization": section}


# -- zero_optimization ------------------------------------------------------------------------
@pytest.mark.parametrize("stage,transforms", [
    (0, ["shard_optimizer"]), (1, ["shard_optimizer"]),
    (2, ["shard_optimizer", "shard_grads"]),
    (3, ["shard_optimizer", "shard_grads", "shard_params"])])
def test_stage(stage, transforms):
    s = read(zero(stage=stage))
    assert list(s.transforms) == transforms and s.stage == stage
    assert plan_of(s.transform).stage == max(stage, 1)     # stage 0 runs as ZeRO-1


def test_no_zero_section_is_stage_0():
    s = read(BATCH)
    assert s.stage == 0 and plan_of(s.transform).stage == 1


def test_bucket_sizes_map_to_bucket_size():
    s = read(zero(stage=2, reduce_bucket_size=3e5, allgather_bucket_size=7e5))
    assert plan_of(s.transform).sharding.bucket_size == 700_000
    s = read(zero(stage=3, reduce_bucket_size=3e5, stage3_prefetch_bucket_size=9e5))
    assert plan_of(s.transform).sharding.bucket_size == 900_000
    s = read(zero(stage=3, reduce_bucket_size=3e5, prefetch_bucket_size=1e5))
    assert plan_of(s.transform).sharding.bucket_size == 300_000
    assert read(zero(stage=2)).transforms["shard_optimizer"] == {}   # zerofn's default


def test_prefetch_bucket_size_zero_disables_prefetch():
    no_prefetch = read(zero(stage=3, stage3_prefetch_bucket_size=0))
    assert plan_of(no_prefetch.transform).sharding.prefetch == 0
    assert plan_of(read(zero(stage=3)).transform).sharding.prefetch == 1


@pytest.mark.parametrize("key", ["stage3_param_persistence_threshold",
                                 "param_persistence_threshold"])
def test_persistence_threshold_maps_to_persist_below(key):
    # DeepSpeed keeps params with numel <= threshold whole; zerofn those with numel < persist_below
    plan = plan_of(read(zero(stage=3, **{key: 1000})).transform)
    assert plan.sharding.persist_below == 1001


def test_persistent_params_are_those_deepspeed_keeps():
    from zerofn.core.units import build_units
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 9))   # 100, 10, 90, 9 elements
    persist = plan_of(read(zero(stage=3, stage3_param_persistence_threshold=90)).transform)
    units = build_units(model, None, 2, 0, persist.sharding.persist_below)
    whole = sorted(s.fqn for u in units if u.replicated for s in u.slots)
    assert whole == ["0.bias", "1.bias", "1.weight"]          # numel <= 90


def test_offload_optimizer():
    s = read(zero(stage=2, offload_optimizer={"device": "cpu", "pin_memory": True}))
    assert s.transforms["offload"] == {"device": "cpu", "params": False}
    plan = plan_of(s.transform)
    assert (plan.offload.device, plan.offload.params) == ("cpu", False)
    s = read(zero(stage=1, offload_optimizer={"device": "nvme", "nvme_path": "/nvme"}))
    assert plan_of(s.transform).offload.device == "nvme"
    assert plan_of(s.transform).offload.path == "/nvme"
    assert "offload" not in read(zero(stage=2, offload_optimizer={"device": "none"})).transforms


def test_offload_optimizer_ratio_is_the_share_offloaded_at_every_stage():
    for stage in (1, 2, 3):
        s = read(zero(stage=stage, offload_optimizer={"device": "cpu", "ratio": 0.3}))
        assert plan_of(s.transform).offload.ratio == 0.3
    assert plan_of(read(zero(stage=2, offload_optimizer={"device": "cpu"})).transform
                   ).offload.ratio == 1.0


def test_offload_param():
    s = read(zero(stage=3, offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"}))
    assert s.transforms["offload"] == {"device": "cpu", "params": True}
    s = read(zero(stage=3, offload_param={"device": "nvme", "nvme_path": "/n", "buffer_count": 3},
                  offload_optimizer={"device": "nvme", "nvme_path": "/n"}))
    plan = plan_of(s.transform)
    assert (plan.offload.device, plan.offload.params, plan.offload.path,
            plan.offload.units_in_flight) == ("nvme", True, "/n", 3)


def test_legacy_cpu_offload_booleans():
    assert read(zero(stage=2, cpu_offload=True)).transforms["offload"]["device"] == "cpu"
    s = read(zero(stage=3, cpu_offload=True, cpu_offload_param=True))
    assert s.transforms["offload"] == {"device": "cpu", "params": True}


def test_keys_zerofn_always_honours_are_silent():
    read(zero(stage=3, overlap_comm=True, contiguous_gradients=True, reduce_scatter=True,
              stage3_gather_16bit_weights_on_model_save=False,
              offload_optimizer={"device": "cpu", "pin_memory": True, "ratio": 1.0}))


def test_keys_without_meaning_get_one_warning():
    config = zero(stage=3, overlap_comm=False, contiguous_gradients=False,
                  stage3_max_live_parameters=1e9, max_reuse_distance=1e9,
                  sub_group_size=1e9, offload_optimizer={"device": "cpu", "buffer_count": 8})
    config["prescale_gradients"] = True
    s, warned = read_warned(config)
    assert len(warned) == 1
    for key in ("zero_optimization.overlap_comm=False", "zero_optimization.contiguous_gradients",
                "zero_optimization.stage3_max_live_parameters",
                "zero_optimization.max_reuse_distance", "zero_optimization.sub_group_size",
                "zero_optimization.offload_optimizer.buffer_count", "prescale_gradients=True"):
        assert key in warned[0] and any(i.startswith(key) for i in s.ignored), key


def test_zero3_keys_under_stage_2_are_reported():
    s, warned = read_warned(zero(stage=2, stage3_param_persistence_threshold=10))
    assert "a ZeRO-3 setting, and the stage is 2" in warned[0]
    assert "persist_below" not in s.transforms["shard_optimizer"]


# -- precision, clipping, the rest ------------------------------------------------------------
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 50,
        "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 4}


def test_fp16_dynamic_loss_scaling_keys():
    s = read({**BATCH, "fp16": FP16, "zero_optimization": {"stage": 2}})
    plan = plan_of(s.transform)
    assert s.param_dtype == torch.float16 and plan.precision.param_dtype == torch.float16
    assert plan.precision.loss_scale is None            # DeepSpeed's 0: dynamic
    for key in ("initial_scale_power", "loss_scale_window", "hysteresis",
                "consecutive_hysteresis", "min_loss_scale"):
        assert getattr(plan.precision, key) == FP16[key], key


def test_fp16_static_loss_scale_and_auto_cast():
    s = read({**BATCH, "fp16": {"enabled": True, "loss_scale": 128, "auto_cast": True}})
    assert plan_of(s.transform).precision.loss_scale == 128 and s.fp16_auto_cast
    assert not read({**BATCH, "fp16": {"enabled": False, "auto_cast": True}}).fp16_auto_cast


@pytest.mark.parametrize("key", ["bf16", "bfloat16"])
def test_bf16(key):
    s = read({**BATCH, key: {"enabled": True}})
    assert s.param_dtype == torch.bfloat16
    assert plan_of(s.transform).precision.param_dtype == torch.bfloat16


def test_bf16_optimizer_states_and_masters_map_onto_the_host_state_dtypes():
    bf16 = {"enabled": True, "bf16_optimizer_states": True,
            "bf16_master_weights_and_grads": True}
    s = read({**zero(stage=2, offload_optimizer={"device": "cpu"}), "bf16": bf16})
    offload = plan_of(s.transform).offload
    assert (offload.state_dtype, offload.master_dtype) == (torch.bfloat16, torch.bfloat16)
    # Without host offload zerofn stores neither in bf16, and says so.
    s, warned = read_warned({**zero(stage=2), "bf16": bf16})
    assert "bf16.bf16_optimizer_states=True: zerofn stores bf16 optimizer state only in " \
           "host memory" in warned[0] and "bf16.bf16_master_weights_and_grads" in warned[0]
    assert "offload" not in s.transforms


def test_communication_data_type_is_the_reduce_dtype():
    s = read({**BATCH, "bf16": {"enabled": True}, "communication_data_type": "fp32"})
    plan = plan_of(s.transform)
    assert (plan.precision.param_dtype, plan.precision.reduce_dtype) == \
        (torch.bfloat16, torch.float32)
    plan = plan_of(read({**BATCH, "communication_data_type": "bf16"}).transform)
    assert (plan.precision.param_dtype, plan.precision.reduce_dtype) == \
        (torch.float32, torch.bfloat16)


def test_gradient_clipping_defaults_to_deepspeeds_one():
    assert read(BATCH).gradient_clipping == 1.0          # DeepSpeed 0.19.8's default
    assert read({**BATCH, "gradient_clipping": 0.0}).gradient_clipping == 0.0
    assert read({**BATCH, "gradient_clipping": 0.5}).gradient_clipping == 0.5


def test_steps_per_print_drop_last_and_activation_checkpointing():
    s = read({**BATCH, "steps_per_print": 10, "dataloader_drop_last": True,
              "activation_checkpointing": {"cpu_checkpointing": True}})
    assert s.steps_per_print == 10 and s.dataloader_drop_last
    assert s.activation_checkpointing["cpu_checkpointing"] is True
    assert s.activation_checkpointing["partition_activations"] is False
    _, warned = read_warned({**BATCH, "activation_checkpointing": {"partition_activations": True}})
    assert "activation_checkpointing.partition_activations" in warned[0]


def test_monitoring_sections_are_kept_and_unbuilt_ones_warn():
    """(How tensorboard and csv_monitor map onto zf.tensorboard: tests/test_tensorboard.py.)"""
    config = {**BATCH, "tensorboard": {"enabled": True, "output_path": "tb", "job_name": "j"},
              "csv_monitor": {"enabled": False}, "wall_clock_breakdown": True,
              "comms_logger": {"enabled": True, "verbose": False}, "wandb": {"enabled": True}}
    s, warned = read_warned(config)
    assert len(warned) == 1 and "W&B" in warned[0]
    assert "'wandb'" in warned[0] and "'tensorboard'" not in warned[0]
    assert s.monitoring == {k: config[k] for k in ("tensorboard", "csv_monitor",
                                                   "wall_clock_breakdown", "comms_logger",
                                                   "wandb")}
    assert read({**BATCH, "tensorboard": {"enabled": False}}).monitoring["tensorboard"] == \
        {"enabled": False}


# -- optimizer and scheduler sections ---------------------------------------------------------
def build_optimizer(section):
    s = read({**BATCH, "optimizer": section})
    return s.optimizer([nn.Parameter(torch.zeros(2))])


def test_adam_is_adamw_unless_adam_w_mode_is_false():
    opt = build_optimizer({"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.9],
                                                      "eps": 1e-6, "weight_decay": 0.1}})
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == \
        (0.01, (0.8, 0.9), 1e-6, 0.1)
    opt = build_optimizer({"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}})
    assert type(opt) is torch.optim.Adam and opt.param_groups[0]["weight_decay"] == 0.1
    assert type(build_optimizer({"type": "AdamW", "params": {"adam_w_mode": False}})) is \
        torch.optim.AdamW


def test_adam_weight_decay_default_follows_torch_adam():
    # DeepSpeed's fused/CPU Adam default to no decay; torch_adam uses torch's defaults
    assert build_optimizer({"type": "AdamW"}).param_groups[0]["weight_decay"] == 0.0
    opt = build_optimizer({"type": "AdamW", "params": {"torch_adam": True}})
    assert opt.param_groups[0]["weight_decay"] == 0.01
    assert opt.param_groups[0]["lr"] == 1e-3


def test_sgd_and_other_torch_optimizers():
    opt = build_optimizer({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9,
                                                     "nesterov": True}})
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["nesterov"]
    assert type(build_optimizer({"type": "RMSprop", "params": {"lr": 0.1}})) is \
        torch.optim.RMSprop


@pytest.mark.parametrize("section,message", [
    ({"type": "Lamb"}, "DeepSpeed's own"),
    ({"type": "Adamm"}, "did you mean 'Adam'"),
    ({"type": "AdamW", "params": {"bias_correction": False}}, "bias_correction"),
    ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, "gradient_clipping"),
    ({"type": "AdamW", "params": {"betaz": [0.9, 0.99]}}, "did you mean 'betas'"),
    ({"params": {"lr": 1.0}}, "needs a \"type\""),
])
def test_bad_optimizer_sections(section, message):
    with pytest.raises(ValueError, match=message):
        read({**BATCH, "optimizer": section})


def test_scheduler_sections():
    s = read({**BATCH, "scheduler": {"type": "WarmupDecayLR",
                                     "params": {"total_num_steps": 10, "warmup_num_steps": 2}}})
    assert s.scheduler.cls is WarmupDecayLR and s.scheduler.kwargs["total_num_steps"] == 10
    s = read({**BATCH, "scheduler": {"type": "StepLR", "params": {"step_size": 3}}})
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    assert isinstance(s.scheduler(opt), torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ValueError, match="OneCycleLR"):
        read({**BATCH, "scheduler": {"type": "OneCycle"}})
    with pytest.raises(ValueError, match="did you mean 'warmup_num_steps'"):
        read({**BATCH, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 3}}})


# -- "auto", as Hugging Face's integration resolves it ----------------------------------------
def hf_fills(hidden: int) -> dict:
    """Hugging Face's formulas (transformers' HfTrainerDeepSpeedConfig)."""
    return {"reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}


AUTO_ZERO3 = zero(stage=3, reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto",
                  stage3_param_persistence_threshold="auto")


@pytest.mark.parametrize("config,hidden", [
    (SimpleNamespace(hidden_size=48), 48),
    (SimpleNamespace(hidden_sizes=[16, 96, 40]), 96),
    (SimpleNamespace(text_config=SimpleNamespace(hidden_size=72)), 72),
    (SimpleNamespace(text_config=SimpleNamespace(hidden_sizes=[8, 24])), 24),
])
def test_auto_hidden_size_keys(config, hidden):
    model = nn.Linear(2, 2)
    model.config = config
    s = read(AUTO_ZERO3, model=model)
    assert {k: s.config["zero_optimization"][k] for k in hf_fills(hidden)} == hf_fills(hidden)
    plan = plan_of(s.transform)
    assert plan.sharding.bucket_size == max(hidden * hidden, int(0.9 * hidden * hidden))
    assert plan.sharding.persist_below == 10 * hidden + 1


def test_auto_hidden_size_without_a_model_config_names_the_key():
    with pytest.raises(ValueError, match="zero_optimization.reduce_bucket_size.*no model"):
        read(zero(stage=2, reduce_bucket_size="auto"))
    with pytest.raises(ValueError, match="neither hidden_size nor hidden_sizes"):
        read(zero(stage=2, reduce_bucket_size="auto"), model=nn.Linear(2, 2))


def test_auto_zero3_keys_under_stage_2_are_left_unused():
    # Hugging Face fills them only for ZeRO-3; under stage 2 they mean nothing either way
    s = read(zero(stage=2, stage3_prefetch_bucket_size="auto",
                  stage3_param_persistence_threshold="auto"))
    assert "stage3_prefetch_bucket_size" not in s.config["zero_optimization"]


@pytest.mark.parametrize("given,world,expected", [
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto",
      "gradient_accumulation_steps": 2}, 4, (64, 8, 2)),
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 3,
      "gradient_accumulation_steps": "auto"}, 2, (48, 3, 8)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
      "gradient_accumulation_steps": "auto"}, 2, (16, 8, 1)),   # HF's default micro batch 8
])
def test_auto_batch_sizes(given, world, expected):
    s, _ = read_warned(given, world_size=world)
    assert (s.train_batch_size, s.micro_batch_size, s.gradient_accumulation_steps) == expected


def test_auto_training_arguments_defaults_warn():
    config = {**BATCH, "gradient_clipping": "auto", "fp16": {"enabled": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                        "eps": "auto", "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupLR", "params": {
                  "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}}
    s, warned = read_warned(config)
    assert len(warned) == 1 and "optimizer.params.lr=5e-05" in warned[0]
    assert s.gradient_clipping == 1.0 and s.param_dtype is None
    assert s.optimizer.kwargs == {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                  "weight_decay": 0.0}
    opt = s.optimizer([nn.Parameter(torch.zeros(1))])
    sched = s.scheduler(opt)
    assert sched.max_lrs == [5e-5] and sched.min_lrs == [0] and sched.warmup_num_steps == 2


@pytest.mark.parametrize("config,key", [
    ({**BATCH, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
     "scheduler.params.total_num_steps"),
    (zero(stage=2, allgather_bucket_size="auto"), "zero_optimization.allgather_bucket_size"),
    ({**BATCH, "steps_per_print": "auto"}, "steps_per_print"),
])
def test_unresolvable_auto_names_the_key(config, key):
    with pytest.raises(ValueError, match=key):
        read(config)


# -- the batch rule -----------------------------------------------------------------------
@pytest.mark.parametrize("given,world,expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_batch_size": 16}, 4, (16, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 5}, 3, (15, 5, 1)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3,
      "gradient_accumulation_steps": 2}, 4, (24, 3, 2)),
])
def test_batch_rule(given, world, expected):
    s = read(given, world_size=world)
    assert (s.train_batch_size, s.micro_batch_size, s.gradient_accumulation_steps) == expected


@pytest.mark.parametrize("given,world", [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2),      # 30 // 4 // 2 = 3
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3,
      "gradient_accumulation_steps": 2}, 2),
    ({"train_batch_size": 2, "gradient_accumulation_steps": 4}, 2),          # micro 0
])
def test_batch_rule_error_names_all_three(given, world):
    with pytest.raises(ValueError, match=r"train_batch_size \(\d+\) must equal "
                                         r"train_micro_batch_size_per_gpu .* world size"):
        read(given, world_size=world)


def test_batch_sizes_are_needed():
    with pytest.raises(ValueError, match="give train_batch_size or train_micro_batch_size"):
        read({"gradient_accumulation_steps": 2})
    with pytest.raises(ValueError, match="must be an integer"):
        read({"train_batch_size": 8.5})


def test_world_size_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert from_deepspeed_config(BATCH).train_batch_size == 8


# -- diagnostics ------------------------------------------------------------------------------
@pytest.mark.parametrize("config,suggestion", [
    ({**BATCH, "gradient_cliping": 1.0}, "did you mean 'gradient_clipping'"),
    ({**BATCH, "zero_optimization": {"stgae": 2}}, "zero_optimization.'stage'"),
    ({**BATCH, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 5}},
     "'stage3_prefetch_bucket_size'"),
    ({**BATCH, "fp16": {"enabled": False, "loss_scale_windw": 5}}, "'loss_scale_window'"),
    ({**BATCH, "zero_optimization": {"offload_optimizer": {"devise": "cpu"}}}, "'device'"),
    ({**BATCH, "qwertyuiop": 1}, "no known key is close"),
])
def test_unknown_keys_warn_with_the_closest_known_key(config, suggestion):
    _, warned = read_warned(config)
    unknown = [w for w in warned if "unknown key" in w]
    assert len(unknown) == 1 and suggestion in unknown[0], warned


@pytest.mark.parametrize("config,names", [
    ({**BATCH, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
     ["fp16.enabled", "bf16.enabled"]),
    (zero(stage=2, offload_param={"device": "cpu"}),
     ["zero_optimization.offload_param", "zero_optimization.stage"]),
    (zero(stage=3, offload_param={"device": "cpu"},
          offload_optimizer={"device": "nvme", "nvme_path": "/n"}),
     ["offload_param.device", "offload_optimizer.device"]),
    (zero(stage=3, offload_param={"device": "nvme", "nvme_path": "/a"},
          offload_optimizer={"device": "nvme", "nvme_path": "/b"}),
     ["offload_optimizer.nvme_path", "offload_param.nvme_path"]),
    (zero(stage=2, offload_optimizer={"device": "nvme"}), ["offload_optimizer.nvme_path"]),
    (zero(stage=3, prefetch_bucket_size=10, stage3_prefetch_bucket_size=20),
     ["zero_optimization.prefetch_bucket_size", "zero_optimization.stage3_prefetch_bucket_size"]),
    (zero(stage=2, offload_optimizer={"device": "gpu"}), ["offload_optimizer.device"]),
    ({**BATCH, "amp": {"enabled": True}}, ["amp"]),
    (zero(stage=4), ["zero_optimization.stage"]),
])
def test_contradictions_raise_naming_both_keys(config, names):
    with pytest.raises(ValueError) as err:
        read(config)
    for name in names:
        assert name in str(err.value), (name, str(err.value))


def test_config_file_with_duplicate_keys(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ValueError, match="appears twice"):
        read(str(path))
    path.write_text(json.dumps({**BATCH, "zero_optimization": {"stage": 2}}))
    assert read(str(path)).stage == 2
    with pytest.raises(ValueError, match="no such file"):
        read(str(tmp_path / "missing.json"))


def test_from_deepspeed_config_is_exported():
    assert zf.from_deepspeed_config is from_deepspeed_config


# -- schedulers -------------------------------------------------------------------------------
SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
              "WarmupCosineLR": WarmupCosineLR}


def _lrs(name, params, base_lrs, steps):
    weights = [nn.Parameter(torch.zeros(1)) for _ in base_lrs]
    opt = torch.optim.SGD([{"params": [w], "lr": lr} for w, lr in zip(weights, base_lrs)])
    sched = SCHEDULERS[name](opt, **params)
    out = [[g["lr"] for g in opt.param_groups]]
    for _ in range(steps):
        sched.step()
        out.append([g["lr"] for g in opt.param_groups])
    return out, sched


def test_schedulers_match_deepspeeds_own_values():
    with open(os.path.join(DATA, "schedulers.json")) as f:
        records = json.load(f)["schedules"]
    assert {r["type"] for r in records} == set(SCHEDULERS)
    for record in records:
        expected = record["lrs_after_init_then_each_step"]
        ours, _ = _lrs(record["type"], record["params"], record["base_lrs"], len(expected) - 1)
        flat = [lr for row in ours for lr in row]
        assert flat == pytest.approx([lr for row in expected for lr in row], rel=1e-12,
                                     abs=1e-15), record


def test_scheduler_formulas():
    """DeepSpeed's formulas, written out, at several steps (n = last_batch_iteration)."""
    lrs, _ = _lrs("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1,
                               "warmup_num_steps": 5}, [1.0], 8)
    for n in range(8):   # lrs[n + 1] is the lr after the (n+1)-th step(): iteration n
        gamma = math.log(n + 1) / math.log(5) if n < 5 else 1.0
        assert lrs[n + 1][0] == pytest.approx(0.01 + 0.09 * gamma, rel=1e-12)
    assert lrs[0] == [0.01]
    lrs, _ = _lrs("WarmupDecayLR", {"total_num_steps": 10, "warmup_min_lr": 0.0,
                                    "warmup_max_lr": 0.2, "warmup_num_steps": 4,
                                    "warmup_type": "linear"}, [1.0], 12)
    for n in range(12):
        gamma = n / 4 if n < 4 else max(0.0, (10 - n) / (10 - 4))
        assert lrs[n + 1][0] == pytest.approx(0.2 * gamma, rel=1e-12, abs=1e-15)
    lrs, _ = _lrs("WarmupCosineLR", {"total_num_steps": 9, "warmup_min_ratio": 0.2,
                                     "warmup_num_steps": 3, "cos_min_ratio": 0.05},
                  [0.5], 12)
    assert lrs[0] == [0.0]
    for n in range(12):
        if n < 3:
            ratio = 0.2 + 0.8 * math.log(n + 1) / math.log(3)
        else:
            progress = min(1.0, (n - 3 + 1) / (9 - 3))
            ratio = 0.05 + 0.95 * (1 + math.cos(math.pi * progress)) / 2
        assert lrs[n + 1][0] == pytest.approx(0.5 * ratio, rel=1e-12)


def test_scheduler_state_dict_resumes():
    _, sched = _lrs("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 3}, [1.0], 4)
    assert sched.state_dict() == {"last_batch_iteration": 3}
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    fresh = WarmupDecayLR(opt, total_num_steps=10, warmup_num_steps=3)
    fresh.load_state_dict(sched.state_dict())
    fresh.step()
    sched.step()
    assert fresh.get_last_lr() == sched.get_last_lr()


def test_warmup_num_steps_must_be_positive():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="positive integer"):
        WarmupLR(opt, warmup_num_steps=0)


# -- activation checkpointing -----------------------------------------------------------------
@pytest.mark.parametrize("cpu", [False, True])
def test_activation_checkpointing_recomputes_the_same_gradients(cpu):
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {
        "cpu_checkpointing": cpu}})
    assert checkpointing.is_configured()
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6))
    x = torch.randn(4, 6, requires_grad=True)
    block(x).square().sum().backward()
    plain = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    out = checkpointing.checkpoint(block, x)
    assert out.grad_fn is not None
    out.square().sum().backward()
    for a, b in zip(plain, [p.grad for p in block.parameters()] + [x.grad]):
        assert torch.allclose(a, b, atol=1e-7)
