"""Conversion streams: its peak memory is about one tensor, not the model (measured in a fresh
process with the kernel's peak-RSS counter; the full numbers are in benchmarks/convert_peak_rss.py)."""

import os
import sys

import pytest

from msllm.convert import hf
from msllm.convert.verify import write_random_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from convert_peak_rss import child  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")


def test_peak_memory_is_about_one_tensor_not_the_model(tmp_path):
    cfg = write_random_hf_dir(str(tmp_path / "hf"), seed=0, vocab_size=8000, hidden_size=512,
                              intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                              max_position_embeddings=256)
    sizes = [hf.tensor_nbytes(s, "float32") for s in hf.param_shapes(hf.hf_config_to_msllm(cfg)).values()]
    model_mib, largest_mib = sum(sizes) / 2**20, max(sizes) / 2**20
    assert model_mib > 75 and largest_mib < 16  # the model is many times its largest tensor
    for mode, a, b in (("hf2ms", str(tmp_path / "hf"), str(tmp_path / "m.ckpt")),
                       ("ms2hf", str(tmp_path / "m.ckpt"), str(tmp_path / "back")),
                       ("hf2ms_bf16", str(tmp_path / "hf"), str(tmp_path / "m16.ckpt"))):
        r = child(mode, a, b)
        delta_mib = (r["peak_kb"] - r["baseline_kb"]) / 1024
        print(f"{mode}: model {model_mib:.0f} MiB, largest tensor {largest_mib:.1f} MiB, peak - baseline "
              f"{delta_mib:.1f} MiB")
        assert delta_mib < 3 * largest_mib + 8, mode   # one tensor, its cast copy, small buffers
        assert delta_mib < 0.5 * model_mib, mode        # and nowhere near holding the model
