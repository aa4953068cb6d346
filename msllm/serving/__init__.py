"""An OpenAI-compatible HTTP server over msllm's batched decoding (``tools/serve.py``).

* :mod:`msllm.serving.protocol`: the request bodies of ``/v1/completions`` and
  ``/v1/chat/completions`` checked and turned into jobs, the response and error JSON;
* :mod:`msllm.serving.engine`: one thread owning the model, batching the jobs that arrive
  together on the key/value cache, each row with its own settings;
* :mod:`msllm.serving.app`: the Starlette application (routes, bearer key, server-sent events).
"""
