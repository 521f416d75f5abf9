#!/usr/bin/env bash
# GPU smoke test of unirl-sglang against a REAL SGLang server. NOT RUN in this project's CI, and never
# run by its authors: the CI machine has no GPU, and SGLang 0.5.23's kernels are CUDA-only. The plugin's
# tests use a stand-in server (plugins/unirl-sglang/tests/sglang_standin.py) instead.
#
# What it checks, on one CUDA GPU with `pip install sglang==0.5.23` and this repo installed (make install,
# or pip install -e core -e plugins/unirl-sglang):
#   1. generate: seeded samples through POST /generate (return_logprob, output_token_logprobs);
#   2. log-probs against a teacher-forced transformers fp32 replay of the same weights (prints max |diff|;
#      fails above SMOKE_TOL, default 1e-3: GPU kernels are not bit-identical to the replay);
#   3. weight update from disk: a perturbed policy exported as a version directory, loaded with
#      /update_weights_from_disk (+ /flush_cache, pause/continue), receipts committed to a VersionLedger,
#      outputs change and match the perturbed model's replay;
#   4. a failed update (a path that does not exist) keeps the old version serving and committed.
#
# Usage: scripts/sglang_gpu_smoke.sh [port]       (env: PYTHON, SMOKE_TOL, SMOKE_DIR, SGLANG_ARGS)
# Dry run of this script's own logic on a CPU machine (the stand-in, NOT SGLang):
#   SMOKE_SERVER_MODULE=sglang_standin PYTHONPATH=plugins/unirl-sglang/tests scripts/sglang_gpu_smoke.sh
set -euo pipefail
PORT="${1:-30123}"
PYTHON="${PYTHON:-python}"
DIR="${SMOKE_DIR:-$(mktemp -d /tmp/unirl-sglang-smoke.XXXXXX)}"
TOL="${SMOKE_TOL:-1e-3}"
SGLANG_ARGS="${SGLANG_ARGS:---dtype float32 --mem-fraction-static 0.3}"
MODULE="${SMOKE_SERVER_MODULE:-sglang.launch_server}"
[ "$MODULE" = "sglang.launch_server" ] && "$PYTHON" -c "import sglang, sys; print('sglang', sglang.__version__); sys.exit(sglang.__version__ != '0.5.23' and print('warning: plugin targets 0.5.23') or 0)"

# a tiny random Qwen3 (head_dim 64, float32) with the demo tokenizer
"$PYTHON" - "$DIR/model" <<'PY'
import sys, torch
from transformers import Qwen3ForCausalLM
from unirl.config import RunConfig
from unirl.models.qwen3 import Qwen3Adapter
from unirl.models.tokenizer import build_demo_tokenizer
out = sys.argv[1]
tok = build_demo_tokenizer()
cfg = RunConfig.model_validate({"model": {"build": {"hidden_size": 128, "intermediate_size": 256, "head_dim": 64,
                                                    "num_attention_heads": 2, "num_key_value_heads": 1}}})
hf = Qwen3Adapter().hf_config(cfg, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
torch.manual_seed(0)
Qwen3ForCausalLM(hf).to(torch.float32).save_pretrained(out)
tok.save_pretrained(out)
PY

SGLANG_RETURN_ORIGINAL_LOGPROB=1 "$PYTHON" -m "$MODULE" --model-path "$DIR/model" --host 127.0.0.1 \
  --port "$PORT" $SGLANG_ARGS > "$DIR/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT

"$PYTHON" - "$DIR" "$PORT" "$TOL" <<'PY'
import json, sys, torch
from transformers import AutoModelForCausalLM
from unirl.api import Qwen3Adapter, RunConfig, Sample, SamplingParams, VersionLedger, WeightSyncError, fingerprint
from unirl_sglang.engine import SGLangEngine

root, port, tol = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
cfg = RunConfig.model_validate({"run": {"output_dir": root, "name": "smoke"}, "model": {"path": f"{root}/model"},
                                "rollout": {"engine": "sglang", "options": {"servers": [f"http://127.0.0.1:{port}"],
                                                                            "health_timeout_s": 600}},
                                "weight_sync": {"name": "sglang"}})
adapter = Qwen3Adapter()
engine = SGLangEngine(config=cfg, adapter=adapter, tokenizer=adapter.build_tokenizer(cfg))

def replay(model, s):
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    p = len(s.prompt_ids)
    return torch.log_softmax(logits[p - 1:-1], -1).gather(-1, ids[0, p:, None])[:, 0].tolist()

def worst(model, samples):
    return max(abs(a - b) for s in samples for a, b in zip(s.rollout_logprobs, replay(model, s)))

def batch(tag, temperature=1.0):
    ss = [Sample(id=f"{tag}{i}", prompt_ids=[3 + i, 7, 11, 5], seed=100 + i) for i in range(8)]
    return engine.generate(ss, SamplingParams(max_new_tokens=16, temperature=temperature))

report = {}
base = AutoModelForCausalLM.from_pretrained(f"{root}/model", dtype=torch.float32).eval()
first = batch("a")
report["generate_tokens"] = sum(len(s.response_ids) for s in first)
report["logprob_max_diff"] = worst(base, first)
again = batch("a")
report["seeded_repeatable"] = [s.response_ids for s in again] == [s.response_ids for s in first]

g = torch.Generator().manual_seed(7)
with torch.no_grad():
    for p in base.parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=g))
named = [(n, t.detach().clone()) for n, t in base.state_dict().items() if n != "lm_head.weight"]
ledger = VersionLedger()
greedy_before = [s.response_ids for s in batch("g", 0.0)]
staged = engine.stage()
staged.fingerprint = fingerprint(staged.tap(iter(named)))
ledger.commit(1, engine.load_weights(staged, 1), staged.fingerprint)
after = batch("g", 0.0)
report["update_version"] = ledger.version
report["update_changed_outputs"] = [s.response_ids for s in after] != greedy_before
report["update_logprob_max_diff"] = worst(base, after)
try:
    engine.update_from_dir(f"{root}/does-not-exist", 2)
    report["failed_update_refused"] = False
except WeightSyncError as exc:
    report["failed_update_refused"] = True
    report["failed_update_message"] = str(exc)[:300]
report["version_after_failed_update"] = engine.weight_version
report["still_serves_v1"] = [s.response_ids for s in batch("g", 0.0)] == [s.response_ids for s in after]
engine.close()
print(json.dumps(report, indent=2))
ok = (report["logprob_max_diff"] < tol and report["update_logprob_max_diff"] < tol and report["update_changed_outputs"]
      and report["failed_update_refused"] and report["version_after_failed_update"] == 1 and report["still_serves_v1"])
print("SMOKE", "PASSED" if ok else "FAILED")
sys.exit(0 if ok else 1)
PY
