#!/usr/bin/env bash
# Every benchmark behind docs/results.md, in one sequential run, then the page and README's table
# rendered from the reports. Run on a quiet machine (nothing else using the cores):
#   ./bench/run_all.sh [OUT_DIR]                 (default docs/results: a rerun replaces it)
#   STEPS="report int4_long" ./bench/run_all.sh  (only those steps; the others' reports stay)
# Each step writes OUT_DIR/<step>/ (removed first), with a machine.json of the host and date.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results}
STEPS=${STEPS:-report ablation structured processing code_edit trees stability concurrency prefix_reuse server sampling verify_cost kernels q8 quality advise fused_paths int4_long predicted predicted_polyglot peer_spread}
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
mkdir -p "$OUT"
for step in $STEPS; do
  echo "== $step $(date +%T)"
  D="$OUT/$step"
  rm -rf "$D"
  mkdir -p "$D"
  $PY -c 'import json; from verispec.bench.hardware import machine; print(json.dumps(machine()))' > "$D/machine.json"
  case $step in
    report)       # the report split (Spec-Bench seed 1, HumanEval 100-119, chat-formatted coding requests; no
                  # default was tuned on it): verispec's defaults against plain and the fixed k they choose among
      $V bench "${INT4_PAIR[@]}" --methods none,hybrid,hybrid:policy=fixed,k=2,hybrid:policy=fixed,k=3,hybrid:policy=fixed,k=5 \
        --dataset spec_bench,humaneval:100-119,chat_code --per-category 2 --seed 1 --max-tokens 128 --repeats 1 \
        --no-progress --out "$D" ;;
    ablation)     # the tune split (Spec-Bench seed 0, HumanEval 0-5, code edits on HumanEval 0-5): verispec's
                  # defaults against the same with one rule of the cost policy switched off, 2 repeats
      $V bench "${INT4_PAIR[@]}" --methods none,hybrid,hybrid:off=probes,hybrid:off=lookup_cut,hybrid:off=margin \
        --dataset spec_bench,humaneval,code_edit_tune --per-category 2 --n 6 --seed 0 --max-tokens 128 --repeats 2 \
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
    concurrency)  # the int4 pair under verispec's defaults at 1-4 clients (2 repeats) and 8-16 (one run), each
                  # level at least two waves of requests, Spec-Bench prompts of the report split; "alone" runs the
                  # same requests one at a time
      $V bench "${INT4_PAIR[@]}" --methods none,hybrid --clients alone,1,2,4 --repeats 2 --dataset spec_bench \
        --per-category 1 --seed 1 --max-tokens 64 --max-len 2048 --no-progress --out "$D/1-4"
      $V bench "${INT4_PAIR[@]}" --methods none,hybrid --clients 8,16 --dataset spec_bench \
        --per-category 2 --seed 1 --max-tokens 64 --max-len 2048 --no-progress --out "$D/8-16" ;;
    structured)   # structured outputs: the packaged json_extract requests (extraction with a JSON schema each),
                  # answers constrained to their schema against unconstrained, plain and under the defaults, with
                  # schema validity and the constraint's time per token (no setting was tuned on these prompts)
      $V bench "${INT4_PAIR[@]}" --methods none,none:constrain=1,hybrid,hybrid:constrain=1 --dataset json_extract --n 30 \
        --max-tokens 512 --repeats 1 --no-progress --out "$D"
      # the grammar engines' mask time per token (xgrammar and outlines-core measured where installed beside)
      $PY -m verispec.bench.grammar_engines --out "$D/engines" ;;
    processing)   # what penalties and logprobs cost plain decoding (report split, Spec-Bench seed 1), 3 repeats
      $V bench "${INT4_PAIR[@]}" --methods none,none:presence_penalty=0.5,frequency_penalty=0.5,none:logprobs=5 \
        --dataset spec_bench --per-category 2 --seed 1 --max-tokens 256 --repeats 3 --no-progress --out "$D" ;;
    stability)    # odd inputs (context limits, markup, emoji, control characters), plain against speculative
      $V bench "${PAIR[@]}" "${SPEC[@]}" --methods draft,ngram --dataset humaneval --n 1 --max-tokens 16 --max-len 1024 \
        --stability --no-progress --out "$D" ;;
    prefix_reuse) # a chat's follow-up turn with prefix reuse and without: time to first token, same outputs
      $PY bench/prefix_reuse.py --out "$D" ;;
    server)       # `verispec serve` on the pair with its defaults: launch to ready, then the first requests
      $PY bench/server_ready.py --max-tokens 128 --out "$D" ;;
    replicas)     # opt-in (STEPS=replicas; needs the replicas extra): `verispec serve --replicas 2`, the router's
                  # time per request and launch to ready (docs/replicas.md)
      $PY bench/replicas.py router --out "$D" && $PY bench/replicas.py ready --model smollm2-135m-instruct --out "$D" ;;
    sampling)     # plain decoding greedy, at temperature 0.8 and with top-p 0.9, and the defaults sampled: tokens/s
                  # side by side and the verification stage's share of the scoring stage
      T=temperature=0.8
      $V bench "${INT4_PAIR[@]}" --methods none,none:$T,none:$T,top_p=0.9,hybrid,hybrid:$T,top_p=0.9 \
        --dataset spec_bench,chat_code --per-category 1 --seed 1 --n 4 --max-tokens 128 --repeats 3 --max-len 2048 \
        --no-progress --out "$D" ;;
    verify_cost)  # the whole target forward's t(M)/t(1) per weight format and kernels, with a plot
      $PY bench/verify_cost.py --formats dense,int8,int4 --kernels stock,auto,q8 --dtype auto --m-max 16 --reps 5 \
        --decode-tokens 32 --out "$D" \
        | tee "$D/verify_cost.md" ;;
    kernels)      # per-projection t(M): PyTorch's stock kernels against verispec's small-M kernels (and q8)
      $PY bench/kernel_bench.py --m-max 16 | tee "$D/kernels.md" ;;
    q8)           # --kernels auto (the activation path it chooses here) against bf16 activations, plain and the
                  # defaults, one engine per kernels; the report split's Spec-Bench sample and the first 4 of the others
      $V bench "${INT4_PAIR[@]}" --methods none,hybrid,none:kernels=bf16,hybrid:kernels=bf16 \
        --dataset spec_bench,humaneval:100-103,chat_code,code_edit --per-category 1 --seed 1 --n 4 --max-tokens 128 \
        --repeats 2 --max-len 2048 --no-progress --out "$D" ;;
    quality)      # the kernels' quality gate: perplexity under bf16 and 8-bit activations and llama.cpp, pass@1
      $V bench --quality --model qwen2.5-coder-1.5b-instruct --weights int4 --out "$D" ;;
    advise)       # `verispec advise` on the report split: calibrate, predict every drafter and k, measure the best
                  # predicted and the defaults (and the other activation path), recommend the measured best
      $V advise "${INT4_PAIR[@]}" --dataset spec_bench,humaneval:100-119,chat_code --per-category 2 --seed 1 \
        --n 12 --max-tokens 128 --out "$D" > "$D/advise.txt" ;;
    fused_paths)  # fused attend against SDPA in the prefill; lean against module projection calls in decode
      $PY bench/fused_paths.py --json "$D/fused_paths.json" | tee "$D/fused_paths.md" ;;
    int4_long)    # the report split plus the code edits, 256 new tokens (where the prefill weighs little): plain
                  # decoding and the defaults (kernels auto) against llama.cpp plain decoding on the same GGUF
      $V bench "${INT4_PAIR[@]}" --methods none,hybrid \
        --dataset spec_bench,humaneval:100-119,chat_code,code_edit --per-category 2 --seed 1 --max-tokens 256 \
        --peers llamacpp --peer-methods llamacpp-plain --no-progress --out "$D" ;;
    predicted|predicted_polyglot) # code edits with their quoted code as the predicted output (and another's, an
                  # unrelated one) against the defaults without one and llama.cpp plain; answers run to their end
      [ "$step" = predicted ] && SET=code_edit || SET=code_edit_polyglot
      $V bench "${INT4_PAIR[@]}" --kernels q8 --methods none,hybrid,hybrid:predict=1,hybrid:predict=other \
        --dataset "$SET" --max-tokens 1024 --peers llamacpp --peer-methods llamacpp-plain --no-progress --out "$D" ;;
    peer_spread)  # the spread of the ratios nearest their goals: llama.cpp interleaved prompt by prompt, 3 repeats
      $V bench "${INT4_PAIR[@]}" --kernels q8 --methods none,hybrid,hybrid:lookup=suffix,k=16,global=0 \
        --dataset chat_code,spec_bench --categories translation,summarization --per-category 2 --seed 1 \
        --max-tokens 256 --repeats 3 --peers llamacpp --peer-methods llamacpp-plain --no-progress --out "$D" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
# Lean, compact JSON and small plots redrawn from it, then docs/results.md and README's table from the reports.
$PY -m verispec.bench.render --tidy "$OUT"
echo "== done $(date +%T)"
