"""DPO against TRL's DPOTrainer (trl 1.16.0) on the real SmolLM2-135M-Instruct and a held-out pair set made
from the bundled Alpaca records (chosen = the record's own answer, rejected = another record's answer):

1. tokenization: msllm's preference rows are TRL's ``prompt_ids + chosen_ids`` / ``+ rejected_ids``, and the
   completion (labels) is TRL's;
2. the first step: chosen and rejected summed log-probs per pair, and for sigmoid / ipo / hinge the loss and
   rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected equal
   TRL's ``_compute_loss`` and its logged metrics;
3. one SGD step from the same weights (no clipping, no loss scaling, lr 0.005): every parameter's update equal
   to TRL's (full fine-tune), then the second step's loss and metrics for each loss type (policy and reference
   now differ); and the same LoRA adapter after the step (PEFT; A copied from PEFT's initialisation; lr 0.5, since
   B starts at zero).

msllm runs in PyNative mode here (no graph compiles of the 30-layer model: the run through run_msllm.py in
graph mode is tests/training/test_dpo_run.py). Seeds: TRL's ``seed`` 0 (its data order does not matter: one
batch holds every pair and the losses are means).

Tolerances (``TOL`` 1e-4): the summed log-probs of 13-35 completion tokens differ by up to ~5e-5 between the
two float32 implementations (SmolLM2's logits reach |38|; tests/lora/test_real_model_finetune.py measures the
logit noise floor at ~1.3e-4); the weight updates compared are >= 100x the tolerance.
"""

import json
import os

import numpy as np
import pytest

from helpers import DATA

from helpers.trl_env import trl_importable

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
trl_importable()   # pyarrow 21 beside numpy<2 (see tests/helpers/trl_env.py)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

SEQ = 96
N_PAIRS = 3
BETA = 0.1
LR = 0.005
LORA_LR = 0.5   # B starts at zero: a larger step for an update well above the tolerance
TOL = 1e-4
SEED = 0
LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def held_out_pairs() -> list[dict]:
    """TRL conversational pairs from the last short Alpaca records (not the first three, which the demo holds
    out for its answers): chosen = own output, rejected = the next record's output."""
    with open(os.path.join(DATA, "alpaca_en_demo.json"), encoding="utf-8") as fh:
        recs = [r for r in json.load(fh) if not r.get("input") and len(r["instruction"]) + len(r["output"]) < 160]
    recs = recs[-(N_PAIRS + 1):]
    return [{"prompt": [{"role": "user", "content": a["instruction"]}],
             "chosen": [{"role": "assistant", "content": a["output"]}],
             "rejected": [{"role": "assistant", "content": b["output"]}]} for a, b in zip(recs, recs[1:])]


@pytest.fixture(scope="module")
def rows(tmp_path_factory, smollm2_dir):
    from msllm.data.preference import preprocess_preference, read_preference_arrays

    d = tmp_path_factory.mktemp("dpo_trl")
    src = str(d / "pairs.json")
    with open(src, "w", encoding="utf-8") as fh:
        json.dump(held_out_pairs(), fh)
    out = str(d / "pairs.mindrecord")
    assert preprocess_preference(src, smollm2_dir, SEQ, out, shuffle=False)["pairs_written"] == N_PAIRS
    a = read_preference_arrays(out)
    ids = np.stack([a["chosen_input_ids"], a["rejected_input_ids"]], 1)            # (N, 2, L)
    lab = np.stack([a["chosen_labels"], a["rejected_labels"]], 1)
    return ids, lab


def trl_trainer(smollm2_dir, tmp, loss_type="sigmoid", peft_config=None, lr=LR):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    # transformers builds the embedding with padding_idx = pad_token_id (SmolLM2: 2, <|im_end|>), and torch then
    # drops that row's gradient from every *input* occurrence, also the real <|im_end|> tokens of the prompts
    # (measured: the only difference of the updates, 4.9e-3 in row 2). msllm's embedding has no padding row;
    # without it here both sides compute the same gradient.
    model.model.embed_tokens.padding_idx = None
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    args = trl.DPOConfig(output_dir=str(tmp), per_device_train_batch_size=N_PAIRS, max_length=SEQ + 1, beta=BETA,
                         loss_type=[loss_type], learning_rate=lr, optim="sgd", lr_scheduler_type="constant",
                         warmup_steps=0, max_steps=1, max_grad_norm=0.0, report_to="none", use_cpu=True,
                         seed=SEED, save_strategy="no", logging_steps=1, weight_decay=0.0,
                         # TRL's configs default to bf16 = True: accelerate then runs the reference under bf16 autocast
                         bf16=False)
    return trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(held_out_pairs()),
                          processing_class=tok, peft_config=peft_config)


def trl_metrics(trainer, inputs) -> dict:
    """{loss type: {"loss", TRL's logged metrics}} of TRL's ``_compute_loss`` on ``inputs``, as they are now."""
    out = {}
    trainer.model.train()
    for lt in LOSS_TYPES:
        trainer.loss_types = [lt]
        trainer._metrics["train"].clear()
        with torch.no_grad():
            loss = float(trainer._compute_loss(trainer.model, inputs, False))
        out[lt] = {"loss": loss, **{k: v[-1] for k, v in trainer._metrics["train"].items()}}
    return out


def msllm_metrics(net, ids, lab) -> dict:
    import mindspore as ms

    from msllm.training.dpo import metrics_dict

    out = {}
    for lt in LOSS_TYPES:
        net.loss_type = lt
        loss, metrics = net(ms.Tensor(ids), ms.Tensor(lab))
        out[lt] = {"loss": float(loss.asnumpy()), **metrics_dict(metrics.asnumpy())}
    return out


@pytest.fixture(scope="module")
def msllm_model(smollm2_dir):
    """msllm's SmolLM2 (PyNative), weights from the HF directory."""
    import dataclasses

    import mindspore as ms

    from msllm.convert.starting import load_base_into, open_base
    from msllm.models.llama.model import LlamaForCausalLM

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    src = open_base(smollm2_dir)
    cfg = dataclasses.replace(src.config, seq_length=SEQ)
    src.close()

    def build():
        net = LlamaForCausalLM(cfg, fast_paths=True)
        load_base_into(net, smollm2_dir)
        return net
    return build


@pytest.fixture(scope="module")
def full(rows, msllm_model, smollm2_dir, tmp_path_factory):
    """Both sides of a full fine-tune: the first step's per-sequence log-probs and metrics, one SGD step, the
    parameters before/after (msllm names), and the second step's metrics."""
    import mindspore as ms

    from msllm.models.llama.names import hf_to_msllm_name
    from msllm.training.dpo import DPONetwork, build_reference

    ids, lab = rows
    trainer = trl_trainer(smollm2_dir, tmp_path_factory.mktemp("trl_full"))
    examples = [trainer.train_dataset[i] for i in range(N_PAIRS)]
    inputs = trainer.data_collator(examples)
    with torch.no_grad():
        trl_logps = [t.numpy() for t in trainer.compute_ref_log_probs(trainer.model, inputs)]   # TRL's sums
    trl_first = trl_metrics(trainer, inputs)
    before = {hf_to_msllm_name(n): p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = {hf_to_msllm_name(n): p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}
    trl_second = trl_metrics(trainer, inputs)

    policy = msllm_model()
    start = {p.name: p.asnumpy().copy() for p in policy.get_parameters()}
    net = DPONetwork(policy, build_reference(policy, False, True, "CPU"), beta=BETA)
    logps = [x.asnumpy() for x in net.pair_logps(ms.Tensor(ids), ms.Tensor(lab))]
    first = msllm_metrics(net, ids, lab)
    _msllm_step(net, policy.trainable_params(), ids, lab)
    mine = {p.name: p.asnumpy() for p in policy.get_parameters()}
    second = msllm_metrics(net, ids, lab)
    return dict(examples=examples, trl_logps=trl_logps, trl_first=trl_first, before=before, after=after,
                trl_second=trl_second, logps=logps, first=first, start=start, mine=mine, second=second)


def test_rows_are_trls_tokenization(rows, full):
    ids, lab = rows
    for i, ex in enumerate(full["examples"]):
        for side, key in ((0, "chosen_ids"), (1, "rejected_ids")):
            whole = ex["prompt_ids"] + ex[key]
            np.testing.assert_array_equal(ids[i, side, :len(whole)], whole)
            completion = lab[i, side][lab[i, side] != -100]
            np.testing.assert_array_equal(completion, ex[key])
            assert (lab[i, side, :len(ex["prompt_ids"])] == -100).all()


def _same_metrics(mine: dict, ref: dict):
    for lt in LOSS_TYPES:
        print(lt, mine[lt], {k: ref[lt][k] for k in mine[lt]})
        for k, v in mine[lt].items():
            assert abs(v - ref[lt][k]) <= TOL, (lt, k, v, ref[lt][k])


def test_first_step_logps_loss_and_metrics_equal_trl(full):
    lc, lr, rc, rr, nc, nr = full["logps"]
    trl_c, trl_r = full["trl_logps"]
    print("msllm logps chosen", lc, "rejected", lr, "TRL", trl_c, trl_r)
    np.testing.assert_allclose(lc, trl_c, atol=TOL, rtol=0)
    np.testing.assert_allclose(lr, trl_r, atol=TOL, rtol=0)
    np.testing.assert_array_equal(lc, rc)          # policy = reference at the start
    _same_metrics(full["first"], full["trl_first"])


def test_one_sgd_step_full_equals_trl_then_second_step_metrics(full):
    before, after, start, mine = full["before"], full["after"], full["start"], full["mine"]
    assert set(mine) == set(after), set(mine) ^ set(after)
    worst, biggest = 0.0, 0.0
    for name, value in mine.items():
        np.testing.assert_array_equal(start[name], before[name])   # same start
        d_ms, d_trl = value - start[name], after[name] - before[name]
        worst = max(worst, float(np.abs(d_ms - d_trl).max()))
        biggest = max(biggest, float(np.abs(d_trl).max()))
    print(f"largest update {biggest:.3g}, largest difference of the updates {worst:.3g}")
    assert worst <= TOL and biggest >= 10 * TOL
    # second step: policy and reference differ now, so every loss type and reward is non-trivial
    assert all(abs(full["second"][lt]["rewards/margins"]) > 10 * TOL for lt in LOSS_TYPES)
    _same_metrics(full["second"], full["trl_second"])


def _msllm_step(net, params, ids, lab, lr=LR):
    import mindspore as ms
    from mindspore import nn

    from msllm.training.step import TrainStep

    step = TrainStep(net, nn.SGD(params, learning_rate=lr), loss_scale="none", max_grad_norm=None)
    step.set_train()
    return float(step(ms.Tensor(ids), ms.Tensor(lab))[0].asnumpy())


def test_one_sgd_step_lora_gives_peft_adapter(rows, msllm_model, smollm2_dir, tmp_path):
    import mindspore as ms
    from peft import LoraConfig

    from msllm.lora.apply import apply_lora
    from msllm.config_lora import PetConfig
    from msllm.training.dpo import DPONetwork, build_reference

    ids, lab = rows
    trainer = trl_trainer(smollm2_dir, tmp_path, peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                        target_modules=["q_proj", "v_proj"]),
                          lr=LORA_LR)
    assert trainer.ref_model is None            # TRL: the base with the adapter disabled
    before = {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    after = {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters() if "lora_" in n}

    def msllm_name(peft):   # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
        return peft.replace("base_model.model.", "", 1).replace(".default", "")

    policy = msllm_model()
    apply_lora(policy, PetConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, target_modules="q_proj|v_proj"))
    adapters = {p.name: p for p in policy.trainable_params()}
    assert set(adapters) == {msllm_name(n) for n in before}
    for n, v in before.items():          # PEFT's random A (and zero B) as the start
        adapters[msllm_name(n)].set_data(ms.Tensor(v))
    net = DPONetwork(policy, build_reference(policy, True, True, "CPU"), beta=BETA)
    assert not any(p.name.startswith("reference.") for p in net.get_parameters())   # no second copy
    _msllm_step(net, policy.trainable_params(), ids, lab, LORA_LR)
    worst, biggest = 0.0, 0.0
    for n, v in before.items():
        d_ms, d_trl = adapters[msllm_name(n)].asnumpy() - v, after[n] - v
        worst = max(worst, float(np.abs(d_ms - d_trl).max()))
        biggest = max(biggest, float(np.abs(d_trl).max()))
    print(f"LoRA: largest update {biggest:.3g}, largest difference of the updates {worst:.3g}")
    assert worst <= TOL and biggest >= 10 * TOL
