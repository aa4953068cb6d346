"""Checkpoint files, shared by training and conversion (so neither imports the other).

* :mod:`msllm.formats.dtypes`: storage dtypes (bfloat16 as raw bits), casts, ``TensorRef``.
* :mod:`msllm.formats.mindspore_ckpt`: MindSpore ``.ckpt`` (protobuf), streaming reader/writer.
* :mod:`msllm.formats.safetensors`: safetensors header reader and streaming writer.
* :mod:`msllm.formats.torch_weights`: ``.bin`` / ``.pth`` read with ``torch.load(weights_only=True)``.
* :mod:`msllm.formats.manifest`: the ``X.ckpt.json`` manifest (size, SHA-256, model config) and the
  checkpoint file-name pattern ``{prefix}_{rank}-{epoch}_{step}.ckpt``.
* :mod:`msllm.formats.mindformers`: MindFormers-named checkpoints (renaming, ``qkv_concat`` rows).
"""
