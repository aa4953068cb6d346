"""PyTorch CPU training-step worker: a LLaMA of the same shapes, fp32, the same initial weights
(msllm names are HF names except the embedding table), the same loss (mean token cross-entropy
over ``labels[:, 1:] != -100``) and an AdamW with MindSpore ``AdamWeightDecay`` semantics (no bias
correction, decoupled decay on matrices only) written with ``torch._foreach_*`` ops, so its
losses can be compared step by step. No loss scale, no clipping (like the MindFormers worker).
``torch.set_num_threads(2)``.

Two models:
* ``model: "hf"`` (default): Hugging Face ``transformers.LlamaForCausalLM`` (SDPA attention), as a
  new user would train it;
* ``model: "lean"``: a lean LLaMA written directly on torch's fused operators (nanoGPT / litgpt
  style: ``F.rms_norm``, ``F.scaled_dot_product_attention(is_causal=True)`` (a fused
  flash-attention CPU kernel), ``F.silu``), no HF wrapper overhead: the harder peer.

Usage: python torch_worker.py '{"shape": "tiny", "steps": 20, "warmup": 3, "compile": false,
                                "model": "hf", "spawn_time": ...}'
``compile: true`` wraps the loss function in ``torch.compile`` (inductor; the optimizer stays
eager). Prints one ``BENCH_RESULT {json}`` line.
"""

import time

T_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402


def lean_llama(torch, s: dict):
    """A LLaMA in plain torch with HF parameter names (so the common weights load by name)."""
    nn, F = torch.nn, torch.nn.functional
    c, h, nl, f, v, t = (s["hidden_size"], s["num_heads"], s["num_layers"], s["intermediate_size"],
                         s["vocab_size"], s["seq_length"])
    d = c // h
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(torch.arange(t, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().float(), ang.sin().float()                       # (T, D), HF rotate_half layout

    def rope(x):                                                          # (B, H, T, D)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(c))

        def forward(self, x):
            return F.rms_norm(x, (c,), self.weight, common.RMS_EPS)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(c, c, bias=False) for _ in range(4))

        def forward(self, x):
            b, tt, _ = x.shape
            q, k, vv = (p(x).view(b, tt, h, d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
            y = F.scaled_dot_product_attention(rope(q), rope(k), vv, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, tt, c))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(c, f, bias=False), nn.Linear(c, f, bias=False)
            self.down_proj = nn.Linear(f, c, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()
            self.self_attn, self.mlp = Attention(), MLP()

        def forward(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(v, c)
            self.layers = nn.ModuleList(Block() for _ in range(nl))
            self.norm = RMSNorm()

    class Lean(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Body()
            self.lm_head = nn.Linear(c, v, bias=False)

        def forward(self, input_ids):
            x = self.model.embed_tokens(input_ids)
            for layer in self.model.layers:
                x = layer(x)
            return self.lm_head(self.model.norm(x))

    return Lean()


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
    lean = args.get("model", "hf") == "lean"
    model = lean_llama(torch, s) if lean else LlamaForCausalLM(cfg).float()
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
        logits = model(tokens) if lean else model(input_ids=tokens).logits
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
        "framework": args.get("name") or ("torch-compile" if args.get("compile") else "torch-eager"),
        "model": "lean" if lean else "hf", "shape": args["shape"],
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "import_s": import_s, "build_s": build_s,
        "first_step_s": first_step_s, "startup_to_first_step_s": startup_to_first_step,
        "step_s_median": med, "step_s_all": times, "cpu_s_median": common.median(cpus[warmup:]), "cpu_s_all": cpus,
        "tokens_per_s": ntok / med, "losses": losses, "peak_rss_mib": common.peak_rss_mib(),
    })


if __name__ == "__main__":
    main()
