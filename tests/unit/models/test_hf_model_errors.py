"""A Hugging Face model directory that cannot be used is an HFModelError naming the file and the
field (an InputError: the CLI prints it as one line), never a KeyError or ZeroDivisionError."""

from __future__ import annotations

import json

import pytest

from megatron_rl.common.errors import InputError
from megatron_rl.models.hf_config import HFModelError, read_hf_config
from megatron_rl.models.hf_load import HFCheckpoint

GOOD = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rope_theta": 10000.0}


def _write(tmp_path, cfg=None, raw: bytes | None = None):
    (tmp_path / "config.json").write_bytes(raw if raw is not None else json.dumps(cfg).encode())
    return tmp_path


def test_good_config_reads(tmp_path):
    arch = read_hf_config(_write(tmp_path, GOOD))
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.max_position_embeddings) == (4, 2, 8, 128)


@pytest.mark.parametrize("change,says", [
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
    ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer"),
    ({"hidden_size": "32"}, "hidden_size must be a positive integer"),
    ({"vocab_size": None}, "vocab_size is missing"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"hidden_size": 2}, "hidden_size (2) / num_attention_heads (4) < 1"),
    ({"head_dim": 0}, "head_dim must be a positive integer"),
    ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
])
def test_unusable_config_names_file_and_field(tmp_path, change, says):
    cfg = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(HFModelError) as e:
        read_hf_config(_write(tmp_path, cfg))
    assert str(tmp_path / "config.json") in str(e.value) and says in str(e.value), str(e.value)
    assert isinstance(e.value, InputError)


@pytest.mark.parametrize("raw", [b"{", b"\xff\xfe", b"[1, 2]"])
def test_unreadable_config(tmp_path, raw):
    with pytest.raises(HFModelError, match="config.json"):
        read_hf_config(_write(tmp_path, raw=raw))


def test_missing_model_dir(tmp_path):
    with pytest.raises(HFModelError, match="does not exist"):
        read_hf_config(tmp_path / "nope")


def test_unreadable_weights_name_the_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(HFModelError) as e:
        HFCheckpoint(tmp_path)
    assert str(tmp_path / "model.safetensors") in str(e.value)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(HFModelError, match="no model.safetensors"):
        HFCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(HFModelError, match="index"):
        HFCheckpoint(tmp_path)
