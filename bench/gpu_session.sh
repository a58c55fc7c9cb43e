#!/usr/bin/env bash
# What a lent GPU runs, in two calls of the device tool, each under its 600 s limit (docs/testing.md, "On a lent
# GPU"): `bash bench/gpu_session.sh checks`, then `bash bench/gpu_session.sh estimate`. Every result file is
# written into $OUT (the only folder the tool brings back), never only into the device's copy of bench/results;
# copy them into bench/results/ here, then `python bench/report.py`.
#   checks:   gpu_check.py (NCCL, bf16 GPT, ZeRO-3 budget and bf16 offload, parity, memory timeline, several
#             ranks sharing the GPU, offload's copies: side streams against the compute stream) and
#             gpu_moe_check.py: about 3-4 min
#   estimate: gpu_curves.py (GEMM, attention, HBM, grouped-GEMM, launch and program sweeps) then
#             gpu_estimate_check.py priced on those curves: about 3 min
set -u
part=${1:?usage: bash bench/gpu_session.sh checks|estimate}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA')"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
case "$part" in
  checks)
    timeout 300 python3 bench/gpu_check.py --out "$OUT/gpu_check.json"; echo "gpu_check exit $?"
    rm -f bench/results/gpu_moe_check.json  # the committed one must not come back as this run's
    timeout 240 python3 bench/gpu_moe_check.py; code=$?; echo "gpu_moe_check exit $code"
    # written after each check: whatever finished comes back, a run cut off by the timeout (124) too
    cp bench/results/gpu_moe_check.json "$OUT/" 2>/dev/null || true
    ;;
  estimate)
    timeout 230 python3 bench/gpu_curves.py --out "$OUT/gpu_curves.json"; echo "gpu_curves exit $?"
    timeout 320 python3 bench/gpu_estimate_check.py --curves "$OUT/gpu_curves.json" --out "$OUT/gpu_estimate_check.json"
    echo "gpu_estimate_check exit $?"
    ;;
  *) echo "unknown part $part: checks or estimate" >&2; exit 2 ;;
esac
ls -l "$OUT"
