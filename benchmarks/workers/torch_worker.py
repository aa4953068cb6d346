"""PyTorch CPU training-step worker: Hugging Face ``transformers.LlamaForCausalLM`` of the same
shapes (SDPA attention, fp32), the same initial weights (msllm names are HF names except the
embedding table), the same loss (mean token cross-entropy over ``labels[:, 1:] != -100``) and an
AdamW with MindSpore ``AdamWeightDecay`` semantics (no bias correction, decoupled decay on
matrices only) written with ``torch._foreach_*`` ops, so its losses can be compared step by step.
No loss scale, no clipping (like the MindFormers worker). ``torch.set_num_threads(2)``.

Usage: python torch_worker.py '{"shape": "tiny", "steps": 20, "warmup": 3, "compile": false,
                                "spawn_time": ...}'
``compile: true`` wraps the model in ``torch.compile`` (inductor; the optimizer stays eager).
Prints one ``BENCH_RESULT {json}`` line.
"""

import time

T_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402


def main():
    args = json.loads(sys.argv[1])
    spawn = args.get("spawn_time", T_START)
    s = common.shape(args["shape"])
    steps, warmup = args["steps"], args["warmup"]
    np = common.np

    t = time.perf_counter()
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM
    import_s = time.perf_counter() - t

    t = time.perf_counter()
    torch.set_num_threads(int(args.get("threads", 2)))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                      intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_layers"],
                      num_attention_heads=s["num_heads"], num_key_value_heads=s["num_heads"],
                      max_position_embeddings=s["seq_length"], rms_norm_eps=common.RMS_EPS,
                      rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                      mlp_bias=False, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = args.get("attn", "sdpa")
    model = LlamaForCausalLM(cfg).float()
    init = np.load(common.prepare_weights(args["shape"]))
    sd = {}
    for k in init.files:
        sd[k.replace("embed_tokens.embedding_table", "embed_tokens.weight")] = torch.from_numpy(init[k].copy())
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    assert not missing and not unexpected, (missing, unexpected)
    model.train()
    o = common.OPTIM
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [(decay, o["weight_decay"]), (no_decay, 0.0)]
    state = {id(p): (torch.zeros_like(p), torch.zeros_like(p)) for p in model.parameters()}

    @torch.no_grad()
    def adamw_step():
        """MindSpore AdamWeightDecay: m, v moments; p -= lr * (m / (sqrt(v) + eps) + wd * p)."""
        for params, wd in groups:
            g = [p.grad for p in params]
            m = [state[id(p)][0] for p in params]
            v = [state[id(p)][1] for p in params]
            torch._foreach_mul_(m, o["beta1"])
            torch._foreach_add_(m, g, alpha=1 - o["beta1"])
            torch._foreach_mul_(v, o["beta2"])
            torch._foreach_addcmul_(v, g, g, value=1 - o["beta2"])
            upd = torch._foreach_sqrt(v)
            torch._foreach_add_(upd, o["eps"])
            upd = torch._foreach_div(m, upd)
            if wd:
                torch._foreach_add_(upd, params, alpha=wd)
            torch._foreach_add_(params, upd, alpha=-o["lr"])

    def loss_fn(tokens, targets):
        logits = model(input_ids=tokens).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                               ignore_index=-100)

    fwd = torch.compile(loss_fn) if args.get("compile") else loss_fn
    build_s = time.perf_counter() - t

    data = common.batches(common.data_file(s["seq_length"]), s["batch_size"], warmup + steps)
    losses, times, cpus = [], [], []
    first_step_s = startup_to_first_step = None
    for i, (ids, lab) in enumerate(data):
        tokens = torch.from_numpy(ids[:, :-1].astype(np.int64))
        targets = torch.from_numpy(lab[:, 1:].astype(np.int64))
        c0, t = time.process_time(), time.perf_counter()
        for p in model.parameters():
            p.grad = None
        loss = fwd(tokens, targets)
        loss.backward()
        adamw_step()
        lv = float(loss.detach())
        dt = time.perf_counter() - t
        cpus.append(time.process_time() - c0)
        if i == 0:
            first_step_s = dt
            startup_to_first_step = time.time() - spawn
        losses.append(lv)
        times.append(dt)
    med = common.median(times[warmup:])
    ntok = s["batch_size"] * s["seq_length"]
    import transformers
    common.emit({
        "framework": "torch-compile" if args.get("compile") else "torch-eager", "shape": args["shape"],
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "import_s": import_s, "build_s": build_s,
        "first_step_s": first_step_s, "startup_to_first_step_s": startup_to_first_step,
        "step_s_median": med, "step_s_all": times, "cpu_s_median": common.median(cpus[warmup:]),
        "tokens_per_s": ntok / med, "losses": losses, "peak_rss_mib": common.peak_rss_mib(),
    })


if __name__ == "__main__":
    main()
