"""benchmarks/ratios.py: every "x faster" figure is the median of the per-round paired ratios (with
min and max), not the ratio of the medians. Hand-checked numbers; the stored SmolLM2 fine-tuning
result (issue #31's example: 1.59 / 1.49 / 1.26 -> 1.49, where the medians' ratio is 1.52); and the
benchmark scripts' summaries that compute ratios (lora_speed, eval_speed, train_throughput's table)
give the paired figure on stored result files, without running anything."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
RESULTS = os.path.join(BENCH, "results")
sys.path.insert(0, BENCH)

import ratios  # noqa: E402


def _runs(a_vals, b_vals, key="tokens_per_s"):
    runs = []
    for rnd, (a, b) in enumerate(zip(a_vals, b_vals)):
        runs += [{"framework": "a", key: a, "round": rnd}, {"framework": "b", key: b, "round": rnd}]
    return runs


def test_stats_hand_checked():
    s = ratios.stats([1.59, 1.49, 1.26])
    assert s["median"] == pytest.approx(1.49) and s["min"] == 1.26 and s["max"] == 1.59 and s["n"] == 3
    assert ratios.fmt(s) == "1.49 (1.26-1.59)"
    assert ratios.stats([2.0, 1.0])["median"] == pytest.approx(1.5)      # two rounds: their mean
    one = ratios.stats([1.034])
    assert ratios.fmt(one) == "1.03 (1 round: unpaired)"                  # says so, invents no range
    assert ratios.stats([])["n"] == 0 and ratios.fmt(ratios.stats([])) == "n/a"


def test_paired_is_not_ratio_of_medians():
    # a: 159, 149, 126 tokens/s against b at 100 in every round but one slow b round
    a, b = [159.0, 149.0, 100.0], [100.0, 100.0, 50.0]
    r = ratios.paired(_runs(a, b), "a", "b", "tokens_per_s")
    assert r == pytest.approx([1.59, 1.49, 2.0])
    assert ratios.stats(r)["median"] == pytest.approx(1.59)
    assert 149.0 / 100.0 == pytest.approx(1.49)   # the ratio of the medians: a different figure


def test_paired_times_and_order_pairing():
    # times: lower is better, the ratio is den / num (how many times faster num is)
    runs = _runs([2.0, 4.0], [3.0, 4.0], key="s")
    assert ratios.paired(runs, "a", "b", "s", lower_is_better=True) == pytest.approx([1.5, 1.0])
    # without a round field the occurrence order stands for it (alternating A, B, A, B files)
    for r in runs:
        del r["round"]
    assert ratios.paired(runs, "a", "b", "s", lower_is_better=True) == pytest.approx([1.5, 1.0])
    # a failed side (no value) drops that round instead of pairing across rounds
    runs = _runs([2.0, 4.0, 6.0], [1.0, None, 3.0])
    assert ratios.paired(runs, "a", "b", "tokens_per_s") == pytest.approx([2.0, 2.0])


def test_match_fields_keep_shapes_apart():
    runs = [{"framework": "a", "shape": s, "round": 0, "v": v} for s, v in (("x", 10.0), ("y", 30.0))]
    runs += [{"framework": "b", "shape": s, "round": 0, "v": v} for s, v in (("x", 5.0), ("y", 10.0))]
    assert ratios.paired(runs, "a", "b", "v", match=("shape",)) == pytest.approx([2.0, 3.0])


def test_stored_smollm2_full_fine_tune_is_1_49():
    rows = dict(ratios.report(os.path.join(RESULTS, "lora_speed_smollm2.json")))
    s = rows["tokens/s msllm-full / torch-full"]
    assert [round(x, 2) for x in s["rounds"]] == [1.59, 1.49, 1.26]
    assert round(s["median"], 2) == 1.49 and round(s["min"], 2) == 1.26 and round(s["max"], 2) == 1.59


def test_lora_speed_summary_is_paired():
    import lora_speed

    with open(os.path.join(RESULTS, "lora_speed_smollm2.json")) as f:
        d = json.load(f)
    row = lora_speed.summarise(d["shape"], d["runs"])["frameworks"]["msllm-full"]
    assert round(row["speed_vs_torch"], 2) == 1.49
    assert (round(row["speed_vs_torch_min"], 2), round(row["speed_vs_torch_max"], 2)) == (1.26, 1.59)
    assert "1.49 (1.26-1.59)" in lora_speed.markdown(lora_speed.summarise(d["shape"], d["runs"]))
    # the like-for-like switch: every msllm variant has a dense-head twin passed to the worker
    assert "msllm-full-dense" in lora_speed.VARIANTS and "msllm-lora-r8-attn-p0-dense" in lora_speed.VARIANTS
    assert "peft-lora-r8-attn-dense" not in lora_speed.VARIANTS


def test_train_throughput_table_shows_paired_range():
    import train_throughput

    with open(os.path.join(RESULTS, "train_throughput_medium_amd_zen4_3rounds.json")) as f:
        d = json.load(f)
    md = train_throughput.markdown(d)
    row = next(ln for ln in md.splitlines() if ln.startswith("| msllm |"))
    assert "1.59 (1.44-1.66)" in row and "1.55 (1.54-1.62)" in row


def test_eval_speed_old_file_pairs_by_order():
    rows = dict(ratios.report(os.path.join(RESULTS, "eval_speed_amd_zen4.json")))
    s = rows["tiny ppl cold msllm / harness"]
    # 3 alternating rounds; the medians' ratio (2308 / 1802 = 1.28) is not the paired figure
    assert s["n"] == 3 and round(s["median"], 2) == 1.30


def test_lora_dense_variant_reaches_the_worker(monkeypatch):
    import harness
    import lora_speed

    seen = {}
    monkeypatch.setattr(harness, "run_worker", lambda name, script, args, timeout: seen.setdefault(name, args))
    lora_speed.run_worker("msllm-full-dense", "tiny", 1, 0, 10.0)
    lora_speed.run_worker("msllm-full", "tiny", 1, 0, 10.0)
    lora_speed.run_worker("msllm-lora-r8-attn-p0-dense", "tiny", 1, 0, 10.0)
    assert seen["msllm-full-dense"]["compact_loss"] is False and "compact_loss" not in seen["msllm-full"]
    assert seen["msllm-lora-r8-attn-p0-dense"]["pet"] == lora_speed.VARIANTS["msllm-lora-r8-attn-p0"][1]
    # a dense LoRA run is compared with the dense full run and with the same PEFT config
    runs = []
    for rnd in range(2):
        for name, tps in (("msllm-full", 100.0), ("msllm-full-dense", 80.0), ("torch-full", 50.0),
                          ("msllm-lora-r8-attn-p0-dense", 120.0), ("peft-lora-r8-attn-p0", 60.0)):
            runs.append({"framework": name, "tokens_per_s": tps + rnd, "round": rnd, "step_s_median": 1.0,
                         "first_step_s": 1.0, "peak_rss_mib": 1.0, "rss_mib": {}, "checkpoint_bytes": 1,
                         "base_params": 10, "trainable_params": 1, "optimizer_state_elements": 2,
                         "pet": {"lora_rank": 8} if "lora" in name else None, "load_before": "", "load_after": ""})
    table = lora_speed.summarise("tiny", runs)["frameworks"]
    assert table["msllm-full-dense"]["speed_vs_torch"] == pytest.approx((80 / 50 + 81 / 51) / 2)
    assert table["msllm-lora-r8-attn-p0-dense"]["speed_vs_full"] == pytest.approx((120 / 80 + 121 / 81) / 2)
    assert table["msllm-lora-r8-attn-p0-dense"]["speed_vs_peft"] == pytest.approx((120 / 60 + 121 / 61) / 2)


def test_decode_speed_summary_prints_paired_range():
    import decode_speed

    with open(os.path.join(RESULTS, "decode_speed_smollm2_amd_zen4.json")) as f:
        d = json.load(f)
    summary = decode_speed.summarise(d["runs"])
    row = summary["smollm2/b8"]["msllm"]
    assert round(row["decode_ratio"], 2) == 1.60 and row["decode_ratio_paired"]["n"] == 3
    md = decode_speed.markdown(summary)
    assert "1.60 (1.35-1.61) (target 1.5: met)" in md
