"""An OpenAI-compatible HTTP server over msllm's batched decoding (``tools/serve.py``).

* :mod:`msllm.serving.validate`: every request field checked (types, ranges, limits) before
  anything is tokenized or queued;
* :mod:`msllm.serving.protocol`: checked fields turned into jobs, the response and error JSON;
* :mod:`msllm.serving.defaults`: request defaults from the run YAML's ``generation_config``;
* :mod:`msllm.serving.structured`: ``response_format`` through llguidance's token masks;
* :mod:`msllm.serving.engine`: one thread owning the model, batching the jobs that arrive
  together on the key/value cache (:mod:`msllm.serving.batch`), each row with its own settings;
  long prompts and prompts with a cached prefix join in pieces (:mod:`msllm.serving.joining`,
  :mod:`msllm.serving.staged_prefill`, :mod:`msllm.serving.prefix_cache`); the shapes warmed up
  at start (:mod:`msllm.serving.warmup`);
* :mod:`msllm.serving.metrics`: Prometheus metrics; :mod:`msllm.serving.tokenize_routes`: vLLM's
  ``/tokenize`` and ``/detokenize``;
* :mod:`msllm.serving.app`: the Starlette application (routes, bearer key, server-sent events).
"""
