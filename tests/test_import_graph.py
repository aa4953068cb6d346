"""No import cycles anywhere in msllm (issue #13): module by module, counting imports inside
functions too, so a lazy import cannot hide one; and the packages that load checkpoints
(conversion, LoRA, inference) reach them through msllm.formats, not through the trainer."""

from helpers.imports import find_cycle, import_graph


def test_msllm_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    assert len(graph) > 80 and "msllm.training.trainer" in graph  # the walk saw the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_checkpoint_users_do_not_import_the_trainer_package():
    graph = import_graph()
    for package in ("msllm.convert", "msllm.lora", "msllm.generation", "msllm.eval", "msllm.formats",
                    "msllm.parallel", "msllm.models"):
        bad = {m: sorted(d for d in deps if d.startswith("msllm.training")) for m, deps in graph.items()
               if m.startswith(package)}
        assert not any(bad.values()), {m: d for m, d in bad.items() if d}
    training = {d for m, deps in graph.items() if m.startswith("msllm.training") for d in deps}
    assert not any(d.startswith("msllm.convert") for d in training)
