"""Tensor parallelism (gloo, 2 CPU processes) and device placement.

One spawn of two ranks runs every multi-process check (imports dominate the cost): sharded logits
against the unsharded model for prefill, decode, multi-token verify, batched rows and an early exit,
through the leader/follower protocol; then speculative generation with a TP=2 target, compared in
the parent with the same generation on one process. Workers always end: the process group has a
short timeout and the parent kills whatever is still running at the deadline.
"""

from __future__ import annotations

import gc
import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny import make_tiny

from verispec import Engine, SamplingParams, SpecConfig
from verispec.config import EngineConfig
from verispec.errors import VerispecError
from verispec.launch import shutdown, tp_engine
from verispec.models.loader import build_model, open_source
from verispec.parallel.tp import lead, shard_transformer

WORLD = 2
DEADLINE_S = 120  # spawn + imports on a loaded 2-core machine; a healthy run takes a fraction of it
MAX_LEN = 128
PROMPTS = [[3, 5, 7, 9], [10, 20, 30, 40, 50, 60, 10, 20, 30], [2]]
RUNS = {  # label: (SpecConfig, SamplingParams)
    "draft_greedy": (SpecConfig(k_policy="fixed", method="draft", k=4), SamplingParams(max_tokens=24, ignore_eos=True)),
    "draft_k1": (SpecConfig(k_policy="fixed", method="draft", k=1), SamplingParams(max_tokens=12, ignore_eos=True)),
    "plain": (SpecConfig(k_policy="fixed", method="none", k=0), SamplingParams(max_tokens=12, ignore_eos=True)),
    "draft_sampled": (SpecConfig(k_policy="fixed", method="draft", k=3),
                      SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=11)),
}


# -- what each rank runs ---------------------------------------------------------------------


def _logit_checks(rank: int, folder: str) -> dict:
    """Sharded forwards through lead/follow against the unsharded model; rank 0 reports max |diff|."""
    model = build_model(open_source(folder), torch.float32, progress=False)
    if rank != 0:
        from verispec.parallel.tp import follow

        shard_transformer(model)
        follow(model)
        return {}
    ref = build_model(open_source(folder), torch.float32, progress=False)
    full_kv = model.args.n_kv_heads
    lead(model)
    out: dict = {"kv_heads": (full_kv, model.args.n_kv_heads)}
    gen = torch.Generator().manual_seed(0)
    vocab = model.args.vocab_size
    with torch.inference_mode():
        rc, c = ref.new_cache(1, 64), model.new_cache(1, 64)
        out["cache_heads"] = c.k[0].shape[1]
        diffs = []

        def both(tokens: list[int], start: int, **kw) -> None:
            t = torch.tensor([tokens])
            pos = torch.arange(start, start + len(tokens)).unsqueeze(0)
            diffs.append(float((ref(t, pos, rc, **kw) - model(t, pos, c, **kw)).abs().max()))

        seq = torch.randint(vocab, (20,), generator=gen).tolist()
        both(seq[:8], 0)  # prefill
        both(seq[:8], 0, last_only=True)
        for p in range(8, 11):  # decode
            both([seq[p]], p)
        both(seq[11:16], 11)  # verify k + 1 = 5
        both(seq[12:17], 12)  # a rolled-back step re-verified over stale entries
        both(seq[16:18], 16, n_layers=1)  # early exit (layer-skip drafting)
        out["single"] = max(diffs)

        # A second, batched cache (a new slot on the followers), addressed by rows.
        diffs = []
        rb, b = ref.new_cache(3, 32), model.new_cache(3, 32)
        t = torch.randint(vocab, (2, 6), generator=gen)
        pos = torch.arange(6).expand(2, -1)
        diffs.append(float((ref(t, pos, rb, rows=slice(1, 3)) - model(t, pos, b, rows=slice(1, 3))).abs().max()))
        t2 = torch.randint(vocab, (2, 3), generator=gen)
        pos2 = torch.tensor([[6, 7, 8], [2, 3, 4]])
        diffs.append(float((ref(t2, pos2, rb, rows=slice(1, 3)) - model(t2, pos2, b, rows=slice(1, 3))).abs().max()))
        out["batched"] = max(diffs)
        del b, rb
        gc.collect()  # the followers drop their copy of the batched cache at the next new one
        c3 = model.new_cache(1, 16)
        rc3 = ref.new_cache(1, 16)
        t = torch.tensor([seq[:5]])
        pos = torch.arange(5).unsqueeze(0)
        out["after_free"] = float((ref(t, pos, rc3) - model(t, pos, c3)).abs().max())
    model.forward.close()
    return out


def _generations(rank: int, target: str, draft: str) -> dict:
    engine = tp_engine(target, draft, tp=WORLD, dtype="float32", max_len=MAX_LEN, progress=False)
    if rank != 0:
        assert engine is None
        return {}
    try:
        return {label: [r.token_ids for r in engine.generate(PROMPTS, params, spec)]
                for label, (spec, params) in RUNS.items()}
    finally:
        shutdown(engine)


def _rank_main(rank: int, port: int, out: str, folders: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
        result = {"logits_" + name: _logit_checks(rank, folder) for name, folder in folders["logits"].items()}
        result["generate"] = _generations(rank, folders["target"], folders["draft"])  # leaves the group
        if rank == 0:
            torch.save(result, Path(out) / "result.pt")
    except BaseException:
        (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(out: Path, folders: dict) -> dict:
    """Run :func:`_rank_main` on WORLD spawned processes; kill them all at the deadline."""
    import time

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(out), folders), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        hung = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = "\n".join(f.read_text() for f in sorted(out.glob("error*.txt")))
    if hung:
        pytest.fail(f"ranks {hung} still running after {DEADLINE_S} s (killed)\n{errors}")
    if errors or any(p.exitcode != 0 for p in procs):
        pytest.fail(f"a rank failed (exit codes {[p.exitcode for p in procs]}):\n{errors}")
    return torch.load(out / "result.pt")


@pytest.fixture(scope="module")
def llama_kv2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama without biases, tied embeddings, GQA 4:2 (kv heads divisible by 2)."""
    folder = tmp_path_factory.mktemp("llama_kv2")
    make_tiny(folder, arch="llama", vocab=96, layers=2, dim=64, heads=4, kv_heads=2, seed=4, tie=True)
    return folder


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory, qwen2_tiny, qwen2_noisy_draft_tiny, llama_kv2) -> dict:
    out = tmp_path_factory.mktemp("tp_run")
    folders = {"logits": {"qwen2": qwen2_tiny.path, "llama": str(llama_kv2)}, "target": qwen2_tiny.path,
               "draft": qwen2_noisy_draft_tiny.path}
    return run_ranks(out, folders)


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tp2_logits_match_tp1(tp_results, arch):
    r = tp_results["logits_" + arch]
    assert r["kv_heads"] == (2, 1)  # each rank keeps half of the kv heads ...
    assert r["cache_heads"] == 1  # ... and so does its cache
    assert r["single"] < 1e-4  # prefill, decode, verify, re-verify, early exit
    assert r["batched"] < 1e-4  # a second cache, rows of a batch
    assert r["after_free"] < 1e-4


def test_tp2_speculative_output_identical(tp_results, qwen2_tiny, qwen2_noisy_draft_tiny):
    engine = Engine.from_pretrained(qwen2_tiny.path, qwen2_noisy_draft_tiny.path, dtype="float32", max_len=MAX_LEN,
                                    progress=False)
    got = tp_results["generate"]
    for label, (spec, params) in RUNS.items():
        want = [r.token_ids for r in engine.generate(PROMPTS, params, spec)]
        assert got[label] == want, label
    plain = [r.token_ids for r in engine.generate(PROMPTS, RUNS["plain"][1])]
    assert [ids[:12] for ids in got["draft_greedy"]] == plain  # lossless: TP speculative == plain greedy


def test_explicit_cpu_placement_unchanged(qwen2_tiny, qwen2_noisy_draft_tiny):
    kw = dict(dtype="float32", max_len=MAX_LEN, progress=False)
    default = Engine.from_pretrained(qwen2_tiny.path, qwen2_noisy_draft_tiny.path, **kw)
    placed = Engine.from_pretrained(qwen2_tiny.path, qwen2_noisy_draft_tiny.path, target_device="cpu",
                                    draft_device="cpu", **kw)
    assert placed.config.target_device == placed.config.draft_device == "cpu"
    assert placed.target.device.type == placed.draft.device.type == "cpu"
    for label in ("draft_greedy", "draft_sampled"):
        spec, params = RUNS[label]
        a = [r.token_ids for r in default.generate(PROMPTS, params, spec)]
        b = [r.token_ids for r in placed.generate(PROMPTS, params, spec)]
        assert a == b, label


def test_config_devices_and_tp_validation():
    c = EngineConfig(model="m", device="cpu")
    assert (c.target_device, c.draft_device, c.tp) == ("cpu", "cpu", 1)
    c = EngineConfig(model="m", device="cpu", draft_device="cuda:1")
    assert (c.target_device, c.draft_device) == ("cpu", "cuda:1")
    with pytest.raises(VerispecError, match="dense"):
        EngineConfig(model="m", tp=2, weights="int8")
    with pytest.raises(VerispecError, match="tp must be"):
        EngineConfig(model="m", tp=0)


def test_shard_refuses_quantized_and_indivisible(qwen2_tiny):
    int8 = build_model(open_source(qwen2_tiny.path), torch.float32, "int8", progress=False)
    with pytest.raises(VerispecError, match="dense weights only"):
        shard_transformer(int8, rank=0, world=2)
    dense = build_model(open_source(qwen2_tiny.path), torch.float32, progress=False)
    with pytest.raises(VerispecError, match="divisible by 3"):
        shard_transformer(dense, rank=0, world=3)


def test_shard_shapes_without_a_group(qwen2_tiny):
    """Sharding alone needs no process group: per-rank slices of the fused weights, re-fused."""
    full = qwen2_tiny.model
    a = full.args
    hd = a.head_dim
    for rank in range(2):
        m = shard_transformer(build_model(open_source(qwen2_tiny.path), torch.float32, progress=False), rank, 2)
        attn, mlp = m.layers[0].attn, m.layers[0].mlp
        q, k, v = attn.wqkv.weight.split([a.n_heads // 2 * hd, a.n_kv_heads // 2 * hd, a.n_kv_heads // 2 * hd])
        fq, fk, fv = full.layers[0].attn.wqkv.weight.split([a.n_heads * hd, a.n_kv_heads * hd, a.n_kv_heads * hd])
        assert torch.equal(q, fq.chunk(2)[rank]) and torch.equal(k, fk.chunk(2)[rank])
        assert torch.equal(v, fv.chunk(2)[rank])
        fb = full.layers[0].attn.wqkv.bias.split([a.n_heads * hd, a.n_kv_heads * hd, a.n_kv_heads * hd])
        assert torch.equal(attn.wqkv.bias, torch.cat([t.chunk(2)[rank] for t in fb]))
        assert torch.equal(attn.wo.linear.weight, full.layers[0].attn.wo.weight.chunk(2, dim=1)[rank])
        g, u = full.layers[0].mlp.w_gate_up.weight.chunk(2)
        assert torch.equal(mlp.w_gate_up.weight, torch.cat([g.chunk(2)[rank], u.chunk(2)[rank]]))
        assert torch.equal(mlp.w_down.linear.weight, full.layers[0].mlp.w_down.weight.chunk(2, dim=1)[rank])
        assert (m.args.n_heads, m.args.n_kv_heads, m.args.intermediate_size) == (2, 1, a.intermediate_size // 2)
        assert m.new_cache(1, 8).k[0].shape[1] == 1


def test_tp_without_torchrun_explains(monkeypatch, qwen2_tiny):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(VerispecError, match="torchrun"):
        Engine.from_pretrained(qwen2_tiny.path, dtype="float32", max_len=MAX_LEN, progress=False, tp=2)

