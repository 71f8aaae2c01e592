"""The fleet's inputs, refused before the first request or weight update, each in one line naming the
config key, the URL (or file) and what is wrong: the same server listed twice (however spelled),
URLs and hosts that are none, a service that is not vLLM at a URL (what it answered is said), a vLLM
server without the routes the trainer drives, a malformed engine-registry record (the engine it
leaves missing named, at once, not after the start-up timeout). The real vLLM servers' side (another
model than the policy's, a real server's 404) is in tests/integration/rollout/test_fleet.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.rollout import check_distinct, connect_fleet
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.identity import inspected_shape, policy_shape
from megatron_rl.rollout.registry import EngineRecord, EngineRegistry


def _external(urls, **kw) -> RolloutConfig:
    cfg = RolloutConfig(engine="vllm_server", placement="external", server_urls=list(urls), num_engines=len(urls),
                        start_timeout_s=kw.pop("start_timeout_s", 30.0), control_timeout_s=2.0, **kw)
    cfg.validate()
    return cfg


@pytest.mark.parametrize("urls,says", [
    (["http://localhost:8000", "http://127.0.0.1:8000/"], "entries 0 and 1 are the same server"),
    (["http://h:9000", "http://127.0.0.1:8000", "http://[::1]:8000"], "entries 1 and 2 are the same server"),
    (["http://node7", "http://NODE7.:80/"], "entries 0 and 1"),
    (["https://h", "http://h:443"], "entries 0 and 1"),
    (["http://h:8000/", "http://h:8000//"], "entries 0 and 1"),
    (["http://0.0.0.0:8000", "http://localhost:8000"], "entries 0 and 1"),
    (["http://h:99999"], "entry 0 is not a URL"),
    (["http://:8000"], "entry 0 names no host"),
    (["h:8000"], "entry 0 must start with http:// or https://"),
    (["http://h:8000?x=1"], "no user, query or fragment"),
    (["http://h:0"], "port 0"),
    ([" http://h:8000"], "white space"),
    ([""], "a base URL like http://host:8000 is needed"),
])
def test_fleet_server_urls_each_a_server_once(urls, says):
    with pytest.raises(ConfigError) as e:
        _external(urls)
    assert e.value.key == "server_urls" and says in str(e.value), str(e.value)


def test_fleet_distinct_servers_pass_and_hosts_are_checked():
    _external(["http://127.0.0.2:8000", "http://127.0.0.3:8000", "http://127.0.0.2:8001", "http://h:8000/v2"])
    for hosts, says in ((["n1", "N1."], "entries 0 and 1 are the same host"), (["n1", ""], "entry 1 must be"),
                        (["n1 n2"], "entry 0 must be a host name"), (["n1:22"], "entry 0")):
        with pytest.raises(ConfigError, match=says):
            RolloutConfig(engine="vllm_server", placement="dedicated", hosts=hosts).validate()


def test_fleet_the_same_server_by_name_and_by_address_is_refused_at_connection():
    host = socket.gethostname()
    try:
        ip = socket.getaddrinfo(host, 80, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        pytest.skip(f"{host} does not resolve here")
    urls = [f"http://{host}:8123", "http://10.255.255.1:8123", f"http://{ip}:8123/"]
    keys = [f"rollout.server_urls[{i}]" for i in range(3)]
    with pytest.raises(ConfigError) as e:
        check_distinct(urls, keys)
    assert e.value.key == "rollout.server_urls[2]" and f"same server as http://{host}:8123 (rollout.server_urls[0])" \
        in str(e.value), str(e.value)
    check_distinct(urls[:2], keys[:2])


class _Service:
    """A local HTTP server answering ``routes`` (path -> (status, body)); 404 elsewhere."""

    def __init__(self, routes: dict):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                status, body = routes.get(self.path.split("?")[0], (404, '{"detail":"Not Found"}'))
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_GET

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


VLLM = {"/health": (200, ""), "/v1/models": (200, {"object": "list", "data": [{"id": "m", "max_model_len": 64}]}),
        "/is_paused": (200, {"is_paused": False}), "/weight_info": (200, {"weight_version": "default"}),
        "/inference/v1/generate": (405, {"detail": "Method Not Allowed"})}


@pytest.mark.parametrize("routes,says", [
    ({}, "answered GET /health with HTTP 404 '{\"detail\":\"Not Found\"}': not a vLLM server"),
    ({"/health": (401, "<html><body>Unauthorized</body></html>")}, "answered GET /health with HTTP 401 '<html>"),
    ({**VLLM, "/v1/models": (200, "<html><title>Grafana</title></html>")},
     "answered GET /v1/models with HTTP 200 '<html><title>Grafana"),
    ({**VLLM, "/v1/models": (200, {"models": ["m"]})}, "answered GET /v1/models with HTTP 200"),
    ({k: v for k, v in VLLM.items() if k != "/is_paused"}, "VLLM_SERVER_DEV_MODE=1"),
    ({k: v for k, v in VLLM.items() if k != "/inference/v1/generate"}, "--enable-scale-out"),
])
def test_fleet_another_service_at_a_url_says_what_it_answered(routes, says):
    other = _Service(routes)
    up = _Service(VLLM)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as e:
            connect_fleet(_external([up.url, other.url]))
        assert time.monotonic() - t0 < 10, "refused at once, not at the start-up timeout"
        assert e.value.key == "rollout.server_urls[1]" and other.url in str(e.value), str(e.value)
        assert says in str(e.value), str(e.value)
    finally:
        other.close()
        up.close()


def test_fleet_a_silent_url_is_named_with_what_was_tried_at_the_deadline():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed: nothing listens
    with pytest.raises(ConfigError) as e:
        connect_fleet(_external([f"http://127.0.0.1:{port}"], start_timeout_s=0.5))
    msg = str(e.value)
    assert e.value.key == "rollout.server_urls[0]" and "within rollout.start_timeout_s=0.5s" in msg
    assert f"http://127.0.0.1:{port}: GET /health failed (ConnectError" in msg, msg


def _record(name="h2-0", **kw) -> dict:
    return {**json.loads(EngineRecord(name=name, url="http://127.0.0.2:8000", host="127.0.0.2", port=8000,
                                      model="/m").to_json()), **kw}


@pytest.mark.parametrize("content,says", [
    ("{not json", "not JSON"),
    (json.dumps([1, 2]), "a JSON list, not an object"),
    (json.dumps({k: v for k, v in _record().items() if k != "url"}), "no 'url'"),
    (json.dumps(_record(url=None)), "'url' is None, not a str"),
    (json.dumps(_record(url="127.0.0.2:8000")), "'url' must start with http://"),
    (json.dumps(_record(port="8000")), "'port' is '8000', not an int"),
    (json.dumps(_record(port=0)), "a port in 1..65535"),
    (json.dumps(_record(workers=True)), "'workers' is True"),
    (json.dumps(_record(gpu="0")), "unknown field(s) ['gpu']"),
    (json.dumps(_record(name="h3-0")), "names engine 'h3-0' in the file of engine 'h2-0'"),
    (b"\xff\xfe", "invalid start byte"),
])
def test_fleet_a_malformed_registry_record_names_the_file_and_the_engine(tmp_path, content, says):
    reg = EngineRegistry(tmp_path)
    reg.register(EngineRecord(name="h1-0", url="http://127.0.0.1:1", host="127.0.0.1", port=1, model="/m"))
    (tmp_path / "h2-0.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    (tmp_path / "notes.json").write_text("not ours, not waited for")
    cfg = RolloutConfig(engine="vllm_server", placement="dedicated", num_engines=2, start_timeout_s=30.0)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        connect_fleet(cfg, registry_dir=str(tmp_path), names=["h1-0", "h2-0"])
    msg = str(e.value)
    assert time.monotonic() - t0 < 5, "refused at once, not after rollout.start_timeout_s"
    assert e.value.key == "rollout.registry_dir" and str(tmp_path / "h2-0.json") in msg, msg
    assert says in msg and "engine 'h2-0' cannot be found" in msg, msg
    assert set(reg.records()) == {"h1-0"}  # the good record still reads
    with pytest.raises(ConfigError, match="h2-0.json"):  # counting engines (no names) stops the same
        EngineRegistry(tmp_path).wait(2, None, 30.0)


def test_fleet_model_shapes_from_an_inspection_and_a_config(tiny_llama):
    """The served model's shape read from vLLM's inspection format (here applied to the
    transformers model; the fleet test reads real servers') against the policy's config.json."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.model_inspection import format_model_inspection

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    served = inspected_shape(format_model_inspection(model))
    policy = policy_shape(tiny_llama)
    assert served == policy and policy.num_layers == model.config.num_hidden_layers and policy.vocab_size
    text = ("Qwen2ForCausalLM()(\n  (model): Qwen2Model()(\n    (embed_tokens): VocabParallelEmbedding("
            "num_embeddings=512, num_embeddings_per_partition=256, embedding_dim=96, org_vocab_size=500, "
            "num_embeddings_padded=512, tp_size=2)\n    (layers): ModuleList()(\n      (0-2, 4): 4 x "
            "Qwen2DecoderLayer()(\n        (mlp): X(in_features=1)\n      )\n      (3): PPMissingLayer()\n"
            "    )\n    (norm): RMSNorm(hidden_size=96)\n  )\n)")
    assert inspected_shape(text).__dict__ == dict(architecture="Qwen2ForCausalLM", vocab_size=500, hidden_size=96,
                                                  num_layers=5)
    assert inspected_shape(text).differences(policy) == [
        f"architecture Qwen2ForCausalLM (policy: {policy.architecture})", f"vocab_size 500 (policy: {policy.vocab_size})",
        f"hidden_size 96 (policy: {policy.hidden_size})", f"num_hidden_layers 5 (policy: {policy.num_layers})"]


def test_fleet_the_trainers_early_check_refuses_another_service_before_anything_is_built():
    """trainer.engines.check_external_servers (rank 0, before the policy is built): the same refusal."""
    from megatron_rl.trainer.engines import check_external_servers
    from megatron_rl.trainer.schema import load_run_config
    from tests.unit.test_entry_point_errors import DEMO

    other = _Service({"/health": (404, "<html>nginx</html>")})
    try:
        cfg = load_run_config(DEMO, ["rollout.engine=vllm_server", "rollout.placement=external", "sync.transport=gloo",
                                     f"rollout.server_urls=[http://127.0.0.1:9, {other.url}]"])
        with pytest.raises(ConfigError) as e:
            check_external_servers(cfg)
        assert e.value.key == "rollout.server_urls[1]" and "HTTP 404 '<html>nginx</html>'" in str(e.value)
    finally:
        other.close()


def test_fleet_a_registry_dir_that_is_a_file_is_refused_at_once(tmp_path):
    (tmp_path / "engines").write_text("not a directory")
    reg = EngineRegistry(tmp_path / "engines")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"'rollout.registry_dir'.*engines is not a directory"):
        reg.wait(1, ["h1-0"], 30.0)
    assert time.monotonic() - t0 < 5
    with pytest.raises(ConfigError, match=r"cannot register engine h1-0 in .*engines"):
        reg.register(EngineRecord(name="h1-0", url="http://127.0.0.1:1", host="127.0.0.1", port=1, model="/m"))
