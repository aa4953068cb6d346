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

import worker_common as wc  # first: takes the process start time

common = wc.common


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
    args, s, steps, warmup = wc.train_args()
    phases = wc.Phases()
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401  (used by wc.hf_llama; import time counted here)
    phases.mark("import")

    torch.set_num_threads(int(args.get("threads", 2)))
    torch.manual_seed(0)
    lean = args.get("model", "hf") == "lean"
    model = lean_llama(torch, s) if lean else wc.hf_llama(s, args.get("attn", "sdpa"))
    wc.load_torch_weights(torch, model, args["shape"])
    model.train()
    params = list(model.parameters())
    adamw_step, _ = wc.torch_adamw(torch, params)

    def loss_fn(tokens, targets):
        logits = model(tokens) if lean else model(input_ids=tokens).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                               ignore_index=-100)

    fwd = torch.compile(loss_fn) if args.get("compile") else loss_fn
    phases.mark("build")

    def one_step(tokens, targets):
        for p in params:
            p.grad = None
        loss = fwd(tokens, targets)
        loss.backward()
        adamw_step()
        return float(loss.detach())

    timing = wc.timed_steps(wc.train_batches(s, warmup + steps), lambda ids, lab: wc.torch_targets(torch, ids, lab),
                            one_step, warmup, s["batch_size"] * s["seq_length"], wc.spawn_time(args), phases.rss)
    common.emit({
        "framework": args.get("name") or ("torch-compile" if args.get("compile") else "torch-eager"),
        "model": "lean" if lean else "hf", "shape": args["shape"],
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), **phases.fields(), **timing,
        "peak_rss_mib": common.peak_rss_mib(),
    })


if __name__ == "__main__":
    main()
