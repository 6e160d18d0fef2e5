"""kvtvm.engine.linear: the engine's oneDNN linear layers against torch's ``nn.Linear`` on fresh
random inputs, repacking after a weight changes, the fallbacks and bad input."""

import pytest
import torch

from kvtvm.engine import ModelRunner, build_toy_model
from kvtvm.engine.linear import LinearBackend
from kvtvm.errors import InvalidArgumentError

pytestmark = pytest.mark.e2e


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch_linear_and_repacks(bias):
    lin = LinearBackend(torch.float32, "cpu")
    if lin.name != "onednn":
        pytest.skip("this torch has no usable oneDNN linear")
    gen = torch.Generator().manual_seed(1)
    mod = torch.nn.Linear(96, 160, bias=bias)
    for rows in (1, 8, 300):
        x = torch.randn(rows, 96, generator=gen)
        assert _close(lin(mod, x), mod(x))
    assert lin.packed_bytes() == mod.weight.numel() * 4
    with torch.no_grad():                      # in place: the packed copy must follow
        mod.weight.mul_(-2.0)
    x = torch.randn(5, 96, generator=gen)
    assert _close(lin(mod, x), mod(x))
    mod.weight = torch.nn.Parameter(torch.randn(160, 96, generator=gen))   # a new tensor
    assert _close(lin(mod, x), mod(x))


def test_falls_back_where_onednn_does_not_apply():
    assert LinearBackend(torch.bfloat16, "cpu").name == "torch"
    assert LinearBackend(torch.float32, "cpu", "torch").name == "torch"
    with pytest.raises(InvalidArgumentError, match="linear must be one of"):
        LinearBackend(torch.float32, "cpu", "mkl")
    with pytest.raises(InvalidArgumentError, match="float32"):
        LinearBackend(torch.float16, "cpu", "onednn")


def _run(runner, prompt, last_only):
    from kvtvm.engine.caches import make_cache
    from kvtvm.params import KVCacheParams

    params = KVCacheParams(torch.float32, runner.n_kv_heads, runner.head_dim, "paged",
                           page_size=16)
    cache = make_cache("paged", params, 1, 64, runner.num_layers, "cpu", None)

    class _Req:
        seq_id, output, max_new_tokens = -1, [], 1
    req = _Req()
    req.prompt = prompt
    cache.add(req)
    kv = cache.fetch([req], [prompt])
    return runner.run_step(kv, [prompt], last_only=last_only)


def test_runner_logits_match_transformers_with_either_backend():
    """The whole forward (every token's logits) equals transformers' within float32 rounding,
    through oneDNN and through torch; with ``last_only`` (the last layer's o_proj and MLP on
    each sequence's last row alone) the last row's too."""
    model = build_toy_model(num_layers=2)
    ids = torch.randint(3, 1000, (1, 37), generator=torch.Generator().manual_seed(4))
    want = model(ids).logits[0].float()
    for backend in ("auto", "torch"):
        runner = ModelRunner(model, linear=backend)
        assert ModelRunner(model, linear=backend).linear is runner.linear   # one packed copy
        got = _run(runner, ids[0].tolist(), last_only=False)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), backend
        last = _run(runner, ids[0].tolist(), last_only=True)
        assert last.shape == (1, want.shape[1])
        assert torch.allclose(last[0], want[-1], rtol=1e-4, atol=1e-4), backend
