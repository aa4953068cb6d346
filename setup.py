"""msllm: MindSpore-native LLaMA training. ``pip install -e .`` (add ``[convert]`` for HF conversion)."""

from setuptools import find_packages, setup

setup(
    name="msllm",
    version="0.1.0",
    description="A MindSpore-native toolkit for training and fine-tuning LLaMA-family models",
    packages=find_packages(include=["msllm", "msllm.*"]),
    # tested on Python 3.11 only (CI and the development machines); 3.9 cannot parse the config schema
    python_requires=">=3.11,<3.12",
    install_requires=[
        "mindspore==2.10.0",
        # the mindspore 2.10 wheel is built against numpy 1.x: with numpy 2 multi-process jobs
        # exit non-zero at shutdown (shared NOTES.md)
        "numpy<2",
        "sentencepiece",
        "pyyaml",
        "tqdm",
        "safetensors",
        # Hugging Face tokenizer.json tokenizers and Jinja chat templates (sandboxed; >= 3.1.6 has no
        # known sandbox escape, the floor transformers requires too)
        "tokenizers",
        "jinja2>=3.1.6",
        # training curves: TensorBoard events (MindFormers 1.5+ writes them with tensorboardX) and a loss plot
        "tensorboardX",
        "matplotlib",
        # tools/serve.py: OpenAI-compatible HTTP API (an ASGI application on a well-kept server)
        "starlette==1.10.0",
        "uvicorn==0.54.0",
        # GET /metrics in Prometheus' text format (msllm/serving/metrics.py)
        "prometheus-client==0.26.0",
        # response_format (json_object / json_schema): token masks from a grammar (msllm/serving/structured.py
        # says why this library); no dependencies of its own
        "llguidance==1.9.1",
    ],
    extras_require={
        # weight conversion only; torch 2.13.0 is the CPU build (a plain "torch" pulls CUDA wheels)
        "convert": ["torch==2.13.0", "transformers==5.24.0"],
        # test references: transformers (HF models, generation), peft (LoRA), lm-eval (scoring)
        # gguf + accelerate: transformers dequantizes the real test model (SmolLM2, tools/fetch_model.py);
        # transformers is pinned: the model cache's digest and the parity tests were taken with 5.24.0
        # openai: the official client against tools/serve.py; tenacity: lm-eval's API backends
        # (local-completions) need it; jsonschema: structured output validated against its schema
        # trl: the DPO reference (DPOTrainer); its datasets import needs a pyarrow that imports with numpy<2,
        # which the DPO tests provide themselves (tests/helpers/trl_env.py); pytest-xdist: make test runs
        # each part of the suite on 2 workers (tests/run_parts.sh)
        "dev": ["pytest", "pytest-xdist==3.8.0", "torch==2.13.0", "transformers==5.24.0", "peft", "lm-eval==0.4.13",
                "tensorboard", "gguf==0.19.0", "accelerate", "openai==3.57.0", "tenacity", "jsonschema", "trl==1.16.0"],
    },
    entry_points={
        "console_scripts": [
            "msllm=msllm.cli:main",
        ]
    },
)
