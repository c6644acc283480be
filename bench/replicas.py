"""Replicas: the router's own time per request, and launch to ready of `verispec serve --replicas N`.

``router`` replays multi-turn coding chats through what the ingress does before it forwards a
request: parse the JSON body, render the conversation through the model's chat template, hash its
64-character blocks and choose a replica (:class:`~verispec.server.prefix_router.PrefixRouter`,
tables filled by the earlier turns and by periodic replica reports). Conversations share a system
prompt and paste source files (a few thousand tokens); every later turn carries the whole history.
Reports p50/p99/max per request, split into rendering and hashing + choosing, and what tokenizing
the same prompts would cost instead.

``ready`` starts `verispec serve --replicas N` as a user would and times launch to "ready on" (every
replica loaded and warmed up), then one request.

    python bench/replicas.py router [--model qwen2.5-coder-1.5b-instruct] [--replicas 4] [--chats 64]
                                    [--turns 4] [--out bench_out/replicas]
    python bench/replicas.py ready --model smollm2-135m-instruct [--replicas 2] [--out bench_out/replicas]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from verispec.bench.hardware import machine
from verispec.server.ingress import tokenizer_prompt_text
from verispec.server.metrics import percentile
from verispec.server.prefix_router import PrefixRouter, RouterConfig

SYSTEM = ("You are a careful senior Python engineer. Answer with working code, explain briefly, keep the "
          "existing style, never invent APIs, and say when something cannot be done. ") * 6


def sources() -> list[str]:
    """Source files to paste into chats: verispec's own modules."""
    root = Path(__file__).resolve().parent.parent / "verispec"
    return [p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.py")) if 2000 < p.stat().st_size < 14000]


def conversations(chats: int, turns: int, seed: int) -> list[list[dict[str, Any]]]:
    """Request bodies, turn by turn and interleaved across chats (as concurrent users would send them)."""
    rng = random.Random(seed)
    files = sources()
    bodies: list[list[dict[str, Any]]] = []
    for c in range(chats):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Review this module:\n```python\n{rng.choice(files)}\n```"}]
        chat = []
        for t in range(turns):
            chat.append({"model": "m", "messages": list(messages), "max_tokens": 256, "user": f"user-{c}"})
            answer = rng.choice(files)[:800]
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": f"Now change function number {t + 1} accordingly."}]
        bodies.append(chat)
    order = []
    for t in range(turns):
        order += [bodies[c][t] for c in rng.sample(range(chats), chats)]
    return order


def bench_router(args: argparse.Namespace) -> dict[str, Any]:
    from verispec.models.loader import load_tokenizer, open_source

    tokenizer = load_tokenizer(open_source(args.model))
    render = tokenizer_prompt_text(tokenizer)
    router = PrefixRouter(args.replicas, RouterConfig())
    held: list[set[int]] = [set() for _ in range(args.replicas)]
    for i in range(args.replicas):
        router.report(i, load=0, held=[])
    bodies = [json.dumps(b).encode() for b in conversations(args.chats, args.turns, args.seed)]
    render_s, route_s, total_s, chars, reasons = [], [], [], [], {"prefix": 0, "user": 0, "load": 0}
    in_flight: list[int] = []
    for n, body in enumerate(bodies):
        t0 = time.perf_counter()
        parsed = json.loads(body)
        text = render("chat", parsed) or ""
        t1 = time.perf_counter()
        hashes = router.hashes(text)
        choice = router.choose(hashes, parsed.get("user"))
        assert choice is not None
        router.sent(choice.replica, hashes, parsed.get("user"))
        t2 = time.perf_counter()
        render_s.append(t1 - t0)
        route_s.append(t2 - t1)
        total_s.append(t2 - t0)
        chars.append(len(text))
        reasons[choice.reason] += 1
        held[choice.replica].update(hashes)
        in_flight.append(choice.replica)
        if len(in_flight) > 4 * args.replicas:  # a steady load: each replica has a few requests in flight
            router.finished(in_flight.pop(0))
        if n % 50 == 49:  # replicas report what their caches hold (everything, here: no eviction)
            for i in range(args.replicas):
                router.report(i, load=in_flight.count(i), held=held[i])

    # What tokenizing the same prompts would add (the router does not: see verispec.server.prefix_router).
    tokenize_s, lengths = [], []
    for body in bodies:
        text = render("chat", json.loads(body)) or ""
        t0 = time.perf_counter()
        lengths.append(len(tokenizer.encode(text, add_special_tokens=False)))
        tokenize_s.append(time.perf_counter() - t0)
    tokens = {"p50": percentile(lengths, 0.5), "max": max(lengths)}

    def ms(values: list[float]) -> dict[str, float]:
        return {q: round(1000 * (percentile(values, p) or 0.0), 3) for q, p in (("p50", 0.5), ("p99", 0.99))} | \
            {"max": round(1000 * max(values), 3)}

    return {"tokenizer": args.model, "replicas": args.replicas, "requests": len(bodies),
            "prompt_chars": {"p50": percentile(chars, 0.5), "max": max(chars)}, "prompt_tokens": tokens,
            "decisions": reasons, "total_ms": ms(total_s), "parse_and_render_ms": ms(render_s),
            "hash_and_choose_ms": ms(route_s), "tokenizing_instead_ms": ms(tokenize_s)}


def bench_ready(args: argparse.Namespace) -> dict[str, Any]:
    port = args.port
    cmd = [sys.executable, "-m", "verispec.cli", "serve", "--model", args.model, "--replicas", str(args.replicas),
           "--replica-cpus", str(args.replica_cpus), "--port", str(port), *args.serve_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, ""):
            lines.append((time.perf_counter() - t0, raw.rstrip()))
            print(f"[{lines[-1][0]:7.1f}s] {lines[-1][1]}", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not any("ready on" in line for _, line in lines):
            if proc.poll() is not None or time.perf_counter() - t0 > args.timeout:
                raise SystemExit("the server did not become ready")
            time.sleep(0.1)
        ready_s = next(t for t, line in lines if "ready on" in line)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
            t1 = time.perf_counter()
            r = client.post("/v1/chat/completions", json={"model": args.model, "max_tokens": 32, "messages": [
                {"role": "user", "content": "Write a Python function that reverses a string."}]})
            first_s = time.perf_counter() - t1
            r.raise_for_status()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        reader.join(5)
    return {"model": args.model, "replicas": args.replicas, "replica_cpus": args.replica_cpus,
            "launch_to_ready_s": round(ready_s, 1), "first_request_s": round(first_s, 2), "exit_code": proc.returncode}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("router")
    r.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="whose tokenizer and chat template")
    r.add_argument("--replicas", type=int, default=4)
    r.add_argument("--chats", type=int, default=64)
    r.add_argument("--turns", type=int, default=4)
    r.add_argument("--seed", type=int, default=0)
    g = sub.add_parser("ready")
    g.add_argument("--model", default="smollm2-135m-instruct")
    g.add_argument("--replicas", type=int, default=2)
    g.add_argument("--replica-cpus", type=float, default=1.0)
    g.add_argument("--port", type=int, default=8123)
    g.add_argument("--timeout", type=float, default=900)
    g.add_argument("serve_args", nargs="*", help="more `verispec serve` arguments (after --)")
    for q in (r, g):
        q.add_argument("--out", default="bench_out/replicas")
    args = p.parse_args()
    result = {"machine": machine(), **(bench_router(args) if args.what == "router" else bench_ready(args))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.what}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
