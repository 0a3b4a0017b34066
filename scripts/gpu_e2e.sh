#!/usr/bin/env bash
# The GPU runs of the roles on a device, the model runtime and the A/Bs, on a machine with one H200 and a 10-minute
# limit per run (Python 3.12, torch 2.11+cu130, without pyzmq/fastapi/msgspec/uvicorn/openai: they travel as wheels
# in .whl/, copied with the tree).
#
#   bash scripts/gpu_e2e.sh STAGE...      stages, in the order given:
#     tests     pytest -m cuda on every test file with cuda-marked tests
#     tiny      epd-lab bench e2e --device cuda --model tiny (224², all backends)
#     2b        ... --model qwen2-vl-2b, the grid $SIZES x $IMAGES, --kv-tokens 4096 ($BACKENDS_2B, default all)
#     7b        ... --model qwen2-vl-7b, the same grid ($BACKENDS_7B, default mooncake)
#     notebook  notebooks/08_gpu.ipynb through papermill with -p device cuda (skipped where papermill is absent)
#     rates     epd-lab sweep rates --device cuda --launch-model $RATES_MODEL (default qwen2-vl-2b): goodput against
#               request rate for $RATES_TOPOLOGIES (default monolithic,1e1p1d,2e1p1d; one per run fits 10 minutes) at
#               $RATES (req/s), $RATES_PROMPTS requests each, $RATES_IMAGES x $RATES_RESOLUTION, into
#               $OUT/goodput-h200-<model>-<images>x<side>/ (a later run adds its topologies to the same folder)
#     x2        the placements at equal GPUs: `nvidia-smi topo -m` into $OUT/x2-topo-m.txt, then `epd-lab sweep rates
#               --placements $X2_PLACEMENTS (default all: 2xmonolithic,e-gpu1,d-gpu1,spread) --gpus $X2_GPUS (default
#               cuda:0,cuda:1)` of $RATES_MODEL at $RATES, $RATES_PROMPTS requests each, $RATES_IMAGES x
#               $RATES_RESOLUTION, into $OUT/<placement>/ (commit them as data/bench/e2e-cuda-x2-<model>-<images>x<side>/);
#               $OUT/answers.json compares every placement's answers with 2xmonolithic's
#     ab        before/after, side by side: `bench e2e` of $AB_MODEL (qwen2-vl-2b), mooncake only, $SIZES x $IMAGES at
#               $CONCURRENCY, for this tree ("head") and for $AB_BASE (another commit's tree inside this one, e.g.
#               `git archive REV | tar -x -C ab-base`, carried untracked), alternating base/head $AB_ROUNDS (2) times
#               in the order $AB_ORDER ("base head") in odd rounds and the other in even ones (AB_BALANCED=0: the
#               same in every round): $OUT/e2e-cuda-<model>-ab-{base,head}-r<round>.json (each with its own
#               monolithic row); `epd-lab bench ab $OUT` then gives the head's and the order's effects. A flag's A/B
#               on one tree: AB_BASE=. AB_HEAD_ARGS="--gated-prefill" (arguments given to the head side's runs only;
#               AB_HEAD_ARGS=--keep-cpus-awake: the head's runs with a SCHED_IDLE spinner on every CPU)
#     mps       the ab stage's run on this tree, alternating without and with an MPS daemon (nvidia-cuda-mps-control -d,
#               started and quit here: every CUDA process of the run, the floor's and the servers', is then its
#               client), $AB_ROUNDS (2) times: $OUT/e2e-cuda-<model>-mps-{off,on}-r<round>.json
#     hops      what one cross-process hop costs on this host: scripts/wakeup_latency.py (a ping-pong after idle gaps:
#               idle, /dev/cpu_dma_latency held at 0, a SCHED_IDLE spinner on every CPU) and `epd-lab bench http` (one kept-alive POST per
#               server stack and client): $OUT/wakeup-latency.json, $OUT/http.json
#     runtime   epd-lab bench runtime --device cuda --models $RT_MODELS (default qwen2-vl-2b,qwen2-vl-7b): the model
#               runtimes $RT_RUNTIMES (default hf,fast) in one process ($OUT/runtime-h200-full.json, summary $OUT/runtime-h200.json)
#
# Every stage appends to $OUT/gpu_e2e.log, each line stamped with the UTC time; a bench writes
# $OUT/e2e-cuda-<model>[-$TAG].json. A run on the GPU machine may take at most 10 minutes: give each run the stages
# that fit (about: setup 1-2 min, tests 2-3, each bench 2-4), e.g. "tests tiny" then "2b 7b".
# Knobs (environment): REQUESTS (8 per concurrency level), MAX_TOKENS (16), SIZES (448,896), IMAGES (1,4,8),
# CONCURRENCY (1,4,16), QOS (1: every bench e2e runs with /dev/cpu_dma_latency held at 0 µs), RECV_BUFFER
# (the prefill's --recv-buffer: pinned, device or host; unset: auto), GATED_PREFILL (1: bench e2e --gated-prefill;
# both sides of ab need a tree that has the option), PAIRS (bench e2e --pairs: split and floor
# requests side by side at c=1, alternating; both sides of ab need a tree that has the option), MEDIA (data-uri or url: how the e2e requests carry their images), BACKENDS_7B, NB_MODEL (qwen2-vl-2b), STAGE_TIMEOUT (s, 420), TAG (added to the JSON's name),
# TESTS (pytest arguments, e.g. node ids, instead of every file with cuda tests), EPD_LAB_COMMIT (the commit sent:
# the device copy's .git may be older; the setup line and bench runtime record it).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-$ROOT/out/gpu}
mkdir -p "$OUT"
LOG=$OUT/gpu_e2e.log
REQUESTS=${REQUESTS:-8}
MAX_TOKENS=${MAX_TOKENS:-16}
SIZES=${SIZES:-448,896}
IMAGES=${IMAGES:-1,4,8}
CONCURRENCY=${CONCURRENCY:-1,4,16}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-420}

stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date -u +%H:%M:%S)" "$line"; done | tee -a "$LOG"; }
say() { echo "== $*" | stamp; }

# ---- setup: the carried wheels, the native core, what this machine is (a warm machine keeps the first two) ----
if [ ! -e /tmp/site/.epd-lab-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl 2>&1 | stamp || { say "installing the wheels failed (is .whl carried?)"; exit 1; }
    touch /tmp/site/.epd-lab-wheels
fi
# the servers are child processes started with `python3 -m`: they find epd_lab and the wheels through PYTHONPATH
export PYTHONPATH=$ROOT:/tmp/site PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg
python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || { tail -20 /tmp/build.log | stamp; exit 1; }
# the device copy of the tree may carry an older .git: EPD_LAB_COMMIT names the commit that was sent
commit=${EPD_LAB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
say "setup done: commit $commit, $(git status --short 2>/dev/null | wc -l) files changed"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | stamp
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
            'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))" 2>&1 | stamp

bench() {  # bench MODEL ARGS...: one `bench e2e` run on the GPU, its JSON in $OUT
    local model=$1
    shift
    say "bench e2e --device cuda --model $model $*"
    local hold=()
    [ "${QOS:-0}" = 1 ] && hold=(python3 scripts/wakeup_latency.py --hold --)
    timeout "$STAGE_TIMEOUT" "${hold[@]}" python3 -m epd_lab.cli bench e2e --device cuda --model "$model" \
        --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" --media "${MEDIA:-data-uri}" \
        ${RECV_BUFFER:+--recv-buffer "$RECV_BUFFER"} ${PAIRS:+--pairs "$PAIRS"} \
        ${GATED_PREFILL:+--gated-prefill} --json "$OUT/e2e-cuda-$model${TAG:+-$TAG}.json" "$@" \
        2>&1 | stamp
    say "bench $model: exit ${PIPESTATUS[0]}"
}

ab_bench() {  # ab_bench TREE NAME [ARGS...]: `bench e2e` of $AB_MODEL, mooncake only, with TREE's code and ARGS,
    # into $OUT/e2e-cuda-<model>-NAME.json
    local tree=$1 name=$2
    shift 2
    (cd "$tree" && PYTHONPATH=$tree:/tmp/site timeout "$STAGE_TIMEOUT" python3 -m epd_lab.cli bench e2e \
        --device cuda --model "${AB_MODEL:-qwen2-vl-2b}" --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" \
        --media "${MEDIA:-data-uri}" --image-size "$SIZES" --images "$IMAGES" --concurrency "$CONCURRENCY" \
        --kv-tokens 4096 --backends mooncake ${PAIRS:+--pairs "$PAIRS"} ${GATED_PREFILL:+--gated-prefill} \
        --json "$OUT/e2e-cuda-${AB_MODEL:-qwen2-vl-2b}-$name.json" "$@") 2>&1 | stamp
    say "$name: exit ${PIPESTATUS[0]}"
}

sweep_rates() {  # sweep_rates NAME ARGS...: `sweep rates` of $RATES_MODEL at $RATES, the stage's own ARGS (--out...)
    local name=$1
    shift
    say "sweep rates --launch-model $RATES_MODEL, $RATES_IMAGES x $RATES_RESOLUTION $*"
    # shellcheck disable=SC2086  # RATES_SLOS is a list of arguments
    timeout "$STAGE_TIMEOUT" python3 -m epd_lab.cli sweep rates --launch-model "$RATES_MODEL" \
        --rates "${RATES:-2,4,8,16,32}" --num-prompts "${RATES_PROMPTS:-48}" --image-count "$RATES_IMAGES" \
        --image-resolution "$RATES_RESOLUTION" --kv-blocks 4096 --goodput ${RATES_SLOS:-ttft:300 tpot:30} "$@" 2>&1 |
        stamp
    say "$name: exit ${PIPESTATUS[0]}"
}
RATES_MODEL=${RATES_MODEL:-qwen2-vl-2b}
RATES_IMAGES=${RATES_IMAGES:-4}
RATES_RESOLUTION=${RATES_RESOLUTION:-448x448}

for stage in "$@"; do
    case $stage in
        tests)
            mapfile -t files < <(grep -l "mark.cuda" tests/test_*.py)
            # shellcheck disable=SC2086  # TESTS is a list of arguments
            [ -n "${TESTS:-}" ] && files=($TESTS)
            say "pytest -m cuda ${files[*]}"
            # addopts cleared: they name nbval, which this machine does not have
            timeout "$STAGE_TIMEOUT" python3 -m pytest -o addopts="" -p no:cacheprovider -m cuda -ra -v "${files[@]}" \
                2>&1 | stamp
            say "tests: exit ${PIPESTATUS[0]}"
            ;;
        tiny) bench tiny ;;
        hops)
            say "wakeup latency; bench http"
            timeout "$STAGE_TIMEOUT" python3 scripts/wakeup_latency.py --json "$OUT/wakeup-latency.json" 2>&1 |
                tail -3 | stamp
            timeout "$STAGE_TIMEOUT" python3 -m epd_lab.cli bench http --rounds 10 --load-rounds 2 \
                --json "$OUT/http.json" 2>&1 | tail -40 | stamp
            say "hops: exit ${PIPESTATUS[0]}"
            ;;
        2b) bench qwen2-vl-2b --image-size "$SIZES" --images "$IMAGES" --concurrency "$CONCURRENCY" --kv-tokens 4096 \
                ${BACKENDS_2B:+--backends "$BACKENDS_2B"} ;;
        7b) bench qwen2-vl-7b --image-size "$SIZES" --images "$IMAGES" --concurrency "$CONCURRENCY" --kv-tokens 4096 \
                --backends "${BACKENDS_7B:-mooncake}" ;;
        rates)
            # the folder is named by the image's height: 448x448 -> goodput-h200-qwen2-vl-2b-4x448
            dir="$OUT/goodput-h200-$RATES_MODEL-${RATES_IMAGES}x$RATES_RESOLUTION"
            sweep_rates rates --device cuda --topologies "${RATES_TOPOLOGIES:-monolithic,1e1p1d,2e1p1d}" \
                --out "${dir%x*}"
            ;;
        x2)
            # into $OUT itself: results come back from folders two deep at most ($OUT/<placement>/<topology>/);
            # one $RATES_IMAGES x $RATES_RESOLUTION a run, committed as data/bench/e2e-cuda-x2-<model>-<images>x<side>/
            nvidia-smi topo -m > "$OUT/x2-topo-m.txt" 2>&1
            sweep_rates x2 --placements "${X2_PLACEMENTS:-all}" --gpus "${X2_GPUS:-cuda:0,cuda:1}" --out "$OUT"
            ;;
        ab)
            [ -d "${AB_BASE:-}" ] || { say "ab: AB_BASE is not a directory"; exit 2; }
            (cd "$AB_BASE" && python3 setup.py -q build_ext --inplace > /tmp/build-base.log 2>&1) ||
                { tail -20 /tmp/build-base.log | stamp; exit 1; }
            order=${AB_ORDER:-base head}
            for round in $(seq "${AB_ROUNDS:-2}"); do
                sides=$order
                # balanced: every other round in the other order, so that one run holds both (the side that ran
                # second in a round did worse by 0.17-0.48 ms in three A/Bs); `epd-lab bench ab` separates the two
                if [ "${AB_BALANCED:-1}" = 1 ] && [ $((round % 2)) = 0 ]; then
                    sides=$(echo "$order" | awk '{print $2, $1}')
                fi
                for side in $sides; do
                    tree=$ROOT args=()
                    [ "$side" = base ] && tree=$(cd "$AB_BASE" && pwd)
                    # shellcheck disable=SC2206  # AB_HEAD_ARGS is a list of arguments
                    [ "$side" = head ] && args=(${AB_HEAD_ARGS:-})
                    say "ab round $round: $side ($tree) ${args[*]}"
                    ab_bench "$tree" "ab-$side-r$round" "${args[@]}"
                done
            done
            ;;
        mps)
            # a daemon that this stage starts and quits; no GPU setting is changed
            export CUDA_MPS_PIPE_DIRECTORY=/tmp/epd-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/epd-mps/log
            mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
            for round in $(seq "${AB_ROUNDS:-2}"); do
                for side in off on; do
                    if [ "$side" = on ]; then
                        nvidia-cuda-mps-control -d 2>&1 | stamp
                        pgrep -x nvidia-cuda-mps >/dev/null || { say "mps: the daemon did not start"; exit 1; }
                    fi
                    say "mps round $round: $side"
                    ab_bench "$ROOT" "mps-$side-r$round"
                    if [ "$side" = on ]; then
                        echo quit | nvidia-cuda-mps-control 2>&1 | stamp
                        # its control pipe stays behind: wait for the daemon's process to end
                        for _ in $(seq 50); do pgrep -x nvidia-cuda-mps >/dev/null || break; sleep 0.2; done
                    fi
                done
            done
            unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
            ;;
        runtime)
            say "bench runtime --models ${RT_MODELS:=qwen2-vl-2b,qwen2-vl-7b}"
            timeout "$STAGE_TIMEOUT" python3 -m epd_lab.cli bench runtime --device cuda --models "$RT_MODELS" \
                --runtimes "${RT_RUNTIMES:-hf,fast}" \
                --json "$OUT/runtime-h200-full.json" --summary "$OUT/runtime-h200.json" 2>&1 | stamp
            say "runtime: exit ${PIPESTATUS[0]}"
            ;;
        notebook)
            if python3 -c "import papermill, plotly, ipykernel" >/dev/null 2>&1; then
                nb_model=${NB_MODEL:-qwen2-vl-2b}
                say "papermill notebooks/08_gpu.ipynb -p device cuda -p model $nb_model"
                timeout "$STAGE_TIMEOUT" python3 -m papermill notebooks/08_gpu.ipynb "$OUT/08_gpu-cuda.ipynb" \
                    -k python3 -p device cuda -p model "$nb_model" -p recv_buffer device -p image_size 896 2>&1 | stamp
                say "notebook: exit ${PIPESTATUS[0]}"
            else
                say "notebook skipped: papermill, plotly or ipykernel is not installed here"
            fi
            ;;
        *) say "unknown stage '$stage' (tests, tiny, hops, 2b, 7b, ab, mps, rates, runtime, notebook)"; exit 2 ;;
    esac
done
say "done"
