#!/usr/bin/env bash
# Every benchmark behind the figures in README.md and docs/benchmarks/, in one sequential run.
# Run on a quiet machine (nothing else using the cores): ./bench/run_all.sh [OUT_DIR]
# Steps can be picked: STEPS="plain humaneval full" ./bench/run_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/benchmarks/$(date +%F)}
STEPS=${STEPS:-plain humaneval full advise two_process stability concurrency verify_cost kernels fused_paths int4 int4_long draft_window draft_cost load compile}
V=.venv/bin/verispec
PY=.venv/bin/python
PAIR=(--model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --dtype bfloat16 --weights dense
      --draft-weights int8)
INT4_PAIR=(--model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --dtype bfloat16 --weights int4
           --draft-weights int4-all)
# The speculation settings these figures were measured with, for whatever a method string leaves out
# (fixed k, full draft head, whole prompt, no confidence stop), not verispec's current defaults.
SPEC=(--k-policy fixed --draft-vocab 0 --draft-window 0 --confidence 0)
# The retrieval drafter's datastore: this Python's standard library (code), built once outside the repo.
STORE=${VERISPEC_HOME:-$HOME/.cache/verispec}/datastores/python-stdlib
mkdir -p "$OUT"
for step in $STEPS; do
  echo "== $step $(date +%T)"
  case $step in
    plain)        # issue 2: plain decoding vs transformers, and the bandwidth roofline
      $PY bench/plain_decode.py --dtype bfloat16 --tokens 128 --json "$OUT/plain_decode.json" | tee "$OUT/plain_decode.md" ;;
    humaneval)    # issue 3: first 20 HumanEval prompts, 128 new tokens, greedy
      $V bench "${PAIR[@]}" "${SPEC[@]}" --methods none,draft,draft:policy=cost,ngram,hybrid --dataset humaneval --n 20 \
        --max-tokens 128 -k 5 --no-progress --out "$OUT/humaneval" ;;
    full)         # issues 4-6: Spec-Bench (5 per category) + 20 HumanEval, with transformers as peers
      $V bench "${PAIR[@]}" "${SPEC[@]}" --methods none,draft,draft:k=3,draft:policy=cost,ngram,hybrid \
        --dataset spec_bench,humaneval --per-category 5 --n 20 --seed 0 --max-tokens 48 -k 5 --peers hf \
        --no-progress --out "$OUT/full" ;;
    advise)       # issue 5: measured costs, predicted vs measured speedup
      mkdir -p "$OUT/advise"; $V advise "${PAIR[@]}" --k-max 16 --max-tokens 64 --out "$OUT/advise" | tee "$OUT/advise/advise.txt" ;;
    two_process)  # issue 9: draft and target in one process vs one process each
      $PY bench/two_process.py --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --dtype bfloat16 --max-tokens 64 --prompts 2 --json "$OUT/two_process.json" | tee "$OUT/two_process.md" ;;
    concurrency)  # issue 7: a concurrency sweep (1-4 with 8 requests, 8-16 with 32; all but fixed k 3 runs each)
      $PY bench/concurrency.py --dtype bfloat16 --draft-weights int4-all --max-tokens 48 --concurrency 1,2,4 \
        --requests 8 --repeats 3 --once fixed --out "$OUT/concurrency"
      $PY bench/concurrency.py --dtype bfloat16 --draft-weights int4-all --max-tokens 48 --concurrency 8,16 \
        --requests 32 --repeats 3 --once fixed --out "$OUT/concurrency-8-16" ;;
    stability)    # issue 6: odd inputs, plain vs speculative
      $V bench "${PAIR[@]}" "${SPEC[@]}" --methods draft,ngram --dataset humaneval --n 1 --max-tokens 16 --max-len 1024 \
        --stability --no-progress --out "$OUT/stability" ;;
    verify_cost)  # issue 10: the whole target forward's t(M)/t(1) per weight format, with a plot
      mkdir -p "$OUT/verify_cost"; $PY bench/verify_cost.py --formats dense,int8,int4 --reps 5 --decode-tokens 32 --out "$OUT/verify_cost" \
        | tee "$OUT/verify_cost/verify_cost.md" ;;
    kernels)      # issue 10: per-projection t(M), stock PyTorch kernels vs verispec's small-M kernels
      $PY bench/kernel_bench.py | tee "$OUT/kernels.md" ;;
    fused_paths)  # issue 10: fused attend vs SDPA in the prefill, lean vs module projection calls in decode
      $PY bench/fused_paths.py --json "$OUT/fused_paths.json" | tee "$OUT/fused_paths.md" ;;
    int4)         # issues 4, 5, 10: int4 pair, every drafter, the cost policy, llama.cpp as the peer
      test -f "$STORE/meta.json" || $V datastore build "$($PY -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"/*.py \
        -o "$STORE" --model qwen2.5-coder-1.5b-instruct
      $V bench "${INT4_PAIR[@]}" "${SPEC[@]}" --methods none,draft,draft:k=3,draft:policy=cost,draft:policy=cost,vocab=32768,ngram,hybrid,hybrid:policy=cost,hybrid:policy=cost,vocab=32768,retrieval:datastore="$STORE" \
        --dataset spec_bench,humaneval --per-category 3 --n 10 --seed 0 --max-tokens 64 -k 5 --peers llamacpp \
        --no-progress --out "$OUT/int4" ;;
    int4_long)    # issue 10: longer answers (256 new tokens, nearer Spec-Bench's protocol, where prefill weighs
                  # little), the best methods of the int4 step against llama.cpp plain; 3 repeats (median per prompt)
      $V bench "${INT4_PAIR[@]}" "${SPEC[@]}" --methods none,hybrid:policy=cost,vocab=32768,confidence=0.3,hybrid:policy=cost,vocab=32768,confidence=0.3,window=256 \
        --dataset spec_bench,humaneval --per-category 3 --n 10 --seed 0 --max-tokens 256 -k 5 --repeats 3 \
        --peers llamacpp --peer-methods llamacpp-plain --no-progress --out "$OUT/int4_long" ;;
    draft_window) # issue 10: how much of a long prompt the draft reads (summaries, RAG) and what it costs on code
      H=hybrid:policy=cost,vocab=32768,confidence=0.3
      $V bench "${INT4_PAIR[@]}" "${SPEC[@]}" --methods none,$H,$H,window=64,$H,window=128,$H,window=256 \
        --dataset spec_bench,humaneval --per-category 3 --seed 0 --categories rag,summarization --n 10 \
        --max-tokens 256 -k 5 --no-progress --out "$OUT/draft_window" ;;
    draft_cost)   # issue 4: the draft cost ratio c for dense, int8 and int4 drafts (bf16 and int4 targets)
      { $PY bench/draft_cost.py --weights dense --draft-formats dense,int8,int4,int4-all
        $PY bench/draft_cost.py --weights int4 --draft-formats int8,int4,int4-all; } | tee "$OUT/draft_cost.md" ;;
    load)         # issue 10: loading the targets from the converted cache
      $PY bench/load_time.py --formats int4,dense | tee "$OUT/load_time.md" ;;
    compile)      # issue 5: eager vs --compile side by side (bf16 target + int8 draft, then the int4 pair)
      $PY bench/compile_vs_eager.py --json "$OUT/compile_vs_eager.json" | tee "$OUT/compile_vs_eager.md"
      $PY bench/compile_vs_eager.py --weights int4 --draft-weights int4 --json "$OUT/compile_vs_eager_int4.json" \
        | tee "$OUT/compile_vs_eager_int4.md" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
echo "== done $(date +%T)"
