#!/usr/bin/env bash
# On the GPU device machine (offline): install the carried wheelhouse, then run the named stages.
#   bash tools/gpu_run.sh tests decode offline dp      (results and logs go to $OUT, default ./gpu_out)
# `tests` = `kernels` + `gdn` + `e2e`: one device call may run 10 min at most and on a cold machine `kernels` + `gdn`
# took 9-10 min (fla's first-call autotuning), so run `kernels`, `gdn` and `e2e` in separate calls.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site:$PWD/.deepep/site PATH=/tmp/site/bin:$PATH RAY_AUTH_MODE=disabled NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o 'H[0-9]*' | head -1 | tr A-Z a-z)  # results files name the card
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    kernels) python3 -m pytest -q -p no:cacheprovider --durations=8 -m gpu tests/test_kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -30 ;;
    gdnsnap) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gdn_prefill.py -k snapshots 2>&1 | tee "$OUT/gdnsnap.log" | tail -3 ;;
    gdn) python3 -m pytest -q -p no:cacheprovider --durations=4 -m gpu tests/test_gdn_prefill.py 2>&1 | tee "$OUT/gdn.log" | tail -12 ;;
    deepep) [ -d .deepep/site ] || bash tools/deepep.sh build 2>&1 | tee "$OUT/deepep_build.log" | tail -8
            python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_deepep.py 2>&1 | tee "$OUT/deepep.log" | tail -8 ;;
    e2e) python3 -m pytest -q -rs -p no:cacheprovider --durations=8 -m gpu tests/test_gpu.py tests/test_deepep.py 2>&1 | tee "$OUT/e2e.log" | tail -30 ;;
    tests) python3 -m pytest -q -p no:cacheprovider --durations=12 -rs -m gpu tests/test_kernels.py tests/test_gdn_prefill.py tests/test_gpu.py tests/test_deepep.py 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    decode) python3 bench/decode.py --out "$OUT/decode_h200.json" 2>&1 | tail -12 ;;
    offline) python3 bench/offline.py --device cuda --dtype bfloat16 --prompts 16 --repeats 3 --out "$OUT/offline_h200_bf16.json" 2>&1 | tail -16 ;;
    mtpphases) python3 bench/mtp_phases.py --out "$OUT/mtp_phases_$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o 'H[0-9]*' | head -1 | tr A-Z a-z).json" 2>&1 | tail -40 ;;
    kernsweep) timeout 200 python3 bench/kernels.py --rows 1 --out "$OUT/kernels_h200.json" 2>&1 | tail -30 ;;
    moe) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py -k "experts or shared or moe or plan or gemv" 2>&1 | tail -2 ;;
    recurrent) python3 bench/kernels.py --recurrent --gemm-rows ${REC_ROWS:-64 256} --out "$OUT/kernels_h200_recurrent.json" 2>&1 | grep "^recurrent" ;;
    grouped) python3 bench/kernels.py --grouped --gemm-rows ${GROUPED_ROWS:-8 16 32 64 256 1024 2048} --out "$OUT/kernels_h200_grouped_moe.json" 2>&1 | grep "grouped\|best" ;;
    fp8) python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_fp8_kernels.py 2>&1 | tee "$OUT/fp8.log" | grep "agreement\|passed\|failed\|Error" | tail -8
         python3 bench/decode.py --fp8 --mtp-k 0 --kernel-batches 1 64 --out "$OUT/decode_h200_fp8.json" 2>&1 | grep -A40 "^| batch" ;;
    pdl) python3 bench/decode.py --mtp-k 0 --batches ${PDL_BATCHES:-1 8 64} --pdl-ab ${PDL_ARGS:-} --out "$OUT/decode_h200_pdl.json" 2>&1 | grep -A40 "^| batch" ;;
    pdlmtp) python3 bench/decode.py --mtp-k 3 --batches 1 8 --mtp-batches 1 8 --draft-vocab 0 --pdl-ab --kernel-batches --out "$OUT/decode_h200_pdl_mtp.json" 2>&1 | grep -A40 "^| batch" ;;
    fp8sweep) timeout ${FP8_TIMEOUT:-250} python3 bench/kernels.py --fp8 ${FP8_SHAPES:-gdn_qkv out_proj router} --fp8-parts ${FP8_PARTS:-gemv experts gemm} --out "$OUT/kernels_h200_fp8.json" 2>&1 | grep "^fp8 " ;;
    profile) python3 bench/profile_step.py --device cuda --out "$OUT/profile_step_h200.json" 2>&1 | grep -v USDT | tail -50 ;;
    profilesv) python3 bench/profile_step.py --device cuda --sync-verify --out "$OUT/profile_step_h200_sync.json" 2>&1 | grep "^k=" ;;
    profreq) python3 bench/profile_step.py --device cuda --phase requests --steps 200 --out "$OUT/profile_step_h200_requests.json" 2>&1 | grep "^k=" ;;
    profile128) python3 bench/profile_step.py --device cuda --batch 128 --steps 20 --out "$OUT/profile_step_h200_b128.json" 2>&1 | grep -v USDT | tail -50 ;;
    prefill) python3 bench/prefill.py --layers 4 --out "$OUT/prefill_h200.json" 2>&1 | grep "^{'seq" ;;
    prof35p) python3 bench/profile_step.py --device cuda --model 35b --layers 8 --phase prefill --batch 256 --steps 6 --k 0 --out "$OUT/profile_35b_prefill.json" 2>&1 | grep -v USDT | tail -30 ;;
    prof35d) python3 bench/profile_step.py --device cuda --model 35b --layers 8 --phase decode --batch 256 --steps 20 --k 0 --out "$OUT/profile_35b_decode.json" 2>&1 | grep -v USDT | tail -30 ;;
    serve) TRITON_CACHE_DIR=$(mktemp -d) python3 bench/serve.py --yaml deployments/qwen35_gpu.yaml --model 35b --layers 4 --groups 1 --variants ${SERVE_VARIANTS:-dp1k0 dp1k3} --profile-s 6 ${SERVE_ARGS:-} --out "$OUT/serve_h200.json" 2>&1 | grep -v '^ \|^{\|^}' | tail -40 ;;
    capacity) TRITON_CACHE_DIR=$(mktemp -d) python3 bench/serve.py --yaml deployments/qwen35_gpu.yaml --model 35b --layers 4 --groups 1 --variants ${SERVE_VARIANTS:-dp1k0 dp1k3} --concurrency ${SERVE_C:-1 64 128} --cold-burst 0 --out "$OUT/serve_$CARD.json" 2>&1 | grep "c=\|Error\|error" | cut -c1-400 ;;
    serveint) TRITON_CACHE_DIR=$(mktemp -d) python3 bench/serve.py --yaml deployments/qwen35_gpu.yaml --model 35b --layers 4 --groups 1 --variants ${SERVE_VARIANTS:-dp1k0s0 dp1k0s5} --concurrency 1 64 128 --cold-burst 0 --out "$OUT/serve_h200_interval.json" 2>&1 | grep "c=" | cut -c1-330 ;;
    servedirect) TRITON_CACHE_DIR=$(mktemp -d) python3 bench/serve.py --yaml deployments/qwen35_gpu.yaml --model 35b --layers 4 --groups 1 --variants ${SERVE_VARIANTS:-dp1k0s5 dp1k0s5d} --concurrency 1 64 128 --cold-burst 0 --out "$OUT/serve_h200_direct.json" 2>&1 | grep "c=" | cut -c1-330 ;;
    cold) for mk in ${COLD:-bundled:0 bundled:3 35b:0 35b:3}; do m=${mk%:*} k=${mk#*:} f="$OUT/cold_${m}_k$k"
            TRITON_CACHE_DIR=$(mktemp -d) python3 bench/cold_compiles.py --model $m --k $k --out $f.json > $f.log 2>&1
            python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], d['engine_start_s'], d['compiles_in_warmup'], d['compiles_after_warmup'], [c['kernel'] for c in d['after_warmup']])" $f.json || tail -20 $f.log; done ;;
    prefix) for dt in float32 bfloat16; do python3 bench/prefix.py --device cuda --dtype $dt --out "$OUT/prefix_h200_$dt.json" 2>&1 | grep "prefill tokens computed"; done ;;
    prefix35) python3 bench/prefix.py --device cuda --dtype bfloat16 --model 35b --layers 8 --system 1000 --sample-prompt 2000 --out "$OUT/prefix_h200_35b.json" 2>&1 | grep "prefill tokens computed\|Error" ;;
    mixed) python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_gpu.py -k "${MIXED_K:-mixed or graphs_equal or prefix_caching}" 2>&1 | tee "$OUT/mixed.log" | tail -12
           python3 bench/mixed_steps.py --layers ${LAYERS:-4} --out "$OUT/mixed_steps_${CARD}_${LAYERS:-4}l.json" 2>&1 | grep -v "^ \|^{\|^}" | tail -8
           python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('decode', d['decode_ms'], {k: (r['graph_ms'], r['eager_ms'], r['graph_over_decode'], r['graph_steps']) for k, r in d['rows'].items()})" "$OUT/mixed_steps_${CARD}_${LAYERS:-4}l.json" ;;
    mixedbench) f="$OUT/mixed_steps_${CARD}_${LAYERS:-4}l${MIXED_TAG:-}.json"; python3 bench/mixed_steps.py --layers ${LAYERS:-4} ${MIXED_ARGS:-} --out "$f" 2>&1 | grep -v "^ \|^{\|^}" | tail -8
           python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('decode', d['decode_ms'], {k: (r['graph_ms'], r['eager_ms'], r['graph_over_decode'], r['graph_steps']) for k, r in d['rows'].items()})" "$f" ;;
    graphkern) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py -k "greedy_block or feed_in" 2>&1 | tee "$OUT/graphkern.log" | tail -3 ;;
    graphops) python3 bench/graph_ops.py --out "$OUT/graph_ops_h200.json" 2>&1 | tail -2 ;;
    offline256) python3 bench/offline.py --device cuda --dtype bfloat16 --prompts 16 --max-tokens 256 --repeats 3 --no-transformers --out "$OUT/offline_h200_bf16_256.json" 2>&1 | tail -16 ;;
    offline32) python3 bench/offline.py --device cuda --dtype float32 --prompts 8 --out "$OUT/offline_h200_fp32.json" 2>&1 | tail -16 ;;
    dp) python3 bench/dp.py --device cuda --requests 256 --max-tokens 64 --max-num-seqs 128 --repeats 3 --out "$OUT/dp_h200x2.json" 2>&1 | grep -A3 '"dp2_over\|"tokens_per_s"\|_step_ms\|graph_wait' ;;
    dpk) python3 bench/dp.py --device cuda --k 3 --requests 256 --max-tokens 64 --max-num-seqs 128 --repeats 3 --out "$OUT/dp_h200x2_k3.json" 2>&1 | grep -A3 '"dp2_over\|"tokens_per_s"\|_step_ms\|graph_wait' ;;
    dpsat) python3 bench/dp.py --device cuda --requests 1024 --max-tokens 64 --max-num-seqs 512 --repeats 2 --out "$OUT/dp_h200x2_sat.json" 2>&1 | grep -A3 '"dp2_over\|"tokens_per_s"\|_step_ms\|graph_wait' ;;
    dp35) python3 bench/dp.py --device cuda --model 35b --layers 8 --requests 512 --max-tokens 64 --max-num-seqs 256 --repeats 3 --out "$OUT/dp_h200x2_35b.json" 2>&1 | grep -A3 '"dp2_over\|"tokens_per_s"\|_step_ms\|graph_wait' ;;
    dp35b) python3 bench/dp.py --device cuda --model 35b --layers 8 --requests 512 --max-tokens 64 --max-num-seqs 256 --repeats 3 --submit batch --out "$OUT/dp_h200x2_35b_batch.json" 2>&1 | grep -A3 '"dp2_over\|"tokens_per_s"\|_step_ms\|graph_wait' ;;
    dp35prof) python3 bench/dp.py --device cuda --model 35b --layers 8 --requests 512 --max-tokens 64 --max-num-seqs 256 --repeats 1 --profile-steps 40 --out "$OUT/dp_h200x2_35b_prof.json" 2>&1 | grep -A3 '"dp2_over' ;;
  esac
done
echo "=== end $(date +%T)"
