"""The command lines off the usual grid (session 12's fuzzing of the serving path): option
values the other tests do not use. A user's mistake is one line naming the option and exit
status 2, never a traceback; odd but valid values run."""

import pytest

from kvtvm.bench.__main__ import main as bench_main

pytestmark = pytest.mark.e2e


def _status(call, argv):
    try:
        return call(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.mark.parametrize("argv, names", [
    # a one-token window scores nothing: ZeroDivisionError after loading SmolLM2
    (["quality", "--tokens", "40", "--window", "1", "--stride", "1"], "--window"),
    # no way at all: it loaded the model, ran nothing and exited 0
    (["e2e", "--model", "toy", "--ways", ","], "--ways"),
    (["e2e", "--model", "toy", "--ways", ""], "--ways"),
    # a format matplotlib cannot write: a traceback after the whole benchmark had run
    (["decode", "--cases", "1x16", "--plot", "out.txt"], "--plot"),
    # sizes no memory holds: the allocator's traceback (after minutes, at 100000x100000)
    (["decode", "--cases", "1x99999999999"], "--cases"),
    (["decode", "--head-dim", "99999999999"], "--head-dim"),
    (["prefill", "--cases", "1:1:99999999999"], "--cases"),
    (["append", "--head-dim", "99999999999"], "--head-dim"),
    (["copy", "--n-kv-heads", "99999999999"], "--n-kv-heads"),
    # nothing left to measure: it printed nothing and exited 0
    (["transfer", "--skip", "transfer,host"], "--skip"),
])
def test_bench_bad_option_is_one_line_naming_it(argv, names, capsys):
    status = _status(bench_main, argv)
    err = capsys.readouterr().err
    assert status == 2, (status, err)
    assert "Traceback" not in err
    assert names in err.strip().splitlines()[-1]


def test_bench_e2e_runs_a_way_named_twice_once(capsys):
    """``--ways engine,engine`` ran and printed the engine twice."""
    argv = ["e2e", "--model", "toy", "--requests", "1", "--prompt-lens", "3", "--new-tokens",
            "2", "--ways", "engine, engine"]
    assert _status(bench_main, argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("prompt") and " engine " in line]
    assert len(rows) == 1, rows


def test_generate_prompt_that_is_not_utf8(capsys):
    """Bytes of another encoding on the command line (``café`` in Latin-1) reach Python as
    lone surrogates, and SmolLM2's tokenizer raised TypeError: a traceback."""
    pytest.importorskip("gguf")
    from kvtvm.cli import main as cli_main

    status = _status(cli_main, ["generate", "--prompt", "caf\udce9", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert "--prompt" in err.strip().splitlines()[-1] and "xe9" in err


def test_generate_cache_too_big_names_max_new_tokens(capsys, monkeypatch):
    """The cache is sized by the prompt + ``--max-new-tokens``: when it cannot be allocated
    the error named only ``cache``."""
    import kvtvm.engine.core as core
    from kvtvm.cli import main as cli_main
    from kvtvm.errors import KVCacheCapacityError

    def refuse(*args):
        raise KVCacheCapacityError("cache: cannot allocate (...) (4096000000000 bytes) on cpu")
    monkeypatch.setattr(core, "make_cache", refuse)
    argv = ["generate", "--model", "toy", "--prompt", "5 6", "--max-new-tokens", "2000000000"]
    assert _status(cli_main, argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--max-new-tokens 2000000000" in last and "cannot allocate" in last


def test_a_rejected_prompt_is_said_once(capsys):
    from kvtvm.cli import main as cli_main

    assert _status(cli_main, ["generate", "--model", "toy", "--prompt", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --prompt: empty prompt (at least one token is needed)"], err


def test_a_prompt_past_the_models_positions_is_warned_about(capsys):
    """A 9,000-token prompt to SmolLM2 (8,192 positions) ran without a word."""
    from kvtvm.cli import main as cli_main

    prompt = " ".join(["5"] * 4097)  # the toy model has 4096 positions
    assert _status(cli_main, ["generate", "--model", "toy", "--prompt", prompt,
                              "--max-new-tokens", "1"]) == 0
    assert "max_position_embeddings (4096)" in capsys.readouterr().err


def test_load_model_refuses_a_name_that_is_not_one():
    """``load_model(None)`` raised TypeError (``Path(None)``); a dtype that is not a name
    (``torch.float32``) is refused by name."""
    import torch

    from kvtvm.engine import load_model
    from kvtvm.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="name"):
        load_model(None)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        load_model("toy", dtype=[torch.float32])


GEN = ["generate", "--model", "toy", "--prompt", "5 6"]


@pytest.mark.parametrize("argv, names", [
    # refused once the toy model was loaded and the request rejected, by the request's
    # field name (top_p), not the option's
    ([*GEN, "--top-p", "0"], "argument --top-p"),
    ([*GEN, "--top-p", "nan"], "argument --top-p"),
    ([*GEN, "--temperature", "-0.5"], "argument --temperature"),
    ([*GEN, "--temperature", "1", "--seed", str(-(1 << 63) - 1)], "argument --seed"),
    (["generate", "--model", "toy", "--prompt", "5 1000"], "--prompt: token id 1000"),
    (["generate", "--model", "toy", "--prompt", "-1"], "--prompt: token id -1"),
    # refused before the model loads, naming the option (not the engine's keyword)
    ([*GEN, "--k-cache-dtype", "float16"], "argument --k-cache-dtype"),
    ([*GEN, "--dtype", "bfloat16", "--v-cache-dtype", "float32"], "argument --v-cache-dtype"),
    ([*GEN, "--cache-dtype", "int8", "--skip-layers", "0", "0"], "--skip-layers: each layer"),
    (["generate", "--model", "", "--prompt", "hi"], "argument --model"),
    ([*GEN, "--temperature", "0.5", "--check"], "--check compares greedy tokens"),
])
def test_generate_bad_value_names_the_option(argv, names, capsys):
    from kvtvm.cli import main as cli_main

    status = _status(cli_main, argv)
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert names in err.strip().splitlines()[-1]


def test_generate_on_cpu_0_and_check_of_a_sampled_answer(capsys):
    """``--device cpu:0`` (which the option takes) was refused by the engine ("expected the
    model's device (cpu)")."""
    from kvtvm.cli import main as cli_main

    assert _status(cli_main, [*GEN, "--device", "cpu:0", "--max-new-tokens", "3",
                              "--check"]) == 0
    assert "checked: 3 tokens equal" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Mistral (vocabulary of 64, window 4) saved alone: no tokenizer."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, sliding_window=4,
        pad_token_id=0, eos_token_id=None, bos_token_id=1, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp("tiny-mistral")
    model.save_pretrained(path)
    return path


def test_generate_model_directory_without_a_tokenizer(model_dir, tmp_path, capsys):
    """A model saved without its tokenizer raised out of ``AutoTokenizer`` (a traceback);
    it now takes token ids like the toy. A tokenizer that does not load names ``--model``."""
    from kvtvm.cli import main as cli_main

    argv = ["generate", "--model", str(model_dir), "--max-new-tokens", "5", "--check"]
    assert _status(cli_main, [*argv, "--prompt", "3 4 5 6 7 8 9"]) == 0
    assert "checked: 5 tokens equal" in capsys.readouterr().err
    assert _status(cli_main, [*argv, "--prompt", "hi"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "tokenizer_config.json").write_text("{not json")
    assert _status(cli_main, ["generate", "--model", str(broken), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "tokenizer does not load" in err


def test_bench_e2e_on_a_small_vocabulary(model_dir, capsys):
    """Prompts were drawn from ids [100, vocab - 1): ValueError (low >= high) for a model of
    64 tokens."""
    argv = ["e2e", "--model", str(model_dir), "--requests", "2", "--prompt-lens", "5",
            "--new-tokens", "2", "--ways", "engine,hf-generate-sdpa"]
    assert _status(bench_main, argv) == 0
    assert "every way's tokens equal" in capsys.readouterr().out


def test_generate_top_k(capsys):
    """``--top-k 1`` samples the greedy tokens at any temperature; a negative one is refused
    by name."""
    from kvtvm.cli import main as cli_main

    assert _status(cli_main, [*GEN, "--max-new-tokens", "4"]) == 0
    greedy = capsys.readouterr().out.split()
    assert _status(cli_main, [*GEN, "--max-new-tokens", "4", "--temperature", "3",
                              "--top-k", "1"]) == 0
    assert capsys.readouterr().out.split() == greedy
    assert _status(cli_main, [*GEN, "--top-k", "-1"]) == 2
    assert "argument --top-k" in capsys.readouterr().err.strip().splitlines()[-1]


def test_bench_quality_refuses_a_layer_named_twice(capsys):
    """``--skip-layers 0 0`` (and ``0 -30``, layer 0 twice of SmolLM2's 30) was taken;
    ``generate`` and the engine refuse it (KVCacheParams: distinct layers)."""
    argv = ["quality", "--tokens", "8", "--window", "8", "--stride", "8", "--new-tokens", "1",
            "--settings", "--skip-layers", "0", "0"]
    assert _status(bench_main, argv) == 2
    assert "--skip-layers" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, names", [
    (["--seed", str(-(1 << 70))], "argument --seed"),   # torch.manual_seed: a traceback
    (["--temperature", "-1"], "argument --temperature"),   # taken (ignored by the toy demo)
    (["--top-p", "0"], "argument --top-p"),
])
def test_serve_example_bad_sampling_values(argv, names, capsys):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "serve.py"
    spec = importlib.util.spec_from_file_location("kvtvm_example_serve_fuzz", path)
    serve = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = serve
    spec.loader.exec_module(serve)
    status = _status(serve.main, ["--model", "toy", "--requests", "1", *argv])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert names in err.strip().splitlines()[-1]


def test_generate_model_directory_without_usable_weights(model_dir, tmp_path, capsys):
    """A directory with a config and no weights (OSError) or a corrupt ``model.safetensors``
    (SafetensorError) was a traceback out of ``from_pretrained``."""
    from kvtvm.cli import main as cli_main

    none = tmp_path / "none"
    none.mkdir()
    (none / "config.json").write_text((model_dir / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((model_dir / "config.json").read_text())
    (bad / "model.safetensors").write_text("garbage")
    for path in (none, bad):
        assert _status(cli_main, ["generate", "--model", str(path), "--prompt", "3 4"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "weights do not load" in err, err[-500:]
