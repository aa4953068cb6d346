"""The Ascend job compiled by MindSpore's simulation ("dry-run") on any machine: the driver that
runs one compile per rank in a child process (:mod:`msllm.dryrun.driver`), the child that builds
and compiles the configured train step (:mod:`msllm.dryrun.compile`), the per-rank report read
from MindSpore's output and compiled graph (:mod:`msllm.dryrun.report`), and the
``run_distribute.sh ... --sim_level`` front (:mod:`msllm.dryrun.launch`). The device layer it
needs without CANN is :mod:`msllm.cluster.simulation`. Above the trainer: it compiles the trainer's
own network and step. Details: docs/dryrun.md."""
