"""Issue 16, point 5: ``memtrace mcp``, an MCP server whose tools ``summary``, ``diff`` and ``estimate`` return exactly
the JSON of the commands with ``--json``; errors are tool errors with the command's one line, a hostile pickle is
refused (nothing in it runs) and the size limit holds. The tool tests skip where the ``mcp`` package is missing."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
from shared_files import fixture_path

from lightning_memtrace.cli import build_parser, main
from lightning_memtrace.cli import mcp as cli_mcp
from lightning_memtrace.models import TINY_QWEN2_CONFIG

SRC = Path(__file__).resolve().parents[2] / "src"


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_mcp_subcommand_is_registered() -> None:
    parser = build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    assert "mcp" in choices


def test_without_the_mcp_package_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_mcp, "mcp_available", lambda: False)
    code, out, err = run_cli(capsys, ["mcp"])
    assert code == 2 and out == ""
    assert err == "memtrace: error: the MCP server needs the mcp package: pip install 'lightning_memtrace[mcp]'\n"


def test_tool_arguments_become_the_command_line() -> None:
    assert cli_mcp.summary_argv("-odd.pickle", window="1:2", at=3, rules=["x=a.*b"]) == [
        "summary",
        "--window=1:2",
        "--at=3",
        "--rule=x=a.*b",
        "--",
        "-odd.pickle",
    ]
    assert cli_mcp.diff_argv("a", "b", sites=3) == ["diff", "--sites=3", "--", "a", "b"]
    argv = cli_mcp.estimate_argv("c.json", 32, batch_size=2, gradient_checkpointing=True, device_memory="80GiB")
    assert argv == ["estimate", "--config=c.json", "--seq-len=32", "--batch-size=2", "--gradient-checkpointing",
                    "--device-memory=80GiB"]  # fmt: skip
    assert cli_mcp.estimate_argv("c.json", 32, batch_size=2, ddp=True) == [
        "estimate", "--config=c.json", "--seq-len=32", "--batch-size=2", "--ddp"
    ]  # fmt: skip
    assert cli_mcp.estimate_argv("v.json", batch_size=4, task="image-classification", image_size=64) == [
        "estimate", "--config=v.json", "--batch-size=4", "--task=image-classification", "--image-size=64"
    ]  # fmt: skip
    argv = cli_mcp.estimate_argv("c.json", 32, batch_size=2, quantize="nf4", lora=True, lora_rank=8,
                                 lora_dropout=0.05, lora_targets="all-linear")  # fmt: skip
    assert argv == ["estimate", "--config=c.json", "--seq-len=32", "--batch-size=2", "--quantize=nf4", "--lora",
                    "--lora-rank=8", "--lora-dropout=0.05", "--lora-targets=all-linear"]  # fmt: skip


# --- through the MCP SDK ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mcp_client() -> Any:
    pytest.importorskip("mcp")
    if not cli_mcp.mcp_available():
        pytest.skip(f"{cli_mcp.MCP_REQUIREMENT} is not installed")
    from mcp import Client

    return Client


def call(client_class: Any, name: str, arguments: dict[str, Any], server: Any = None) -> Any:
    """One tool call on an in-process server (the SDK's in-memory transport)."""

    async def go() -> Any:
        async with client_class(server if server is not None else cli_mcp.build_server()) as client:
            return await client.call_tool(name, arguments)

    return asyncio.run(go())


def assert_same_json(result: Any, stdout: str, timed: bool = False) -> None:
    """The tool's text is the very text the command prints, its structured content the same object (``timed``: but
    for the estimate's ``seconds``, the time it took)."""
    assert not result.is_error, result.content
    assert len(result.content) == 1
    text, structured = result.content[0].text, result.structured_content
    if timed:
        cli, tool = json.loads(stdout), json.loads(text)
        assert isinstance(tool["estimate"].pop("seconds"), float) and structured["estimate"].pop("seconds")
        tool["estimate"]["seconds"] = structured["estimate"]["seconds"] = cli["estimate"]["seconds"]
        text = json.dumps(tool, indent=2)
    assert text + "\n" == stdout
    assert json.loads(text) == json.loads(stdout) == structured


def test_tools_listed(mcp_client: Any) -> None:
    async def go() -> Any:
        async with mcp_client(cli_mcp.build_server()) as client:
            return await client.list_tools()

    tools = {tool.name: tool for tool in asyncio.run(go()).tools}
    assert set(tools) == {"summary", "diff", "estimate"}
    assert {"path", "window", "at", "rules"} <= set(tools["summary"].input_schema["properties"])
    assert tools["summary"].input_schema["required"] == ["path"]
    assert set(tools["diff"].input_schema["required"]) == {"base", "other"}
    assert {"config", "batch_size", "seq_len", "precision", "device", "optimizer", "gradient_checkpointing", "fsdp",
            "device_memory", "ddp", "task", "target_len", "image_size", "quantize", "lora", "lora_rank",
            "lora_dropout", "lora_targets"} <= set(
        tools["estimate"].input_schema["properties"]
    )  # fmt: skip
    assert tools["estimate"].input_schema["required"] == ["config"]  # seq_len: not for an image task


@pytest.mark.parametrize(
    ("name", "arguments", "options"),
    [
        ("drisspg_mini_snapshot.pickle", {}, []),
        ("shreyansh26_profile_grad.pkl", {"window": "0:2000000000000000"}, ["--window", "0:2000000000000000"]),
        ("shreyansh26_profile_grad.pkl", {"at": 10, "sites": 3}, ["--at", "10", "--sites", "3"]),
    ],
)
def test_summary_tool_is_the_commands_json(
    mcp_client: Any, capsys: pytest.CaptureFixture[str], name: str, arguments: dict[str, Any], options: list[str]
) -> None:
    path = str(fixture_path(name))
    code, out, _ = run_cli(capsys, ["summary", path, "--json", *options])
    assert code == 0
    assert_same_json(call(mcp_client, "summary", {"path": path, **arguments}), out)


def test_diff_tool_is_the_commands_json(mcp_client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    a = str(fixture_path("shreyansh26_profile_no_grad.pkl"))
    b = str(fixture_path("shreyansh26_profile_grad.pkl"))
    code, out, _ = run_cli(capsys, ["diff", a, b, "--json"])
    assert code == 0
    assert_same_json(call(mcp_client, "diff", {"base": a, "other": b}), out)


def test_estimate_tool_is_the_commands_json(
    mcp_client: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "one_layer.json"
    config.write_text(json.dumps(dict(TINY_QWEN2_CONFIG, num_hidden_layers=1)))
    argv = ["--config", str(config), "--batch-size", "2", "--seq-len", "16", "--device", "cpu"]
    argv += ["--optimizer", "sgd", "--device-memory", "1MiB"]
    code, out, _ = run_cli(capsys, ["estimate", *argv, "--json"])
    assert code == 1  # does not fit: the command's status; the tool still answers
    arguments = {"config": str(config), "batch_size": 2, "seq_len": 16, "device": "cpu", "optimizer": "sgd"}
    assert_same_json(call(mcp_client, "estimate", {**arguments, "device_memory": "1MiB"}), out, timed=True)
    assert json.loads(out)["fits"] is False


def assert_same_error(result: Any, err: str) -> None:
    assert result.is_error
    assert len(result.content) == 1 and result.content[0].text + "\n" == err
    assert err.startswith("memtrace: error: ") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("tool", "arguments", "argv"),
    [
        ("summary", {"path": "/no/such/snapshot.pickle"}, ["summary", "/no/such/snapshot.pickle"]),
        ("summary", {"path": "FIXTURE", "window": "5:1"}, ["summary", "FIXTURE", "--window", "5:1"]),
        ("summary", {"path": "FIXTURE", "at": 10**9}, ["summary", "FIXTURE", "--at", str(10**9)]),
        ("summary", {"path": "FIXTURE", "max_bytes": "1KiB"}, ["summary", "FIXTURE", "--max-bytes", "1KiB"]),
        ("diff", {"base": "FIXTURE", "other": "/no/such"}, ["diff", "FIXTURE", "/no/such"]),
        ("estimate", {"config": "/no/such/config.json", "batch_size": 1, "seq_len": 8},
         ["estimate", "--config", "/no/such/config.json", "--batch-size", "1", "--seq-len", "8"]),
        ("estimate", {"config": "c.json", "seq_len": 8}, ["estimate", "--config", "c.json", "--seq-len", "8"]),
    ],
)  # fmt: skip
def test_errors_are_the_commands_one_line(
    mcp_client: Any, capsys: pytest.CaptureFixture[str], tool: str, arguments: dict[str, Any], argv: list[str]
) -> None:
    fixture = str(fixture_path("drisspg_mini_snapshot.pickle"))
    arguments = {k: fixture if v == "FIXTURE" else v for k, v in arguments.items()}
    argv = [fixture if v == "FIXTURE" else v for v in argv]
    code, out, err = run_cli(capsys, [*argv, "--json"])
    assert code == 2 and out == ""
    assert_same_error(call(mcp_client, tool, arguments), err)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_hostile_pickle_is_refused_and_never_runs(
    mcp_client: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_Evil(marker)]]}))
    result = call(mcp_client, "summary", {"path": str(evil)})
    assert result.is_error and "refused" in result.content[0].text and "posix.system" in result.content[0].text
    result = call(mcp_client, "diff", {"base": str(evil), "other": str(evil)})
    assert result.is_error and "refused" in result.content[0].text
    assert not marker.exists()
    code, _, err = run_cli(capsys, ["summary", str(evil), "--json"])
    assert code == 2
    assert_same_error(call(mcp_client, "summary", {"path": str(evil)}), err)
    assert not marker.exists()


def test_stdio_server(mcp_client: Any, tmp_path: Path) -> None:
    """``memtrace mcp`` in a subprocess, over stdio with the SDK's client: stdout carries the protocol alone."""
    from mcp import StdioServerParameters

    path = str(fixture_path("drisspg_mini_snapshot.pickle"))
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps(_Evil(marker)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    params = StdioServerParameters(command=sys.executable, args=["-m", "lightning_memtrace.cli", "mcp"], env=env)

    async def go() -> tuple[Any, Any]:
        async with mcp_client(params) as client:
            good = await client.call_tool("summary", {"path": path})
            bad = await client.call_tool("summary", {"path": str(evil)})
            return good, bad

    good, bad = asyncio.run(asyncio.wait_for(go(), timeout=120))
    assert not good.is_error and good.structured_content["schema"] == "memtrace.summary/1"
    assert bad.is_error and bad.content[0].text.startswith("memtrace: error: ") and "refused" in bad.content[0].text
    assert not marker.exists()


def _has_rule_option() -> bool:
    parser = build_parser()
    summary = next(a for a in parser._actions if a.dest == "command").choices["summary"]
    return any("--rule" in action.option_strings for action in summary._actions)


def test_summary_and_diff_tools_pass_rules(mcp_client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``rules`` become ``--rule NAME=REGEX`` (where the command has the option)."""
    if not _has_rule_option():
        pytest.skip("memtrace summary has no --rule option in this checkout")
    path = str(fixture_path("shreyansh26_profile_grad.pkl"))
    rule = "mine=profile_grad"
    code, out, _ = run_cli(capsys, ["summary", path, "--json", "--rule", rule])
    assert code == 0
    assert_same_json(call(mcp_client, "summary", {"path": path, "rules": [rule]}), out)
    other = str(fixture_path("shreyansh26_profile_no_grad.pkl"))
    code, out, _ = run_cli(capsys, ["diff", other, path, "--json", "--rule", rule])
    assert code == 0
    assert_same_json(call(mcp_client, "diff", {"base": other, "other": path, "rules": [rule]}), out)
