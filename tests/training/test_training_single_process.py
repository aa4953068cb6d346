"""One-process training on real Alpaca data: loss falls, checkpoints are written, kept, loadable;
configs the device cannot run are refused with one clear message."""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from msllm.config import load_config
from msllm.training import checkpoint as ckpt
from msllm.training.schedule import cosine_with_warmup

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml")


def test_cosine_schedule_shape():
    lr = cosine_with_warmup(100, 1e-3, 1e-5, 10)
    assert lr.shape == (100,) and lr.dtype == np.float32
    assert lr[0] == pytest.approx(1e-4) and lr[9] == pytest.approx(1e-3)
    assert np.all(np.diff(lr[10:]) <= 0) and lr[-1] == pytest.approx(1e-5, rel=0.05)


def run(args, cwd=ROOT):
    env = dict(os.environ, GLOG_v="3")
    for k in ("MS_WORKER_NUM", "RANK_SIZE", "MS_ROLE"):
        env.pop(k, None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_train_loss_falls_and_checkpoints_are_kept_and_loadable(tmp_path, alpaca_mindrecord):
    out = tmp_path / "out"
    r = run(["--config", TINY, "--run_mode", "train", "--parallel_config.data_parallel=1",
             "--model.model_config.seq_length=64", f"--train_dataset_dir={alpaca_mindrecord}",
             f"--output_dir={out}", "--runner_config.train_steps=40", "--runner_config.batch_size=8",
             "--lr_schedule.learning_rate=3e-3", "--callbacks.checkpoint.save_checkpoint_steps=10",
             "--callbacks.checkpoint.keep_checkpoint_max=2", "--runner_config.sink_mode=True",
             "--profile=True", "--profile_start_step=2", "--profile_stop_step=3",
             "--do_eval=True", f"--eval_dataset_dir={alpaca_mindrecord}", "--eval_step_interval=20",
             "--eval_dataset.batch_size=16", f"--tensorboard.tensorboard_dir={tmp_path / 'tb'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    # MindFormers' default sink_mode: True does not stop a run; the start-up line says what happens
    assert "settings with no effect on this run: runner_config.sink_mode=True" in log
    assert "steps are fed one by one" in log
    assert "step:[   40/   40]" in log and "tgs:" in log and "MFU:" in log
    # do_eval at steps 20 and 40 (the step interval; the epoch end at 40 is not evaluated twice)
    evals = re.findall(r"eval: step (\d+), epoch \d+, loss ([0-9.]+), perplexity ([0-9.]+)", log)
    assert [int(s) for s, _, _ in evals] == [20, 40]
    assert all(abs(np.exp(float(lo)) - float(p)) < 1e-2 * float(p) for _, lo, p in evals)
    # TensorBoard events, read back with TensorBoard's own reader, hold the logged losses
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb" / "rank_0"), size_guidance={"scalars": 0})
    acc.Reload()
    logged = [float(x) for x in re.findall(r"loss:\[([0-9.]+)/", log)]
    tb_loss = [e.value for e in acc.Scalars("loss")]
    assert len(tb_loss) == 40 and len(logged) == 4  # per_print_times 10 in the tiny config
    np.testing.assert_allclose([tb_loss[i] for i in (9, 19, 29, 39)], logged, atol=5e-4)
    assert [e.step for e in acc.Scalars("eval-loss")] == [20, 40]
    assert (out / "loss_curve_rank_0.png").stat().st_size > 10_000 and "loss curve:" in log
    summary = json.loads((out / "train_summary_rank_0.json").read_text())
    assert summary["steps"] == 40
    assert summary["last_avg_loss"] < summary["first_avg_loss"] - 1.0  # ln(32000)=10.4 -> clearly lower
    files = ckpt.list_checkpoints(str(out / "checkpoint" / "rank_0"))
    assert [os.path.basename(f) for f in files] == ["checkpoint_0-1_30.ckpt", "checkpoint_0-1_40.ckpt"]
    assert (out / "msllm_config.yaml").exists()
    traces = [os.path.join(d, f) for d, _, fs in os.walk(out / "profile" / "rank_0") for f in fs]
    assert any(t.endswith("trace_view.json") for t in traces), traces
    cfg = load_config(str(out / "msllm_config.yaml"))
    assert cfg.runner_config.train_steps == 40
    # the last checkpoint holds weights, optimizer moments, step and loss scale
    import mindspore as ms
    params = ckpt.load_params(files[-1])
    assert int(params["step_num"]) == 40 if not hasattr(params["step_num"], "asnumpy") \
        else int(params["step_num"].asnumpy()) == 40
    assert "adam_m.model.layers.0.mlp.up_proj.weight" in params and "loss_scale" in params
    from msllm.models.llama.model import LlamaForCausalLM
    ms.set_device("CPU")
    net = LlamaForCausalLM(cfg.model_config)
    ckpt.load_into(net, params, files[-1])
    w = net.model.layers[0].mlp.up_proj.weight.asnumpy()
    np.testing.assert_array_equal(w, params["model.layers.0.mlp.up_proj.weight"].asnumpy())


def test_checkpoint_shape_mismatch_is_one_clear_error(tmp_path):
    import mindspore as ms
    from msllm.errors import MsllmError
    from msllm.models.llama.config import LlamaConfig
    from msllm.models.llama.model import LlamaForCausalLM
    ms.set_device("CPU")
    a = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, seq_length=8))
    b = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2,
                                     intermediate_size=24, seq_length=8))
    path = str(tmp_path / "a_0-1_1.ckpt")
    ckpt.save_checkpoint(a, path, 1, 1)
    with pytest.raises(MsllmError, match=r"mlp\.\w+_proj\.weight has shape .* expects"):
        ckpt.load_into(b, ckpt.load_params(path), path)


@pytest.mark.parametrize("override,message", [
    ("--parallel_config.model_parallel=2", "cannot compile operator sharding or pipeline stages on CPU"),
    ("--parallel_config.pipeline_stage=2", "cannot compile operator sharding or pipeline stages on CPU"),
    ("--parallel.parallel_mode=1", "use parallel_mode: 0"),
    ("--model.model_config.compute_dtype=float16", "no bf16 kernels"),
    ("--model.model_config.cpu_kernels=False --model.model_config.compute_dtype=bfloat16",
     "compute_dtype: bfloat16 on CPU runs on msllm's CPU kernels"),
    ("--model.model_config.compute_dtype=bfloat16 --model.model_config.layernorm_compute_type=bfloat16",
     "needs layernorm_compute_type and softmax_compute_type float32"),
])
def test_refuses_what_it_cannot_do(tmp_path, override, message):
    r = run(["--config", TINY, *override.split(), "--parallel_config.data_parallel=1", f"--output_dir={tmp_path}"])
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "checkpoint")


def test_trains_with_bf16_compute_on_the_cpu_kernels(tmp_path, alpaca_mindrecord):
    """compute_dtype: bfloat16 (MindFormers' training setting) runs on CPU with float32 parameters:
    the start-up line says what it means here, the loss falls, and the checkpoint holds float32
    weights (the GEMM precision is tested in tests/kernels/test_kernels_bf16_gemm.py and
    tests/models/test_llama_bf16_compute.py)."""
    out = tmp_path / "out"
    r = run(["--config", TINY, "--run_mode", "train", "--parallel_config.data_parallel=1",
             "--model.model_config.compute_dtype=bfloat16", "--model.model_config.seq_length=64",
             f"--train_dataset_dir={alpaca_mindrecord}", f"--output_dir={out}", "--runner_config.train_steps=20",
             "--runner_config.batch_size=8", "--lr_schedule.learning_rate=3e-3",
             "--callbacks.checkpoint.save_checkpoint_steps=20"])
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert "compute_dtype bfloat16: GEMM inputs rounded to bfloat16, float32 sums" in log
    assert "MFU peak: CPU bfloat16 GEMM" in log   # MFU against the unit the GEMMs run on, not float32's
    summary = json.loads((out / "train_summary_rank_0.json").read_text())
    assert summary["steps"] == 20 and summary["last_avg_loss"] < summary["first_avg_loss"] - 0.5
    params = ckpt.load_params(ckpt.list_checkpoints(str(out / "checkpoint" / "rank_0"))[-1])
    import mindspore as ms
    weights = [v for k, v in params.items() if k.endswith("q_proj.weight")]
    assert weights and all(v.dtype == ms.float32 for v in weights)


def test_data_parallel_must_match_process_count(tmp_path):
    r = run(["--config", TINY, f"--output_dir={tmp_path}"])  # tiny asks for data_parallel 2
    assert r.returncode == 2
    assert "2 processes, but 1 were started" in r.stderr


def test_finetune_needs_a_checkpoint(tmp_path, alpaca_mindrecord):
    r = run(["--config", TINY, "--run_mode", "finetune", "--parallel_config.data_parallel=1",
             "--model.model_config.seq_length=64", f"--train_dataset_dir={alpaca_mindrecord}",
             f"--output_dir={tmp_path}"])
    assert r.returncode == 2 and "needs load_checkpoint" in r.stderr


@pytest.mark.slow
def test_finetune_from_a_mindformers_named_checkpoint(tmp_path, alpaca_mindrecord):
    """A MindFormers user's checkpoint (its LLaMA parameter names) is a valid load_checkpoint."""
    import mindspore as ms
    from msllm.convert.mindformers import msllm_to_mindformers_name
    from msllm.models.llama.model import LlamaForCausalLM
    ms.set_device("CPU")
    cfg = load_config(TINY, ["--model.model_config.seq_length=64"])
    net = LlamaForCausalLM(cfg.model_config)
    entries = [{"name": msllm_to_mindformers_name(p.name), "data": p} for p in net.trainable_params()]
    assert any(e["name"] == "model.layers.0.attention.wq.weight" for e in entries)
    mf = str(tmp_path / "mindformers_llama.ckpt")
    ms.save_checkpoint(entries, mf)
    out = tmp_path / "out"
    r = run(["--config", TINY, "--run_mode", "finetune", "--parallel_config.data_parallel=1",
             "--model.model_config.seq_length=64", f"--train_dataset_dir={alpaca_mindrecord}",
             f"--output_dir={out}", "--runner_config.train_steps=2", f"--load_checkpoint={mf}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"loaded weights from {mf}" in r.stdout + r.stderr
    # the first step's loss is the loaded model's loss on that batch, not a fresh random init's
    from msllm.data.dataset import build_train_data
    data = build_train_data(alpaca_mindrecord, 64, cfg.runner_config.batch_size, True, True, 0, 1, cfg.seed)
    input_ids, labels = next(data.epoch_batches(0))
    expected = float(net(input_ids, labels).asnumpy())
    first = json.loads((out / "train_summary_rank_0.json").read_text())["losses"][0]
    assert abs(first - expected) < 1e-4, (first, expected)


def test_pipeline_training_is_accepted_on_ascend_and_refused_on_cpu():
    """Issue #30: pipeline_stage > 1 trains on Ascend (msllm/training/pipeline.py, compiled by the
    dry-run in tests/cluster/test_dryrun.py); CPU cannot compile stages; a split MindFormers
    would refuse is refused before MindSpore."""
    from msllm.cluster.context import check_device_support
    from msllm.errors import MsllmError
    path = os.path.join(ROOT, "configs", "llama", "run_llama_70b.yaml")  # Ascend, pp 4, 80 layers
    check_device_support(load_config(path))
    with pytest.raises(MsllmError, match="pipeline_stage=4.*Invalid backend: CPU"):
        check_device_support(load_config(path, ["--context.device_target=CPU"]))
    with pytest.raises(MsllmError, match="offset=.*sums to 1"):
        check_device_support(load_config(path, ["--model.model_config.offset=[1,0,0,0]"]))
    check_device_support(load_config(os.path.join(ROOT, "configs", "llama", "run_llama_13b.yaml")))


@pytest.mark.slow
def test_auto_trans_ckpt_merges_a_model_parallel_checkpoint_at_start(tmp_path, alpaca_mindrecord):
    """A checkpoint sharded model_parallel=2 (with its strategy files) trains on 1 CPU process with
    auto_trans_ckpt: the first loss is the full model's loss on the first batch."""
    import mindspore as ms
    from msllm.config import ParallelLayoutConfig
    from msllm.data.dataset import build_train_data
    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.parallel.reshard import transform_checkpoints
    from msllm.parallel.strategy import write_strategy_files
    ms.set_device("CPU")
    cfg = load_config(TINY, ["--model.model_config.seq_length=64"])
    net = LlamaForCausalLM(cfg.model_config)
    full = tmp_path / "full" / "rank_0"
    full.mkdir(parents=True)
    ms.save_checkpoint(net, str(full / "checkpoint_0.ckpt"))
    strategy = tmp_path / "strategy_mp2"
    write_strategy_files(cfg.model_config, ParallelLayoutConfig(model_parallel=2), str(strategy))
    transform_checkpoints(str(tmp_path / "full"), str(tmp_path / "mp2"), None, str(strategy))
    assert sorted(os.listdir(tmp_path / "mp2")) == ["rank_0", "rank_1"]
    out = tmp_path / "out"
    r = run(["--config", TINY, "--parallel_config.data_parallel=1", "--model.model_config.seq_length=64",
             f"--train_dataset_dir={alpaca_mindrecord}", f"--output_dir={out}", "--runner_config.train_steps=1",
             f"--load_checkpoint={tmp_path / 'mp2'}", f"--src_strategy_path_or_dir={strategy}",
             "--auto_trans_ckpt=True"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "auto_trans_ckpt: resharded" in r.stdout + r.stderr
    data = build_train_data(alpaca_mindrecord, 64, cfg.runner_config.batch_size, True, True, 0, 1, cfg.seed)
    expected = float(net(*next(data.epoch_batches(0))).asnumpy())
    first = json.loads((out / "train_summary_rank_0.json").read_text())["losses"][0]
    assert abs(first - expected) < 1e-4, (first, expected)


@pytest.mark.slow
def test_exception_between_steps_saves_the_last_completed_step(tmp_path, alpaca_mindrecord):
    """The input pipeline fails before step 4 (as a vanished disk would): the run saves step 3,
    names it in the log, and exits non-zero; resuming from it continues at step 4."""
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        import msllm.data.dataset as dataset
        original = dataset.TrainData.epoch_batches
        def failing(self, epoch, start_step=0):
            for i, batch in enumerate(original(self, epoch, start_step)):
                if i == 3:
                    raise RuntimeError("the dataset disk went away")
                yield batch
        dataset.TrainData.epoch_batches = failing
        from msllm.cli import main
        main(sys.argv[1:])
    """)
    args = ["--config", TINY, "--parallel_config.data_parallel=1", "--model.model_config.seq_length=64",
            f"--train_dataset_dir={alpaca_mindrecord}", f"--output_dir={out}", "--runner_config.train_steps=6",
            "--callbacks.checkpoint.save_checkpoint_steps=100"]
    env = dict(os.environ, GLOG_v="3")
    r = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    log = r.stdout + r.stderr
    assert "failed after step 3 (RuntimeError: the dataset disk went away); saved" in log, log[-3000:]
    good = ckpt.good_checkpoints(str(out / "checkpoint" / "rank_0"))
    assert list(good) == [3]
    r = run(args + ["--resume_training=True"])
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "train_summary_rank_0.json").read_text())
    assert s["start_step"] == 3 and s["steps"] == 3


@pytest.mark.parametrize("case", ["qwen2_bias_yarn", "mistral_window16", "mixtral_moe"])
def test_finetune_straight_from_a_family_hf_directory(tmp_path, alpaca_mindrecord, case):
    """run_msllm.py finetune with an HF Qwen2 / Mistral / Mixtral directory as load_checkpoint:
    config.json decides the model (biases, YaRN, the sliding window, experts) and the first step's
    loss equals transformers' loss on the same batch (for Mixtral with the load-balancing term)."""
    import torch

    from helpers.families import FAMILY_CASES
    from msllm.convert.verify import make_random_hf_model
    from msllm.data.dataset import build_train_data

    kw = {**FAMILY_CASES[case], "vocab_size": 32000}   # the real LLaMA tokenizer's ids of the bundled data
    hf = make_random_hf_model(str(tmp_path / "hf"), seed=5, **kw)
    out = tmp_path / "out"
    r = run(["--config", TINY, "--run_mode", "finetune", "--parallel_config.data_parallel=1",
             "--model.model_config.seq_length=64", f"--train_dataset_dir={alpaca_mindrecord}",
             f"--output_dir={out}", "--runner_config.train_steps=2", f"--load_checkpoint={tmp_path / 'hf'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = load_config(TINY, ["--model.model_config.seq_length=64"])
    data = build_train_data(alpaca_mindrecord, 64, cfg.runner_config.batch_size, True, True, 0, 1, cfg.seed)
    input_ids, labels = next(data.epoch_batches(0))
    ids, targets = input_ids.asnumpy(), torch.from_numpy(labels.asnumpy()[:, 1:]).long()
    with torch.no_grad():   # the T tokens the model runs and their next-token targets (the router's rows too)
        expected = hf(input_ids=torch.from_numpy(ids[:, :-1]).long(), labels=targets, shift_labels=targets).loss.item()
    first = json.loads((out / "train_summary_rank_0.json").read_text())["losses"][0]
    assert abs(first - expected) < 1e-4 * expected, (first, expected)


def test_capacity_factor_drops_token_choices_and_the_log_says_how_many(tmp_path, alpaca_mindrecord):
    """Fine-tuning an HF Mixtral directory with the YAML's moe_config.capacity_factor 0.5 (graph
    mode, msllm's capacity dispatch): every experts' step logs the load-balancing loss, the
    dropped share and the experts' smallest / largest share; with capacity ceil(k N 0.5 / E) the
    experts keep at most E x capacity of the k N choices, so at least that much is dropped."""
    from helpers.families import FAMILY_CASES
    from msllm.convert.verify import make_random_hf_model
    from msllm.models.llama.moe import expert_capacity

    kw = {**FAMILY_CASES["mixtral_moe"], "vocab_size": 32000}
    make_random_hf_model(str(tmp_path / "hf"), seed=7, **kw)
    out = tmp_path / "out"
    r = run(["--config", TINY, "--run_mode", "finetune", "--parallel_config.data_parallel=1",
             "--model.model_config.seq_length=64", f"--train_dataset_dir={alpaca_mindrecord}",
             f"--output_dir={out}", "--runner_config.train_steps=2", f"--load_checkpoint={tmp_path / 'hf'}",
             "--model.model_config.moe_config.capacity_factor=0.5"])
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "train_summary_rank_0.json").read_text())
    batch = load_config(TINY).runner_config.batch_size
    n, k, e = batch * 64, 2, 4
    floor = 1 - e * expert_capacity(n, k, 0.5, e) / (k * n)
    assert floor > 0.4
    assert len(s["dropped_fractions"]) == 2 and all(floor - 1e-6 <= d < 1 for d in s["dropped_fractions"])
    assert all(a > 0 for a in s["aux_losses"])
    assert all(0 <= lo <= 1 / e <= hi <= 1 for lo, hi in s["expert_share_min_max"])
    log = (out / "log" / "rank_0" / "msllm.log").read_text() if (out / "log").exists() else r.stdout + r.stderr
    assert "aux_loss: " in log and "dropped: " in log and "expert share min/max: " in log
