"""The MindFormers run-YAML keys that have no effect in msllm, each with the reason.

Read by :func:`msllm.compat.mindformers.translate_mindformers_yaml`; the table in
``docs/mindformers_compat.md`` is this data. Keys come from MindFormers' LLaMA configs
(``configs/llama/run_llama_{7b,13b,65b}*.yaml``, ``configs/llama2/*.yaml``, r0.6 .. r1.x) and the
defaults of the classes they name (mindformers r1.0, commit 6a4076003f0c2461637b477199844cb92774e4d1).

``NO_EFFECT``: removed whatever their value. ``NEUTRAL``: removed when the value is one of the
listed neutral values (the feature is off); any other value is refused, because msllm cannot do
what it asks. ``{ds}`` stands for ``train_dataset`` and ``eval_dataset``.
"""

from __future__ import annotations

_OBS = "uploads to Huawei OBS / ModelArts (AICC) storage; msllm writes to output_dir only"
_AUTOTUNE = ("MindSpore dataset AutoTune (tunes the input pipeline's worker counts): speed only; "
             "msllm's pipeline does not use it")
_RESUME = ("MindFormers' resume bookkeeping, filled in by its trainer; msllm restores epoch and step "
           "from the checkpoint when resume_training is True")
_SPEED = "an Ascend speed/memory option with the same results; msllm does not set it"

NO_EFFECT: dict[str, str] = {
    # top level
    "use_parallel": ("msllm starts the distributed context from the launch (scripts/run_distribute.sh "
                     "sets RANK_SIZE / MS_WORKER_NUM > 1) with parallel.parallel_mode; a process started "
                     "alone runs alone"),
    "micro_batch_interleave_num": ("MindFormers splits each batch in N interleaved parts to overlap "
                                   "communication on Ascend: speed only; msllm runs the batch whole"),
    "auto_tune": _AUTOTUNE,
    "filepath_prefix": _AUTOTUNE,
    "autotune_per_step": _AUTOTUNE,
    "init_start_profile": "msllm starts the profiler at profile_start_step",
    "profile_communication": "msllm's profile uses mindspore.Profiler's defaults (no communication data)",
    "profile_memory": "msllm's profile uses mindspore.Profiler's defaults (no tensor memory data)",
    "layer_scale": ("MindFormers applies layer-wise learning-rate decay to ViT and Swin models only and "
                    "resets it to False for others (trainer/optimizer_grouped_parameters.py)"),
    "layer_decay": "read by MindFormers only when layer_scale is True (ViT and Swin models only)",
    "lr_scale_factor": "read by MindFormers only when lr_scale is True",
    "remote_save_url": _OBS,
    "aicc_config": _OBS,
    "infer": ("MindIR export / MindSpore Lite inference settings; msllm predicts with the MindSpore "
              "network (generation_config)"),
    "eval_callbacks": "callbacks of MindFormers' evaluation (ObsMonitor); msllm logs its evaluation itself",
    "trainer": ("msllm has one trainer (causal language modelling); the model comes from "
                "model.model_config"),
    "processor": ("msllm takes the tokenizer given to the command (--tokenizer: a SentencePiece model file, or "
                  "an HF directory / tokenizer.json for Qwen2Tokenizer or Llama3Tokenizer), not the YAML's "
                  "processor; padding = model_config.pad_token_id"),
    "train_dataset_task": ("MindFormers replaces its dataset_config with train_dataset "
                           "(dataset/utils.py check_dataset_config); msllm reads train_dataset"),
    "eval_dataset_task": ("MindFormers replaces its dataset_config with eval_dataset "
                          "(dataset/utils.py check_dataset_config); msllm reads eval_dataset"),
    # runner_config
    "runner_config.initial_epoch": _RESUME,
    "runner_config.has_trained_epoches": _RESUME,
    "runner_config.has_trained_steps": _RESUME,
    "runner_config.per_epoch_size": "MindFormers 0.x alias of sink_size filled in by its trainer; msllm reads sink_size",
    # datasets
    "{ds}.python_multiprocessing": ("msllm's input pipeline has no Python map operations to run in "
                                    "worker processes"),
    "{ds}.numa_enable": "NUMA binding of the dataset workers: speed only; msllm does not set it",
    "{ds}.seed": ("MindFormers overwrites it with the top-level seed (dataset/utils.py "
                  "check_dataset_config); msllm's data order comes from the top-level seed"),
    "{ds}.batch_size": ("MindFormers overwrites it with runner_config.batch_size (dataset/utils.py "
                        "check_dataset_config); msllm uses runner_config.batch_size"),
    "{ds}.do_eval": "set by MindFormers' trainer itself",
    "{ds}.auto_tune": _AUTOTUNE,
    "{ds}.filepath_prefix": _AUTOTUNE,
    "{ds}.autotune_per_step": _AUTOTUNE,
    "{ds}.profile": "copied by MindFormers from the top-level profile",
    # context
    "context.enable_graph_kernel": "graph-kernel fusion, a compiler speed option; msllm leaves MindSpore's default",
    "context.graph_kernel_flags": "graph-kernel fusion flags; msllm leaves MindSpore's default",
    "context.save_graphs": "IR graph dumps (a compiler debugging aid); msllm does not enable them",
    "context.save_graphs_path": "IR graph dumps (a compiler debugging aid); msllm does not enable them",
    "context.runtime_num_threads": "msllm keeps MindSpore's default runtime thread count",
    "context.memory_optimize_level": _SPEED,
    "context.mempool_block_size": _SPEED,
    "context.ascend_config": "Ascend operator precision/tuning options; msllm sets none",
    # parallel
    "parallel.enable_alltoall": ("MindSpore's all-to-all for expert parallelism; msllm sets it exactly where "
                                 "expert_parallel > 1 (Ascend), whatever the YAML says"),
    "parallel.parallel_optimizer_config": ("tuning of optimizer-state sharding (memory only); msllm shards "
                                           "by parallel.enable_parallel_optimizer / optimizer_shard"),
    "parallel.strategy_ckpt_config.only_trainable_params": "msllm's strategy files list every parameter",
    "parallel_config.mem_coeff": ("MindFormers' memory-balancing coefficient for its automatic pipeline "
                                  "stage split; msllm splits layers evenly"),
    "recompute_config.select_comm_recompute": "selective recomputation of communication: memory only",
    # runner_wrapper
    "runner_wrapper.enable_check_overflow": ("msllm always checks the gradients for overflow and skips "
                                             "that step's update"),
    "runner_wrapper.micro_batch_num": "set by MindFormers' trainer from parallel_config.micro_batch_num",
    # model
    "model.model_config.batch_size": ("MindFormers' inference batch hint; msllm batches from "
                                      "runner_config.batch_size / generation_config.batch_size"),
    "model.model_config.rotary_dtype": "msllm computes the rotary tables in float32",
    "model.model_config.use_prompt_flash_attention": "Ascend inference kernel choice: speed only",
    "model.model_config.use_paged_attention": "Ascend paged-attention inference: speed/memory only",
    "model.model_config.block_size": "paged-attention block size (use_paged_attention only)",
    "model.model_config.num_blocks": "paged-attention block count (use_paged_attention only)",
    "model.model_config.is_dynamic": "dynamic-shape inference graphs on Ascend: speed only",
    "model.model_config.use_kvcache_op": "Ascend key/value cache operator choice: speed only",
    "model.model_config.is_flexible_shape": "Ascend inference shape option: speed only",
    "model.model_config.use_rope_slice": "rotary-embedding kernel choice: speed only",
    "model.model_config.compute_in_2d": "MindFormers' 2-D layout of activations: speed only",
    "model.model_config.use_past_shard": "sharding of the key/value cache (model parallel inference): memory only",
    "model.model_config.fine_grain_interleave": "Ascend communication/compute overlap: speed only",
    "model.model_config.qkv_concat": ("MindFormers' fused q/k/v weight layout; msllm's model keeps q, k, v "
                                      "apart and its checkpoint loader splits qkv_concat tensors"),
    "model.model_config.pretrain_seqlen": "deprecated in MindFormers (replaced by scaling_factor)",
    "model.model_config.need_nz": "Ascend weight format option",
    "model.model_config.llm_backend": "MindFormers inference backend choice",
    "model.model_config.boost_model_type": "MindFormers inference backend choice",
    # at MindFormers' place: looked up (compat.mindformers._generic) before pet_config moves to the
    # run config's top-level section (hoist_pet_config)
    "model.model_config.pet_config.in_channels": "msllm takes the adapter shapes from the layers",
    # read by no MindFormers LlamaConfig / LlamaForCausalLM (research/qwen2_5 YAMLs keep them
    # "copied from Qwen"; dev branch fd4deebc)
    "model.model_config.emb_dropout_prob": "MindFormers' LLaMA model never reads it (no embedding dropout)",
    "model.model_config.rotary_pct": "MindFormers' LLaMA model never reads it (the whole head is rotated)",
    "model.model_config.rotary_emb_base": "MindFormers' LLaMA model never reads it (its base is theta)",
    "model.model_config.auto_map": ("MindFormers' custom tokenizer classes (research/*_tokenizer.py); msllm "
                                    "reads the tokenizer given to the command (an HF directory's tokenizer.json)"),
    "model.model_config.pet_config.out_channels": "msllm takes the adapter shapes from the layers",
}

# key -> (neutral values, reason when neutral, why other values are refused)
NEUTRAL: dict[str, tuple[tuple, str, str]] = {
    "lr_scale": ((False, None), "learning-rate scaling by batch size is off",
                 "scaling the learning rate by the global batch size is not implemented; put the scaled "
                 "value in lr_schedule.learning_rate"),
    "{ds}.repeat": ((1, None), "1: each epoch reads the data once",
                    "repeating the dataset is not implemented; raise runner_config.epochs instead"),
    "parallel.auto_pipeline": ((False, None), "off", "automatic pipeline stage search is not implemented"),
    "lr_schedule.num_cycles": ((0.5,), "0.5: one half cosine, msllm's schedule",
                               "msllm's cosine schedule is one half cosine (num_cycles 0.5)"),
    "lr_schedule.warmup_lr_init": ((0, 0.0), "0: warmup starts from 0 as in msllm",
                                   "msllm's warmup starts from 0"),
    "model.model_config.quant": (("", None), "no quantization",
                                 "msllm's quantization is model.model_config.quantization_config (weight-only int8, "
                                 "inference)"),
    "parallel_config.context_parallel": ((1, None), "1: no sequence split",
                                         "context (sequence) parallelism is not implemented"),
    "load_ckpt_format": (("ckpt", "safetensors", None), "msllm tells a checkpoint's format from its file",
                         "msllm loads ckpt and safetensors checkpoints"),
}

# Arguments of MindFormers' callbacks: neutral values as in NEUTRAL ...
CALLBACK_ARGS_NEUTRAL: dict[str, tuple[tuple, str, str]] = {
    "CheckpointMonitor.save_checkpoint_seconds": ((0, None), "0: save by steps",
                                                  "time-based checkpointing is not implemented; use "
                                                  "save_checkpoint_steps"),
    "CheckpointMonitor.keep_checkpoint_per_n_minutes": ((0, None), "0: keep by count",
                                                        "time-based retention is not implemented; use "
                                                        "keep_checkpoint_max"),
    "CheckpointMonitor.enc_key": ((None, ""), "no encryption", "encrypted checkpoints are not supported"),
}

# ... and the ones msllm takes from elsewhere (key -> reason).
CALLBACK_ARGS_NO_EFFECT: dict[str, str] = {
    "MFLossMonitor.learning_rate": "filled in by MindFormers' trainer; msllm logs the schedule's value",
    "MFLossMonitor.micro_batch_num": "filled in by MindFormers' trainer from parallel_config",
    "MFLossMonitor.micro_batch_interleave_num": "filled in by MindFormers' trainer",
    "MFLossMonitor.origin_epochs": "filled in by MindFormers' trainer from runner_config.epochs",
    "MFLossMonitor.dataset_size": "filled in by MindFormers' trainer from the dataset",
    "MFLossMonitor.initial_epoch": _RESUME,
    "MFLossMonitor.initial_step": _RESUME,
    "MFLossMonitor.global_batch_size": "filled in by MindFormers' trainer; msllm computes it",
    "MFLossMonitor.gradient_accumulation_steps": "filled in by MindFormers' trainer from runner_config",
    "MFLossMonitor.check_for_nan_in_loss_and_grad": "msllm always checks for overflow (the log's overflow cond)",
    "CheckpointMonitor.integrated_save": ("merging sharded parameters at save time; msllm saves each rank's own "
                                          "parameters (merge with tools/transform_ckpt.py)"),
    "CheckpointMonitor.async_save": ("msllm writes checkpoints synchronously (temporary name, rename, "
                                     "manifest), so an interrupted write never looks complete"),
    "CheckpointMonitor.save_network_params": ("MindFormers also saves the weights alone; msllm's one checkpoint "
                                              "per step holds weights and optimizer state"),
    "CheckpointMonitor.save_trainable_params": ("MindFormers also saves the trainable weights alone; msllm's "
                                                "one checkpoint per step holds them"),
    "CheckpointMonitor.directory": "msllm saves under output_dir/checkpoint/rank_{r}",
    "CheckpointMonitor.append_info": "msllm's checkpoint manifest records step, epoch and the model config",
    "CheckpointMonitor.enc_mode": "used only with enc_key",
    "CheckpointMonitor.exception_save": ("msllm always saves the last completed step when an exception stops "
                                         "training between steps"),
    "CheckpointMonitor.remove_redundancy": "msllm saves each rank's own parameters",
    "CheckpointMonitor.config": "msllm builds the checkpoint settings from these keys",
    "SummaryMonitor.collect_freq": "msllm writes TensorBoard scalars at every logged step",
    "SummaryMonitor.collect_specified_data": "MindInsight summary option; msllm writes TensorBoard scalars",
    "SummaryMonitor.keep_default_action": "MindInsight summary option; msllm writes TensorBoard scalars",
    "SummaryMonitor.custom_lineage_data": "MindInsight summary option; msllm writes TensorBoard scalars",
    "SummaryMonitor.collect_tensor_freq": "MindInsight summary option; msllm writes TensorBoard scalars",
    "SummaryMonitor.max_file_size": "MindInsight summary option; msllm writes TensorBoard scalars",
    "SummaryMonitor.export_options": "MindInsight summary option; msllm writes TensorBoard scalars",
    "ProfileMonitor.output_path": "msllm writes the profile to output_dir/profile/rank_{r}",
    "ProfileMonitor.start_profile": "msllm starts the profiler at profile_start_step",
    "ProfileMonitor.profile_communication": "msllm's profile uses mindspore.Profiler's defaults",
    "ProfileMonitor.profile_memory": "msllm's profile uses mindspore.Profiler's defaults",
    "ObsMonitor.*": _OBS,
    "EvalCallBack.*": "msllm evaluates during training by do_eval / eval_step_interval / eval_epoch_interval",
}
