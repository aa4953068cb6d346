"""transformers decode worker: ``LlamaForCausalLM.from_pretrained`` (float32, torch eager,
``torch.set_num_threads(threads)``) and ``generate(do_sample=False)`` with its KV cache on the same
prompts and weights as the msllm worker, no EOS stop, once cold and ``reps`` times warm. The time
to first token and the decode time come from a streamer (``BaseStreamer.put`` is called with the
prompt, then after every new token).

Usage: python decode_torch.py '{"model_dir": ..., "prompts": ".npz", "batch": 1, "new": 128,
                                "reps": 3, "threads": 2}'
Prints one ``BENCH_RESULT {json}`` line (fields as decode_msllm.py).
"""

import time

import worker_common as wc  # first: takes the process start time

common = wc.common


def main():
    args = wc.worker_args()
    phases = wc.Phases()
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM
    from transformers.generation.streamers import BaseStreamer
    phases.mark("import")
    torch.set_num_threads(int(args.get("threads", 2)))

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    model = LlamaForCausalLM.from_pretrained(args["model_dir"], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    phases.mark("build")
    ids = torch.tensor(np.load(args["prompts"])["ids"][:args["batch"]], dtype=torch.long)
    runs = []
    for rep in range(1 + args["reps"]):
        clock = Clock()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args["new"],
                                 do_sample=False, pad_token_id=0, streamer=clock)
        t_end = time.perf_counter()
        new = out.shape[1] - ids.shape[1]
        assert new == args["new"], new
        first = clock.times[1]               # times[0]: the prompt
        runs.append({"ttft_s": first - t0, "decode_s": t_end - first, "steps": new - 1,
                     "decode_tokens_per_s": ids.shape[0] * (new - 1) / (t_end - first)})
    common.emit({
        "framework": "torch-eager", "batch": ids.shape[0], "prompt_tokens": ids.shape[1], "new_tokens": args["new"],
        **wc.decode_summary(runs, args), "tokens_row0": out[0, ids.shape[1]:].tolist(),
        **phases.fields(), "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
