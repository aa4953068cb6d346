"""Evaluation: perplexity, multiple-choice benchmarks (MMLU, C-Eval, BoolQ, own JSONL sets) scored by
log-likelihood, and GSM8K by greedy generation, following EleutherAI's lm-evaluation-harness v0.4
request by request (see ``docs/evaluation.md``).

Modules: ``requests`` (context/continuation pairs -> model rows, as the harness tokenises and
truncates them), ``scoring`` (batched log-likelihood over the msllm network, few-shot prefix
reuse through the key/value cache), ``tasks/`` (file readers and prompt builders per benchmark),
``perplexity`` (sliding-window perplexity, evaluation loss during training), ``dist``
(data-parallel split and exact merge), ``results`` (tables and the JSON results file),
``runner`` (the commands).
"""
