"""Issue #30, the parts of the dry-run that need no compile: the pipeline stage split (MindFormers'
offset / pp_interleave_num rule, refused by msllm before MindSpore), the version pin, the stub
source's special behaviours, the rank list, the parsers of MindSpore's output, the zero
initializers of the compile child and the clean-up of MindSpore's ./offload directory."""

from __future__ import annotations

import os
import re

import pytest

from msllm.dryrun import report as rep
from msllm.dryrun.driver import parse_ranks
from msllm.cluster.simulation import check_version, simulation_env, DeviceLayer
from msllm.cluster.stub_source import SOC_NAME, stub_source
from msllm.config import load_config
from msllm.errors import MsllmError
from msllm.parallel.stage_split import stage_assignment, stage_layers_of
from msllm.training.pipeline import check_pipeline_device

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_stage_assignment_follows_mindformers_layer_setting():
    # even split; chunk-major order with interleave (stage = chunk's position, as LayerSetting.pp_ids)
    assert stage_assignment(4, 2) == [(0, 0), (0, 0), (1, 0), (1, 0)]
    assert stage_assignment(8, 2, 0, 2) == [(0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1)]
    # offset: avg 40 // 3 = 13 per stage, +1 on the middle stage
    assert [s for s, _ in stage_assignment(40, 3, [0, 1, 0])].count(1) == 14
    # a negative offset moves layers off a stage (MindFormers' usual use on the last stage)
    assert [s for s, _ in stage_assignment(8, 2, [1, -1])].count(0) == 5


@pytest.mark.parametrize("layers,pp,offset,v,match", [
    (5, 2, 0, 1, r"num_layers=5 is not divisible by pipeline_stage=2: set model.model_config.offset"),
    (6, 2, [1, 0], 1, r"offset=\[1, 0\] sums to 1.*must sum to 0"),
    (4, 2, [2, -2], 1, r"leaves a pipeline stage without a layer"),
    (4, 2, [1, 0, 0], 1, r"expected an int, a list of pipeline_stage=2"),
    (7, 2, 0, 2, r"not divisible by pipeline_stage=2 x pp_interleave_num=2"),
])
def test_a_wrong_split_is_refused_before_mindspore(layers, pp, offset, v, match):
    with pytest.raises(MsllmError, match=match):
        stage_assignment(layers, pp, offset, v)


def test_the_yaml_keys_reach_the_split_and_cpu_refuses_pipelines():
    path = os.path.join(ROOT, "configs", "llama", "run_llama_70b.yaml")   # 80 layers, pp 4
    cfg = load_config(path, ["--model.model_config.offset=[1,0,0,-1]"])
    assert stage_layers_of(cfg.model_config, 4) == [21, 20, 20, 19]
    with pytest.raises(MsllmError, match="cannot compile pipeline stages on CPU.*--sim_level"):
        check_pipeline_device(load_config(path, ["--context.device_target=CPU"]))


def test_untested_mindspore_is_refused_with_one_message():
    check_version("2.10.0")
    with pytest.raises(MsllmError, match="tested with MindSpore 2.10.0; this is MindSpore 2.9.0"):
        check_version("2.9.0")


def test_stub_source_defines_each_name_and_the_four_behaviours():
    syms = ["aclInit", "aclrtGetSocName", "rtGetSocVersion", "_ZN2ge13StatusFactory8InstanceEv",
            "_ZN2ge15OperatorFactory14CreateOperatorERKSsS2_", "_ZN8optiling23CTilingDataClassFactory11GetInstanceEv"]
    src = stub_source(syms)
    for s in syms:
        assert f'__asm__("{s}")' in src
    assert "return &status_factory;" in src and "std::map<uint32_t, std::string>" in src
    assert "std::memset(ret, 0, 24)" in src                      # ge::Operator written to the return slot
    assert f'return "{SOC_NAME}";' in src and "strncpy" in src
    assert "static unsigned char block_5" in src                 # a singleton: a zeroed block, not null
    assert src.count("return 0; }") >= 1                         # everything else: 0


def test_simulation_env_sets_mindsporeS_variables_and_drops_cluster_ones():
    layer = DeviceLayer("/x/latest", stub=True, python_path="/x/latest/python")
    env = simulation_env(layer, 1, 5, 8, {"MS_ROLE": "MS_WORKER", "LD_LIBRARY_PATH": "/a", "PYTHONPATH": "/p"})
    assert env["MS_SIMULATION_LEVEL"] == "1" and env["RANK_ID"] == "5" and env["RANK_SIZE"] == "8"
    assert "MS_ROLE" not in env and env["ASCEND_HOME_PATH"] == "/x/latest"
    assert env["LD_LIBRARY_PATH"].split(":")[:3] == ["/x/latest/lib64", "/x/latest/lib64/driver", "/a"]
    assert env["PYTHONPATH"].split(":") == ["/x/latest/python", "/p"]
    with pytest.raises(MsllmError, match="levels 2 and 3 execute kernels"):
        simulation_env(layer, 2, 0, 8, {})
    with pytest.raises(MsllmError, match="expected 0..7"):
        simulation_env(layer, 1, 8, 8, {})


def test_parse_ranks():
    assert parse_ranks(None, 4) == [0, 1, 2, 3]
    assert parse_ranks("0,5", 8) == [0, 5]
    assert parse_ranks("[8,16]", 16) == list(range(8, 16))
    with pytest.raises(MsllmError, match="0..7"):
        parse_ranks("9", 8)


IR = """  %91(x) = AllReduce(%90) {instance name: f} primitive_attrs: {group: "2-65", op: "sum", group_rank_ids: (4, 5), no_eliminate: Bool(1)}
      : (<Tensor[Float32], (64, 128)>) -> (<Tensor[Float32], (64, 128)>)
      # Fullname with scope: (Default/network-PipelineCell/network-LlamaForCausalLM/model-LlamaModel/layers-CellList/2-DecoderLayer/self_attn-Attention/o_proj-Linear/AllReduce-op0)
  %5(y) = Send(%4) {instance name: s} primitive_attrs: {group_rank_ids: (1, 5)}
      # Fullname with scope: (Gradients/Default/Grad_Receive/Send-op0)
"""


def test_ir_and_memory_parsers():
    nodes = rep.collectives(IR)
    assert [(n["kind"], n["group"], n["layer"], n["backward"]) for n in nodes] == [
        ("AllReduce", (4, 5), 2, False), ("Send", (1, 5), None, True)]
    s = rep.summarize(nodes)
    assert s["total"] == {"AllReduce x2": 1, "Send x2": 1} and s["per_layer"] == {"2": {"AllReduce x2": 1}}
    # the graph's size: node lines and subgraph headers (a reused cell is one subgraph, BENCHMARKS.md)
    size = rep.graph_size("subgraph @3293_LlamaForCausalLM_construct_249(%para1_x) {\n" + IR)
    assert (size["nodes"], size["subgraphs"]) == (2, 1) and size["ir_bytes"] > len(IR)
    text = "Used peak memory usage (without fragments): 23716M\nActual peak memory usage (with fragments): 26244M\n"
    assert rep.parse_peak_memory(text) == {"used_peak_mib": 23716, "actual_peak_mib": 26244}
    assert rep.parse_peak_memory("nothing") is None
    msg = "The strategy of MatMul is not divisible\n\n------\n- C++ Call Stack"
    assert rep.key_for_error(msg) == "parallel_config.model_parallel / data_parallel"
    assert rep.first_lines(msg) == "The strategy of MatMul is not divisible"
    # the message the fp16 13B job gave before the pipeline step cast its gradients (issue #30)
    fp16 = "For primitive[AdamWeightDecay], the input type must be same. name:[grad]:Tensor[Float32]."
    assert rep.key_for_error(fp16).startswith("model.model_config.param_init_type")


@pytest.mark.parametrize("mode,size,match", [
    ("train", "3", r"RANK_SIZE 3, but the layout of .*run_llama_tiny.yaml .* has 2 ranks"),
    ("predict", "3", r"MODE 'predict' with --sim_level: the dry-run compiles a training job"),
    ("train", "4", r"has 3 devices but RANK_SIZE is 4"),
])
def test_run_distribute_sim_level_checks_its_arguments_before_compiling(mode, size, match):
    """scripts/run_distribute.sh with --sim_level runs the dry-run's launcher (msllm.dryrun.launch),
    which checks the arguments as a real launch does before compiling anything."""
    import subprocess
    import sys

    table = os.path.join(ROOT, "tests", "bad_inputs", "rank_table_3_devices.json")
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "run_distribute.sh"), table,
                        os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml"), "[0,3]", mode, size,
                        "--sim_level", "1"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode == 2 and re.search(match, r.stderr), r.stderr[-2000:]


def test_the_real_launcher_refuses_sim_level():
    from msllm.cluster.launch import launch

    table = os.path.join(ROOT, "tests", "bad_inputs", "rank_table_3_devices.json")
    with pytest.raises(MsllmError, match="--sim_level is the dry-run"):
        launch([table, os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml"), "[0,3]", "train", "3",
                "--sim_level", "1"])

def test_zero_initializers_swap_deferred_weights_for_zeros_of_the_same_shape_and_dtype():
    """What the dry-run child does before the level-1 step: every deferred initializer becomes Zero
    (MindSpore's Tensor.init_data then allocates np.zeros and writes nothing); shapes and dtypes
    are kept, values already Zero or already filled are left alone."""
    import mindspore as ms
    import numpy as np
    from mindspore import Parameter, Tensor, nn
    from mindspore.common.initializer import initializer
    from mindspore.nn.utils import no_init_parameters

    from msllm.dryrun.compile import zero_initializers

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(initializer("normal", (6, 4), ms.float16), name="w")
            self.m = Parameter(initializer("zeros", (6, 4), ms.float32), name="m")
            self.b = Parameter(Tensor(np.ones(4, np.float32)), name="b")  # filled at creation

    with no_init_parameters():
        net = Net()
    assert net.w.has_init and net.m.has_init and not net.b.has_init
    assert zero_initializers(net) == 1                    # only w: m is Zero already, b is filled
    assert zero_initializers(net) == 0
    w = net.w.init_data()
    assert w.shape == (6, 4) and w.dtype == ms.float16 and not np.any(w.asnumpy())
    np.testing.assert_array_equal(net.b.asnumpy(), np.ones(4, np.float32))


def test_the_empty_offload_directory_is_removed_and_a_non_empty_one_kept(tmp_path, monkeypatch):
    from msllm.dryrun.driver import OFFLOAD_DIR, remove_empty_offload_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / OFFLOAD_DIR).mkdir()
    assert remove_empty_offload_dir() and not (tmp_path / OFFLOAD_DIR).exists()
    assert not remove_empty_offload_dir()                 # nothing there: nothing done
    (tmp_path / OFFLOAD_DIR).mkdir()
    (tmp_path / OFFLOAD_DIR / "user.data").write_text("x")
    assert not remove_empty_offload_dir() and (tmp_path / OFFLOAD_DIR / "user.data").exists()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_deferred_embedding_table_keeps_its_dtype_for_the_pipeline_accumulator(dtype):
    """Built as the dry-run builds (under no_init_parameters), the embedding table's deferred
    initializer has the table's dtype, so the gradient accumulator MindSpore's pipeline clones from
    it (ParameterTuple.clone, as mindspore.nn.wrap's accumulators) has it too. Before, the table was
    made float32 and cast with set_dtype: the initializer stayed float32 and a 13B rank carried a
    float32 accumulator of its float16 table (625 MiB at 4 layers, docs/dryrun.md)."""
    import mindspore as ms
    from mindspore import ParameterTuple
    from mindspore.nn.utils import no_init_parameters

    from msllm.models.llama.config import preset
    from msllm.models.llama.model import LlamaModel

    want = getattr(ms, dtype)
    with no_init_parameters():
        model = LlamaModel(preset("tiny", num_layers=1, param_init_type=dtype))
    table = model.embed_tokens.embedding_table
    assert table.dtype == want and table.init_mode.dtype == want
    assert ParameterTuple([table]).clone(prefix="accu_grads", init="zeros")[0].dtype == want


def test_max_call_depth_reaches_mindspore():
    """context.max_call_depth (MindFormers' key; its LLaMA YAMLs say 10000) is MindSpore's: the
    80-layer 70B graph exceeds MindSpore's default 1000 (the dry-run: "Exceed function call depth
    limit 1000")."""
    import mindspore as ms

    from msllm.cluster.context import setup_runtime
    from msllm.config import load_config

    before = ms.get_context("max_call_depth")
    try:
        assert load_config(os.path.join(ROOT, "configs", "llama", "run_llama_70b.yaml")).context.max_call_depth == 10000
        setup_runtime(load_config(os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml"),
                                  ["--context.max_call_depth=4321", "--context.mode=1",
                                   "--parallel_config.data_parallel=1"]))
        assert ms.get_context("max_call_depth") == 4321
    finally:
        ms.set_context(max_call_depth=before)
