#!/usr/bin/env bash
# A self-contained session on the lent H200 (see the device tool): installs the carried wheels
# (.whl: transformers >= 5.23, trio, msgspec, structlog, ...), then runs what the first argument names:
#   tests  - every Triton kernel test, the golden tests and the pool-poison test on CUDA (graphs on)
#   bench  - benchmarks/bench_decode.py (JSON to $OUT/bench.json and stdout)
#   kernels - benchmarks/bench_kernels.py [--mhc | --moe] (tile sweeps, JSON to stdout)
#   glm    - bench_decode.py --model glm4_moe_lite with prefills 1x8192 and 8x1024 (JSON to $OUT/glm.json)
#   mla    - GLM's kernel (MLA, norms) and golden tests on CUDA, with MLA_SWEEP=1 bench_mla.py --sweep (launch choices
#            of the MLA kernels), bench_mla.py (one layer's MLA attention) ($OUT/mla*.json), then
#            bench_long_prompt.py (one 131,072-token GLM prompt through the engine against
#            transformers, $OUT/long.json; LONG_PROMPT=0 skips it)
#   native - issue 27's kernels: the FP8 / MXFP4 / int8 kernel tests on CUDA, bench_experts.py,
#            bench_fp8.py, then bench_decode.py --weights for each of $WEIGHTS (default: official)
#            ($OUT/{experts,fp8,<weights>}.json)
#   front  - issue 29: the engine golden tests on CUDA (graphs on; -k $FRONT_TESTS, "-" skips them),
#            bench_serving.py (--skip-single, --embedded-core, HTTP with $FRONTS front processes,
#            default "4 1"; the server's steps and graph captures in $OUT/serving.err; $OUT/serving.json),
#            then bench_kv_sizing.py ($OUT/kv_sizing.json; KV_SIZING=0 skips it); CONC: the stream counts,
#            EMBEDDED_CORE="" drops the --embedded-core door
#   before - issue 30's single-GPU check: bench_decode.py on this tree and on the tree in $BASE (an
#            ignored `git archive` of the commit before multi-device, carried), same flags, same machine
#            ($OUT/{head,base}.json)
#   all    - bench, then kernels
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
case "$1" in
tests)
    DSV4SERVE_TEST_DEVICE=cuda timeout 330 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_*.py \
        2>&1 | tee "$OUT/kernels.log" | tail -25
    DSV4SERVE_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_golden_dsv4.py \
        tests/test_golden_engine.py tests/test_pool_poison.py tests/test_golden_glm.py tests/test_devices.py 2>&1 | tee "$OUT/golden.log" | tail -25
    ;;
bench)
    shift
    timeout 560 python3 benchmarks/bench_decode.py --out "$OUT/bench.json" "$@" 2> "$OUT/bench.err" \
        | tee "$OUT/bench.stdout"
    tail -40 "$OUT/bench.err"
    ;;
glm)
    shift
    timeout 400 python3 benchmarks/bench_decode.py --model glm4_moe_lite --prefills 1x8192 8x1024 \
        --out "$OUT/glm.json" "$@" 2> "$OUT/glm.err" | tee "$OUT/glm.stdout"
    tail -30 "$OUT/glm.err"
    ;;
mla)
    DSV4SERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_mla.py \
        tests/test_kernels_norm_rope.py tests/test_golden_glm.py tests/test_pool_poison.py tests/test_glm_ops.py 2>&1 \
        | tee "$OUT/glm_tests.log" | tail -8
    [ "${MLA_SWEEP:-0}" = 1 ] && timeout 170 python3 benchmarks/bench_mla.py --sweep --out "$OUT/mla_sweep.json" | tail -1
    timeout 60 python3 benchmarks/bench_mla.py --out "$OUT/mla.json" | tail -1
    [ "${LONG_PROMPT:-1}" = 1 ] && timeout 150 python3 benchmarks/bench_long_prompt.py --out "$OUT/long.json" 2>&1 | tail -3
    ;;
kernels)
    shift
    DSV4SERVE_TEST_DEVICE=cuda timeout 300 python3 benchmarks/bench_kernels.py "$@" 2>&1 | tee "$OUT/kernels.json"
    ;;
native)
    shift
    DSV4SERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_linear.py \
        tests/test_kernels_moe.py tests/test_formats.py 2>&1 | tee "$OUT/native_tests.log" | tail -12
    timeout 150 python3 benchmarks/bench_experts.py --out "$OUT/experts.json" 2>&1 | tail -3 | cut -c1-3000
    [ "${FP8_BENCH:-1}" = 1 ] && timeout 40 python3 benchmarks/bench_fp8.py --out "$OUT/fp8.json" 2>&1 | tail -1 | cut -c1-1500
    for w in ${WEIGHTS:-official}; do
        timeout 280 python3 benchmarks/bench_decode.py --weights "$w" --out "$OUT/$w.json" "$@" \
            2> "$OUT/$w.err" | tee "$OUT/$w.stdout" | cut -c1-400
        tail -3 "$OUT/$w.err"
    done
    ;;
front)
    [ "${FRONT_TESTS:-}" != "-" ] && DSV4SERVE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider \
        tests/test_golden_engine.py -k "${FRONT_TESTS:-}" 2>&1 | tail -4
    timeout "${SERVING_S:-400}" python3 benchmarks/bench_serving.py ${EMBEDDED_CORE---embedded-core} --skip-single \
        --server-log-level info --api-server-count ${FRONTS:-4 1} --concurrency ${CONC:-64 256} \
        --out "$OUT/serving.json" 2> "$OUT/serving.err" > /dev/null
    python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
for door in [d for d in r if d.startswith(("embedded", "http"))]:
    for n, f in r[door].items():
        print(door, n, {k: v for k, v in f.items() if k not in ("streams_done", "ttft_all_s")})
print(r.get("ratios"))' "$OUT/serving.json"
    awk '/graphs_ready/ {print; r = 1; next} /^run:|Error|Traceback/ {print; next} r && /graph_captured/' \
        "$OUT/serving.err" | tail -40 | cut -c1-220
    [ "${KV_SIZING:-1}" = 1 ] && timeout 100 python3 benchmarks/bench_kv_sizing.py --out "$OUT/kv_sizing.json" \
        2> "$OUT/kv.err" | tail -c 1500 && tail -3 "$OUT/kv.err"
    ;;
before)
    shift
    for tree in head base head base; do
        dir=$PWD; [ "$tree" = base ] && dir=$PWD/${BASE:-.base55}
        (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 200 python3 benchmarks/bench_decode.py --out "$OUT/$tree.$RANDOM.json" \
            "$@" 2> "$OUT/$tree.err" | tail -c 600)
        echo "== $tree rc=$?"; tail -2 "$OUT/$tree.err"
    done
    ;;
all)
    shift
    timeout 400 python3 benchmarks/bench_decode.py --out "$OUT/bench.json" "$@" 2> "$OUT/bench.err" \
        | tee "$OUT/bench.stdout"
    tail -30 "$OUT/bench.err"
    DSV4SERVE_TEST_DEVICE=cuda timeout 150 python3 benchmarks/bench_kernels.py 2>&1 | tee "$OUT/kernels.json"
    ;;
esac
