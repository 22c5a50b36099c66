"""DeepSpeed 0.19.8's config keys, as zerofn sorts them: acted on, monitoring, ignored, removed.

Data only; ``config/`` reads a config against these tables. The table in
``docs/deepspeed.md`` says the same thing for people.

An ignored key is reported only when its value asks for something zerofn does not do:
each entry lists the values zerofn already honours (writing ``"overlap_comm": true`` asks
for what zerofn always does, so it is not reported).
"""
from __future__ import annotations

from typing import NamedTuple

ANY = object()   # an "honoured" marker: every value of the key is fine as it is


class Ignored(NamedTuple):
    reason: str
    honoured: tuple = ()


# -- top level ------------------------------------------------------------------------------
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
TOP_USED = frozenset(BATCH_KEYS + (
    "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16", "bfloat16",
    "zero_optimization", "activation_checkpointing", "steps_per_print", "dataloader_drop_last",
    "communication_data_type", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
))
# Sections whose output zerofn cannot produce yet (no TensorBoard/profiling output): their
# parsed values are kept on the settings for when it can.
MONITORS = ("tensorboard", "csv_monitor", "wandb", "comet", "comms_logger", "flops_profiler",
            "wall_clock_breakdown", "memory_breakdown")

_ALL_REDUCE = "zerofn averages gradients inside the reduction itself"
_PARALLEL = "zerofn shards over one data-parallel group; it has no {} parallelism"
TOP_IGNORED = {
    "prescale_gradients": Ignored(_ALL_REDUCE, (False,)),
    "gradient_predivide_factor": Ignored(_ALL_REDUCE, (1, 1.0)),
    "gradient_allreduce_op": Ignored(_ALL_REDUCE + " (a mean, always)", ("mean",)),
    "disable_allgather": Ignored("ZeRO-1/2 always all-gather the updated rows", (False,)),
    "dump_state": Ignored("zerofn prints no engine state", (False,)),
    "disable_python_gc": Ignored("zerofn leaves Python's garbage collector alone", (False,)),
    "log_level": Ignored("zerofn logs through the standard logging module", (None,)),
    "timers": Ignored("zerofn keeps no engine timers"),
    "checkpoint": Ignored("zerofn's checkpoints are DCP (see docs/deepspeed.md); DeepSpeed's "
                          "checkpoint engine options have no meaning there"),
    "aio": Ignored("zerofn's NVMe offload does its own file I/O; DeepSpeed's libaio tuning "
                   "has no meaning there"),
    "data_types": Ignored("zerofn accumulates gradients in the reduce dtype "
                          "(communication_data_type)"),
    "torch_autocast": Ignored("zerofn has no autocast mode: wrap the forward in torch.autocast, "
                              "or use bf16"),
    "pipeline": Ignored(_PARALLEL.format("pipeline")),
    "tensor_parallel": Ignored(_PARALLEL.format("tensor")),
    "expert_parallel": Ignored(_PARALLEL.format("expert")),
    "sequence_parallel_size": Ignored(_PARALLEL.format("sequence"), (1,)),
    "data_parallel_size": Ignored("zerofn's data-parallel size is the group's size", (ANY,)),
    "seq_parallel_communication_data_type": Ignored(_PARALLEL.format("sequence"), ("fp32",)),
    "use_data_before_expert_parallelism": Ignored(_PARALLEL.format("expert"), (False,)),
    "hybrid_engine": Ignored("zerofn has no RLHF hybrid engine"),
    "autotuning": Ignored("zerofn has no autotuner"),
    "compile": Ignored("zerofn does not compile the model: call torch.compile yourself"),
    "data_efficiency": Ignored("zerofn has no data-efficiency sampler"),
    "weight_quantization": Ignored("zerofn does not quantize weights"),
    "managed_gradient_accumulation": Ignored(
        "the engine counts micro-steps as DeepSpeed's managed mode does", (True,)),
    "vocabulary_size": Ignored("zerofn pads no vocabulary", (None,)),
}
# DeepSpeed 0.19.8 itself refuses these (DeepSpeedConfigError); so does zerofn.
REMOVED = ("nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
           "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting",
           "curriculum_learning", "progressive_layer_drop")
TOP_KNOWN = TOP_USED | frozenset(MONITORS) | frozenset(TOP_IGNORED) | frozenset(REMOVED)

# Sections zerofn reads into: a JSON object, or where DeepSpeed allows it another form
# (zero_optimization: true is its legacy stage 1; an offload section may be null).
SECTION_FORMS = {
    "zero_optimization": (dict, bool), "zero_optimization.offload_optimizer": (dict, None),
    "zero_optimization.offload_param": (dict, None), "fp16": (dict,), "bf16": (dict,),
    "bfloat16": (dict,), "optimizer": (dict, None), "optimizer.params": (dict, None),
    "scheduler": (dict, None), "scheduler.params": (dict, None),
    "activation_checkpointing": (dict,), "tensorboard": (dict,), "csv_monitor": (dict,),
}



class Takes(NamedTuple):
    """What a key zerofn acts on may hold: ``kind`` "int" (a whole number, 5e8 too),
    "number" (finite), "bool" or "str", within ``low``..``high`` (``above``: low itself
    excluded); ``null``: JSON null too (the default)."""
    kind: str
    low: float | None = None
    high: float | None = None
    null: bool = False
    above: bool = False


_SIZE = Takes("int", 0)
_BOOL = Takes("bool")
VALUES = {
    "gradient_clipping": Takes("number", 0), "steps_per_print": Takes("int", 1, null=True),
    "dataloader_drop_last": _BOOL, "zero_allow_untested_optimizer": _BOOL,
    "zero_force_ds_cpu_optimizer": _BOOL, "communication_data_type": Takes("str", null=True),
    # (a bound on elements in flight: 0 would be none at all; prefetch's 0 is "no prefetch")
    "zero_optimization.reduce_bucket_size": Takes("int", 1),
    "zero_optimization.allgather_bucket_size": Takes("int", 1),
    **{f"zero_optimization.{p}{name}": _SIZE for p in ("", "stage3_") for name in (
        "prefetch_bucket_size", "param_persistence_threshold")},
    **{f"zero_optimization.{name}": _BOOL for name in (
        "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")},
    **{f"zero_optimization.{section}.{name}": Takes("str", null=True)
       for section in ("offload_optimizer", "offload_param") for name in ("device", "nvme_path")},
    "zero_optimization.offload_optimizer.ratio": Takes("number", 0, 1),
    "zero_optimization.offload_param.buffer_count": Takes("int", 1),
    **{f"{section}.enabled": _BOOL for section in ("fp16", "bf16", "bfloat16")},
    "fp16.auto_cast": _BOOL, "fp16.consecutive_hysteresis": _BOOL,
    "fp16.loss_scale": Takes("number", 0), "fp16.initial_scale_power": Takes("int", 0, 64),
    "fp16.loss_scale_window": Takes("int", 1), "fp16.hysteresis": Takes("int", 1),
    "fp16.min_loss_scale": Takes("number", 0, above=True),
    **{f"{section}.{name}": Takes("str", null=True) for section in ("tensorboard", "csv_monitor")
       for name in ("output_path", "job_name")},
    "tensorboard.enabled": _BOOL, "csv_monitor.enabled": _BOOL,
    "optimizer.type": Takes("str"), "scheduler.type": Takes("str"),
}

# -- zero_optimization ------------------------------------------------------------------------
# (name, its stage3_ alias or None): DeepSpeed accepts either spelling.
STAGE3_ALIASED = ("prefetch_bucket_size", "param_persistence_threshold",
                  "model_persistence_threshold", "max_live_parameters", "max_reuse_distance",
                  "gather_16bit_weights_on_model_save", "module_granularity_threshold",
                  "use_all_reduce_for_fetch_params", "allgather_sequential")
ZERO_USED = frozenset((
    "stage", "offload_optimizer", "offload_param", "reduce_bucket_size", "allgather_bucket_size",
    "prefetch_bucket_size", "param_persistence_threshold", "cpu_offload", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "leaf_module",
    # the engine's save_16bit_model always gathers, whatever these say
    "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
))
_ALWAYS = "zerofn always does this"
_NO_CAP = ("zerofn keeps gathered only the running unit and `prefetch` units ahead; it has "
           "no cap or cache in elements (reshard_after_forward=False keeps every unit)")
ZERO_IGNORED = {
    "overlap_comm": Ignored("zerofn always overlaps collectives with compute", (True, None)),
    "contiguous_gradients": Ignored("zerofn always keeps gradients in flat per-unit buffers",
                                    (True,)),
    "reduce_scatter": Ignored("ZeRO-2/3 always reduce-scatter", (True,)),
    "allgather_partitions": Ignored(_ALWAYS, (True,)),
    "use_multi_rank_bucket_allreduce": Ignored(_ALWAYS, (True,)),
    "compute_grad_norm": Ignored("the engine always computes the gradient norm", (True,)),
    "load_from_fp32_weights": Ignored("zerofn checkpoints hold the fp32 masters", (True,)),
    "ignore_unused_parameters": Ignored("parameters without gradients are left alone", (True,)),
    "max_live_parameters": Ignored(_NO_CAP),
    "max_reuse_distance": Ignored(_NO_CAP),
    "model_persistence_threshold": Ignored("zerofn has no cap on persistent elements"),
    "sub_group_size": Ignored("zerofn's offloaded step goes one unit at a time; it has no "
                              "element-sized sub-groups"),
    "module_granularity_threshold": Ignored(
        "zerofn's units are chosen by `units` (ModuleList children by default)", (0,)),
    "use_all_reduce_for_fetch_params": Ignored("ZeRO-3 gathers with all-gather", (False,)),
    "allgather_sequential": Ignored("ZeRO-3 gathers one unit per collective", (False,)),
    "elastic_checkpoint": Ignored("zerofn checkpoints load at any world size", (False,)),
    "legacy_stage1": Ignored("zerofn has one ZeRO-1", (False,)),
    "round_robin_gradients": Ignored("zerofn assigns rows, not whole gradients", (False,)),
    "parameter_alignment": Ignored("zerofn's row split needs no alignment", (False,)),
    "zero_hpz_partition_size": Ignored("zerofn has no hierarchical (ZeRO++ hpZ) sharding", (1,)),
    "zero_quantized_weights": Ignored("zerofn does not quantize collectives (ZeRO++)", (False,)),
    "zero_quantized_nontrainable_weights": Ignored("zerofn does not quantize weights", (False,)),
    "zero_quantized_gradients": Ignored("zerofn does not quantize collectives (ZeRO++)",
                                        (False,)),
    "memory_efficient_linear": Ignored("zerofn does not replace nn.Linear", (True,)),
    "pipeline_loading_checkpoint": Ignored(_PARALLEL.format("pipeline"), (False,)),
    "override_module_apply": Ignored("zerofn does not patch Module.apply", (True,)),
    "log_trace_cache_warnings": Ignored("zerofn has no trace cache", (False,)),
    "enable_sanity_checks": Ignored("zerofn checks its set-up across ranks always", (False,)),
    "save_muon_momentum_buffer_in_memory": Ignored("zerofn keeps Muon's momentum on its owner",
                                                   (False,)),
    "zenflow": Ignored("zerofn has no ZenFlow"),
}
ZERO_KNOWN = (ZERO_USED | frozenset(ZERO_IGNORED)
              | frozenset("stage3_" + name for name in STAGE3_ALIASED))

_PIN = "zerofn pins host memory whenever an accelerator exists"
OFFLOAD_OPTIMIZER_IGNORED = {
    "pin_memory": Ignored(_PIN, (True,)),
    "buffer_count": Ignored("DeepSpeed counts buffers per optimizer-state tensor; zerofn stages "
                            "whole units (units_in_flight, default 2)"),
    "pipeline_read": Ignored("zerofn always reads the next unit while one steps", (ANY,)),
    "pipeline_write": Ignored("zerofn always writes back while the next unit steps", (ANY,)),
    "fast_init": Ignored("zerofn writes the swap file once at set-up", (False,)),
    "super_offload": Ignored("zerofn has no SuperOffload", (False,)),
    "cpuadam_cores_perc": Ignored("zerofn's CPU Adam uses torch's thread count"),
}
OFFLOAD_PARAM_IGNORED = {
    "pin_memory": Ignored(_PIN, (True,)),
    "buffer_size": Ignored("zerofn reads whole unit shards, no fixed-size buffers"),
    "max_in_cpu": Ignored("zerofn keeps no parameters in host memory under NVMe offload"),
}
OFFLOAD_USED = frozenset(("device", "nvme_path"))
OFFLOAD_OPTIMIZER_KNOWN = OFFLOAD_USED | frozenset(("ratio",)) | frozenset(OFFLOAD_OPTIMIZER_IGNORED)
OFFLOAD_PARAM_KNOWN = OFFLOAD_USED | frozenset(("buffer_count",)) | frozenset(OFFLOAD_PARAM_IGNORED)

# -- precision ------------------------------------------------------------------------------
FP16_SCALING = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                "consecutive_hysteresis", "min_loss_scale")
FP16_IGNORED = {
    "fp16_master_weights_and_grads": Ignored("zerofn's masters are fp32", (False,)),
}
FP16_KNOWN = frozenset(("enabled", "auto_cast") + FP16_SCALING) | frozenset(FP16_IGNORED)
BF16_IGNORED = {
    "immediate_grad_update": Ignored("zerofn updates at the step", (False,)),
    "check_grad_overflow": Ignored(
        "zerofn skips a step whose gradients hold inf or nan under every precision "
        "(on_nonfinite='skip', the default); for an unchecked step pass "
        "on_nonfinite='ignore' to the transforms", (True,)),
    "bf16_master_weights_and_grads": Ignored(
        "zerofn stores bf16 masters only in host memory: with offload_optimizer.device "
        "\"cpu\"", (False,)),
    "bf16_optimizer_states": Ignored(
        "zerofn stores bf16 optimizer state only in host memory: with "
        "offload_optimizer.device \"cpu\"", (False,)),
}
BF16_KNOWN = frozenset(("enabled",)) | frozenset(BF16_IGNORED)

# -- the rest -------------------------------------------------------------------------------
OPTIMIZER_KNOWN = frozenset(("type", "params", "legacy_fusion"))
SCHEDULER_KNOWN = frozenset(("type", "params"))
WRITER_KNOWN = frozenset(("enabled", "output_path", "job_name"))   # tensorboard, csv_monitor
ACTIVATION_CHECKPOINTING_DEFAULTS = {
    "partition_activations": False, "contiguous_memory_optimization": False,
    "cpu_checkpointing": False, "number_checkpoints": None,
    "synchronize_checkpoint_boundary": False, "profile": False,
}
ACTIVATION_CHECKPOINTING_KNOWN = frozenset(ACTIVATION_CHECKPOINTING_DEFAULTS)
ACTIVATION_CHECKPOINTING_IGNORED = {
    "partition_activations": Ignored(_PARALLEL.format("model"), (False,)),
    "contiguous_memory_optimization": Ignored("checkpoints live where torch puts them",
                                              (False,)),
    "number_checkpoints": Ignored("only used with contiguous_memory_optimization", (None,)),
    "synchronize_checkpoint_boundary": Ignored("zerofn does not synchronize at checkpoints",
                                               (False,)),
    "profile": Ignored("zerofn has no checkpointing profiler", (False,)),
}
