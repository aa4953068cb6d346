"""What every benchmark worker does the same way: read its JSON arguments, make ``benchmarks/``
(``common``) importable, time the training steps, summarise decode runs, and the PyTorch
pieces the two PyTorch workers share (HF model of a shape, the common initial weights, AdamW).

Import it first in a worker (``import worker_common as wc``): ``T_START`` is taken here, the
worker process's start for ``startup_to_first_step_s`` when the parent sent no ``spawn_time``.
At top level it imports only the standard library and ``common`` (numpy): the MindFormers
worker runs it under ``benchmarks/.venv-mindformers`` (MindSpore 2.9, no msllm dependencies);
torch and transformers are imported inside the functions that use them.
"""

import time

T_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

np = common.np


def worker_args() -> dict:
    """The worker's arguments: the JSON object given as its one command-line argument."""
    return json.loads(sys.argv[1])


def train_args() -> tuple[dict, dict, int, int]:
    """A training worker's arguments: (all of them, the shape of ``args["shape"]`` (see
    ``common.SHAPES``), measured steps, warm-up steps)."""
    args = worker_args()
    return args, common.shape(args["shape"]), args["steps"], args["warmup"]


class Phases:
    """Wall seconds and resident memory of a worker's phases. Timing starts at creation;
    ``mark(name)`` ends the running phase: ``{name}_s`` seconds, RSS ``after_{name}`` (MiB),
    and starts the next one."""

    def __init__(self):
        self.seconds, self.rss = {}, {}
        self.t = time.perf_counter()

    def mark(self, name: str) -> None:
        self.seconds[f"{name}_s"] = time.perf_counter() - self.t
        self.rss[f"after_{name}"] = common.rss_mib()
        self.t = time.perf_counter()

    def fields(self) -> dict:
        return {**self.seconds, "rss_mib": self.rss}


def spawn_time(args: dict) -> float:
    """When the parent spawned this process (``time.time()``), else this process's start."""
    return args.get("spawn_time", T_START)


def train_batches(s: dict, n: int) -> list:
    """The first ``n`` batches of the common data for shape ``s`` (see ``common.batches``)."""
    return common.batches(common.data_file(s["seq_length"], s.get("data_tag")), s["batch_size"], n)


def timed_steps(data, prepare, step, warmup: int, tokens: int, spawn: float, rss: dict) -> dict:
    """Run ``step(*prepare(input_ids, labels))`` (returns the loss as a float) on every batch of
    ``data``. Only ``step`` is timed (wall: ``perf_counter``, CPU: ``process_time``), so
    building the framework's tensors from numpy is not. After the first step
    ``rss["after_first_step"]`` is set (MiB). Returns the result fields every training worker
    reports: first step and spawn-to-first-loss seconds, the median step after ``warmup``,
    tokens/s = ``tokens`` / that median, all step and CPU times, and the losses."""
    losses, times, cpus = [], [], []
    first_step_s = startup_to_first_step = None
    for i, (ids, lab) in enumerate(data):
        inputs = prepare(ids, lab)
        c0, t = time.process_time(), time.perf_counter()
        loss = step(*inputs)
        dt = time.perf_counter() - t
        cpus.append(time.process_time() - c0)
        if i == 0:
            rss["after_first_step"] = common.rss_mib()
            first_step_s, startup_to_first_step = dt, time.time() - spawn
        losses.append(loss)
        times.append(dt)
    med = common.median(times[warmup:])
    return {"first_step_s": first_step_s, "startup_to_first_step_s": startup_to_first_step,
            "step_s_median": med, "step_s_all": times, "cpu_s_median": common.median(cpus[warmup:]),
            "cpu_s_all": cpus, "tokens_per_s": tokens / med, "losses": losses, "rss_mib": rss}


def msllm_run_config(s: dict, overrides: list):
    """msllm's RunConfig from configs/llama/run_llama_tiny.yaml with shape ``s``, one process,
    :data:`common.OPTIM`'s AdamW betas / eps / weight decay, and the extra ``overrides``."""
    common.use_repo()
    from msllm.config import load_config

    o = common.OPTIM
    shape_overrides = ["--parallel_config.data_parallel=1", *common.model_overrides(s),
                       f"--runner_config.batch_size={s['batch_size']}",
                       f"--optimizer.betas=[{o['beta1']},{o['beta2']}]", f"--optimizer.eps={o['eps']}",
                       f"--optimizer.weight_decay={o['weight_decay']}"]
    return load_config(os.path.join(common.ROOT, "configs", "llama", "run_llama_tiny.yaml"),
                       shape_overrides + list(overrides))


def single_process():
    """The ``rt`` argument of ``msllm.training.trainer.build_train_step`` for one process."""
    return type("RT", (), {"world_size": 1})()


# ---------------------------------------------------------------------------------------------
# PyTorch


def hf_llama(s: dict, attn: str = "sdpa"):
    """Hugging Face ``LlamaForCausalLM`` of shape ``s``, fp32, MHA, no biases, untied head,
    attention implementation ``attn``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family = s.get("family", "llama")   # qwen2 / mistral: the family's own transformers class
    extra = {"sliding_window": s["sliding_window"]} if family == "mistral" else {}
    if family == "llama":
        extra = {"attention_bias": False, "mlp_bias": False}
    cfg = AutoConfig.for_model(family, vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                               intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_layers"],
                               num_attention_heads=s["num_heads"], num_key_value_heads=s["num_heads"],
                               max_position_embeddings=s["seq_length"], rms_norm_eps=common.RMS_EPS,
                               rope_theta=10000.0, tie_word_embeddings=False, use_cache=False, pad_token_id=0,
                               bos_token_id=1, eos_token_id=2, **extra)
    cfg._attn_implementation = attn
    return AutoModelForCausalLM.from_config(cfg).float()


def load_torch_weights(torch, model, shape_name: str) -> None:
    """Load the common initial weights of ``shape_name`` into ``model`` (msllm names are HF names
    except the embedding table); every parameter but rotary buffers must be covered."""
    init = np.load(common.prepare_weights(shape_name))
    sd = {k.replace("embed_tokens.embedding_table", "embed_tokens.weight"): torch.from_numpy(init[k].copy())
          for k in init.files}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    assert not missing and not unexpected, (missing, unexpected)


def torch_adamw(torch, params: list):
    """AdamW with MindSpore ``AdamWeightDecay`` semantics over ``params`` (:data:`common.OPTIM`; no
    bias correction; decay on matrices only): ``p -= lr * (m / (sqrt(v) + eps) + wd * p)``, written
    with ``torch._foreach_*``. Returns ``(step, state)``: ``step()`` applies the gradients,
    ``state[id(p)]`` is ``(m, v)``."""
    o = common.OPTIM
    groups = [([p for p in params if p.ndim >= 2], o["weight_decay"]), ([p for p in params if p.ndim < 2], 0.0)]
    groups = [g for g in groups if g[0]]
    state = {id(p): (torch.zeros_like(p), torch.zeros_like(p)) for p in params}

    @torch.no_grad()
    def step():
        for group, wd in groups:
            g = [p.grad for p in group]
            m = [state[id(p)][0] for p in group]
            v = [state[id(p)][1] for p in group]
            torch._foreach_mul_(m, o["beta1"])
            torch._foreach_add_(m, g, alpha=1 - o["beta1"])
            torch._foreach_mul_(v, o["beta2"])
            torch._foreach_addcmul_(v, g, g, value=1 - o["beta2"])
            upd = torch._foreach_sqrt(v)
            torch._foreach_add_(upd, o["eps"])
            upd = torch._foreach_div(m, upd)
            if wd:
                torch._foreach_add_(upd, group, alpha=wd)
            torch._foreach_add_(group, upd, alpha=-o["lr"])

    return step, state


def torch_targets(torch, ids, lab):
    """numpy ``(B, T+1)`` rows -> (tokens ``ids[:, :-1]``, targets ``labels[:, 1:]``), int64."""
    return (torch.from_numpy(ids[:, :-1].astype(np.int64)), torch.from_numpy(lab[:, 1:].astype(np.int64)))


# ---------------------------------------------------------------------------------------------
# Decode


def decode_summary(runs: list[dict], args: dict) -> dict:
    """Result fields of a decode worker from its runs (the first cold, the rest warm; each
    ``{"ttft_s", "decode_s", "steps", "decode_tokens_per_s"}``): medians of the warm runs, the
    cold run's extra time as compile time, and peak RSS / spawn-to-end."""
    cold, warm = runs[0], runs[1:]
    med = common.median
    ttft, decode = med([w["ttft_s"] for w in warm]), med([w["decode_s"] for w in warm])
    return {"ttft_s": ttft, "decode_tokens_per_s": med([w["decode_tokens_per_s"] for w in warm]),
            "decode_step_ms": 1000 * med([w["decode_s"] / w["steps"] for w in warm]),
            "compile_s": (cold["ttft_s"] + cold["decode_s"]) - (ttft + decode),
            "cold_ttft_s": cold["ttft_s"], "runs": runs, "peak_rss_mib": common.peak_rss_mib(),
            "spawn_to_end_s": time.time() - spawn_time(args)}
