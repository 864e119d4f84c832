"""``memtrace estimate``: the table, fits / does not fit, the max-batch search and one-line errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest

from lightning_memtrace.cli.estimate import add_estimate_subcommand, main, run_estimate
from lightning_memtrace.estimator import build_meta_model, estimate_from_config
from lightning_memtrace.models import TINY_QWEN2_CONFIG

from shared_files import CONFIGS, config_path
TINY = str(CONFIGS / "qwen2-tiny.json")
TINY_PARAM_BYTES = 13_714_432
ONE_LAYER = dict(TINY_QWEN2_CONFIG, num_hidden_layers=1)
ONE_LAYER_PARAM_BYTES = 5_002_240


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("configs") / "one_layer.json"
    path.write_text(json.dumps(ONE_LAYER))
    return str(path)


@pytest.fixture(scope="module")
def tiny_peaks(one_layer) -> dict[int, int]:
    model = build_meta_model(one_layer)
    return {b: estimate_from_config(one_layer, b, 128, model=model).peak_bytes for b in (4, 5, 6)}


def test_table_and_fits(capsys, tiny_peaks, one_layer):
    budget = tiny_peaks[4] + 1
    assert main(["--config", one_layer, "--batch-size", "4", "--seq-len", "128", "--device-memory", str(budget)]) == 0
    out = capsys.readouterr().out
    assert "after_forward" in out and "optimizer_state" in out
    assert f"{ONE_LAYER_PARAM_BYTES:,} B" in out
    assert f"{2 * ONE_LAYER_PARAM_BYTES:,} B" in out  # AdamW state on CUDA: step scalars are host memory
    assert f"({tiny_peaks[4]:,} B)" in out
    assert "fits in" in out and "does not fit" not in out


def test_does_not_fit_exits_1(capsys, tiny_peaks, one_layer):
    budget = tiny_peaks[4] - 1
    assert main(["--config", one_layer, "--batch-size", "4", "--seq-len", "128", "--device-memory", str(budget)]) == 1
    assert "does not fit in" in capsys.readouterr().out


def test_find_max_batch(capsys, tiny_peaks, one_layer):
    budget = (tiny_peaks[5] + tiny_peaks[6]) // 2
    code = main(
        [
            "--config",
            one_layer,
            "--seq-len",
            "128",
            "--device-memory",
            str(budget),
            "--find-max-batch",
            "--max-batch-size",
            "64",
            "--json",
        ]
    )
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["max_batch_size"] == 5
    assert payload["fits"] is True
    assert payload["estimate"]["batch_size"] == 5
    assert payload["estimate"]["peak_bytes"] == tiny_peaks[5]
    assert payload["searched_peaks"]["6"] == tiny_peaks[6]
    assert payload["estimate"]["categories"]["parameters"] == ONE_LAYER_PARAM_BYTES
    # 1 and 2, then the line through their peaks: 6 is the first too large, 5 the last that fits
    assert sorted(int(k) for k in payload["searched_peaks"]) == [1, 2, 5, 6]


def test_options_reach_the_estimate(capsys, one_layer):
    code = main(
        [
            "--config",
            one_layer,
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--optimizer",
            "sgd",
            "--precision",
            "bf16-true",
            "--gradient-checkpointing",
            "--device",
            "cpu",
            "--json",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)["estimate"]
    assert data["optimizer"] == "SGD" and data["precision"] == "bf16-true" and data["gradient_checkpointing"]
    assert data["categories"]["parameters"] == ONE_LAYER_PARAM_BYTES // 2
    assert data["categories"]["optimizer_state"] == ONE_LAYER_PARAM_BYTES // 2  # momentum buffers, bf16


def test_ddp_adds_its_gradient_buckets(capsys, one_layer):
    """``--ddp``: DDP's buckets, one fp32 slot per parameter, held throughout (``other``), on top of the same run."""
    argv = ["--config", one_layer, "--batch-size", "2", "--seq-len", "32", "--json"]
    peaks = {}
    for extra in ([], ["--ddp"]):
        assert main(argv + extra) == 0
        peaks[bool(extra)] = json.loads(capsys.readouterr().out)["estimate"]
    assert peaks[True]["ddp_bucket_bytes"] == ONE_LAYER_PARAM_BYTES and peaks[False]["ddp_bucket_bytes"] == 0
    assert peaks[True]["peak_bytes"] - peaks[False]["peak_bytes"] == ONE_LAYER_PARAM_BYTES
    assert peaks[True]["categories"]["other"] - peaks[False]["categories"]["other"] == ONE_LAYER_PARAM_BYTES


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", "/no/such/config.json", "--batch-size", "1", "--seq-len", "8"], "no such config"),
        (["--config", TINY, "--seq-len", "8"], "--batch-size is required"),
        (["--config", TINY, "--seq-len", "8", "--find-max-batch"], "needs --device-memory"),
        (["--config", str(CONFIGS), "--batch-size", "1", "--seq-len", "8"], "cannot read the model config"),
        (["--config", TINY, "--batch-size", "1", "--seq-len", "8", "--ddp", "--fsdp", "2"], "two different runs"),
    ],
)
def test_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memtrace: error: ") and message in err[0]


def test_bad_arguments_are_one_line(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["--config", TINY, "--batch-size", "0", "--seq-len", "8"])
    assert raised.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a positive integer" in err[0]
    with pytest.raises(SystemExit):
        main(["--config", TINY, "--batch-size", "1", "--seq-len", "8", "--device-memory", "lots"])
    assert "not a size" in capsys.readouterr().err


def test_subcommand_wiring():
    parser = argparse.ArgumentParser(prog="memtrace")
    subparsers = parser.add_subparsers(dest="command")
    add_estimate_subcommand(subparsers)
    args = parser.parse_args(
        ["estimate", "--config", TINY, "--batch-size", "3", "--seq-len", "16", "--device-memory", "80GiB"]
    )
    assert args.func is run_estimate
    assert args.device_memory == 80 * 1024**3 and args.batch_size == 3 and args.optimizer == "adamw"


def test_standalone_module_runs():
    config_path("qwen2-tiny.json")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_memtrace.estimate_cli",
            "--config",
            TINY,
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--device-memory",
            "1GiB",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "fits in 1.0 GiB" in out.stdout
    assert "Traceback" not in out.stderr


def test_search_line_shows_digits_that_tell_the_peaks_apart():
    """Issue 13, point 8: "63 fits (peak 2.0 GiB; 64 peaks at 2.0 GiB)" hid the answer in the rounding."""
    from lightning_memtrace.cli.estimate import _fit_line, _search_line
    from lightning_memtrace.estimator import MaxBatchResult

    gib = 1024**3
    budget, p63, p64 = 2 * gib, 2 * gib - 3 * 1024**2, 2 * gib + 2 * 1024**2
    line = _search_line(budget, MaxBatchResult(63, budget, {63: p63, 64: p64}))
    assert line == "largest micro-batch that fits in 2.000 GiB: 63 (peak 1.997 GiB; 64 peaks at 2.002 GiB)"
    close = _search_line(budget, MaxBatchResult(63, budget, {63: budget - 10, 64: budget + 10}))
    assert f"({budget - 10:,} B)" in close and f"({budget + 10:,} B)" in close
    assert "1.0 KiB" not in _search_line(4096, MaxBatchResult(1, 4096, {1: 1000, 2: 5000}))  # plain where distinct

    class Shown:
        peak_bytes = budget - 5 * 1024**2

    assert _fit_line(budget, Shown(), True).startswith("fits in 2.000 GiB: peak 1.995 GiB, 5.0 MiB to spare")


def test_optimizer_choices_say_sgd_has_momentum(capsys, one_layer):
    """Issue 13, point 8: ``sgd`` is SGD with momentum 0.9 (state); ``sgd-plain`` is SGD without (no state)."""
    from lightning_memtrace.cli.estimate import OPTIMIZERS
    from lightning_memtrace.estimator import OptimizerName

    assert OPTIMIZERS == {name.value: name.help for name in OptimizerName}
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "sgd: SGD with momentum 0.9" in " ".join(capsys.readouterr().out.split())
    for name, state, detail in (("sgd", ONE_LAYER_PARAM_BYTES, "momentum 0.9"), ("sgd-plain", 0, "no momentum")):
        argv = ["--config", one_layer, "--batch-size", "1", "--seq-len", "16", "--device", "cpu", "--optimizer", name]
        assert main([*argv, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)["estimate"]
        assert data["categories"]["optimizer_state"] == state and data["optimizer_detail"].startswith(detail)
        assert main(argv) == 0
        assert f"SGD ({detail}" in capsys.readouterr().out


def test_hub_id_offline_fails_fast_in_one_line(capsys, monkeypatch):
    """Issue 13, point 8: a hub id without network took 27 s and printed 5 retry lines."""
    import time

    from lightning_memtrace.estimator import config as config_module

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    assert main(["--config", "memtrace-nobody/no-such-model", "--batch-size", "1", "--seq-len", "8"]) == 2
    assert time.perf_counter() - started < 10
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memtrace: error: ") and "HF_HUB_OFFLINE" in err[0]
    assert captured.out == ""
    # not marked offline, the hub unreachable: one probe, one line
    monkeypatch.setattr(config_module, "hub_offline", lambda: False)
    monkeypatch.setattr(config_module, "_hub_reachable", lambda endpoint, timeout=3.0: False)
    assert main(["--config", "memtrace-nobody/no-such-model", "--batch-size", "1", "--seq-len", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be reached" in err[0]


def test_attention_implementation(capsys, one_layer):
    argv = ["--config", one_layer, "--batch-size", "2", "--seq-len", "32", "--device", "cpu", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["estimate"]["attention"] == "sdpa (flash kernel)"  # Qwen2's default
    assert main([*argv, "--attn-implementation", "eager"]) == 0
    assert json.loads(capsys.readouterr().out)["estimate"]["attention"] == "eager"
    assert main(argv[:-1]) == 0
    assert "attention sdpa (flash kernel)" in capsys.readouterr().out.splitlines()[0]  # the table's header


def test_unavailable_attention_is_one_line(capsys, one_layer):
    pytest.importorskip("transformers")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("flash_attn is installed")
    argv = ["--config", one_layer, "--batch-size", "1", "--seq-len", "8", "--attn-implementation", "flash_attention_2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "estimate with 'sdpa'" in err[0] and "cannot read the model config" not in err[0]


def test_odd_configs_are_one_short_line(capsys, tmp_path):
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "nonexistent_model", "hidden_size": 8}))
    (tmp_path / "empty_folder").mkdir()
    cases = [
        (str(unknown), "cannot read the model config", "model_type 'nonexistent_model' is unknown to transformers"),
        (str(tmp_path / "empty_folder"), "empty_folder", "is a folder without a config.json"),
    ]
    if sys.platform.startswith("linux"):
        cases.append(("/dev/zero", "/dev/zero", "is not a regular file"))  # read without end before
    for config, first, second in cases:
        assert main(["--config", config, "--batch-size", "1", "--seq-len", "8"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("memtrace: error: ") and first in line and second in line
        assert len(line) < 300  # transformers' own message lists every model type it knows: thousands of characters


@pytest.mark.parametrize(
    "change, message",
    [
        # a billion layers: transformers' config alone makes a list of one entry per layer, and never returned
        ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000: the estimate builds 0 to 10,000 layers"),
        ({"n_layer": -2}, "n_layer=-2: the estimate builds 0 to 10,000 layers"),
        ({"hidden_size": -64}, "does not build a model (RuntimeError: Trying to create tensor with negative dimension"),
        ({"num_attention_heads": 0}, "does not build a model (ZeroDivisionError"),
        ({"hidden_size": "64"}, "does not build a model ("),
    ],
)
def test_configs_that_build_no_model_are_one_line(capsys, tmp_path, change, message):
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({**TINY_QWEN2_CONFIG, **change}))
    started = time.perf_counter()
    assert main(["--config", str(path), "--batch-size", "1", "--seq-len", "8"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("memtrace: error: ") and message in line, line
    assert time.perf_counter() - started < 30


def test_a_config_nested_too_deeply_is_one_line(capsys, tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["--config", str(path), "--batch-size", "1", "--seq-len", "8"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"memtrace: error: cannot read the model config {str(path)!r}: maximum recursion depth")


def test_a_seq_len_over_the_models_positions_is_noted(capsys, one_layer):
    assert main(["--config", one_layer, "--batch-size", "1", "--seq-len", "600"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "note: --seq-len 600 is over the model's 512 positions: it may not run at that length"
    assert main(["--config", one_layer, "--batch-size", "1", "--seq-len", "512"]) == 0
    assert "note:" not in capsys.readouterr().out


def test_transformers_log_lines_stay_off_the_console(tmp_path):
    """A small GPT-2 config makes transformers log three WARNING lines ([transformers] loss_type=None ...,
    bos/eos_token_id outside the vocabulary) through its own stderr handler: the command's output is its answer."""
    config = tmp_path / "gpt2.json"
    config.write_text(
        json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128})
    )
    out = subprocess.run(
        [sys.executable, "-m", "lightning_memtrace.cli", "estimate", "--config", str(config), "--batch-size", "1",
         "--seq-len", "16"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("estimate (rows of step 1") and "[transformers]" not in out.stdout + out.stderr
