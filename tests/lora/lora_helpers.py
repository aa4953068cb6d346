"""Shared helpers of the LoRA tests: tiny model configs, base checkpoints, real Alpaca batches."""

from __future__ import annotations

import numpy as np

from helpers import REPO as ROOT  # noqa: F401  (re-exported to the LoRA tests)

SEED = 1234

# tiny LLaMA (GQA, untied head, real 32000 vocabulary so the real tokenizer's ids fit)
TINY = dict(vocab_size=32000, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=96,
            seq_length=64)


def tiny_config(**kw):
    """The tiny model's config (LoRA's settings are not the model's: tests pass a PetConfig to
    apply_lora / the layout functions beside it)."""
    from msllm.models.llama.config import LlamaConfig

    return LlamaConfig(**{**TINY, **kw})


def set_mode(mode: str) -> None:
    import mindspore as ms

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)


def build(cfg, seed: int = SEED, fast_paths: bool = False):
    """A ``LlamaForCausalLM`` with seeded random weights of O(1) activations (so LoRA updates and
    base mistakes show in the logits)."""
    import mindspore as ms

    from msllm.models.llama.model import LlamaForCausalLM

    net = LlamaForCausalLM(cfg, fast_paths=fast_paths)
    rng = np.random.default_rng(seed)
    for p in net.get_parameters():
        shape = p.shape
        if len(shape) == 1:
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "embed" in p.name:
            v = rng.standard_normal(shape)
        else:
            v = rng.standard_normal(shape) / np.sqrt(shape[1])
        p.set_data(ms.Tensor(v.astype(np.float32)))
    return net


def save_base(net, path: str) -> str:
    """Save ``net``'s weights as an msllm checkpoint with its manifest (model config)."""
    import mindspore as ms

    from msllm.formats.manifest import write_sidecar

    ms.save_checkpoint(net, path)
    write_sidecar(path, net.config)
    return path


def random_adapters(net, seed: int = 7, scale: float = 0.2) -> dict:
    """Give every LoRA matrix of ``net`` random non-zero values; returns ``{name: array}``."""
    import mindspore as ms

    from msllm.lora.apply import adapter_param_names

    rng = np.random.default_rng(seed)
    out = {}
    params = {p.name: p for p in net.get_parameters()}
    for name in adapter_param_names(net):
        v = (scale * rng.standard_normal(params[name].shape)).astype(np.float32)
        params[name].set_data(ms.Tensor(v))
        out[name] = v
    return out


def alpaca_rows(mindrecord: str, n: int, pool: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` real (input_ids, labels) rows of the tokenized Alpaca MindRecord, (n, T+1) int32: the
    first ``n``, or with ``pool`` the ``n`` of the first ``pool`` rows with the most targets (at
    seq_length 64 many rows are all prompt)."""
    import mindspore.dataset as ds

    data = ds.MindDataset(mindrecord, columns_list=["input_ids", "labels"], shuffle=False)
    ids, labels = [], []
    for row in data.create_tuple_iterator(output_numpy=True, num_epochs=1):
        ids.append(row[0])
        labels.append(row[1])
        if len(ids) == max(n, pool):
            break
    ids, labels = np.stack(ids).astype(np.int32), np.stack(labels).astype(np.int32)
    keep = np.sort(np.argsort(-(labels != -100).sum(1), kind="stable")[:n]) if pool else np.arange(n)
    return ids[keep], labels[keep]


def logits(net, ids: np.ndarray) -> np.ndarray:
    import mindspore as ms

    net.set_train(False)
    return net(ms.Tensor(ids.astype(np.int32))).asnumpy()
