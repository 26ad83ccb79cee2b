#!/usr/bin/env bash
# One-shot check of the GPU path on a single-GPU machine (not yet run on one: its checks' time limits add up to
# 11 minutes, so a hung check cannot outlast a 15-minute GPU loan), with nothing but this repository,
# the machine's own Python and packages (torch with CUDA, transformers, peft, accelerate, pandas, tensorboard,
# pytest) and wheels/ made beforehand by `python scripts/gpu_wheels.py` on a machine that reaches the registry.
#
#   bash scripts/gpu_check.sh [out_dir]        # default: $OUT where set, else runs/gpu_check
#
# Checks, one line each (PASS/FAIL, seconds), logs in out_dir/<check>.log, results in out_dir/gpu_check.json:
#   install     the missing packages from wheels/ (pip resolves; what is there stays), then this project --no-deps
#   cuda        torch sees a GPU; bf16 support
#   gpu_tests   the tests marked gpu (tests/gpu): CPU = GPU greedy tokens, train steps at ZeRO 0/2/3, LoRA with
#               the disabled-adapter reference, external rollouts, eval / generate / sft / export on CUDA
#   train       the main job (the embedded models) for 6 steps on CUDA, held-out pass@1 before and after
#   step_8b     one GRPO step of a random LLaDA-8B-shaped model: LoRA r=128, gradient checkpointing, bf16, ZeRO-2
#   speculative speculative external rollouts (SRT) against plain sampling on CUDA (scripts/bench_speculative.py)
# Behind a flag, since it needs real weights and data (LLADA8B=<LLaDA-8B-Instruct dir> GSM8K_TEST=<test jsonl>):
#   eval_llada8b  `dllm-rl eval protocol=d1` of that model on that file, every d1 length (128, 256, 512) in bf16,
#               the first EVAL_PROMPTS problems (default 64; the literature uses all 1319), within EVAL_LIMIT_S
#               seconds (default 1800); the table in out_dir/eval_llada8b.log, the results in out_dir/eval_llada8b/
#   LLADA8B=/ckpt/LLaDA-8B-Instruct GSM8K_TEST=/data/gsm8k/test.jsonl bash scripts/gpu_check.sh
# Exits non-zero when any check fails.
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-runs/gpu_check}}
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/dllm_rl_gpu_check.XXXX)
export PY SKIP_INSTALL PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout imports even where `pip install -e` cannot
if [ -n "${LLADA8B:-}" ] && [ -z "${GSM8K_TEST:-}" ]; then
  echo "LLADA8B=$LLADA8B needs GSM8K_TEST=<a GSM8K test jsonl> (the problems the d1 protocol evaluates)" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/checks.tsv"
failed=0

check() {  # check <name> <timeout s> <command...>
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  local took=$(( $(date +%s) - start ))
  if [ $rc -eq 0 ]; then
    echo "PASS $name (${took} s)"
  else
    failed=1
    [ $rc -eq 124 ] && why="timed out after ${limit} s" || why="exit $rc"
    echo "FAIL $name (${took} s, $why): $(grep -v '^\s*$' "$OUT_DIR/$name.log" | tail -1 | cut -c1-200)"
  fi
  printf '%s\t%s\t%s\n' "$name" "$rc" "$took" >> "$OUT_DIR/checks.tsv"
  return $rc
}

install() {  # SKIP_INSTALL=1: use the environment as it is
  [ -n "${SKIP_INSTALL:-}" ] && { echo "install skipped (SKIP_INSTALL=1)"; return 0; }
  if [ -d wheels ]; then
    "$PY" -m pip install --no-index --find-links wheels deepspeed diffusers omegaconf hydra-core math-verify || return 1
    # datasets needs pyarrow, which wheels/ leaves out (too big to carry); only the file tasks use it
    "$PY" -m pip install --no-index --find-links wheels datasets \
      || "$PY" -m pip install --no-index --no-deps --find-links wheels datasets dill xxhash multiprocess fsspec \
      || return 1
  fi
  "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . || return 1
  "$PY" -c "import deepspeed, diffusers, omegaconf, hydra, math_verify, peft, dllm_rl; print('imports ok')"
}

cuda() {
  "$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} finds no CUDA GPU"
print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"bf16 {torch.cuda.is_bf16_supported()}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
PY
}

export -f install cuda
check install 120 bash -c install
if ! check cuda 30 bash -c cuda; then
  for name in gpu_tests train step_8b speculative ${LLADA8B:+eval_llada8b}; do
    echo "FAIL $name (not run: no usable GPU)"
    printf '%s\t%s\t%s\n' "$name" 1 0 >> "$OUT_DIR/checks.tsv"
  done
  SKIP_REST=1
fi
if [ -z "${SKIP_REST:-}" ]; then
check gpu_tests 180 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider
check train 120 "$PY" -m dllm_rl.cli train steps=6 eval_every=6 eval_prompts=64 checkpoint_every=0 tensorboard=false \
  run_dir="$WORK/train"
cp "$WORK/train/metrics.jsonl" "$OUT_DIR/train_metrics.jsonl" 2>/dev/null
check step_8b 150 "$PY" scripts/gpu_step.py --work "$WORK/step" --out "$OUT_DIR/gpu_step.json"
check speculative 60 "$PY" scripts/bench_speculative.py --device cuda --rounds 3 --draft-tokens 4 8 \
  --out "$OUT_DIR/bench_speculative.json"
if [ -n "${LLADA8B:-}" ]; then
  check eval_llada8b "${EVAL_LIMIT_S:-1800}" "$PY" -m dllm_rl.cli eval protocol=d1 trust_remote_code=true \
    model="$LLADA8B" task=gsm8k task.test_file="$GSM8K_TEST" num_prompts="${EVAL_PROMPTS:-64}" dtype=bfloat16 \
    batch_size=8 output_dir="$OUT_DIR/eval_llada8b"
fi
fi

"$PY" - "$OUT_DIR" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
result = {"checks": {}}
for line in (out / "checks.tsv").read_text().splitlines():
    name, rc, seconds = line.split("\t")
    result["checks"][name] = {"passed": rc == "0", "seconds": int(seconds)}
cuda_log = out / "cuda.log"
result["device"] = cuda_log.read_text().strip().splitlines()[-1] if cuda_log.is_file() else None
metrics = out / "train_metrics.jsonl"
if metrics.is_file():
    lines = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    keep = ("step", "reward/on_policy", "eval/pass@1", "perf/rollout_s", "perf/update_s", "perf/tokens_per_s")
    result["train"] = [{k: l[k] for k in keep if k in l} for l in lines]
speculative = out / "bench_speculative.json"
if speculative.is_file():
    result["speculative"] = json.loads(speculative.read_text())["rows"]
step = out / "gpu_step.json"
if step.is_file():
    result["step_8b"] = json.loads(step.read_text())
evaluation = out / "eval_llada8b" / "summary.json"
if evaluation.is_file():
    summary = json.loads(evaluation.read_text())
    result["eval_llada8b"] = {"protocol": summary["meta"]["protocol"]["name"], "device": summary["meta"]["device_name"],
                              "pass@1": {n: s["gsm8k"]["pass@1"] for n, s in summary["lengths"].items()}}
(out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
print(f"wrote {out / 'gpu_check.json'}")
PY
rm -rf "$WORK"
exit $failed
