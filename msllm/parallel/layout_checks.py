"""Checks of a parallel layout against the model and the run, and the split of decoder layers
over pipeline stages.

A layout is ``data_parallel x model_parallel x pipeline_stage`` (Megatron-LM terms, MindFormers'
``parallel_config`` keys). :func:`validate_layout` checks it against a :class:`LlamaConfig` (the
rules the sharding table of :mod:`msllm.parallel.layout_rules` relies on), :func:`validate_run_layout`
against a whole :class:`RunConfig` (parallel mode, optimizer-shard switches, global batch).
Pipeline: embedding on stage 0, decoder layers split evenly over ``pipeline_stage`` stages (or per
an explicit per-stage list, :func:`stage_layer_counts`), final norm, head and loss on the last
stage. Nothing here builds a network.
"""

from __future__ import annotations

from typing import Optional, Sequence

from msllm.errors import MsllmError


def stage_layer_counts(num_layers: int, pipeline_stage: int,
                       stage_layers: Optional[Sequence[int]] = None) -> list[int]:
    """Decoder layers per pipeline stage.

    ``stage_layers`` (explicit, one count per stage, each >= 1, summing to ``num_layers``) wins.
    Otherwise layers are split as evenly as possible; when ``num_layers % pipeline_stage != 0``
    the extra layers go to the middle stages first (stage 0 already holds the embedding and the
    most in-flight micro batches under 1F1B, the last stage the output head and loss).

    Raises:
        MsllmError: a bad explicit list or fewer layers than stages.
    """
    if stage_layers is not None:
        counts = [int(c) for c in stage_layers]
        if len(counts) != pipeline_stage:
            raise MsllmError(f"stage_layers={counts} has {len(counts)} entries, but "
                             f"parallel_config.pipeline_stage={pipeline_stage}: give one layer count per stage")
        if any(c < 1 for c in counts):
            raise MsllmError(f"stage_layers={counts}: every pipeline stage needs at least one layer")
        if sum(counts) != num_layers:
            raise MsllmError(f"stage_layers={counts} sums to {sum(counts)}, but "
                             f"model.model_config.num_layers={num_layers}")
        return counts
    if num_layers < pipeline_stage:
        raise MsllmError(f"parallel_config.pipeline_stage={pipeline_stage} exceeds "
                         f"model.model_config.num_layers={num_layers}: every stage needs a layer")
    base, extra = divmod(num_layers, pipeline_stage)
    counts = [base] * pipeline_stage
    order = list(range(1, pipeline_stage - 1)) + [pipeline_stage - 1, 0] if pipeline_stage > 2 \
        else list(range(pipeline_stage))[::-1]
    for s in order[:extra]:
        counts[s] += 1
    return counts


def layer_stages(num_layers: int, pipeline_stage: int,
                 stage_layers: Optional[Sequence[int]] = None) -> list[int]:
    """The pipeline stage of each decoder layer, in layer order (see :func:`stage_layer_counts`)."""
    out: list[int] = []
    for stage, count in enumerate(stage_layer_counts(num_layers, pipeline_stage, stage_layers)):
        out.extend([stage] * count)
    return out


def _check_experts(mc, pc) -> None:
    """Mixture-of-experts rules: expert_parallel only with experts and dividing expert_num; each
    expert's and the shared expert's width divisible by model_parallel; no pipeline stages (the
    load-balancing loss sums router statistics over every layer, which a pipeline would cut)."""
    moe, ep, mp = mc.moe_config, pc.expert_parallel, pc.model_parallel
    if moe is None:
        if ep > 1:
            raise MsllmError(f"parallel_config.expert_parallel={ep} without model.model_config.moe_config: "
                             "a dense model has no experts to split")
        return
    if moe.expert_num % ep:
        raise MsllmError(f"model.model_config.moe_config.expert_num={moe.expert_num} is not divisible by "
                         f"parallel_config.expert_parallel={ep}: each expert-parallel rank holds expert_num / ep")
    for key, width in (("moe_intermediate_size (each expert's width)", mc.expert_size),
                       ("shared_expert_intermediate_size", moe.shared_expert_intermediate_size)):
        if width % mp:
            raise MsllmError(f"model.model_config.moe_config.{key}={width} is not divisible by "
                             f"parallel_config.model_parallel={mp}")
    if pc.pipeline_stage > 1:
        raise MsllmError(f"model.model_config.moe_config with parallel_config.pipeline_stage={pc.pipeline_stage}: "
                         "pipeline-parallel mixture of experts is not implemented (the load-balancing loss pools "
                         "the router statistics of every layer); use data, expert and model parallel")


def validate_layout(model_config, parallel_config, device_num: Optional[int] = None,
                    global_batch_size: Optional[int] = None,
                    stage_layers: Optional[Sequence[int]] = None) -> list[int]:
    """Check a :class:`ParallelLayoutConfig` against a :class:`LlamaConfig`; returns layers per stage.

    Rules (each failure is one :class:`MsllmError` naming the key):
        * data_parallel, model_parallel, pipeline_stage, micro_batch_num >= 1;
        * num_heads and n_kv_heads divisible by model_parallel (heads are the unit of the
          attention split; GQA key/value heads too, Ainslie et al. 2023);
        * intermediate (ffn) size divisible by model_parallel (column/row split of the MLP);
        * vocab_size divisible by model_parallel when ``vocab_emb_dp`` is False (vocab-parallel
          embedding and head);
        * seq_length divisible by model_parallel with ``use_seq_parallel``;
        * num_layers >= pipeline_stage, or a valid explicit ``stage_layers`` list;
        * pipeline_stage > 1: micro_batch_num >= pipeline_stage (1F1B needs the pipeline full)
          and untied embeddings (a table shared by the first and last stage is not supported);
        * ``global_batch_size`` (if given) divisible by data_parallel x micro_batch_num;
        * ``device_num`` (if given) == data_parallel x model_parallel x pipeline_stage.
    """
    pc, mc = parallel_config, model_config
    pc.validate("parallel_config")
    mp = pc.model_parallel
    _check_experts(mc, pc)
    if mc.num_heads % mp:
        raise MsllmError(f"model.model_config.num_heads={mc.num_heads} is not divisible by "
                         f"parallel_config.model_parallel={mp}: attention is split by heads")
    if mc.kv_heads % mp:
        raise MsllmError(f"model.model_config.n_kv_heads={mc.kv_heads} is not divisible by "
                         f"parallel_config.model_parallel={mp}: key/value heads are split like query heads")
    if mc.ffn_size % mp:
        raise MsllmError(f"model.model_config.intermediate_size (ffn size {mc.ffn_size}) is not divisible "
                         f"by parallel_config.model_parallel={mp}")
    if not pc.vocab_emb_dp and mc.vocab_size % mp:
        raise MsllmError(f"model.model_config.vocab_size={mc.vocab_size} is not divisible by "
                         f"parallel_config.model_parallel={mp}, which a vocab-parallel embedding needs "
                         "(parallel_config.vocab_emb_dp=False); set vocab_emb_dp: True or pad the vocabulary")
    if pc.use_seq_parallel and mc.seq_length % mp:
        raise MsllmError(f"parallel_config.use_seq_parallel needs model.model_config.seq_length="
                         f"{mc.seq_length} divisible by parallel_config.model_parallel={mp}")
    counts = stage_layer_counts(mc.num_layers, pc.pipeline_stage, stage_layers)
    if pc.pipeline_stage > 1:
        if pc.micro_batch_num < pc.pipeline_stage:
            raise MsllmError(f"parallel_config.micro_batch_num={pc.micro_batch_num} is smaller than "
                             f"parallel_config.pipeline_stage={pc.pipeline_stage}: 1F1B pipelining needs at "
                             "least one micro batch per stage")
        if mc.tie_word_embeddings:
            raise MsllmError("model.model_config.tie_word_embeddings=True with parallel_config.pipeline_stage"
                             f"={pc.pipeline_stage}: a table shared by the first and last stage is not supported")
    if global_batch_size is not None and global_batch_size % (pc.data_parallel * pc.micro_batch_num):
        raise MsllmError(f"global batch size {global_batch_size} is not divisible by parallel_config."
                         f"data_parallel x micro_batch_num = {pc.data_parallel} x {pc.micro_batch_num}")
    if device_num is not None and device_num != pc.device_num:
        raise MsllmError(f"parallel_config: data_parallel x model_parallel x pipeline_stage = "
                         f"{pc.data_parallel} x {mp} x {pc.pipeline_stage} = {pc.device_num}, "
                         f"but the device count is {device_num}")
    return counts


def global_batch_size(run_config) -> int:
    """Samples per optimizer step over all ranks, MindFormers' formula:
    ``batch_size x data_parallel x micro_batch_num x gradient_accumulation_steps``, where
    ``runner_config.batch_size`` is one micro batch of one data-parallel rank
    (``micro_batch_num`` counts only when pipelining, ``pipeline_stage > 1``)."""
    pc, rc = run_config.parallel_config, run_config.runner_config
    micro = pc.micro_batch_num if pc.pipeline_stage > 1 else 1
    return rc.batch_size * pc.data_parallel * micro * rc.gradient_accumulation_steps


def optimizer_shard_enabled(run_config) -> bool:
    """Whether the run shards the optimizer; ``parallel_config.optimizer_shard`` and
    ``parallel.enable_parallel_optimizer`` must agree (MsllmError otherwise)."""
    a, b = run_config.parallel_config.optimizer_shard, run_config.parallel.enable_parallel_optimizer
    if a != b:
        raise MsllmError(f"parallel_config.optimizer_shard={a} disagrees with parallel.enable_parallel_optimizer"
                         f"={b}; they name the same switch (MindSpore's parallel optimizer): set both")
    return a


def validate_run_layout(run_config, device_num: Optional[int] = None,
                        stage_layers: Optional[Sequence[int]] = None) -> list[int]:
    """:func:`validate_layout` for a whole :class:`RunConfig`, plus the rules joining sections:
    model_parallel/pipeline_stage > 1 need ``parallel.parallel_mode`` semi_auto_parallel, and the
    two optimizer-shard switches must agree; MoE's capacity dispatch (``capacity_factor`` > 0) is
    refused under semi_auto_parallel (MindSpore rejects it). Returns the layers per stage."""
    pc = run_config.parallel_config
    mode = run_config.parallel.mode_name
    if (pc.model_parallel > 1 or pc.pipeline_stage > 1) and mode != "semi_auto_parallel":
        raise MsllmError(f"parallel_config.model_parallel={pc.model_parallel}, pipeline_stage="
                         f"{pc.pipeline_stage} need parallel.parallel_mode: 1 (semi_auto_parallel), "
                         f"got {run_config.parallel.parallel_mode!r}")
    if mode in ("auto_parallel", "hybrid_parallel"):
        raise MsllmError(f"parallel.parallel_mode={run_config.parallel.parallel_mode!r}: msllm sets strategies "
                         "by hand; use 0 (data_parallel) or 1 (semi_auto_parallel)")
    moe = run_config.model_config.moe_config
    if mode == "semi_auto_parallel" and moe is not None and moe.capacity_factor > 0:
        # compiled by MindSpore's dry-run (docs/dryrun.md): "Failure:operator Select init failed"
        raise MsllmError(f"model.model_config.moe_config.capacity_factor={moe.capacity_factor} with "
                         "parallel.parallel_mode semi_auto_parallel: MindSpore rejects msllm's capacity dispatch "
                         "(queues over the whole batch's token choices) under operator sharding; use "
                         "capacity_factor: 0 (dropless: each expert runs on every token under a layout) "
                         "or parallel_mode 0 (data_parallel)")
    optimizer_shard_enabled(run_config)
    return validate_layout(run_config.model_config, pc, device_num, global_batch_size(run_config), stage_layers)


def check_packed_layout(run_config, source: str) -> None:
    """Refuse packed rows (``actual_seq_len``, read from ``source``) under operator sharding or
    pipeline stages (``parallel_mode`` semi_auto_parallel; data parallel takes every form) where
    msllm cannot build them: with MindSpore's ``FlashAttentionScore``
    (``use_flash_attention``), whose TND layout takes the batch's cumulative document ends over all
    B x T tokens, and MindSpore accepts it sharded only with those ends split by dp (dry-run probe,
    docs/packing.md), but does not document whether it rebases each shard's ends, which cannot be
    checked without a device. The composed attention trains packed rows under every layout."""
    from msllm.kernels import select

    if run_config.parallel.mode_name == "data_parallel":
        return
    if select.choose(run_config.model_config, fast_paths=False, device="Ascend").attention == select.ASCEND_FLASH:
        raise MsllmError(f"train_dataset {source!r} holds packed rows (actual_seq_len) and "
                         "model.model_config.use_flash_attention is True under parallel_mode semi_auto_parallel: "
                         "FlashAttentionScore's per-document (TND) form is not established under operator sharding "
                         "(docs/packing.md); set use_flash_attention: False (the composed attention keeps each "
                         "document to itself) or use unpacked data")


__all__ = ["check_packed_layout", "global_batch_size", "layer_stages", "optimizer_shard_enabled",
           "stage_layer_counts", "validate_layout", "validate_run_layout"]
