#!/usr/bin/env bash
# Every benchmark behind docs/results.md, in one sequential run, then the page and README's table
# rendered from the reports. Run on a quiet machine (nothing else using the cores):
#   ./bench/run_all.sh [OUT_DIR]                 (default docs/results: a rerun replaces it)
#   STEPS="plain humaneval" ./bench/run_all.sh   (only those steps; the others' reports stay)
# Each step writes OUT_DIR/<step>/ (removed first), with a machine.json of the host and date.
# The gpu step (bench/gpu_check.py) needs a CUDA device and is not in the default STEPS.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results}
STEPS=${STEPS:-plain humaneval full report code_edit trees advise two_process stability concurrency prefix_reuse server sampling verify_cost kernels q8 fused_paths int4 int4_long int4_long_q8 predicted predicted_polyglot peer_spread draft_window draft_cost load compile}
V=.venv/bin/verispec
PY=.venv/bin/python
PAIR=(--model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --dtype bfloat16 --weights dense
      --draft-weights int8)
# auto dtype: bf16 where the CPU computes it natively, else fp32 (the int4 kernels quantize activations anyway).
INT4_PAIR=(--model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --dtype auto --weights int4
           --draft-weights int4-all)
# The speculation settings these figures were measured with, for whatever a method string leaves out
# (fixed k, full draft head, whole prompt, no confidence stop), not verispec's current defaults.
SPEC=(--k-policy fixed --draft-vocab 0 --draft-window 0 --confidence 0)
# The retrieval drafter's datastore: this Python's standard library (code), built once outside the repo.
STORE=${VERISPEC_HOME:-$HOME/.cache/verispec}/datastores/python-stdlib
mkdir -p "$OUT"
for step in $STEPS; do
  echo "== $step $(date +%T)"
  D="$OUT/$step"
  rm -rf "$D"
  mkdir -p "$D"
  $PY -c 'import json; from verispec.bench.hardware import machine; print(json.dumps(machine()))' > "$D/machine.json"
  case $step in
    plain)        # plain decoding of the bf16 target against transformers, and the memory-bandwidth roofline
      $PY bench/plain_decode.py --dtype bfloat16 --tokens 128 --json "$D/plain_decode.json" | tee "$D/plain_decode.md" ;;
    humaneval)    # bf16 target on code: first 20 HumanEval prompts, 128 new tokens, greedy
      $V bench "${PAIR[@]}" "${SPEC[@]}" --methods none,draft,draft:policy=cost,ngram,hybrid --dataset humaneval --n 20 \
        --max-tokens 128 -k 5 --no-progress --out "$D" ;;
    full)         # bf16 target on Spec-Bench (5 per category) + 20 HumanEval, transformers as peers
      $V bench "${PAIR[@]}" "${SPEC[@]}" --methods none,draft,draft:k=3,draft:policy=cost,ngram,hybrid \
        --dataset spec_bench,humaneval --per-category 5 --n 20 --seed 0 --max-tokens 48 -k 5 --peers hf \
        --no-progress --out "$D" ;;
    report)       # the report split (Spec-Bench seed 1, HumanEval 100-119, chat-formatted coding requests; no
                  # default was tuned on it): verispec's defaults against plain and the fixed k they choose among
      $V bench "${INT4_PAIR[@]}" --methods none,hybrid,hybrid:policy=fixed,k=2,hybrid:policy=fixed,k=3,hybrid:policy=fixed,k=5 \
        --dataset spec_bench,humaneval:100-119,chat_code --per-category 2 --seed 1 --max-tokens 128 --repeats 2 \
        --no-progress --out "$D" ;;
    code_edit)    # requests to rewrite a quoted function, where most of the answer repeats the prompt: the
                  # lookups (n-gram, suffix decoding) against the defaults; 256 new tokens
      # global=0: each request matches only its own tokens, so no figure depends on the order of the prompts
      $V bench "${INT4_PAIR[@]}" --methods none,hybrid,ngram:k=16,suffix:k=16,global=0,hybrid:lookup=suffix,k=16,global=0 \
        --dataset code_edit --max-tokens 256 --no-progress --out "$D" ;;
    trees)        # suffix drafts as token trees (width 3) against chains, in the hybrid, on the report split's
                  # code edits and chat-formatted coding requests; 256 new tokens
      $V bench "${INT4_PAIR[@]}" --methods none,hybrid:lookup=suffix,global=0,hybrid:lookup=suffix,global=0,width=3 \
        --dataset code_edit,chat_code --max-tokens 256 --no-progress --out "$D" ;;
    advise)       # measured costs and acceptance, predicted against measured speedup
      $V advise "${PAIR[@]}" --k-max 16 --max-tokens 64 --out "$D" | tee "$D/advise.txt" ;;
    two_process)  # draft and target in one process against one process each
      $PY bench/two_process.py --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --dtype bfloat16 --max-tokens 64 --prompts 2 --json "$D/two_process.json" | tee "$D/two_process.md" ;;
    concurrency)  # the int4 pair under verispec's defaults at 1-4 clients (8 requests, 3 repeats) and 8-16 (two
                  # waves of requests, one run), Spec-Bench prompts of the report split; "alone" runs the same
                  # requests one at a time
      $PY bench/concurrency.py --weights int4 --draft-weights int4-all --max-tokens 64 --concurrency 1,2,4 \
        --requests 8 --repeats 3 --seed 1 --modes plain,policy,alone --out "$D/1-4"
      $PY bench/concurrency.py --weights int4 --draft-weights int4-all --max-tokens 64 --concurrency 8,16 \
        --requests 16 --repeats 1 --seed 1 --modes plain,policy --out "$D/8-16" ;;
    stability)    # odd inputs (context limits, markup, emoji, control characters), plain against speculative
      $V bench "${PAIR[@]}" "${SPEC[@]}" --methods draft,ngram --dataset humaneval --n 1 --max-tokens 16 --max-len 1024 \
        --stability --no-progress --out "$D" ;;
    prefix_reuse) # a chat's follow-up turn with prefix reuse and without: time to first token, same outputs
      $PY bench/prefix_reuse.py --out "$D" ;;
    server)       # `verispec serve` on the pair with its defaults: launch to ready, then the first requests
      $PY bench/server_ready.py --max-tokens 128 --out "$D" ;;
    sampling)     # plain decoding greedy, at temperature 0.8 and with top-p 0.9, and the defaults sampled: tokens/s
                  # side by side and the verification stage's share of the scoring stage
      $PY bench/sampling_speed.py --max-tokens 128 --repeats 3 --out "$D" | tee "$D/sampling.txt" ;;
    verify_cost)  # the whole target forward's t(M)/t(1) per weight format and kernels, with a plot
      $PY bench/verify_cost.py --formats dense,int8,int4 --kernels stock,auto,q8 --dtype auto --m-max 16 --reps 5 \
        --decode-tokens 32 --out "$D" \
        | tee "$D/verify_cost.md" ;;
    kernels)      # per-projection t(M): PyTorch's stock kernels against verispec's small-M kernels (and q8)
      $PY bench/kernel_bench.py --m-max 16 | tee "$D/kernels.md" ;;
    q8)           # the int4 pair on 8-bit activations against the bf16 kernels, plain and the defaults
      $PY bench/q8_speed.py --max-tokens 128 --repeats 2 --out "$D" | tee "$D/q8.txt" ;;
    fused_paths)  # fused attend against SDPA in the prefill; lean against module projection calls in decode
      $PY bench/fused_paths.py --json "$D/fused_paths.json" | tee "$D/fused_paths.md" ;;
    int4)         # int4 pair: every drafter and the cost policy, llama.cpp on the same GGUF files; 64 new tokens
      test -f "$STORE/meta.json" || $V datastore build "$($PY -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"/*.py \
        -o "$STORE" --model qwen2.5-coder-1.5b-instruct
      $V bench "${INT4_PAIR[@]}" "${SPEC[@]}" --methods none,draft,draft:k=3,draft:policy=cost,draft:policy=cost,vocab=32768,ngram,hybrid,hybrid:policy=cost,hybrid:policy=cost,vocab=32768,retrieval:datastore="$STORE" \
        --dataset spec_bench,humaneval --per-category 3 --n 10 --seed 0 --max-tokens 64 -k 5 --peers llamacpp \
        --no-progress --out "$D" ;;
    int4_long)    # the report split plus the code edits, 256 new tokens (where the prefill weighs little): plain
                  # decoding, the defaults and the hybrid with the suffix lookup against llama.cpp plain decoding
                  # on the same GGUF; global=0 as in code_edit
      $V bench "${INT4_PAIR[@]}" --methods none,hybrid,hybrid:lookup=suffix,k=16,global=0 \
        --dataset spec_bench,humaneval:100-119,chat_code,code_edit --per-category 2 --seed 1 --max-tokens 256 \
        --peers llamacpp --peer-methods llamacpp-plain --no-progress --out "$D" ;;
    int4_long_q8) # the same on 8-bit activations (--kernels q8, AVX-512 VNNI); llama.cpp as it is
      $V bench "${INT4_PAIR[@]}" --kernels q8 --methods none,hybrid,hybrid:lookup=suffix,k=16,global=0 \
        --dataset spec_bench,humaneval:100-119,chat_code,code_edit --per-category 2 --seed 1 --max-tokens 256 \
        --peers llamacpp --peer-methods llamacpp-plain --no-progress --out "$D" ;;
    predicted|predicted_polyglot) # code edits with their quoted code as the predicted output (and another's, an
                  # unrelated one) against the defaults without one and llama.cpp plain; answers run to their end
      [ "$step" = predicted ] && SET=code_edit || SET=code_edit_polyglot
      $V bench "${INT4_PAIR[@]}" --kernels q8 --methods none,hybrid,hybrid:predict=1,hybrid:predict=other,none:predict=1 \
        --dataset "$SET" --max-tokens 1024 --peers llamacpp --peer-methods llamacpp-plain --no-progress --out "$D" ;;
    peer_spread)  # the spread of the ratios nearest their goals: llama.cpp interleaved prompt by prompt, 3 repeats
      $PY bench/peer_spread.py --kernels q8 --repeats 3 --out "$D" ;;
    draft_window) # how much of a long prompt the draft reads (summaries, RAG) and what it costs on code
      H=hybrid:policy=cost,vocab=32768,confidence=0.3
      $V bench "${INT4_PAIR[@]}" "${SPEC[@]}" --methods none,$H,$H,window=64,$H,window=128,$H,window=256 \
        --dataset spec_bench,humaneval --per-category 3 --seed 0 --categories rag,summarization --n 10 \
        --max-tokens 256 -k 5 --no-progress --out "$D" ;;
    draft_cost)   # the draft cost ratio c per draft weight format, with a bf16 and an int4 target
      { $PY bench/draft_cost.py --weights dense --draft-formats dense,int8,int4,int4-all
        $PY bench/draft_cost.py --weights int4 --draft-formats int8,int4,int4-all; } | tee "$D/draft_cost.md" ;;
    load)         # Engine.from_pretrained of the target from the converted cache
      $PY bench/load_time.py --formats int4,dense | tee "$D/load_time.md" ;;
    compile)      # eager against --compile side by side (bf16 target + int8 draft, then the int4 pair)
      $PY bench/compile_vs_eager.py --json "$D/compile_vs_eager.json" | tee "$D/compile_vs_eager.md"
      $PY bench/compile_vs_eager.py --weights int4 --draft-weights int4 --json "$D/compile_vs_eager_int4.json" \
        | tee "$D/compile_vs_eager_int4.md" ;;
    gpu)          # CUDA correctness checks, and verify cost, draft cost and plain decoding on real shapes
      $PY bench/gpu_check.py --out "$D" --parts checks,figures,engine_compile ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
# Compact JSON and small plots redrawn from it, then docs/results.md and README's table from the reports.
$PY bench/tidy_results.py "$OUT"
$PY bench/readme_tables.py "$OUT"
echo "== done $(date +%T)"
