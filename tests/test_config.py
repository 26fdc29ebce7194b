"""node.yaml: validation names the file and the key; IOP_* overrides."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from iop_trio.adapters.echo import EchoAdapter
from iop_trio.adapters.ollama import OllamaAdapter
from iop_trio.adapters.openai import OpenAIAdapter
from iop_trio.config import ConfigError, apply_env, load_config, structure_config
from iop_trio.model import AutoConcurrency, TenantLimits

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "node.yaml"


def example() -> dict[str, Any]:
    data = yaml.safe_load(EXAMPLE.read_text())
    assert isinstance(data, dict)
    return data


def check(data: dict[str, Any], env: dict[str, str] | None = None) -> Any:
    return structure_config(apply_env(data, env or {}, source="node.yaml"), source="node.yaml")


def test_the_example_config_is_valid_and_builds_a_node():
    config = load_config(EXAMPLE, environ={})
    assert config.node_id == "gpu-node-1"
    assert [t.name for t in config.target_specs()] == [
        "ollama/llama3:8b",
        "ollama/llama3:8b@precise",
        "vllm/meta-llama/Llama-3.1-8B-Instruct",
        "echo/test",
    ]
    slots = {s.adapter.name: s for s in config.build_adapters()}
    assert isinstance(slots["ollama"].adapter, OllamaAdapter)
    assert isinstance(slots["vllm"].adapter, OpenAIAdapter)
    assert isinstance(slots["echo"].adapter, EchoAdapter)
    assert slots["vllm"].adapter.capabilities.max_concurrency == 16
    assert (slots["ollama"].concurrency, slots["echo"].concurrency) == (4, None)
    assert config.limits().concurrency == 8
    assert config.metrics.address == ("127.0.0.1", 9464)
    vllm = config.target_specs()[2]
    assert "extra_body.min_p" in (vllm.allow_options or ())
    assert vllm.option_caps == {"max_tokens": 1024, "presence_penalty": {"min": -1, "max": 1}}
    assert config.limits().tenants == {
        "batch": TenantLimits(
            weight=1,
            max_queued=200,
            concurrency=4,
            max_tokens_in_flight=32768,
            tokens_per_minute=200000,
        ),
        "interactive": TenantLimits(weight=3),
    }
    assert slots["vllm"].auto == AutoConcurrency(1, 16)
    assert (vllm.token_budget, vllm.tokenizer, vllm.max_output_tokens) == (65536, "vllm", 512)


def test_environment_overrides_reach_nested_keys():
    config = load_config(
        EXAMPLE,
        environ={
            "IOP_RUNTIME__CONCURRENCY": "16",
            "IOP_EDGE__TOKEN": "from-env",
            "IOP_ADAPTERS__VLLM__API_KEY": "sk-test",
            "IOP_NODE_ID": "gpu-7",
            "IOP_LOGGING__FORMAT": "text",
            "UNRELATED": "x",
        },
    )
    assert config.runtime.concurrency == 16
    assert config.edge_token() == "from-env"
    assert config.adapters["vllm"].settings["api_key"] == "sk-test"
    assert config.node_id == "gpu-7"
    assert config.logging.format == "text"


def test_token_file(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    data = example()
    data["edge"] = {"url": "ws://127.0.0.1:1/node", "token_file": str(token)}
    assert check(data).edge_token() == "s3cret"
    token.chmod(0o640)  # readable by the group: refused, as ssh refuses such a key
    with pytest.raises(ConfigError, match=r"may be read by others \(mode 0640\); .*chmod 600"):
        check(data).edge_token()
    data["edge"]["token_file"] = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"node.yaml: edge.token_file: .*No such file"):
        check(data).edge_token()


def mutate(path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(example())
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is KeyError:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("runtime.concurrency", 0, "runtime.concurrency: must be an integer >= 1, not 0"),
        ("runtime.concurrency", 2.5, "runtime.concurrency: must be an integer, not 2.5"),
        ("runtime.concurrency", True, "runtime.concurrency: must be an integer, not True"),
        ("runtime.queue_timeout", "soon", "runtime.queue_timeout: must be a number, not 'soon'"),
        ("runtime.queue_timeout", -1, "runtime.queue_timeout: must be a number >= 0"),
        ("runtime.concurency", 3, "runtime: unknown key\\(s\\) concurency"),
        ("runtime.probe_interval", 0, "runtime.probe_interval: must be a number of seconds > 0"),
        ("runtime.chars_per_token", 0, "runtime.chars_per_token: must be a number > 0, not 0"),
        ("node_id", KeyError, "node_id: required key 'node_id' is missing"),
        ("targets.1.model", KeyError, "targets\\[1\\].model: required key 'model' is missing"),
        ("targets.0.adapter", "nope", "targets\\[0\\].adapter: 'nope' is not one of the adapters"),
        ("targets.2.concurrency", -1, "targets\\[2\\].concurrency: must be an integer >= 0"),
        ("adapters.ollama.kind", "llamafile", "adapters.ollama.kind: unknown kind 'llamafile'"),
        ("adapters.ollama.base_ur", "x", "adapters.ollama.base_ur: not a setting of kind"),
        ("adapters.vllm.concurrency", 0, "adapters.vllm.concurrency: must be an integer >= 1"),
        ("edge.url", "http://x", "edge.url: must start with ws:// or wss://"),
        ("logging.format", "xml", "logging.format: must be one of 'text', 'json', not 'xml'"),
        ("store.kind", "postgres", "store.kind: must be one of 'sqlite', 'memory'"),
        ("metrics.listen", "nope", "metrics.listen: must be host:port"),
        ("targets", [], "targets: a node needs at least one target"),
        ("tenants.batch.weight", 0, "tenants.batch.weight: must be a number > 0, not 0"),
        (
            "tenants.batch.weight",
            float("inf"),
            "tenants.batch.weight: must be a number > 0, not inf",
        ),
        ("tenants.batch.concurrency", -2, "tenants.batch.concurrency: must be an integer >= 0"),
        ("tenants.batch.share", 2, "tenants.batch: unknown key\\(s\\) share"),
        ("tenants.bad name", {}, "tenants: tenant 'bad name' must be up to 128 characters"),
        (
            "targets.2.allow_options",
            ["temperature", "extra_body.model"],
            "targets\\[2\\].allow_options: option 'extra_body.model' is pinned by the operator",
        ),
        ("targets.2.option_caps", {"max_tokens": -1}, "targets\\[2\\].option_caps.max_tokens"),
        (
            "metrics.listen",
            "0.0.0.0:9464",
            "metrics.listen: 0.0.0.0:9464 is not a loopback address; the ops port shows",
        ),
    ],
)
def test_bad_values_name_the_file_and_the_key(path, value, message):
    with pytest.raises(ConfigError, match=f"^node.yaml: {message}"):
        check(mutate(path, value))


def test_a_target_twice_is_refused():
    data = example()
    data["targets"].append(dict(data["targets"][0]))
    with pytest.raises(ConfigError, match="targets\\[4\\]: target 'ollama/llama3:8b' is config"):
        check(data)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"IOP_RUNTIME__CONCURRENCY": "many"}, "runtime.concurrency: must be an integer, not 'm"),
        ({"IOP_RUNTIME__CONCURRENCY": "[1"}, "IOP_RUNTIME__CONCURRENCY, line 1, column 1: this"),
    ],
)
def test_bad_environment_overrides(env, message):
    with pytest.raises(ConfigError, match=message):
        check(example(), env)


def test_file_problems_name_the_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"{missing}: cannot read"):
        load_config(missing, environ={})
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"node_id: x\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=f"^{latin}, line 2: not UTF-8 text$"):
        load_config(latin, environ={})
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config(listy, environ={})


def test_a_minimal_config_gets_defaults(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text(
        "node_id: n\nadapters: {echo: {kind: echo}}\ntargets: [{adapter: echo, model: m}]\n"
    )
    config = load_config(path, environ={})
    assert (config.edge.url, config.store.kind, config.runtime.max_queued) == ("", "sqlite", 1000)
    assert config.target_specs()[0].concurrency == 1
    assert config.limits().probe_interval == 30  # engines are asked every 30 s
    never = load_config(path, environ={"IOP_RUNTIME__PROBE_INTERVAL": "null"})
    assert never.limits().probe_interval is None
    often = load_config(path, environ={"IOP_RUNTIME__PROBE_INTERVAL": "5"})
    assert often.limits().probe_interval == 5
    assert config.limits().chars_per_token == 4  # a prompt's tokens, where none is reported
    dense = load_config(path, environ={"IOP_RUNTIME__CHARS_PER_TOKEN": "2.5"})
    assert dense.limits().chars_per_token == 2.5


@pytest.mark.parametrize("token", ["987654321", "@abc", "*abc", "~", "null", "abc #x", "'q'"])
def test_string_overrides_are_taken_as_they_are(token):
    data = copy.deepcopy(example())
    config = check(data, {"IOP_EDGE__TOKEN": token, "IOP_ADAPTERS__VLLM__API_KEY": token})
    assert config.edge_token() == token
    assert config.adapters["vllm"].settings["api_key"] == token
    # other keys still read YAML: numbers stay numbers
    assert check(data, {"IOP_RUNTIME__CONCURRENCY": "16"}).runtime.concurrency == 16


def test_a_secret_is_never_shown_in_a_message():
    data = copy.deepcopy(example())
    data["edge"]["token"] = 987654321  # in the file: a number, not a string
    with pytest.raises(ConfigError) as bad:
        check(data)
    assert "edge.token: must be a string" in str(bad.value)
    assert "987654321" not in str(bad.value)
    data = copy.deepcopy(example())
    data["adapters"]["vllm"]["api_key"] = ["sk-live-123"]
    with pytest.raises(ConfigError) as bad_key:
        check(data)
    assert "adapters.vllm.api_key" in str(bad_key.value)
    assert "sk-live-123" not in str(bad_key.value)
    data = copy.deepcopy(example())
    data["adapters"]["vllm"]["base_url"] = "ftp://admin:hunter2@engine"
    with pytest.raises(ConfigError) as bad_url:
        check(data)
    assert "hunter2" not in str(bad_url.value) and "ftp://***@engine" in str(bad_url.value)


def test_the_ops_port_off_loopback_needs_a_token(tmp_path):
    data = copy.deepcopy(example())
    data["metrics"] = {"listen": "0.0.0.0:9464", "token": "t0k"}
    assert check(data).ops_token() == "t0k"
    token = tmp_path / "ops-token"
    token.write_text("from-file\n")
    token.chmod(0o600)
    data["metrics"] = {"listen": "[::1]:9464", "token_file": str(token)}
    assert check(data).ops_token() == "from-file"
    data["metrics"] = {"listen": "127.0.0.1:9464"}
    assert check(data).ops_token() is None  # loopback: the run routes then answer 401


def test_relative_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    folder = tmp_path / "etc"
    folder.mkdir()
    path = folder / "node.yaml"
    data = copy.deepcopy(example())
    data["store"] = {"path": "var/node.db"}
    data["edge"] = {"url": "ws://127.0.0.1:1/node", "token_file": "secrets/token"}
    path.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)  # run from somewhere else
    config = load_config(path, environ={})
    assert config.store.path == str(folder / "var" / "node.db")
    assert config.edge.token_file == str(folder / "secrets" / "token")
    data["store"] = {"path": "/abs/node.db"}
    path.write_text(yaml.safe_dump(data))
    assert load_config(path, environ={}).store.path == "/abs/node.db"


#: A valid node.yaml, line by line; each case below breaks one line of it.
GOOD_YAML = [
    "node_id: n",  # 1
    "edge:",  # 2
    "  url: ws://127.0.0.1:8765/node",  # 3
    "  token_file: edge-token",  # 4
    "adapters:",  # 5
    "  echo: {kind: echo}",  # 6
    "targets:",  # 7
    "  - adapter: echo",  # 8
    "    model: m",  # 9
]


@pytest.mark.parametrize(
    ("line", "text", "where", "words"),
    [
        (4, "\ttoken_file: edge-token", "line 4, column 1", "a tab is not allowed for indenting"),
        (4, "    token_file: edge-token", "line 4, column 5", "this line is indented more than"),
        (4, " token_file: edge-token", "line 4, column 2", "this line does not line up with"),
        (3, "  url ws://127.0.0.1:8765/node", "line 3, column 3", "a ':' is missing after the key"),
        (2, "edge", "line 2, column 1", "a ':' is missing after the key"),
        (9, "    model m", "line 9, column 5", "a ':' is missing after the key"),
        (3, '  url: "ws://127.0.0.1/node', "line 3, column 8", "an unclosed quote starts here"),
        (3, "  url: 'ws://x' /node", "line 3, column 17", "unexpected text after the value"),
        (6, "  echo: {kind: echo", "line 6, column 9", "this '{' is not closed"),
        (6, "  echo: [{kind: echo}", "line 6, column 9", "this '[' is not closed"),
        (3, "  url: ws://x: 1", "line 3, column 14", "a value holds ': '; put the value in quotes"),
        (4, "  url: ws://y/node", "line 4, column 3", "'url' is given twice (first on line 3)"),
        (9, "    model: m\n    model: n", "line 10, column 5", "'model' is given twice (fi"),
        (4, "  - edge-token", "line 4, column 3", "a '- ' item where a key should be"),
        (1, "node_id: @n", "line 1, column 10", "a value cannot start with '@'; quote it"),
        (1, "node_id: *n", "line 1, column 10", "'*n' names no anchor"),
    ],
)
def test_yaml_mistakes_name_the_line_in_plain_words(tmp_path, line, text, where, words):
    lines = list(GOOD_YAML)
    lines[line - 1] = text
    path = tmp_path / "node.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as bad:
        load_config(path, environ={})
    message = str(bad.value)
    assert message.startswith(f"{path}, {where}: {words}"), message
    said = message.removeprefix(f"{path}, {where}: ")
    assert "\n" not in said
    for jargon in ("while ", "mapping values", "but found", "could not", "<", "scalar", "token"):
        assert jargon not in said


def test_the_good_yaml_of_the_mistakes_is_good(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text("\n".join(GOOD_YAML) + "\n")
    assert load_config(path, environ={}).edge.url == "ws://127.0.0.1:8765/node"


def test_a_variable_that_names_no_key_is_ignored_and_said_once(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text(
        "node_id: n\nadapters: {echo: {kind: echo}}\ntargets: [{adapter: echo, model: m}]\n"
    )
    environ = {
        "IOP_RUNTIME__CONCURENCY": "3",  # a typo
        "IOP_PY": "/usr/bin/python3",  # someone else's
        "IOP_EDGE_TOKEN": "t",  # iop-node edge's own
        "IOP_ADAPTERS__NOPE__BASE_URL": "x",
        "IOP_RUNTIME__MAX_QUEUED": "7",
    }
    config = load_config(path, environ=environ)
    assert config.runtime.max_queued == 7
    assert [w.split()[0] for w in config.warnings] == [
        "IOP_ADAPTERS__NOPE__BASE_URL",
        "IOP_PY",
        "IOP_RUNTIME__CONCURENCY",
    ]
    assert "names no configuration key (runtime.concurency); ignored" in config.warnings[2]
