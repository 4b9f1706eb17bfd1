#!/usr/bin/env bash
# The whole GPU check in one call: GPU test suite, compiler facts, benchmark; logs under $OUT,
# a short table printed last.
#   OUT=<dir> experiments/gpu_check.sh [tests] [compile] [quick] [grid]   (default: all four)
#   tests    pytest on the GPU (the same suite CI runs in the simulator, plus the GPU-only tests),
#            as 22 pytest processes at once: it is compile-bound (the groups' times add up to
#            about an hour cold), and the groups compile in parallel on the host's cores. Cold on
#            the 16-core H100 host, as 14 groups, fa1's forward and the real-size backward took
#            9.4 minutes and the options and fa1's backward more than 9.6 (session 9), hence the
#            finer split; give `tests` a call of its own; FA_KERNEL_CACHE (kept in .kcache/) makes a rerun after an edit to
#            one variant short. tests/test_compile.py is the CPU-side `compile` step, not here.
#            TESTS=<paths> runs those paths in one process instead.
#   bwd_fa2, bwd_other   tests/test_backward*.py for fa2, and for fa1, standard and the protocol
#   bwd_ncu  ncu sections of the fa2 backward (dq separate and atomic) and SDPA's (backward_profile.py)
#   fa3      the sm90 instruction tests and every fa3 test (tests/test_sm90.py, test_variants,
#            test_masks, test_fp8, test_varlen -k fa3), -n 8 (FA3_WORKERS)
#   fa3_quick  fa3 and fa2 with the SDPA peers, d 64/128, causal and not (FA3_SEQLENS, default 4k,16k)
#   decode   decoding (issue 22): tests/test_decode.py on the GPU (both combines, the CUDA-graph
#            replay, the fused combine under load), then experiments/decode.py --only-decode: split-KV
#            with combine=kernel and combine=fused, eager and replayed from a CUDA graph, in one run
#            (DECODE_BATCHES, default 1,4,8; DECODE_LENGTHS, default 16384,131072) into
#            $OUT/decode.csv; about 10 minutes cold at most (TESTS_TIMEOUT 330 s, DECODE_TIMEOUT 240 s)
#   memcheck compute-sanitizer memcheck (--report-api-errors no) over one call of every variant's
#            forward and backward, masks and fa2's packed batch (experiments/every_kernel.py)
#   compile  registers / spills / mma counts of every kernel (python -m experiments.compile_report), and
#            tests/test_compile.py's assertions on all of them (FA_COMPILE_ALL=1)
#   quick    fa2 + peers at seqlen 4096, head_dim 64 and 128, causal and not (bf16)
#   grid     the FA2 paper's grid (experiment=fa2_grid), fa2 and standard with the peers
#   experiment:<name>   any conf/experiment/<name>.yaml sweep (its CSV lands in $OUT/<name>.csv)
#   cp_tests context parallelism (needs 2 GPUs): tests/test_context_parallel.py (torchrun, NCCL,
#            against one GPU and float64)
#   cp_bench the ring timed on 1 and 2 GPUs into $OUT/cp.csv and drawn
#            (experiments/context_parallel.py; CP_SEQLENS, default 8k..128k; CP_ITERS)
#   sweep_gpus  a Hydra multirun spread over every visible GPU (hydra/launcher=gpus)
#   doors    the places attention is called from, against the real torch and transformers:
#            tests/test_flash_attn_api.py, test_integrations.py, test_torch_compile.py, then
#            experiments/integrations.py (a Llama's training step and generate() beside SDPA)
#   dropout  dropout on P (issue 59): tests/test_dropout.py and the torch / transformers doors' dropout
#            tests on the GPU, then its cost (experiments/score_terms.py --cases plain,dropout: fa2
#            with and without dropout_p=0.1, SDPA's flash backend with and without its own)
#   mods_tests  tests/test_mods.py and test_block_masks.py on the GPU, failures rerun in one process
#   mods     score_mod / mask_mod: fa2 with a mod against its built-in, its plain mask and
#            FlexAttention (experiments/mods.py)
#   first_call  a new process's import, first call and the calls after it, cold and warm cache
#            (experiments/first_call.py)
#   kvcache  flash_attn_with_kvcache's options and the paged prefill (issue 62): tests/test_decode.py,
#            the flash_attn door's kvcache and paged tests, the compiled decode operator and the
#            transformers generation tests on the GPU, then experiments/decode_options.py --prefill
#            (each option's cost beside plain decode, d=256 against the copy rate, paged against
#            contiguous prefill)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Compiled kernels kept between processes (common/host/kernel_cache.py, docs/compile_cache.md): a
# sweep compiles each configuration once, not once per job. The cache is on by default (in
# ~/.cache/flash-numba); the check keeps its own in .kcache/ unless FA_KERNEL_CACHE says otherwise.
# Keyed by the source, so an edit never loads a stale kernel.
export FA_KERNEL_CACHE=${FA_KERNEL_CACHE:-$PWD/.kcache}
steps=${*:-tests compile quick grid}
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv \
  > "$OUT/gpu.txt" 2>&1
for step in $steps; do
  start=$(date +%s)
  case $step in
    tests)
      if [ -n "${TESTS:-}" ]; then
        timeout "${TESTS_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider --durations=12 $TESTS > "$OUT/tests.log" 2>&1 || status=1
        tail -3 "$OUT/tests.log"
      else
        B=tests/test_backward.py O=tests/test_backward_options.py V=tests/test_variants.py
        groups=("misc|tests/test_ptx.py tests/test_tiles.py tests/test_errors.py tests/test_arrays.py tests/test_config.py tests/test_reference.py"
                "bwd_ref_fa2_64|$B -k match_reference and fa2 and 64" "bwd_ref_fa2_128|$B -k match_reference and fa2 and 128"
                "bwd_ref_fa1_64|$B -k match_reference and fa1 and 64" "bwd_ref_fa1_128|$B -k match_reference and fa1 and 128"
                "bwd_ref_standard|$B -k match_reference and standard"
                "bwd_shapes_a|$B -k grouped or rectangular" "bwd_shapes_b|$B -k deterministic or autograd or profile_script"
                "bwd_options_a|$O -k separate" "bwd_options_b|$O -k query_warps and not dq_query"
                "bwd_options_c|$O -k dq_query" "bwd_options_d|$O -k not separate and not query_warps"
                "bwd_real_64|$B -k real_size and 64" "bwd_real_128|$B -k real_size and 128"
                "bwd_protocol_64|$B -k protocol and 64" "bwd_protocol_128|$B -k protocol and 128"
                "fwd_fa2_64|$V -k fa2 and 64" "fwd_fa2_128|$V -k fa2 and 128"
                "fwd_fa1_64|$V -k fa1 and 64" "fwd_fa1_128|$V -k fa1 and 128" "fwd_rest|$V -k not fa2 and not fa1"
                "graphs_sm90|tests/test_graphs.py tests/test_sm90.py")
        pids=()
        for g in "${groups[@]}"; do
          name=${g%%|*} spec=${g#*|}
          if [[ $spec == *" -k "* ]]; then args=("${spec%% -k *}" -k "${spec#* -k }"); else args=($spec); fi
          timeout "${TESTS_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider "${args[@]}" \
            > "$OUT/tests_$name.log" 2>&1 &
          pids+=($!)
        done
        for pid in "${pids[@]}"; do wait "$pid" || status=1; done
        for g in "${groups[@]}"; do name=${g%%|*}; echo "$name: $(tail -1 "$OUT/tests_$name.log")"; done
        grep -h "^FAILED\|^ERROR" "$OUT"/tests_*.log | head -20
      fi ;;
    bwd_fa2|bwd_other)
      filter=$([ "$step" = bwd_fa2 ] && echo "fa2 and not protocol" || echo "not fa2 or protocol")
      timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider --durations=12 \
        tests/test_backward.py tests/test_backward_options.py -k "$filter" > "$OUT/$step.log" 2>&1 || status=1
      tail -3 "$OUT/$step.log" ;;
    bwd_ncu)
      # ncu sections of fa2's backward (both dQ paths) and SDPA's flash backward, one launch each
      # after a warm-up: BWD_NCU="<head_dim> <seqlen> <causal 0|1>" (default d=128, 4k, not causal)
      ncu --clock-control none -k regex:"fa2_backward|flash_bwd" --csv --page details \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        python3 experiments/backward_profile.py ${BWD_NCU:-128 4096 0} \
        > "$OUT/bwd_ncu.csv" 2> "$OUT/bwd_ncu.log" || status=1
      tail -3 "$OUT/bwd_ncu.log"; wc -l "$OUT/bwd_ncu.csv" ;;
    decode)
      # three pytest processes at once (cold compiles dominate; the d=128 group compiles the timed
      # kernels into FA_KERNEL_CACHE for the timing after it), then the timing
      groups=("ref|matches_reference" "rest|not matches_reference and not head_dim_128 and not graph and not load"
              "d128|head_dim_128 or graph or load")
      pids=()
      for g in "${groups[@]}"; do
        timeout "${TESTS_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider --durations=5 -m "not slow" \
          tests/test_decode.py -k "${g#*|}" > "$OUT/tests_decode_${g%%|*}.log" 2>&1 &
        pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid" || status=1; done
      for g in "${groups[@]}"; do echo "decode ${g%%|*}: $(tail -1 "$OUT/tests_decode_${g%%|*}.log")"; done
      grep -h "^FAILED\|^ERROR" "$OUT"/tests_decode_*.log | head -20
      timeout "${DECODE_TIMEOUT:-240}" python3 experiments/decode.py --only-decode \
        --batches "${DECODE_BATCHES:-1,4,8}" --lengths "${DECODE_LENGTHS:-16384,131072}" \
        --csv "$OUT/decode.csv" > "$OUT/decode.log" 2>&1 || status=1
      grep -h "^B=\|copy bandwidth\|Error" "$OUT/decode.log" ;;
    memcheck)
      timeout "${TESTS_TIMEOUT:-900}" compute-sanitizer --tool memcheck --report-api-errors no \
        python3 experiments/every_kernel.py > "$OUT/memcheck.log" 2>&1 || status=1
      tail -3 "$OUT/memcheck.log" ;;
    compile)
      # every target (the CPU suite compiles one of each pair of twins), in parallel, then the
      # suite's assertions on all of them
      python3 -m experiments.compile_report --jobs "$(nproc)" > "$OUT/compile_report.txt" 2>&1 || status=1
      cat "$OUT/compile_report.txt"
      FA_COMPILE_ALL=1 python3 -m pytest -q -p no:cacheprovider tests/test_compile.py \
        > "$OUT/tests_compile.log" 2>&1 || status=1
      tail -2 "$OUT/tests_compile.log" ;;
    fa3)
      # fa3 and the sm90 layer on the GPU: the instructions against NumPy, fa3 against float64
      # (every case, option and library, masks, FP8, packed batches), bitwise repeatability
      timeout "${TESTS_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider -p no:benchmark \
        -n "${FA3_WORKERS:-8}" --durations=8 tests/test_sm90.py tests/test_variants.py \
        tests/test_masks.py tests/test_fp8.py tests/test_varlen.py -k "sm90 or fa3" \
        > "$OUT/tests_fa3.log" 2>&1 || status=1
      tail -3 "$OUT/tests_fa3.log"; grep -h "^FAILED\|^ERROR" "$OUT/tests_fa3.log" | head -20 ;;
    fa3_quick)
      # fa3 beside fa2 and the SDPA peers (timed in the fa3 jobs): bf16, d 64/128, causal and not
      rm -rf /tmp/fa3_quick
      python3 experiments/run.py -m variant=fa3,fa2 problem.head_dim=64,128 \
        problem.causal=false,true problem.seqlen=${FA3_SEQLENS:-4096,16384} \
        'bench.peer_variants=[fa3]' hydra.sweep.dir=/tmp/fa3_quick > "$OUT/fa3_quick.log" 2>&1 || status=1
      cp /tmp/fa3_quick/results.csv "$OUT/fa3_quick.csv" 2>/dev/null ;;
    quick)
      rm -rf /tmp/fa_quick
      python3 experiments/run.py -m problem.head_dim=64,128 problem.causal=false,true \
        problem.seqlen=4096 hydra.sweep.dir=/tmp/fa_quick > "$OUT/quick.log" 2>&1 || status=1
      cp /tmp/fa_quick/results.csv "$OUT/quick.csv" 2>/dev/null ;;
    grid)
      rm -rf /tmp/fa_grid
      python3 experiments/run.py -m experiment=fa2_grid hydra.sweep.dir=/tmp/fa_grid \
        > "$OUT/grid.log" 2>&1 || status=1
      cp /tmp/fa_grid/results.csv "$OUT/grid.csv" 2>/dev/null ;;
    experiment:*)
      name=${step#experiment:}
      rm -rf "/tmp/fa_$name"
      python3 experiments/run.py -m "experiment=$name" "hydra.sweep.dir=/tmp/fa_$name" \
        > "$OUT/$name.log" 2>&1 || status=1
      cp "/tmp/fa_$name/results.csv" "$OUT/$name.csv" 2>/dev/null
      echo "== $name"; python3 experiments/summarize.py --options "$OUT/$name.csv" ;;
    cp_tests)
      timeout "${TESTS_TIMEOUT:-600}" python3 -m pytest -q -p no:cacheprovider -rs \
        tests/test_context_parallel.py > "$OUT/tests_cp.log" 2>&1 || status=1
      tail -3 "$OUT/tests_cp.log"; grep -h "^FAILED\|^ERROR" "$OUT/tests_cp.log" | head ;;
    cp_bench)
      for w in 1 2; do
        timeout "${CP_TIMEOUT:-300}" python3 -m torch.distributed.run --standalone --nproc_per_node=$w \
          experiments/context_parallel.py bench --seqlens "${CP_SEQLENS:-8192,16384,32768,65536,131072}" \
          --iters "${CP_ITERS:-5}" --csv "$OUT/cp.csv" > "$OUT/cp_bench_$w.log" 2>&1 || status=1
        grep "^W=" "$OUT/cp_bench_$w.log"; tail -2 "$OUT/cp_bench_$w.log"
      done
      python3 experiments/context_parallel.py plot "$OUT/cp.csv" || status=1 ;;
    sweep_gpus)
      rm -rf /tmp/fa_sweep
      timeout "${SWEEP_TIMEOUT:-300}" python3 experiments/run.py -m hydra/launcher=gpus \
        variant=fa2,fa3 problem.seqlen=4096,16384 'bench.peers=[sdpa_cudnn]' \
        hydra.sweep.dir=/tmp/fa_sweep > "$OUT/sweep_gpus.log" 2>&1 || status=1
      grep -h "runs on GPU" "$OUT/sweep_gpus.log" | sort | uniq -c
      cp /tmp/fa_sweep/results.csv "$OUT/sweep_gpus.csv" 2>/dev/null
      python3 experiments/summarize.py "$OUT/sweep_gpus.csv" ;;
    doors)
      timeout "${TESTS_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider --durations=10 \
        tests/test_flash_attn_api.py tests/test_integrations.py tests/test_torch_compile.py \
        > "$OUT/doors_tests.log" 2>&1 || status=1
      tail -3 "$OUT/doors_tests.log"
      timeout "${DOORS_TIMEOUT:-600}" python3 experiments/integrations.py ${DOORS_ARGS:-} \
        > "$OUT/integrations.txt" 2>&1 || status=1
      cat "$OUT/integrations.txt" ;;
    dropout)
      # -v: each test's result as it ends (xdist runs that use torch have not exited after their
      # last test on the GPU host: docs/testing.md), so a timeout still leaves the names
      timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -v -p no:cacheprovider -p no:benchmark \
        -n "${DROPOUT_WORKERS:-6}" -rfE tests/test_dropout.py \
        "tests/test_flash_attn_api.py::test_torch_dropout_is_exact_and_reproducible" \
        "tests/test_integrations.py::test_transformers_attention_dropout_trains" \
        > "$OUT/dropout_tests.log" 2>&1 || status=1
      grep -E "FAILED|ERROR|passed|failed" "$OUT/dropout_tests.log" | tail -12
      echo "$(grep -c ' PASSED ' "$OUT/dropout_tests.log") passed so far" 
      timeout "${DROPOUT_TIMEOUT:-420}" python3 experiments/score_terms.py --variants fa2 \
        --cases plain,dropout --seqlens "${DROPOUT_SEQLENS:-4096,16384}" --csv "$OUT/dropout.csv" \
        > "$OUT/dropout_cost.txt" 2>&1 || status=1
      tail -20 "$OUT/dropout_cost.txt" ;;
    mods_tests)
      # tests/test_mods.py and test_block_masks.py on the GPU, -v under xdist (each result as it
      # ends: docs/testing.md's hang after the last test loses the summary), then the failures
      # again in one process, where their tracebacks are printed
      timeout "${TESTS_TIMEOUT:-360}" python3 -m pytest -v -p no:cacheprovider -p no:benchmark \
        -n "${MODS_WORKERS:-8}" -rfE --tb=short tests/test_mods.py tests/test_block_masks.py \
        > "$OUT/mods_tests.log" 2>&1 || status=1
      echo "$(grep -c ' PASSED ' "$OUT/mods_tests.log") passed"
      failed=$(grep -oE "(FAILED|ERROR) tests/[^ ]+" "$OUT/mods_tests.log" | awk '{print $2}' | sort -u)
      if [ -n "$failed" ]; then
        echo "$failed"
        timeout "${RERUN_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -p no:benchmark \
          -p no:xdist -rfE --tb=long $failed > "$OUT/mods_failures.log" 2>&1
        grep -E "^E |Error|^FAILED" "$OUT/mods_failures.log" | head -40
      fi ;;
    mods)
      timeout "${MODS_TIMEOUT:-540}" python3 experiments/mods.py --csv "$OUT/mods.csv" ${MODS_ARGS:-} \
        > "$OUT/mods.txt" 2>&1 || status=1
      tail -20 "$OUT/mods.txt" ;;
    kvcache)
      timeout "${TESTS_TIMEOUT:-330}" python3 -m pytest -v -p no:cacheprovider -p no:benchmark \
        -n "${KVCACHE_WORKERS:-12}" -rfE --tb=short tests/test_decode.py \
        tests/test_flash_attn_api.py -k "not dropout" \
        "tests/test_torch_compile.py::test_compiled_decode_step_is_the_decode_kernel" \
        "tests/test_integrations.py::test_declared_cu_seqlens_are_not_read_back" \
        "tests/test_integrations.py::test_transformers_generation_teacher_forced" \
        > "$OUT/kvcache_tests.log" 2>&1 || status=1
      echo "$(grep -c ' PASSED' "$OUT/kvcache_tests.log") passed"
      grep -E " (FAILED|ERROR)" "$OUT/kvcache_tests.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | head -20
      timeout "${KVCACHE_TIMEOUT:-240}" python3 experiments/decode_options.py --prefill --lengths 16384 \
        --csv "$OUT/decode_options.csv" > "$OUT/decode_options.txt" 2>&1 || status=1
      tail -30 "$OUT/decode_options.txt" ;;
    first_call)
      timeout "${FIRST_CALL_TIMEOUT:-600}" python3 experiments/first_call.py ${FIRST_CALL_ARGS:-} \
        > "$OUT/first_call.txt" 2>&1 || status=1
      cat "$OUT/first_call.txt" ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
  echo "== $step: $(( $(date +%s) - start )) s"
done
for f in "$OUT"/quick.csv "$OUT"/grid.csv "$OUT"/fa3_quick.csv; do
  [ -f "$f" ] && { echo "== $(basename "$f")"; python3 experiments/summarize.py "$f" | tee "$OUT/summary_$(basename "$f" .csv).txt"; }
done
exit $status
