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
    # the trainer reaches starting weights (an HF directory, an msllm or MindFormers checkpoint)
    # through msllm.convert.starting only (issue #31), never the converters themselves
    assert not any(d.startswith("msllm.convert") and d != "msllm.convert.starting" for d in training)


# The dependency floors (DESIGN.md "Habits": a module imports only from below it in the flow).
# A package may import from its own floor or lower, never from a higher one. A new package or
# top-level module must be given a floor here.
FLOORS = {
    "msllm": 0, "errors": 0, "fileio": 0, "config_io": 0, "cli_args": 0,   # no msllm logic
    "config_generation": 0, "config_lora": 0,                               # schema sections, pure Python
    "compat": 1, "kernels": 1, "data": 1,
    "models": 2,
    "config": 3,                                                            # the run schema
    "settings": 4, "formats": 4,
    "convert": 5, "parallel": 5,
    "cluster": 6,
    "lora": 7,
    "generation": 8,
    "eval": 9, "serving": 9,
    "training": 10,
    "dryrun": 11,                                                           # compiles the trainer's step
    "cli": 12, "__main__": 12,
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_imports_flow_down_the_floors():
    graph = import_graph()
    unplaced = sorted({_package(m) for m in graph} - set(FLOORS))
    assert not unplaced, f"give these a floor in FLOORS: {unplaced}"
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                    if d in graph and FLOORS[_package(d)] > FLOORS[_package(m)])
    assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(upward)


def test_the_floor_check_catches_an_upward_import():
    graph = {"msllm.config": {"msllm.generation.decode"}, "msllm.generation.decode": set()}
    upward = [(m, d) for m, deps in graph.items() for d in deps if FLOORS[_package(d)] > FLOORS[_package(m)]]
    assert upward == [("msllm.config", "msllm.generation.decode")]
