"""Compatibility with other toolkits' files: :mod:`msllm.compat.mindformers` reads MindFormers'
run YAMLs into msllm's config schema (``docs/mindformers_compat.md``)."""
