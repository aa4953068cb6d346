"""Benchmark readers and prompt builders, one module per task (see each module's docstring for
the lm-evaluation-harness task file it follows)."""
