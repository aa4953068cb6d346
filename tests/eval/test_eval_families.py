"""Log-likelihood scoring (msllm's evaluation scorer) on the family's other members against
transformers' full forward: requests longer than Mistral's sliding window, through the plain
batched path and through the cached shared-prefix path (whose cache masks carry the window)."""

import dataclasses

import numpy as np
import pytest

from helpers.families import FAMILY_CASES

torch = pytest.importorskip("torch")

SEED = 77


@pytest.mark.parametrize("min_prefix", [0, 32], ids=["plain", "cached_prefix"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "layout"])
@pytest.mark.parametrize("case", ["mistral_window16", "qwen3_qknorm_head_dim", "gemma_geglu_mqa"])
def test_scores_equal_transformers(tmp_path, case, fast, min_prefix):
    import mindspore as ms

    from msllm.convert.hf import convert_hf_to_msllm
    from msllm.convert.verify import make_random_hf_model
    from msllm.eval.requests import Row
    from msllm.eval.scoring import Scorer, score_rows
    from msllm.formats.loading import load_into, load_params
    from msllm.models.llama.model import LlamaForCausalLM

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    print("seed", SEED)
    hf = make_random_hf_model(str(tmp_path / "hf"), seed=SEED, **FAMILY_CASES[case])
    path = str(tmp_path / "m.ckpt")
    cfg = dataclasses.replace(convert_hf_to_msllm(str(tmp_path / "hf"), path, progress=False).config, seq_length=96)
    net = LlamaForCausalLM(cfg, fast_paths=fast)
    load_into(net, load_params(path, cfg), path)
    rng = np.random.default_rng(SEED)
    prefix = [1] + rng.integers(3, cfg.vocab_size, 39).tolist()          # 40 shared tokens > window 16
    rows, expected = [], {}
    for i in range(4):
        suffix = rng.integers(3, cfg.vocab_size, 5 + 3 * i).tolist()
        tokens = prefix + suffix
        positions = list(range(len(prefix) - 1, len(tokens) - 1))
        rows.append(Row(tuple(tokens), [(i, tuple(positions), tuple(suffix))]))
        with torch.no_grad():
            logp = torch.log_softmax(hf(input_ids=torch.tensor([tokens])).logits[0].double(), -1).numpy()
        expected[i] = sum(logp[p, t] for p, t in zip(positions, suffix))
    got = score_rows(Scorer(net, batch_size=2, min_prefix=min_prefix), rows)
    for i, want in expected.items():
        assert abs(got[i][0] - want) <= 1e-4 * max(1.0, abs(want)), (i, got[i][0], want)
