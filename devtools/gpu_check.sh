#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine (CI has none): the CUDA tests
# (every method on a CUDA pool against the CPU) first, then `bench scale --device cuda` for ViT-B-32 × 8
# (every static method) and ViT-L-14 × 8 (the featured ones). Logs go to $OUT (or ./out).
#
# Packages the GPU image lacks (gradio, open_clip, plotly and their needs) travel as one zip of
# unpacked cp312 wheels, .whl/pack/site.zip (ignored by git): `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 ...` each, unzip
# them into one folder, drop gradio's frontend and media and plotly.min.js, zip the folder.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -f .whl/pack/site.zip ]; then
    rm -rf /tmp/site && python3 -m zipfile -e .whl/pack/site.zip /tmp/site && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False PYTHONUNBUFFERED=1
export MERGER_CACHE_DIR=/tmp/merger-cache
step() {  # step SECONDS LOG command...: one check, bounded, logged; a failure does not stop the rest
    local limit=$1 log=$2; shift 2
    case " ${SKIP:-} " in *" ${log%.log} "*) echo "=== skipped ${log%.log}"; return;; esac
    echo "=== $* (limit ${limit} s)"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$log" 2>&1
    local rc=$?
    tail -n "${TAIL:-60}" "$OUT/$log"
    echo "=== rc $rc in $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import merger.ui, torch, gradio, plotly, scipy; from merger._compat import open_clip; \
print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', \
'gradio', gradio.__version__, 'open_clip', open_clip().__version__, 'scipy', scipy.__version__)" 2>&1 | tee -a "$OUT/env.txt"
STATIC=weight_averaging,task_arithmetic,ties,dare_linear,dare_ties,cart,tsv_m,iso_c,breadcrumbs,consensus_ta,iso_cts,magmax,model_stock,slerp,fisher,regmean,wudi
# METHODS / L14_METHODS / MOVES narrow a run to what is still unmeasured (the device time is short)
TAIL=25 step "${TEST_S:-150}" test_cuda.log python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
step "${B32_S:-240}" scale_b32.log python3 -m merger bench scale --arch ViT-B-32 --device cuda --methods "${METHODS:-$STATIC}" \
    ${MOVES:+--moves $MOVES} --debug
step "${L14_S:-200}" scale_l14.log python3 -m merger bench scale --arch ViT-L-14 --device cuda --moves "${MOVES:-10}" \
    ${L14_METHODS:+--methods $L14_METHODS} --debug
TAIL=80 step "${PROFILE_S:-120}" profile_b32.log python3 scripts/gpu_profile.py ViT-B-32
TAIL=80 step "${PROFILE_S:-120}" profile_l14.log python3 scripts/gpu_profile.py ViT-L-14 5
