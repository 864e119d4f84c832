"""A Lightning run whose console output tests/test_console.py compares with and without MemTrace.

Usage: python tests/console_run.py OUT_DIR MODE STEPS [memtrace]
MODE: fit (training and validation, progress bar on), oom (dies of a CPU out-of-memory error in step 2), profiler
(``Trainer(profiler="pytorch")``), resume (fits, then fits again from its checkpoint in the same process), rounds
(three rounds of a fit without MemTrace and one with it, of a tiny LM, in one process, as a benchmark does).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning_memtrace import MemTrace  # noqa: E402
from lm_helpers import MLP, TinyLM  # noqa: E402


def make_trainer(out: Path, steps: int, callbacks: list, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=str(out), max_steps=steps, accelerator="cpu", devices=1, limit_val_batches=2,
        val_check_interval=2, check_val_every_n_epoch=None, log_every_n_steps=1, callbacks=callbacks, **kwargs,
    )


def main() -> None:
    out, mode, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    with_memtrace = sys.argv[4:] == ["memtrace"]

    def callbacks() -> list:
        return [MemTrace()] if with_memtrace else []

    if mode == "fit":
        make_trainer(out, steps, callbacks()).fit(MLP())
    elif mode == "oom":
        make_trainer(out, steps, callbacks()).fit(MLP(oom_at=2))
    elif mode == "profiler":
        make_trainer(out, steps, callbacks(), profiler="pytorch").fit(MLP())
    elif mode == "resume":
        checkpoint = ModelCheckpoint(dirpath=out / "ckpt", save_last=True)
        make_trainer(out, steps, [*callbacks(), checkpoint]).fit(MLP())
        make_trainer(out, 2 * steps, callbacks()).fit(MLP(), ckpt_path=str(out / "ckpt" / "last.ckpt"))
    elif mode == "rounds":
        for round_index in range(3):
            make_trainer(out / f"bare{round_index}", steps, []).fit(TinyLM(n_train=4 * steps))
            make_trainer(out / f"run{round_index}", steps, callbacks()).fit(TinyLM(n_train=4 * steps))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
