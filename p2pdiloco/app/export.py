"""`p2pdiloco export RUN_DIR --to DIR`: a run's latest global model as a Hugging Face `transformers` checkpoint.

The llama's parameters already carry `LlamaForCausalLM`'s names and rotary convention (see training/llama.py),
so the export is its weights as they are, a `config.json` that describes the same shape, and the tokenizer.
The gpt is not exported: its nearest `transformers` class, GPT2LMHeadModel, has biased fused Conv1D layers
under other names and a GELU approximation of its own; llama is the architecture to train for a model that
others load.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from p2pdiloco.app.saved_model import SavedModel, latest_model, run_tokenizer
from p2pdiloco.config import ConfigError, ModelConfig
from p2pdiloco.training.llama import RMS_NORM_EPS, ffn_hidden_size
from p2pdiloco.training.model import named_weights
from p2pdiloco.training.tokenizer import BYTES


def hf_config(cfg: ModelConfig) -> dict:
    """`config.json` of a `LlamaForCausalLM` with the shape of `cfg` (a llama)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.d_model, "intermediate_size": ffn_hidden_size(cfg),
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head, "head_dim": cfg.d_model // cfg.n_head,
        "num_hidden_layers": cfg.n_layer, "rms_norm_eps": RMS_NORM_EPS,
        # rope_theta for transformers 4.x, rope_parameters for 5.x (which also still reads rope_theta)
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,  # p2pdiloco trains without them
        "torch_dtype": "float32", "use_cache": True,
    }


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what a `tokenizers` ByteLevel pre-tokenizer maps
    bytes to)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def byte_tokenizer_json() -> str:
    """A `tokenizer.json` whose token ids are the UTF-8 bytes, as p2pdiloco's byte tokenizer's: a byte-level BPE
    with 256 tokens (token i is byte i) and no merges, so that `PreTrainedTokenizerFast` encodes as training did."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _write_tokenizer(saved: SavedModel, out: Path) -> str:
    """tokenizer.json and tokenizer_config.json for `PreTrainedTokenizerFast`; returns what the tokenizer is."""
    if saved.cfg.data.tokenizer in ("", BYTES):
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
        kind = "bytes (a 256-token byte-level BPE without merges)"
    else:
        source = run_tokenizer(saved).path
        shutil.copyfile(source, out / "tokenizer.json")
        kind = str(source)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": saved.cfg.model.seq_len,
        "clean_up_tokenization_spaces": False}, indent=2))
    return kind


def export_run(run_dir: str | Path, to: str | Path) -> dict:
    """Write the latest global model of `run_dir` (arch llama) to the folder `to`, atomically.

    Returns:
        What was written: {"source", "to", "files", "tokenizer"}.

    Raises:
        ConfigError: no model in `run_dir`, its arch is not llama, or `to` exists and is not empty.
    """
    to = Path(to)
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise ConfigError(f"{to} exists and is not empty: export writes into a new or empty folder")
    saved = latest_model(run_dir)
    if saved.cfg.model.arch != "llama":
        raise ConfigError(f"{saved.path} is a {saved.cfg.model.arch} model; export supports llama only "
                          "(transformers' GPT-2 has other layers and names); train with --set model.arch=llama")
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{to.name}.tmp-", dir=to.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the export is an ordinary folder
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config(saved.cfg.model), indent=2))
        # transformers refuses safetensors files without format=pt in their metadata
        save_file(named_weights(saved.model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        kind = _write_tokenizer(saved, tmp)
        files = sorted(p.name for p in tmp.iterdir())
        for name in files:  # safetensors writes 0600; an export is meant to be shared
            os.chmod(tmp / name, 0o666 & ~umask)
        os.replace(tmp, to)  # a rename: onto a missing or empty folder, all at once
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"source": str(saved.path), "to": str(to), "files": files, "tokenizer": kind}
