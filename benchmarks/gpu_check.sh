#!/usr/bin/env bash
# MemTrace's CUDA paths where they live, in one call on a machine with a GPU and torch, lightning, transformers and
# pandas installed (no install step: the checkout's src/ goes on PYTHONPATH):
#   1. pytest tests/gpu (counters, snapshot with phase metadata, a real CUDA OOM, estimate against measured, FSDP)
#   2. the demo on CUDA, its console searched for C++ log lines
#   3. GPT-2 124M ground truth (benchmarks/gpu_ground_truth.py)
#   4. the overhead on the GPU (benchmarks/overhead.py: plain, counters only, defaults with the history window)
# The log (gpu_check.log) and a tarball of the demo's folder, the OOM post-mortem and the ground-truth run go to $OUT.
# Each section has a time limit, so the whole call ends inside ~9 minutes (it took 5.5 on an H200: tests/gpu 110 s,
# ground truth 55 s, overhead ~130 s: each variant runs in a process of its own, ~20 s to start; tests/gpu has since
# gained a 12-step GPT-2 run and two task estimates, about a minute more).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
# the model configs the tests read from ../shared (carried in as .gpu_shared/ where ../shared does not travel)
if [ ! -d ../shared/reference/configs ] && [ -d .gpu_shared/configs ]; then
  mkdir -p ../shared/reference && cp -r .gpu_shared/configs ../shared/reference/
fi
WORK=$(mktemp -d)
CPP_LINES='\.cpp:[0-9]+\]|^[IWEF][0-9]{4} |STAGE:|USDT|profiler_st(art|op)'
section() { echo; echo "=== $1 ($(date +%T))"; }
{
  section environment
  nvidia-smi -L
  $PY -c "import torch, lightning, transformers, pandas; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'lightning', lightning.__version__, 'transformers', transformers.__version__, 'pandas', pandas.__version__)"

  section "pytest tests/gpu"
  timeout 220 $PY -m pytest -q -p no:cacheprovider tests/gpu -rA --basetemp="$WORK/pytest" -s 2>&1 \
    | grep -vE '^(GPU|TPU|HPU|LOCAL_RANK)|litlogger|max_steps=.*reached|^$'
  echo "pytest exit: ${PIPESTATUS[0]}"

  section "demo on CUDA (examples/train_tiny_lm.py)"
  timeout 60 $PY examples/train_tiny_lm.py --out "$WORK/demo" >"$WORK/demo.out" 2>"$WORK/demo.err"
  echo "demo exit: $?"
  cat "$WORK/demo.out"
  echo "--- demo stderr ($(wc -l <"$WORK/demo.err") lines; C++ log lines: $(grep -cE "$CPP_LINES" "$WORK/demo.err"))"
  head -40 "$WORK/demo.err"

  section "GPT-2 124M ground truth"
  timeout 110 $PY benchmarks/gpu_ground_truth.py --out "$WORK/gpt2" 2>"$WORK/gpt2.err" | grep -v '^$'
  echo "ground truth exit: ${PIPESTATUS[0]}; stderr C++ log lines: $(grep -cE "$CPP_LINES" "$WORK/gpt2.err")"
  grep -vE '^(GPU|TPU|HPU|LOCAL_RANK)|litlogger|max_steps=.*reached|^$' "$WORK/gpt2.err" | tail -15

  section "overhead on the GPU"
  timeout 150 $PY benchmarks/overhead.py --threads 0 --rounds 2 --steps 15 --warmup 5 --batch-size 8 --seq-len 512 \
    --variants plain,memtrace_counters,memtrace
  echo "overhead exit: $?"
  section done
} 2>&1 | tee "$OUT/gpu_check.log"

find "$WORK/pytest" -name 'oom_*' -exec cp {} "$WORK/" \; 2>/dev/null
(cd "$WORK" && tar czf "$OUT/artifacts.tgz" --exclude='*.ckpt' --exclude='plain*' demo gpt2/memtrace oom_* 2>/dev/null)
if [ "$(stat -c %s "$OUT/artifacts.tgz" 2>/dev/null || echo 0)" -gt 15000000 ]; then
  (cd "$WORK" && tar czf "$OUT/artifacts.tgz" --exclude='*.ckpt' --exclude='*.html' --exclude='plain*' demo oom_*)
fi
ls -la "$OUT"
