"""The train step of a pipelined layout (``parallel_config.pipeline_stage`` > 1), and the split of
decoder layers over stages with MindFormers' ``offset`` and ``pp_interleave_num`` keys.

MindSpore 2.10 pipelines a semi-auto-parallel network this way (``mindspore.nn.PipelineCell`` and
``mindspore.nn.PipelineGradReducer`` docstrings; tutorials ``parallel/pipeline_parallel.md``):

* every cell gets ``cell.pipeline_stage`` (and, with interleaving, ``cell.pipeline_segment``);
  MindSpore cuts the graph per stage and inserts Send/Receive between them;
* ``nn.PipelineCell(net_with_loss, micro_batch_num)`` slices the batch into micro batches along
  axis 0 and runs them through the stages (1F1B schedule, ``pipeline_config``); the loss is
  computed on the last stage only (the loss cell has the last stage);
* the gradients are accumulated over the micro batches and reduced by ``nn.PipelineGradReducer``
  before the optimizer; MindSpore's ``TrainOneStepCell`` around a ``PipelineCell`` fails to
  compile (``The pointer[grad_accu] is null``, measured with MindSpore 2.10 in a dry-run);
* the network the micro batches share is marked for lazy inlining (``mindspore.lazy_inline``),
  which MindSpore asks for with pipelines (``Pipeline Parallel with no 'lazy_inline' is
  deprecated``) and requires in 2.10's pipeline pass.

Stage split: :mod:`msllm.parallel.stage_split` (MindFormers' ``offset`` / ``pp_interleave_num``).

Execution needs an Ascend device (CPU cannot compile pipeline stages: ``Invalid backend: CPU``);
the dry-run (``--sim_level``) compiles it on any machine.
"""

from __future__ import annotations

from msllm.errors import MsllmError
from msllm.parallel.stage_split import stage_assignment


def accumulator_reducer(parameters, scale_sense: float):
    """MindSpore's ``nn.PipelineGradReducer`` for ``parameters`` (the gradients divided by the loss
    scale, the accumulators cleared for the next step), except how an accumulator is cleared with
    the optimizer shard on. MindSpore's reducer assigns ``zeros_like(accu_grad)``
    (``mindspore/nn/wrap/grad_reducer.py`` ``tensor_shard_grad_scale_pipeline``), which its frontend
    folds into one constant tensor per accumulator, kept in device memory for the whole run: the
    dry-run's memory tracker found them (``MS_ALLOC_CONF=memory_tracker:True``, docs/dryrun.md),
    3.3 GiB on a whole 13B rank. Here the zeros are computed from the accumulator itself
    (``select`` on a condition derived from the loss-scale parameter, always False, so not a
    constant): a short-lived kernel output, and exact zeros whatever the accumulator holds (an inf
    or NaN from an overflow included, which ``accu * 0`` would keep). Without the optimizer shard
    MindSpore's own path is used unchanged."""
    from mindspore import nn, ops

    scale_and_clear = ops.MultitypeFuncGraph("msllm_scale_and_clear")

    @scale_and_clear.register("Tensor", "Tensor", "Tensor", "Tensor")
    def _scale_and_clear(scale, never, grad, accu_grad):  # pylint: disable=unused-variable
        new_grad = grad * ops.reciprocal(scale)
        accu_grad = ops.depend(accu_grad, new_grad)
        cleared = ops.select(never, accu_grad, ops.zeros_like(never).astype(accu_grad.dtype))
        return ops.depend(new_grad, ops.assign(accu_grad, cleared))

    class AccumulatorReducer(nn.PipelineGradReducer):
        def construct(self, grads):
            if not self.opt_shard:
                return super().construct(grads)
            scale = self.scale_sense * self.degree
            never = scale < 0.0                      # a loss scale is positive
            return self.hyper_map(ops.partial(scale_and_clear, scale, never), grads, self.accu_grads)

    return AccumulatorReducer(parameters, scale_sense=scale_sense)


def mark_lazy_inline(network) -> str:
    """Mark ``network`` (the whole ``LlamaForCausalLM``, which ``PipelineCell`` calls once per micro
    batch) as MindSpore's ``@lazy_inline`` does after a cell's ``__init__``
    (``mindspore/graph/lazy_inline.py``: it sets ``cell_init_args`` to ``"lazy_inline_" + class
    name + the init arguments``). MindFormers decorates ``LlamaForCausalLM.__init__`` the same way;
    MindSpore's pipeline pass needs the micro batches to share this cell ("Pipeline parallel now
    only support shared_cell", measured). Returns the key set.

    Only the model is marked, not its decoder layers: MindSpore's docs allow ``lazy_inline`` on the
    outermost cell only when gradients are accumulated (``mindspore.lazy_inline``'s warnings),
    MindFormers marks its ``LLamaDecodeLayer`` in predict mode only (``predict_lazy_inline``,
    mindformers/models/llama/llama_transformer.py), and marking the layers too (one key per stage)
    fails in MindSpore 2.10 with ``For 'AssignAdd','value' must have the same rank as 'variable'``
    in the bprop of the pipeline's ``_VirtualAssignAdd`` (``ops/_grad_experimental/grad_comm_ops.py``;
    tiny dp2 x mp2 x pp2; with ``policy="front"`` the tiny job compiles, to the same graph, and the
    13B seed job's shapes fail the same way; BENCHMARKS.md "Dry-run"). The micro batches already
    share the model's one subgraph: the compiled graph grows by about 15 nodes per micro batch.
    """
    key = "lazy_inline_" + type(network).__name__ + repr(network.config)
    network.cell_init_args = key
    return key


def assign_stages(network, model_config, pipeline_stage: int) -> list[tuple[int, int]]:
    """Set ``pipeline_stage`` (and ``pipeline_segment`` with interleaving) on each decoder layer of
    ``network`` per :func:`stage_assignment`; the embedding is stage 0, the final norm, head and
    loss the last stage (set by :func:`msllm.parallel.apply.apply_layout`). Returns the assignment."""
    assign = stage_assignment(model_config.num_layers, pipeline_stage, getattr(model_config, "offset", 0),
                              getattr(model_config, "pp_interleave_num", 1))
    interleave = getattr(model_config, "pp_interleave_num", 1) > 1
    for layer, (stage, chunk) in zip(network.model.layers, assign):
        layer.pipeline_stage = stage
        if interleave:
            layer.pipeline_segment = chunk
    return assign


def check_pipeline_device(cfg) -> None:
    """Refuse executing a pipelined layout on CPU (one message); the dry-run compiles it."""
    if cfg.parallel_config.pipeline_stage > 1 and cfg.context.device_target == "CPU":
        raise MsllmError(f"parallel_config.pipeline_stage={cfg.parallel_config.pipeline_stage}: MindSpore 2.10 cannot "
                         "compile pipeline stages on CPU ('Invalid backend: CPU'); run it on Ascend, or compile it "
                         "here with the dry-run: run_msllm.py --config CONFIG --run_mode train --sim_level 1")


def build_pipeline_train_step(network, optimizer, cfg, packed: bool = False):
    """The pipelined train step: ``construct(input_ids, labels[, actual_seq_len]) -> loss`` (fp32
    scalar, meaningful on the last stage), input_ids / labels (B_global, T+1) int32 with
    ``B_global = batch_size x data_parallel x micro_batch_num`` (``full_batch``: every rank feeds
    the global batch); with ``packed`` also ``actual_seq_len`` (B_global, N) int32, the packed
    rows' document ends, which ``PipelineCell`` slices into micro batches with their rows.

    ``PipelineCell(network, micro_batch_num)`` -> gradients of its loss (sensitivity
    ``runner_wrapper.scale_sense`` for a fixed/dynamic scale, divided out by the reducer's
    ``scale_sense``) -> ``PipelineGradReducer`` -> optimizer. Loss scaling is static here: the
    overflow skip and dynamic scale of :class:`msllm.training.step.TrainStep` need the global
    gradient norm across stages, which this step does not compute yet (named in the dry-run's
    report). Gradient clipping likewise is not applied.
    """
    import mindspore as ms
    from mindspore import nn, ops

    pc = cfg.parallel_config
    rw = cfg.runner_wrapper
    sens = float(rw.scale_sense) if rw.loss_scale != "none" else 1.0

    from msllm.training.step import _WithDocuments

    class PipelineTrainStep(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            # a cell of exactly three inputs for packed rows (step.py says why)
            self.network = nn.PipelineCell(_WithDocuments(network) if packed else network, pc.micro_batch_num)
            self.optimizer = optimizer
            self.weights = optimizer.parameters
            self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
            self.reducer = accumulator_reducer(self.weights, sens)
            self.sens = sens

        def construct(self, *inputs):   # (input_ids, labels) or, packed, (..., actual_seq_len)
            loss = self.network(*inputs)
            sens = ops.fill(ms.float32, loss.shape, self.sens)
            grads = self.grad(self.network, self.weights)(*inputs, sens)
            grads = self.reducer(grads)
            # gradients in each parameter's dtype, as the optimizer updates them (TrainStep's convention)
            grads = tuple(ops.cast(g, w.dtype) for g, w in zip(grads, self.weights))
            return ops.depend(loss, self.optimizer(grads))

    step = PipelineTrainStep()
    step.set_train()
    return step


__all__ = ["accumulator_reducer", "assign_stages", "build_pipeline_train_step", "check_pipeline_device",
           "mark_lazy_inline"]
