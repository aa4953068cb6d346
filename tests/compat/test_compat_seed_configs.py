"""Each seed configuration written MindFormers' way (tests/compat/fixtures/mf_run_llama_*.yaml)
resolves to the same RunConfig as msllm's own YAML (configs/llama/run_llama_*.yaml)."""

from __future__ import annotations

import os

import pytest

from msllm.compat.mindformers import translate_mindformers_yaml
from msllm.config import RunConfig, from_dict, read_yaml, to_dict

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _diff(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{path}.{k}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


@pytest.mark.parametrize("name", ["tiny", "7b", "13b", "70b"])
def test_mindformers_yaml_resolves_to_the_msllm_config(name):
    mf_path = os.path.join(HERE, "fixtures", f"mf_run_llama_{name}.yaml")
    msllm_path = os.path.join(REPO, "configs", "llama", f"run_llama_{name}.yaml")
    translated, notes = translate_mindformers_yaml(read_yaml(mf_path), mf_path, RunConfig)
    from_mf = from_dict(RunConfig, translated)
    ours = from_dict(RunConfig, read_yaml(msllm_path))
    from_mf.validate()
    assert _diff(to_dict(from_mf), to_dict(ours)) == []
    assert from_mf == ours
    # the MindFormers file really is MindFormers-shaped: many keys had to be translated or dropped
    assert len(notes) > 30 and {"trainer", "use_parallel", "processor"} <= {p for p, _ in notes}
    assert isinstance(read_yaml(mf_path)["callbacks"], list)
