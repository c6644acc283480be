"""Peer baselines: what users would otherwise run, on the same weights and prompts.

* ``hf``: Hugging Face transformers' ``generate``: plain, assisted generation with the draft model
  (``assistant_model=``) and prompt lookup (``prompt_lookup_num_tokens=``). The models load from
  the very files the engine loaded (GGUF weights dequantised by transformers) in the engine's dtype.
* ``llamacpp``: llama.cpp through llama-cpp-python (the optional extra ``verispec[llamacpp]``):
  ``Llama.generate`` plain and with ``LlamaPromptLookupDecoding``, on the engine's GGUF file itself
  (llama.cpp's own quantised kernels).

Prompts are the engine's own token ids, so both sides start from identical inputs, and EOS
handling and the number of new tokens match the engine's.
"""

from __future__ import annotations

import gc
import multiprocessing
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verispec.bench.harness import Generate, Item
from verispec.engine.engine import Engine, GenerationResult
from verispec.engine.metrics import Metrics
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams

PEERS = ("hf", "llamacpp")
HF_PLAIN, HF_ASSISTED, HF_PROMPT_LOOKUP = "hf-plain", "hf-assisted", "hf-prompt-lookup"
LLAMACPP_PLAIN, LLAMACPP_PROMPT_LOOKUP = "llamacpp-plain", "llamacpp-prompt-lookup"
LLAMACPP_INSTALL = "pip install 'verispec[llamacpp]'"
LLAMACPP_BATCH = 512
LLAMACPP_MAX_NGRAM = 2  # LlamaPromptLookupDecoding's default (and transformers' max_matching_ngram_size)
LLAMACPP_PROBE_TOKENS = 32  # tokens the decode-cost probe (LlamaCppPeers.decode_costs) generates and evaluates


def hf_location(name_or_path: str) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) for ``from_pretrained``: registry name, .gguf file or HF folder."""
    from verispec import hub

    path = hub.resolve(name_or_path, auto_install=False)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and not (path / "config.json").exists():
            return path, ggufs[0].name
        return path, None
    return path.parent, path.name


def load_hf_model(name_or_path: str, dtype: torch.dtype) -> Any:
    """A transformers causal LM from the same files the engine loads, in ``dtype``, eval mode.

    Its generation defaults are reset to transformers' own: a folder's generation_config.json may
    carry a repetition penalty or sampling settings the engine would not apply.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder, gguf = hf_location(name_or_path)
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kwargs)
    except (OSError, ValueError) as e:
        raise VerispecError(f"transformers could not load {name_or_path}: {e}") from None
    model.generation_config = GenerationConfig()
    return model.eval()


def peer_result(engine: Engine, prompt: list[int], new: list[int], finish: str, wall_s: float,
                ttft_s: float) -> GenerationResult:
    """A peer's generation in the engine's result form (EOS not counted as a token), so reports treat both alike."""
    m = Metrics(requests=1, prompt_tokens=len(prompt), generated_tokens=len(new), total_s=wall_s, ttft_s=ttft_s)
    return GenerationResult(prompt, new, engine.decode(new), finish, m)


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first generated token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass
class HFPeers:
    """transformers models for the peer rows; call :meth:`close` to free them."""

    engine: Engine
    model: Any
    assistant: Any | None = None
    lookup_tokens: int = 10
    eos: list[int] = field(default_factory=list)

    @classmethod
    def load(cls, engine: Engine, model: str, draft: str | None, lookup_tokens: int) -> HFPeers:
        """Load the target (and the draft, for assisted generation) in the engine's dtype."""
        dtype = engine.target.dtype
        target = load_hf_model(model, dtype)
        assistant = load_hf_model(draft, dtype) if draft else None
        return cls(engine, target, assistant, lookup_tokens, sorted(engine.eos_ids))

    def methods(self) -> dict[str, Generate]:
        """Labelled generate functions: hf-plain, hf-assisted (with a draft), hf-prompt-lookup."""
        out: dict[str, Generate] = {HF_PLAIN: self._gen({})}
        if self.assistant is not None:
            out[HF_ASSISTED] = self._gen({"assistant_model": self.assistant})
        out[HF_PROMPT_LOOKUP] = self._gen({"prompt_lookup_num_tokens": self.lookup_tokens})
        return out

    def _gen(self, extra: dict[str, Any]) -> Generate:
        def gen(item: Item, params: SamplingParams) -> GenerationResult:
            return self.generate(item, params, extra)
        return gen

    @torch.inference_mode()
    def generate(self, item: Item, params: SamplingParams, extra: dict[str, Any]) -> GenerationResult:
        """One timed ``generate`` call; the result mirrors the engine's (EOS not counted as a token)."""
        prompt = self.engine.encode(item.payload, item.chat)
        ids = torch.tensor([prompt], device=self.model.device)
        sampling: dict[str, Any] = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if not params.greedy:
            sampling = {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
                        "top_k": params.top_k or None}
            if params.seed is not None:
                torch.manual_seed(params.seed)
        eos = [] if params.ignore_eos else self.eos
        clock = _FirstTokenClock()
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                                  eos_token_id=eos or None, pad_token_id=(self.eos or [0])[0], streamer=clock,
                                  **sampling, **extra)
        wall = time.perf_counter() - t0
        new = out[0, len(prompt):].tolist()
        finish = "length"
        for i, tok in enumerate(new):
            if tok in eos:
                new, finish = new[:i], "stop"
                break
        return peer_result(self.engine, prompt, new[:params.max_tokens], finish, wall,
                           (clock.first - t0) if clock.first is not None else 0.0)

    def close(self) -> None:
        """Drop the models and return their memory."""
        self.model = self.assistant = None
        gc.collect()


# -- llama.cpp (llama-cpp-python) ------------------------------------------------------------------

def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module, or a :class:`VerispecError` naming the extra that installs it."""
    try:
        import llama_cpp
        import llama_cpp.llama_speculative  # noqa: F401 (LlamaPromptLookupDecoding)
    except (ImportError, OSError) as e:  # OSError: the package is there but its libllama will not load
        raise VerispecError(f"the llamacpp peer needs llama-cpp-python ({e}); install it with {LLAMACPP_INSTALL} "
                            "(it compiles llama.cpp from source, several minutes; "
                            'CMAKE_ARGS="-DGGML_NATIVE=ON" recommended)') from None
    return llama_cpp


@contextmanager
def extra_buffer_types(llama_cpp: Any, enabled: bool) -> Iterator[None]:
    """``Llama`` objects built inside load with llama.cpp's extra buffer types (weight repacking, AMX) on or off.

    llama-cpp-python builds its model parameters from ``llama_model_default_params()`` and has no
    argument for ``use_extra_bufts``, so the defaults it reads are wrapped while it loads.
    """
    lib = llama_cpp.llama_cpp
    default = lib.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = enabled
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = default


def _decode_check(path: str, extra_buffers: bool) -> None:
    """Load ``path`` in llama.cpp and decode a short batch, then single tokens (a child process's work)."""
    llama_cpp = import_llama_cpp()
    with extra_buffer_types(llama_cpp, extra_buffers):
        llm = llama_cpp.Llama(path, n_ctx=64, n_batch=16, n_threads=1, verbose=False)
    llm.eval(list(range(100, 108)))
    llm.eval([108])
    llm.eval([109])


def llamacpp_extra_buffers(path: Path, timeout_s: float = 600.0, check: Callable[[str, bool], None] = _decode_check,
                           start_method: str = "spawn") -> bool:
    """Whether llama.cpp may use its extra buffer types on ``path`` here: it decodes with them in a child process.

    On some CPUs with AMX, llama.cpp's AMX path crashes the process at the first decode of a
    Q4_K file (a segmentation fault, which would end the whole benchmark). A child process loads the
    file and decodes a few tokens with them, then, if it died, without them; the peer runs the first
    way that decoded. Neither: a :class:`VerispecError` saying so. ``check`` is the child's work.
    """
    ctx = multiprocessing.get_context(start_method)
    codes = []
    for extra in (True, False):
        child = ctx.Process(target=check, args=(str(path), extra), daemon=True)
        child.start()
        child.join(timeout_s)
        if child.is_alive():
            child.kill()
            child.join()
        if child.exitcode == 0:
            return extra
        codes.append(child.exitcode)
    raise VerispecError(f"llama.cpp could not decode {path} in a child process (exit codes {codes}, with and "
                        "without its extra buffer types)")


def gguf_file(name_or_path: str) -> Path:
    """The GGUF file the engine loads for ``name_or_path`` (registry name, .gguf file or a folder holding one)."""
    folder, name = hf_location(name_or_path)
    if name is None or not name.lower().endswith(".gguf"):
        where = folder if name is None else folder / name
        raise VerispecError(f"the llamacpp peer needs a GGUF model, and {name_or_path} is not one ({where}); "
                            "pass --model a registry name or a .gguf file")
    return folder / name


def llamacpp_context(prompt_lens: list[int], max_tokens: int, max_len: int, lookup_tokens: int) -> int:
    """n_ctx for the longest prompt plus its new tokens, the draft's overhang and the eval-only probe."""
    longest = max(prompt_lens, default=1)
    new = max(min(max_tokens, max(max_len - longest, 1)), LLAMACPP_PROBE_TOKENS + 2)
    return longest + new + lookup_tokens + 1


@dataclass
class LlamaCppPeers:
    """Two llama.cpp contexts on the engine's GGUF: plain and with prompt lookup; :meth:`close` frees them.

    They are separate ``Llama`` objects because llama-cpp-python's prompt lookup needs
    ``logits_all=True`` (logits of every position, prompt included, copied to NumPy each step),
    which would slow the plain row down for nothing. Each reads the weights into its own memory
    (``use_mmap=False``), as the engine holds its own: memory-mapped weights live in the page
    cache, which a busy machine may evict in the middle of a run, and llama.cpp would then be
    timed reading the file again.
    """

    engine: Engine
    plain: Any
    lookup: Any
    path: Path
    n_ctx: int
    threads: int
    lookup_tokens: int = 10
    eos: frozenset[int] = frozenset()
    extra_buffers: bool = True  # llama.cpp's extra buffer types (weight repacking, AMX); see llamacpp_extra_buffers
    system_info: str = ""  # the CPU features llama.cpp was built with ("AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 ...")

    @classmethod
    def load(cls, engine: Engine, model: str, lookup_tokens: int, n_ctx: int) -> LlamaCppPeers:
        """Load the GGUF the engine loaded, with the engine's thread count (``torch.get_num_threads()``)."""
        llama_cpp = import_llama_cpp()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        path = gguf_file(model)
        threads = torch.get_num_threads()
        common: dict[str, Any] = {"n_ctx": n_ctx, "n_batch": LLAMACPP_BATCH, "n_ubatch": LLAMACPP_BATCH,
                                  "n_threads": threads, "n_threads_batch": threads, "use_mmap": False,
                                  "verbose": False}
        extra = llamacpp_extra_buffers(path)
        try:
            with extra_buffer_types(llama_cpp, extra):
                plain = llama_cpp.Llama(str(path), **common)
                lookup = llama_cpp.Llama(str(path), logits_all=True, **common, draft_model=LlamaPromptLookupDecoding(
                    max_ngram_size=LLAMACPP_MAX_NGRAM, num_pred_tokens=lookup_tokens))
        except (OSError, ValueError, RuntimeError) as e:
            raise VerispecError(f"llama.cpp could not load {path}: {e}") from None
        vocab = engine.target.args.vocab_size
        if plain.n_vocab() != vocab:
            raise VerispecError(f"llama.cpp reads a vocabulary of {plain.n_vocab()} from {path}, the engine {vocab}")
        features = llama_cpp.llama_print_system_info().decode(errors="replace").strip(" |")
        return cls(engine, plain, lookup, path, n_ctx, threads, lookup_tokens, frozenset(engine.eos_ids), extra,
                   features)

    def methods(self) -> dict[str, Generate]:
        """Labelled generate functions: llamacpp-plain and llamacpp-prompt-lookup."""
        return {LLAMACPP_PLAIN: self._gen(self.plain), LLAMACPP_PROMPT_LOOKUP: self._gen(self.lookup)}

    def _gen(self, llm: Any) -> Generate:
        def gen(item: Item, params: SamplingParams) -> GenerationResult:
            return self.generate(llm, item, params)
        return gen

    @staticmethod
    def fresh(llm: Any) -> None:
        """Forget the previous request: no prefix of it may be reused from the KV cache.

        ``Llama.generate`` reuses the longest common prefix of the cached tokens (its prompt
        cache); ``reset()`` sets the cached token count to 0, which skips that match, and the
        memory clear wipes the KV cache itself, so every prompt is prefilled from scratch.
        """
        import llama_cpp

        llm.reset()
        mem = llama_cpp.llama_get_memory(llm.ctx)
        if mem is not None:
            llama_cpp.llama_memory_clear(mem, True)

    @staticmethod
    def sampling(params: SamplingParams) -> dict[str, Any]:
        """``Llama.generate`` sampling arguments for ``params``; no repetition penalty, min-p or typical-p."""
        neutral = {"repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_p": 0.0,
                   "typical_p": 1.0}
        if params.greedy:
            return {**neutral, "temp": 0.0, "top_k": 1, "top_p": 1.0}
        return {**neutral, "temp": params.temperature, "top_k": params.top_k, "top_p": params.top_p}

    def generate(self, llm: Any, item: Item, params: SamplingParams) -> GenerationResult:
        """One timed ``Llama.generate`` on the engine's prompt ids; the result mirrors the engine's."""
        prompt = self.engine.encode(item.payload, item.chat)
        limit = min(params.max_tokens, self.engine.max_len - len(prompt))
        eos = frozenset() if params.ignore_eos else self.eos
        if not params.greedy:  # the sampler is rebuilt by generate() from this seed
            llm.set_seed(params.seed % 2**32 if params.seed is not None else int(time.time_ns() % 2**32))
        self.fresh(llm)
        new: list[int] = []
        finish, first = "length", None
        t0 = time.perf_counter()
        for tok in llm.generate(prompt, **self.sampling(params)):
            if first is None:
                first = time.perf_counter()
            if tok in eos:
                finish = "stop"
                break
            new.append(int(tok))
            if len(new) >= limit:
                break
        wall = time.perf_counter() - t0
        return peer_result(self.engine, prompt, new, finish, wall, (first - t0) if first is not None else 0.0)

    def decode_costs(self, prompt: list[int], tokens: int = LLAMACPP_PROBE_TOKENS) -> dict[str, Any]:
        """Milliseconds per decoded token after ``prompt``, two ways, on the plain context (medians).

        ``generate_ms_per_token``: between consecutive tokens of a greedy ``Llama.generate`` (EOS
        ignored): ``llama_decode`` plus sampling and llama-cpp-python's Python loop.
        ``eval_ms_per_token``: one ``Llama.eval([token])`` call, i.e. the forward pass alone.
        """
        llm = self.plain
        prompt = prompt[: max(1, self.n_ctx - tokens - 2)]
        self.fresh(llm)
        stamps = []
        for _ in llm.generate(prompt, **self.sampling(SamplingParams())):
            stamps.append(time.perf_counter())
            if len(stamps) > tokens:
                break
        gen = statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))
        self.fresh(llm)
        llm.eval(prompt)
        evals = []
        for _ in range(tokens):
            t = time.perf_counter()
            llm.eval([prompt[-1]])
            evals.append(time.perf_counter() - t)
        self.fresh(llm)
        ev = statistics.median(evals)
        return {"generate_ms_per_token": 1e3 * gen, "eval_ms_per_token": 1e3 * ev,
                "python_loop_ms_per_token": 1e3 * (gen - ev), "probe_prompt_tokens": len(prompt),
                "probe_tokens": tokens}

    def close(self) -> None:
        """Free both llama.cpp contexts and the model."""
        for llm in (self.plain, self.lookup):
            if llm is not None:
                llm.close()
        self.plain = self.lookup = None
        gc.collect()
