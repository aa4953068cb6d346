#!/usr/bin/env bash
# The main job, end to end on the bundled real data (examples/data), with the same commands a
# user runs on an Ascend cluster:
#   Alpaca records -> conversation JSON -> MindRecord (real LLaMA tokenizer)
#   -> HCCL rank table for 1 server x 2 devices -> run_distribute.sh: 2 data-parallel CPU ranks
#   train configs/llama/run_llama_tiny.yaml -> checkpoints + loss summary + loss-curve PNG
#   -> the trained model answers three Alpaca instructions (run_mode predict, its chat template).
# Everything goes under ${DEMO_DIR:-output/demo}. 3 to 10 minutes on 2 cores, by CPU.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
PY="${PYTHON:-$REPO_ROOT/.venv/bin/python}"
OUT="${DEMO_DIR:-output/demo}"
DATA="$OUT/data"
SEQ=256
mkdir -p "$DATA"
export GLOG_v="${GLOG_v:-3}"   # MindSpore's C++ log: errors only

echo "== 1/5 Alpaca -> conversation ($DATA/alpaca-data-conversation.json)"
"$PY" data_preprocess/alpaca_converter.py \
  --data_path examples/data/alpaca_en_demo.json \
  --output_path "$DATA/alpaca-data-conversation.json"

echo "== 2/5 conversation -> MindRecord, seq_length $SEQ, real LLaMA tokenizer"
"$PY" data_preprocess/llama_preprocess.py \
  --input_glob "$DATA/alpaca-data-conversation.json" --dataset_type qa \
  --model_file examples/data/tokenizer.model --seq_length $SEQ --repeat 1 --shuffle 1 \
  --output_file "$DATA/alpaca_$SEQ.mindrecord" --num_workers 2

echo "== 3/5 HCCL rank table: 1 server (127.0.0.1) x 2 devices"
"$PY" tools/hccl_tools.py --device_num "[0,2)" --server_ip 127.0.0.1 --output_dir "$OUT"
RANK_TABLE="$OUT/hccl_2p_01_127.0.0.1.json"

echo "== 4/5 train run_llama_tiny.yaml on 2 data-parallel CPU processes"
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
echo "== 5/5 the trained model answers three instructions of the bundled Alpaca data (its chat template; top-k 40, temperature 0.7, seed 0)"
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
