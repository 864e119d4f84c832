"""``memtrace estimate --what-if``: the table against its expected text, the JSON, and one-line errors."""

from __future__ import annotations

import json

import pytest

from lightning_memtrace.cli.estimate import main
from lightning_memtrace.estimator import build_meta_model, estimate_from_config
from lightning_memtrace.estimator.what_if_results import usable_bytes
from lightning_memtrace.models import TINY_QWEN2_CONFIG

ONE_LAYER = dict(TINY_QWEN2_CONFIG, num_hidden_layers=1)
#: Remedies that need no optional package (peft, bitsandbytes), so that the text is the same everywhere.
REMEDIES = "bf16-mixed,half_micro_batch,gradient_checkpointing,adafactor,bf16-true,optimizer_offload,zero3"
#: A plain byte count: 1.07 GiB, 17.9 MiB usable after the headroom (today's 29.3 MiB does not fit, nor does any
#: remedy alone).
DEVICE_MEMORY = "1150000000"


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("configs") / "one_layer.json"
    path.write_text(json.dumps(ONE_LAYER))
    return str(path)


def _argv(config: str, *extra: str) -> list[str]:
    return [
        "--config", config, "--batch-size", "4", "--seq-len", "64", "--device", "cpu",
        "--device-memory", DEVICE_MEMORY, "--what-if", "--devices", "2", "--remedies", REMEDIES, *extra,
    ]  # fmt: skip


def test_what_if_table(capsys, one_layer, expected):
    assert main(_argv(one_layer)) == 1  # today's setup does not fit
    out = capsys.readouterr().out
    assert "to fit 1.1 GiB: " in out and "snippet:" in out
    expected(out.replace(one_layer, "ONE_LAYER.json"), "what_if_one_layer_cpu.txt")


def test_what_if_json(capsys, one_layer):
    assert main(_argv(one_layer, "--json")) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["device_memory"] == int(DEVICE_MEMORY) and data["usable_bytes"] == usable_bytes(int(DEVICE_MEMORY))
    assert data["fits"] is False and data["devices"] == 2
    model = build_meta_model(one_layer)
    today = estimate_from_config(one_layer, 4, 64, device="cpu", model=model)
    assert data["estimate"]["peak_bytes"] == today.peak_bytes
    rows = {row["remedy"]: row for row in data["what_if"]}
    assert list(rows) == ["bf16-mixed", "half_micro_batch", "gradient_checkpointing", "adafactor", "bf16-true",
                          "optimizer_offload", "fsdp"]  # fmt: skip
    true16 = estimate_from_config(one_layer, 4, 64, device="cpu", model=model, precision="bf16-true")
    assert rows["bf16-true"]["peak_bytes"] == true16.peak_bytes
    assert rows["bf16-true"]["saved_bytes"] == today.peak_bytes - true16.peak_bytes
    assert rows["bf16-true"]["parameters_bytes"] == true16.category_bytes()["parameters"]
    assert rows["optimizer_offload"]["kind"] == "formula"
    # fsdp is measured: FSDP2 over 2 ranks of torch's fake process group, rank 0's peak (the CLI's --fsdp 2)
    sharded = estimate_from_config(one_layer, 4, 64, device="cpu", model=model, fsdp=2)
    assert rows["fsdp"]["kind"] == "measured" and rows["fsdp"]["peak_bytes"] == sharded.peak_bytes
    assert rows["fsdp"]["parameters_bytes"] == sharded.category_bytes()["parameters"] < today.category_bytes()["parameters"]
    assert set(rows["adafactor"]) >= {"remedy", "peak_bytes", "saved_bytes", "fits", "max_micro_batch", "kind", "price"}
    combo = data["combination"]
    assert combo["fits"] and combo["peak_bytes"] <= data["usable_bytes"] and combo["remedies"]
    assert combo["snippet"]


def test_what_if_combination_null_when_nothing_fits(capsys, one_layer):
    argv = _argv(one_layer, "--json")
    argv[argv.index(DEVICE_MEMORY)] = "1140000000"
    argv[argv.index(REMEDIES)] = "bf16-mixed"
    assert main(argv) == 1
    assert json.loads(capsys.readouterr().out)["combination"] is None


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--remedies", "magic"], "unknown remedy magic"),
        (["--devices", "0"], "not a positive integer"),
        (["--device-memory", "lots"], "not a size"),
    ],
)
def test_what_if_errors_are_one_line(capsys, one_layer, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        main(_argv(one_layer, *extra))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memtrace: error: ") and message in err[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-len", "8", "--what-if"], "--what-if needs --batch-size"),
        (["--seq-len", "8", "--batch-size", "2", "--devices", "2"], "go with --what-if"),
    ],
)
def test_what_if_needs(capsys, one_layer, argv, message):
    assert main(["--config", one_layer, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
