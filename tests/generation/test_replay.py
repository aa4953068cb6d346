"""msllm.generation.replay: a compiled graph called again skips MindSpore's per-call compile and
gives what MindSpore's own call gives (outputs, in-place writes to mutable Parameter inputs,
one graph per argument signature)."""

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import Parameter, Tensor, nn, ops  # noqa: E402
from mindspore.graph import api  # noqa: E402

from msllm.generation.replay import replay_cell  # noqa: E402


class Step(nn.Cell):
    """x (B, C) and caches (S, C) Parameters: writes x's rows at ``index`` into each cache, returns
    x @ w + the caches' sums."""

    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.arange(12, dtype=np.float32).reshape(4, 3) / 10), name="w")
        self.scatter = ops.ScatterUpdate()

    def construct(self, x, index, caches):
        out = ops.matmul(x, self.w)
        for c in caches:
            c = self.scatter(c, index, x)
            out = out + c.sum()
        return out


def _caches(n=2, s=6):
    return tuple(Parameter(Tensor(np.zeros((s, 4), np.float32)), name=f"c{i}", requires_grad=False)
                 for i in range(n))


def test_replay_equals_mindspores_call_and_skips_its_compile(monkeypatch):
    ms.set_context(mode=ms.GRAPH_MODE)
    seed = 0
    print("seed", seed)
    rng = np.random.default_rng(seed)
    plain, fast = Step(), replay_cell(Step)()
    fast.w.set_data(plain.w.value())
    caches_p, caches_f = _caches(), _caches()
    compiles = []
    real_compile = api._CellGraphExecutor.compile

    def counting(self, obj, *a, **k):
        compiles.append(type(obj).__name__)
        return real_compile(self, obj, *a, **k)

    monkeypatch.setattr(api._CellGraphExecutor, "compile", counting)
    checks = []
    real_check = nn.Cell._check_construct_args

    def counting_checks(self, *a):
        checks.append(type(self).__name__)
        return real_check(self, *a)

    monkeypatch.setattr(nn.Cell, "_check_construct_args", counting_checks)
    calls = [(2, 0), (2, 2), (3, 1), (2, 4), (3, 3)]   # (rows, first cache row): two signatures
    for rows, first in calls:
        x = rng.standard_normal((rows, 4)).astype(np.float32)
        index = Tensor(np.arange(first, first + rows, dtype=np.int32))
        want = plain(Tensor(x), index, ms.mutable(caches_p)).asnumpy()
        n_before, checks_before = len(compiles), len(checks)
        got = fast(Tensor(x), index, ms.mutable(caches_f)).asnumpy()
        np.testing.assert_array_equal(got, want)
        for a, b in zip(caches_f, caches_p):            # the in-place writes persist as MindSpore's
            np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
        first_of_signature = (rows, first) in ((2, 0), (3, 1))
        assert (len(compiles) > n_before) == first_of_signature, (rows, first, compiles)
        # Cell.__call__'s argument checks too run only at a signature's first call
        assert (len(checks) > checks_before) == first_of_signature, (rows, first, checks)
    assert len(fast.__dict__["_replay_phases"]) == 2


def test_other_arguments_take_mindspores_path():
    ms.set_context(mode=ms.GRAPH_MODE)

    class Scaled(nn.Cell):
        def construct(self, x, k):
            return x * k

    net = replay_cell(Scaled)()
    x = Tensor(np.ones(3, np.float32))
    assert net(x, 2.0).asnumpy().tolist() == [2.0, 2.0, 2.0]
    assert net(x, 3.0).asnumpy().tolist() == [3.0, 3.0, 3.0]   # a Python scalar: never replayed
    assert not net.__dict__["_replay_phases"]


def test_a_replayed_cell_still_refuses_a_wrong_argument_count():
    """After a signature is recorded, a call with one argument fewer is another signature: MindSpore's
    own call, and its TypeError."""
    ms.set_context(mode=ms.GRAPH_MODE)
    net = replay_cell(Step)()
    caches = _caches()
    x = Tensor(np.ones((2, 4), np.float32))
    index = Tensor(np.arange(2, dtype=np.int32))
    net(x, index, ms.mutable(caches))
    net(x, index, ms.mutable(caches))
    with pytest.raises(TypeError):
        net(x, index)
