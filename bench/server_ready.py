"""Launch to ready, and the first requests after it, of `verispec serve` on a real pair.

Starts the server as a user would (`verispec serve --model M --draft D`, the default settings),
stamps every line it logs, polls `GET /health` until it answers 200, then sends chat requests one
at a time: speculative under the server's defaults (the first is the one a warm-up must keep free
of profiling), then plain decoding (`"speculative": {"enabled": false}`), then speculative again.
Reports seconds from launch to listening and to ready, and per request its latency, tokens and
tokens/s. Writes server_ready.md and server_ready.json into --out.

    python bench/server_ready.py [--max-tokens 128] [--out bench_out/server]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from verispec.bench.hardware import machine

PROMPT = "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation."


def stamp_lines(stream: Any, t0: float, lines: list[tuple[float, str]]) -> None:
    """Collect ``stream``'s lines with their seconds since ``t0`` (and echo them)."""
    for raw in iter(stream.readline, ""):
        lines.append((time.perf_counter() - t0, raw.rstrip()))
        print(f"[{lines[-1][0]:7.1f}s] {lines[-1][1]}", flush=True)


def chat(client: httpx.Client, model: str, max_tokens: int, speculative: bool) -> dict[str, Any]:
    """One non-streamed chat request; its latency and what the server reports of it."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                            "messages": [{"role": "user", "content": PROMPT}]}
    if not speculative:
        body["speculative"] = {"enabled": False}
    t = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    latency = time.perf_counter() - t
    r.raise_for_status()
    data = r.json()
    tokens = data["usage"]["completion_tokens"]
    return {"speculative": speculative, "latency_s": latency, "tokens": tokens, "tokens_per_s": tokens / latency,
            "speculative_usage": data["usage"].get("speculative")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for ready")
    ap.add_argument("--serve-args", default="", help="more `verispec serve` flags, space-separated")
    ap.add_argument("--out", type=Path, default=Path("bench_out/server"))
    args = ap.parse_args()

    cmd = [sys.executable, "-m", "verispec.cli", "serve", "--model", args.model, "--draft", args.draft,
           "--port", str(args.port), *args.serve_args.split()]
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    threading.Thread(target=stamp_lines, args=(proc.stdout, t0, lines), daemon=True).start()
    listening = ready = None
    requests: list[dict[str, Any]] = []
    health_s: list[float] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=600) as client:
            while ready is None:
                if proc.poll() is not None:
                    sys.exit(f"the server exited with {proc.returncode} before it was ready")
                if time.perf_counter() - t0 > args.timeout:
                    sys.exit(f"not ready after {args.timeout:.0f} s")
                try:
                    t = time.perf_counter()
                    status = client.get("/health", timeout=5).status_code
                    health_s.append(time.perf_counter() - t)
                except httpx.TransportError:
                    status = None
                now = time.perf_counter() - t0
                if status is not None and listening is None:
                    listening = now
                if status == 200:
                    ready = now
                time.sleep(0.25)
            for speculative in (True, False, True):
                requests.append(chat(client, args.model, args.max_tokens, speculative))
                r = requests[-1]
                print(f"{'speculative' if speculative else 'plain':11s} {r['latency_s']:.2f} s, {r['tokens']} tokens, "
                      f"{r['tokens_per_s']:.1f} tokens/s", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    info = machine()
    result = {"machine": info, "command": " ".join(["verispec", *cmd[3:]]), "listening_s": listening, "ready_s": ready,
              "health_max_s": max(health_s, default=0.0), "requests": requests, "log": lines}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "server_ready.json").write_text(json.dumps(result, indent=1) + "\n")
    names = ["first speculative", "plain", "second speculative"]
    md = [f"`{result['command']}` on {info['cpu']}, {info['threads']} threads, {info['date']}; models "
          "from the converted cache.", "",
          f"Launch to listening: {listening:.1f} s; launch to ready (`/health` 200): {ready:.1f} s; slowest "
          f"`/health` answer meanwhile {result['health_max_s']:.2f} s.", "",
          "| request (after ready, one at a time) | latency s | tokens | tokens/s | mean accepted length |",
          "|---|---:|---:|---:|---:|"]
    for name, r in zip(names, requests, strict=True):
        accepted = (r["speculative_usage"] or {}).get("mean_accepted_length", 0)
        md.append(f"| {name} | {r['latency_s']:.2f} | {r['tokens']} | {r['tokens_per_s']:.1f} | {accepted:.2f} |")
    (args.out / "server_ready.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
