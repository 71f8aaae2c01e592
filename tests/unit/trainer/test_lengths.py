"""Every length that must fit the engines' or the model's context is checked before any model is
built or engine started, naming the field (and the file and row for data): each stage's and the
evaluation's prompt + response against the model's positions and the engines' max model length,
data.max_prompt_len against the engines' prompt length, the SFT cold start's prompt + solution,
an external server's --max-model-len, the difficulty tool's longest prompt + max_tokens."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from megatron_rl.config import ConfigError
from megatron_rl.data import DataError
from megatron_rl.trainer.engines import check_external_servers
from megatron_rl.trainer.schema import check_model_limits, load_run_config, max_sequence_len

MIN = {"model": {"tiny": {}}, "data": {"train_path": "x.jsonl"}, "rollout": {"max_prompt_len": 16},
       "stages": [{"name": "s1", "max_response_len": 8, "max_steps": 1},
                  {"name": "s2", "max_response_len": 12, "max_steps": 1}]}


@pytest.fixture
def cfg_file(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(MIN))
    return p


def test_eval_max_tokens_longer_than_the_tiny_models_positions(cfg_file):
    load_run_config(cfg_file, ["model.tiny.max_position_embeddings=40", "rollout.eval_max_tokens=24"])  # 40 fits
    with pytest.raises(ConfigError) as e:
        load_run_config(cfg_file, ["model.tiny.max_position_embeddings=40", "rollout.eval_max_tokens=25"])
    msg = str(e.value)
    assert e.value.key == "rollout.eval_max_tokens" and "16" in msg and "25" in msg and "41" in msg, msg
    assert "evaluation" in msg and "model.tiny" in msg


def test_eval_max_tokens_longer_than_a_real_models_positions(cfg_file):
    cfg = load_run_config(cfg_file, ["rollout.eval_max_tokens=100"])
    check_model_limits(cfg, 116, "m/config.json")
    with pytest.raises(ConfigError) as e:
        check_model_limits(cfg, 115, "m/config.json")
    assert e.value.key == "rollout.eval_max_tokens" and "m/config.json" in str(e.value)


def test_the_engines_are_sized_for_the_evaluation_too(cfg_file):
    assert max_sequence_len(load_run_config(cfg_file)) == 16 + 12  # the longest stage
    assert max_sequence_len(load_run_config(cfg_file, ["rollout.eval_max_tokens=10"])) == 16 + 12
    assert max_sequence_len(load_run_config(cfg_file, ["rollout.eval_max_tokens=30"])) == 16 + 30


def test_a_data_prompt_limit_above_the_engines_is_refused(cfg_file):
    load_run_config(cfg_file, ["data.max_prompt_len=16"])
    with pytest.raises(ConfigError) as e:
        load_run_config(cfg_file, ["data.max_prompt_len=17"])
    assert e.value.key == "data.max_prompt_len" and "rollout.max_prompt_len (16)" in str(e.value)


def test_the_model_limits_are_checked_before_the_tokenizer_or_anything_else(cfg_file, tmp_path):
    from megatron_rl.trainer.context import build_context

    model = tmp_path / "model"  # a config.json only: build_context must stop before reading more
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 27, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}))
    cfg = load_run_config(cfg_file, [f"model.path={model}"])
    with pytest.raises(ConfigError) as e:
        build_context(cfg, None, str(model), None)
    assert e.value.key == "stages[1].max_response_len" and str(model / "config.json") in str(e.value)


# --- the SFT cold start's demonstrations --------------------------------------------------------
def _rows(tmp_path, solutions) -> str:
    p = tmp_path / "sft.jsonl"
    with p.open("w") as f:
        for i, sol in enumerate(solutions):
            extra = {} if sol is None else {"solution": sol}
            f.write(json.dumps({"prompt": f"{i}+{i}=", "reward_model": {"ground_truth": str(2 * i), "style": "math"},
                                "extra_info": extra}) + "\n")
    return str(p)


def _sft_cfg(cfg_file, path):
    return load_run_config(cfg_file, [f"data.train_path={path}", "sft.enabled=true", "sft.eval_size=1"])


def test_an_sft_problem_without_a_solution_names_file_and_row(cfg_file, tmp_path):
    from megatron_rl.demo import build_char_tokenizer
    from megatron_rl.trainer.context import load_run_data

    path = _rows(tmp_path, ["2", "4", None, "8"])
    with pytest.raises(DataError) as e:
        load_run_data(_sft_cfg(cfg_file, path), build_char_tokenizer(), 64)
    assert f"{path}: row 3:" in str(e.value) and "solution" in str(e.value)


def test_an_sft_sequence_longer_than_the_models_positions_names_file_and_row(cfg_file, tmp_path):
    from megatron_rl.demo import build_char_tokenizer
    from megatron_rl.trainer.context import load_run_data
    from megatron_rl.trainer.phases import sft_batch

    tok = build_char_tokenizer()
    path = _rows(tmp_path, ["0", "2", "4" * 30, "6"])
    cfg = _sft_cfg(cfg_file, path)
    _, sft, _ = load_run_data(cfg, tok, 64)
    longest = max(len(s) for s in sft_batch(sft, tok).sequences)  # what SFT would train on
    load_run_data(cfg, tok, longest)  # fits exactly
    with pytest.raises(DataError) as e:
        load_run_data(cfg, tok, longest - 1)
    msg = str(e.value)
    assert f"{path}: row 3:" in msg and f"is {longest} tokens" in msg and f"({longest - 1})" in msg, msg


# --- an external server's max model length -------------------------------------------------------
@pytest.fixture
def model_card_server():
    """Answers /v1/models as vLLM's server does (vllm/entrypoints/openai/models/serving.py)."""
    card = {"max_model_len": 28}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (and the other routes the trainer checks, answered as vLLM does)
            routes = {"/v1/models": {"object": "list", "data": [{"id": "m", "object": "model", **card}]},
                      "/health": {}, "/is_paused": {"is_paused": False}, "/weight_info": {"weight_version": "default"}}
            body = json.dumps(routes.get(self.path, {"detail": "Not Found"})).encode()
            self.send_response(200 if self.path in routes else 405 if self.path == "/inference/v1/generate" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", card
    srv.shutdown()
    srv.server_close()


def test_an_external_server_too_short_for_the_run_is_refused_before_anything_is_built(cfg_file, model_card_server):
    url, card = model_card_server
    ext = ["rollout.engine=vllm_server", "rollout.placement=external", "sync.transport=gloo",
           "rollout.server_urls=[http://127.0.0.1:9, " + url + "]"]  # the first is not up: checked later
    check_external_servers(load_run_config(cfg_file, ext))  # 16 + 12 = 28 fits
    with pytest.raises(ConfigError) as e:
        check_external_servers(load_run_config(cfg_file, [*ext, "rollout.eval_max_tokens=13"]))
    msg = str(e.value)
    assert e.value.key == "rollout.server_urls[1]" and url in msg and "max_model_len=28" in msg and "29" in msg, msg
    card["max_model_len"] = 27
    with pytest.raises(ConfigError):
        check_external_servers(load_run_config(cfg_file, ext))


# --- the difficulty tool ------------------------------------------------------------------------
def test_difficulty_refuses_a_prompt_plus_max_tokens_beyond_the_model_before_the_engine(tmp_path, tiny_llama):
    from megatron_rl.tools.difficulty import DifficultyConfig, check_fits, run

    check_fits(256, tiny_llama, "x")  # the tiny model has 256 positions
    with pytest.raises(ConfigError):
        check_fits(257, tiny_llama, "x")

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "reward_model": {"ground_truth": "1", "style": "math"}}) + "\n"
                            for p in ("1+0=", "10000+0=", "2+0=")))
    cfg = DifficultyConfig.from_dict({"max_tokens": 250})
    with pytest.raises(ConfigError) as e:
        run(str(data), tiny_llama, str(tmp_path / "o.jsonl"), None, cfg)
    msg = str(e.value)
    assert e.value.key == "max_tokens" and f"{data}: row 2:" in msg and "256" in msg, msg
