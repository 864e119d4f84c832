"""Real fits whose code keeps a tensor from every batch: the report (its findings, and the summary embedded in it)
and ``memtrace summary`` name the rise with its exact bytes per batch, and an out-of-memory post-mortem puts it first
in what to change."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import pytest
import torch
from torch import nn

from lightning_memtrace import MemTrace, cli, load_phases
from lightning_memtrace.analysis.findings import phase_findings
from lightning_memtrace.report import write_report
from lm_helpers import MLP, trainer
from report_pages import summary_json

WIDTH = 256


class KeepsHidden(MLP):
    """Keeps each batch's hidden layer (batch 16 x 256 float32 = 16 KiB), detached: ``kept`` says until when (``fit``:
    for good, ``epoch``: until its epoch ends, ``none``: not at all). ``oom_at``: an out-of-memory error at that batch
    of the last epoch."""

    def __init__(self, kept: str, oom_at: int | None = None) -> None:
        super().__init__(width=WIDTH)
        self.kept, self.outputs, self.oom_after = kept, [], oom_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = self.net[:4](x)
        if self.kept != "none":
            self.outputs.append(hidden.detach())
        if self.oom_after is not None and self.current_epoch == 1 and batch_idx == self.oom_after:
            torch.empty(10**15, dtype=torch.uint8)
        return nn.functional.mse_loss(self.net[4:](hidden), y)

    def on_train_epoch_end(self) -> None:
        if self.kept == "epoch":
            self.outputs.clear()


HIDDEN_BYTES = 16 * WIDTH * 4


def _fit(tmp_path, module: MLP, max_epochs: int = 2) -> MemTrace:
    callback = MemTrace(report=False, what_if_budget_s=0)
    trainer(tmp_path, [callback], max_steps=-1, max_epochs=max_epochs, limit_train_batches=10).fit(module)
    return callback


def _summary_findings(folder, capsys) -> dict[str, dict]:
    """The findings of the run's phases, as dicts (``code``, ``message``, ``severity``, ``numbers``), after checking
    that the report (the summary embedded in it) and ``memtrace summary`` say the same."""
    findings = {f.code: dataclasses.asdict(f) for f in phase_findings(load_phases(folder))}
    page = write_report(folder, folder / "report.html").read_text(encoding="utf-8")
    in_report = {f["code"]: f["message"] for f in summary_json(page)["findings"]}
    assert cli.main(["summary", str(folder)]) == 0
    printed = "".join(capsys.readouterr().out.replace("│", " ").split())
    if "growth" in findings:
        assert in_report["growth"] == findings["growth"]["message"]
        assert "".join(findings["growth"]["message"].split()) in printed
    else:
        assert "growth" not in in_report and "grewby" not in printed
    return findings


def test_outputs_kept_for_good_are_a_warning_with_the_bytes_of_one_batchs_output(tmp_path, capsys):
    callback = _fit(tmp_path, KeepsHidden("fit"))
    finding = _summary_findings(callback.output_dir, capsys)["growth"]
    assert finding["severity"] == "warning"
    numbers = finding["numbers"]
    # from batch 2 (the first two are left out) to the last of 20 batches, one hidden output more each
    assert (numbers["first_step"], numbers["last_step"], numbers["batches"]) == (2, 19, 17)
    assert numbers["bytes_per_batch"] == HIDDEN_BYTES and numbers["total_bytes"] == 17 * HIDDEN_BYTES
    assert numbers["by_category"] == {"other": 17 * HIDDEN_BYTES} and not numbers["freed"]
    assert f"+272.0 KiB ({17 * HIDDEN_BYTES:,} B) over 17 batches" in finding["message"]


def test_outputs_kept_until_each_epoch_ends_are_information(tmp_path, capsys):
    callback = _fit(tmp_path, KeepsHidden("epoch"))
    finding = _summary_findings(callback.output_dir, capsys)["growth"]
    assert finding["severity"] == "info" and finding["numbers"]["freed"]
    # the second epoch: from its first batch (nothing kept yet) to its tenth
    assert finding["numbers"]["total_bytes"] == 9 * HIDDEN_BYTES
    assert finding["numbers"]["bytes_per_batch"] == HIDDEN_BYTES


def test_a_fit_that_keeps_nothing_has_no_growth_finding(tmp_path, capsys):
    callback = _fit(tmp_path, KeepsHidden("none"))
    assert "growth" not in _summary_findings(callback.output_dir, capsys)


def test_the_post_mortem_of_an_out_of_memory_error_names_the_rise_first(tmp_path):
    callback = MemTrace(what_if_budget_s=0, report=False)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        trainer(tmp_path, [callback], max_steps=-1, max_epochs=2, limit_train_batches=10).fit(
            KeepsHidden("fit", oom_at=6)
        )
    text = (callback.output_dir / "oom_rank0_step16.txt").read_text()
    tips = text.split("what to change:\n", 1)[1].splitlines()
    # rows up to batch 16's start: from batch 2 on, one hidden output more each
    first_tip = "  - The memory held at the start of each training batch grew by 16.0 KiB a batch from step 2 "
    assert tips[0].startswith(first_tip)
    assert f"+{14 * HIDDEN_BYTES // 1024}.0 KiB ({14 * HIDDEN_BYTES:,} B) over 14 batches" in tips[0]
    with open(callback.output_dir / "oom_rank0_step16.pickle", "rb") as handle:
        growth = pickle.load(handle)["memtrace"]["post_mortem"]["growth"]
    assert growth["bytes_per_batch"] == HIDDEN_BYTES and growth["last_step"] == 16


@pytest.mark.parametrize("kept", ["fit", "epoch", "none"])
def test_a_rise_still_held_is_said_once_while_the_run_goes_on(tmp_path, monkeypatch, kept):
    """Every GROWTH_CHECK_BATCHES training batches the recorder looks at the rows it holds: memory still rising is one
    warning (once per fit), before anything runs out; a rise freed at each epoch's end, or none, says nothing."""
    from lightning_memtrace.capture import recorder

    monkeypatch.setattr(recorder, "GROWTH_CHECK_BATCHES", 10)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _fit(tmp_path, KeepsHidden(kept), max_epochs=4)
    mine = [str(w.message) for w in seen if "grew by" in str(w.message)]
    if kept == "fit":
        assert len(mine) == 1
        assert mine[0].startswith("MemTrace: the memory held at the start of each training batch grew by 16.0 KiB a")
        assert "It was still held at the latest row" in mine[0]
    else:
        assert mine == []
