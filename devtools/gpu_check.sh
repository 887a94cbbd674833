#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine (CI has none): the compiled image tower against the
# eager one (tests/test_cuda.py), `bench scale --device cuda` for ViT-B-32 × 8 and ViT-L-14 × 8 with each
# image-tower route timed in turn, then the rest of tests/test_cuda.py (every method on a CUDA pool against
# the CPU). Logs go to $OUT (or ./out).
#
# Packages the GPU image lacks (gradio, open_clip, plotly and their needs) travel as one zip of
# unpacked cp312 wheels, .whl/pack/site.zip (ignored by git): `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 ...` each, unzip
# them into one folder, drop gradio's templates and media_assets and plotly.min.js, zip the folder.
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
# B32_METHODS / L14_METHODS / MOVES / TOWER narrow a run to what is still unmeasured (the device time is short)
TAIL=15 step "${TOWER_TEST_S:-90}" test_tower.log python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py \
    -k "tower_routes or forwards_a_cpu or bf16_autocast"
TAIL=45 step "${B32_S:-150}" scale_b32.log python3 -m devtools bench scale --arch ViT-B-32 --device cuda \
    --methods "${B32_METHODS:-task_arithmetic,tsv_m}" --moves "${MOVES:-20}" --tower "${TOWER:-eager,patches,graphs}" --debug
TAIL=40 step "${L14_S:-180}" scale_l14.log python3 -m devtools bench scale --arch ViT-L-14 --device cuda \
    --methods "${L14_METHODS:-task_arithmetic}" --moves "${L14_MOVES:-10}" --tower "${L14_TOWER:-eager,patches,graphs}" --debug
left=$(( ${BUDGET_S:-585} - SECONDS ))  # the rest of the command's time, where enough is left
if [ "$left" -ge 60 ]; then
    TAIL=25 step "$left" test_cuda.log python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "not tower_routes"
fi
