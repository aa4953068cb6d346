"""One side of tests/training/test_dpo_trl.py, in a process of its own: TRL's ``DPOTrainer`` (trl 1.16.0,
torch) or msllm's :class:`~msllm.training.dpo.DPONetwork` (MindSpore PyNative), on the real SmolLM2 and the
held-out pairs, for a full fine-tune or LoRA.

Why a process per side: the two frameworks' copies of the 135M-parameter model (policy, reference, gradients,
SGD state, parameter snapshots) left the pytest process 7.7 GB larger for the rest of the run (measured with
``MSLLM_DURATIONS_FILE``); a process returns all of it when it exits.

    python dpo_trl_worker.py SIDE MODE MODEL_DIR OUT_DIR [--trl_before NPZ]
        SIDE trl | msllm, MODE full | lora; writes OUT_DIR/result.json, and OUT_DIR/delta.npy + delta.json
        (every parameter's update after one SGD step, msllm names, flat float32) for ``full``, or
        OUT_DIR/adapters.npz (LoRA A/B before and after) for ``lora``.

Settings (shared with the test): sequence length ``SEQ`` 96, ``N_PAIRS`` 3 pairs in one batch, beta 0.1, SGD at
lr 0.005 (LoRA 0.5: B starts at zero), no clipping, no loss scaling; TRL's ``seed`` 0 (its data order does not
matter: one batch holds every pair and the losses are means).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))          # tests/: the helpers package

from helpers import DATA  # noqa: E402

SEQ = 96
N_PAIRS = 3
BETA = 0.1
LR = 0.005
LORA_LR = 0.5   # B starts at zero: a larger step for an update well above the tolerance
SEED = 0
LOSS_TYPES = ("sigmoid", "ipo", "hinge")
LORA = dict(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"))


def held_out_pairs() -> list[dict]:
    """TRL conversational pairs from the last short Alpaca records (not the first three, which the demo holds
    out for its answers): chosen = own output, rejected = the next record's output."""
    with open(os.path.join(DATA, "alpaca_en_demo.json"), encoding="utf-8") as fh:
        recs = [r for r in json.load(fh) if not r.get("input") and len(r["instruction"]) + len(r["output"]) < 160]
    recs = recs[-(N_PAIRS + 1):]
    return [{"prompt": [{"role": "user", "content": a["instruction"]}],
             "chosen": [{"role": "assistant", "content": a["output"]}],
             "rejected": [{"role": "assistant", "content": b["output"]}]} for a, b in zip(recs, recs[1:])]


def digest(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()


def save_flat(out: str, arrays: dict) -> None:
    """``arrays`` as one flat float32 ``delta.npy`` plus ``delta.json`` ({name: [offset, shape]}): the test
    maps the file instead of holding the model-sized arrays in its own memory."""
    index, offset = {}, 0
    for name in sorted(arrays):
        index[name] = [offset, list(arrays[name].shape)]
        offset += arrays[name].size
    flat = np.empty(offset, np.float32)
    for name, (start, _) in index.items():
        flat[start:start + arrays[name].size] = arrays[name].reshape(-1)
    np.save(os.path.join(out, "delta.npy"), flat)
    with open(os.path.join(out, "delta.json"), "w", encoding="utf-8") as fh:
        json.dump(index, fh)


# ---- TRL ---------------------------------------------------------------------------------------------------

def trl_trainer(model_dir, tmp, loss_type="sigmoid", peft_config=None, lr=LR):
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # transformers builds the embedding with padding_idx = pad_token_id (SmolLM2: 2, <|im_end|>), and torch then
    # drops that row's gradient from every *input* occurrence, also the real <|im_end|> tokens of the prompts
    # (measured: the only difference of the updates, 4.9e-3 in row 2). msllm's embedding has no padding row;
    # without it here both sides compute the same gradient.
    model.model.embed_tokens.padding_idx = None
    tok = AutoTokenizer.from_pretrained(model_dir)
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
    import torch

    out = {}
    trainer.model.train()
    for lt in LOSS_TYPES:
        trainer.loss_types = [lt]
        trainer._metrics["train"].clear()
        with torch.no_grad():
            loss = float(trainer._compute_loss(trainer.model, inputs, False))
        out[lt] = {"loss": loss, **{k: float(v[-1]) for k, v in trainer._metrics["train"].items()}}
    return out


def trl_full(model_dir: str, out: str) -> None:
    import torch

    from msllm.models.llama.names import hf_to_msllm_name

    trainer = trl_trainer(model_dir, os.path.join(out, "trl"))
    examples = [trainer.train_dataset[i] for i in range(N_PAIRS)]
    inputs = trainer.data_collator(examples)
    with torch.no_grad():
        logps = [t.numpy().tolist() for t in trainer.compute_ref_log_probs(trainer.model, inputs)]   # TRL's sums
    first = trl_metrics(trainer, inputs)
    before = {hf_to_msllm_name(n): p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = {hf_to_msllm_name(n): p.detach().numpy() for n, p in trainer.model.named_parameters()}
    second = trl_metrics(trainer, inputs)
    save_flat(out, {n: after[n] - before[n] for n in after})
    result = dict(examples=[{k: list(ex[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for ex in examples],
                  logps=logps, first=first, second=second, start={n: digest(v) for n, v in before.items()})
    with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh)


def trl_lora(model_dir: str, out: str) -> None:
    from peft import LoraConfig

    trainer = trl_trainer(model_dir, os.path.join(out, "trl"), lr=LORA_LR,
                          peft_config=LoraConfig(r=LORA["r"], lora_alpha=LORA["lora_alpha"], lora_dropout=0.0,
                                                 target_modules=list(LORA["target_modules"])))
    before = {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    after = {n: p.detach().numpy() for n, p in trainer.model.named_parameters() if "lora_" in n}
    np.savez(os.path.join(out, "adapters.npz"), **{"before/" + n: v for n, v in before.items()},
             **{"after/" + n: v for n, v in after.items()})
    with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as fh:
        json.dump({"ref_model_is_none": trainer.ref_model is None}, fh)   # TRL: the base with the adapter disabled


# ---- msllm -------------------------------------------------------------------------------------------------

def msllm_rows(model_dir: str, tmp: str):
    """The held-out pairs through ``llama_preprocess --dataset_type dpo``'s code: (ids, labels) (N, 2, SEQ+1)."""
    from msllm.data.preference import preprocess_preference, read_preference_arrays

    os.makedirs(tmp, exist_ok=True)
    src = os.path.join(tmp, "pairs.json")
    with open(src, "w", encoding="utf-8") as fh:
        json.dump(held_out_pairs(), fh)
    out = os.path.join(tmp, "pairs.mindrecord")
    assert preprocess_preference(src, model_dir, SEQ, out, shuffle=False)["pairs_written"] == N_PAIRS
    a = read_preference_arrays(out)
    return (np.stack([a["chosen_input_ids"], a["rejected_input_ids"]], 1),
            np.stack([a["chosen_labels"], a["rejected_labels"]], 1))


def msllm_policy(model_dir: str):
    """msllm's SmolLM2 (PyNative: no graph compiles of the 30-layer model), weights from the HF directory."""
    import dataclasses

    import mindspore as ms

    from msllm.convert.starting import load_base_into, open_base
    from msllm.models.llama.model import LlamaForCausalLM

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    src = open_base(model_dir)
    cfg = dataclasses.replace(src.config, seq_length=SEQ)
    src.close()
    net = LlamaForCausalLM(cfg, fast_paths=True)
    load_base_into(net, model_dir)
    return net


def msllm_metrics(net, ids, lab) -> dict:
    import mindspore as ms

    from msllm.training.dpo import metrics_dict

    out = {}
    for lt in LOSS_TYPES:
        net.loss_type = lt
        loss, metrics = net(ms.Tensor(ids), ms.Tensor(lab))
        out[lt] = {"loss": float(loss.asnumpy()), **metrics_dict(metrics.asnumpy())}
    return out


def msllm_step(net, params, ids, lab, lr=LR):
    import mindspore as ms
    from mindspore import nn

    from msllm.training.step import TrainStep

    step = TrainStep(net, nn.SGD(params, learning_rate=lr), loss_scale="none", max_grad_norm=None)
    step.set_train()
    return float(step(ms.Tensor(ids), ms.Tensor(lab))[0].asnumpy())


def msllm_full(model_dir: str, out: str) -> None:
    import mindspore as ms

    from msllm.training.dpo import DPONetwork, build_reference

    ids, lab = msllm_rows(model_dir, os.path.join(out, "data"))
    policy = msllm_policy(model_dir)
    start = {p.name: p.asnumpy().copy() for p in policy.get_parameters()}
    net = DPONetwork(policy, build_reference(policy, False, True, "CPU"), beta=BETA)
    logps = [x.asnumpy().tolist() for x in net.pair_logps(ms.Tensor(ids), ms.Tensor(lab))]
    first = msllm_metrics(net, ids, lab)
    msllm_step(net, policy.trainable_params(), ids, lab)
    save_flat(out, {p.name: p.asnumpy() - start[p.name] for p in policy.get_parameters()})
    second = msllm_metrics(net, ids, lab)
    np.savez(os.path.join(out, "rows.npz"), ids=ids, lab=lab)
    result = dict(logps=logps, first=first, second=second, start={n: digest(v) for n, v in start.items()})
    with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh)


def peft_to_msllm_name(peft: str) -> str:   # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
    return peft.replace("base_model.model.", "", 1).replace(".default", "")


def msllm_lora(model_dir: str, out: str, trl_before: str) -> None:
    import mindspore as ms

    from msllm.config_lora import PetConfig
    from msllm.lora.apply import apply_lora
    from msllm.training.dpo import DPONetwork, build_reference

    ids, lab = msllm_rows(model_dir, os.path.join(out, "data"))
    start = {k[len("before/"):]: v for k, v in np.load(trl_before).items() if k.startswith("before/")}
    policy = msllm_policy(model_dir)
    apply_lora(policy, PetConfig(lora_rank=LORA["r"], lora_alpha=float(LORA["lora_alpha"]), lora_dropout=0.0,
                                 target_modules="|".join(LORA["target_modules"])))
    adapters = {p.name: p for p in policy.trainable_params()}
    if set(adapters) != {peft_to_msllm_name(n) for n in start}:
        raise SystemExit(f"adapter names differ: {sorted(set(adapters) ^ {peft_to_msllm_name(n) for n in start})}")
    for n, v in start.items():          # PEFT's random A (and zero B) as the start
        adapters[peft_to_msllm_name(n)].set_data(ms.Tensor(v))
    net = DPONetwork(policy, build_reference(policy, True, True, "CPU"), beta=BETA)
    second_copy = any(p.name.startswith("reference.") for p in net.get_parameters())
    msllm_step(net, policy.trainable_params(), ids, lab, LORA_LR)
    np.savez(os.path.join(out, "adapters.npz"), **{"after/" + n: adapters[peft_to_msllm_name(n)].asnumpy()
                                                   for n in start})
    with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as fh:
        json.dump({"reference_holds_a_second_copy": second_copy}, fh)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("side", choices=("trl", "msllm"))
    p.add_argument("mode", choices=("full", "lora"))
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--trl_before", help="msllm lora: TRL's adapters.npz (PEFT's initial A and B)")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    print("seed", SEED, flush=True)
    if a.side == "trl":
        from helpers.trl_env import trl_importable

        trl_importable()   # pyarrow 21 beside numpy<2 (see tests/helpers/trl_env.py)
        (trl_full if a.mode == "full" else trl_lora)(a.model_dir, a.out)
    elif a.mode == "full":
        msllm_full(a.model_dir, a.out)
    else:
        msllm_lora(a.model_dir, a.out, a.trl_before)


if __name__ == "__main__":
    main()
