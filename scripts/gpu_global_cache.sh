#!/usr/bin/env bash
# The global embedding cache on one GPU: `bench serve` of qwen2-vl-2b as 2e1p1d (two encoders, one prefill, one
# decode and the proxy, all on cuda), one 448x448 image a request by URL, a share $FRACTION (0.5) of the requests
# repeating an earlier image, the same requests against a cluster with the global cache off, then a fresh one
# with it on (its own mooncake_master): $OUT/global-cache-cuda-2b-448-r$FRACTION/result.json, whose "comparison"
# holds the hit rates, TTFT p50/p99 off and on, each encoder stage cost of an L3 hit against a ViT miss
# (encoder_stage_ms) and how many answers were equal.
#
#   bash scripts/gpu_global_cache.sh
#
# Needs, in /tmp/site (a warm machine keeps them): the serving wheels (.whl, as scripts/gpu_e2e.sh installs them)
# and Mooncake's store for the machine's Python (.whl-mooncake/: `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 -d .whl-mooncake
# mooncake-transfer-engine-non-cuda==0.3.13.post1`, 46 MB, ignored by git; carried in a call of its own: the two
# folders together come near the carry limit).
# Knobs (environment): PROMPTS (200), RATE (req/s, 4), FRACTION (0.5), STAGE_TIMEOUT (s, 540), OUT.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-$ROOT/out/gpu}
mkdir -p "$OUT"
# the same mark as scripts/gpu_e2e.sh for the serving wheels: either script installs them once
for pair in .whl:wheels .whl-mooncake:mooncake; do
    dir=${pair%%:*} mark=/tmp/site/.epd-lab-${pair##*:}
    if [ ! -e "$mark" ] && compgen -G "$dir/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$dir"/*.whl || { echo "installing $dir failed"; exit 1; }
        touch "$mark"
    fi
done
[ -e /tmp/site/mooncake/mooncake_master ] && chmod +x /tmp/site/mooncake/mooncake_master
export PYTHONPATH=$ROOT:/tmp/site PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg
python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || { tail -20 /tmp/build.log; exit 1; }
python3 -c "from epd_lab.ep.store import unavailable_reason as r; import sys; sys.exit(r())" ||
    { echo "Mooncake Store is unavailable: carry .whl-mooncake (see the header)"; exit 1; }
dir=$OUT/global-cache-cuda-2b-448-r${FRACTION:-0.5}
timeout "${STAGE_TIMEOUT:-540}" python3 -m epd_lab.cli bench serve --launch 2e1p1d --launch-model qwen2-vl-2b \
    --device cuda --backend openai-chat --dataset-name image-repeat --image-repeat-fraction "${FRACTION:-0.5}" \
    --image-resolution 448x448 --num-prompts "${PROMPTS:-200}" --request-rate "${RATE:-4}" --media url \
    --random-input-len 64 --random-output-len 16 --temperature 0 --ignore-eos --num-warmups 1 \
    --mm-global-cache both --disable-tqdm --save-result --save-detailed --result-dir "$dir" \
    --result-filename result.json 2>&1 |
    grep -v '^[IWE][0-9]\{4\} '  # Mooncake's own log lines
exit "${PIPESTATUS[0]}"
