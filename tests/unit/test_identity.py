"""sglang_hs/server/identity.py: the manifest's `served` names the target, the draft and the chat template
with hashes of exactly the files that define them, and never fails a server over what it cannot read."""
import hashlib
import json
import types

from sglang_hs.server.identity import chat_template_sha256, model_identity, served_identity


def _sha(b):
    return hashlib.sha256(b).hexdigest()


def _model(tmp_path, name, config=b'{"architectures": ["DeepseekV3ForCausalLM"]}', **files):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_bytes(config)
    for fname, data in files.items():
        (d / fname.replace("__", ".")).write_bytes(data)
    return str(d)


def test_a_model_is_its_path_revision_and_config_hash(tmp_path):
    path = _model(tmp_path, "target")
    assert model_identity(path, "abc") == {"path": path, "revision": "abc",
                                           "config_sha256": _sha(b'{"architectures": ["DeepseekV3ForCausalLM"]}')}
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "params.json").write_bytes(b"{}")
    assert model_identity(str(mistral))["config_sha256"] == _sha(b"{}")
    assert model_identity("no-such-org/no-such-model")["config_sha256"] is None  # not cached: no download
    assert model_identity(None) is None and model_identity("") is None


def test_the_chat_template_is_the_one_sglang_applies(tmp_path):
    tok = _model(tmp_path, "tok", tokenizer_config__json=json.dumps({"chat_template": "{{ messages }}"}).encode())
    assert chat_template_sha256(None, tok) == _sha(b"{{ messages }}")
    (tmp_path / "tok" / "chat_template.jinja").write_bytes(b"{% for m in messages %}{{ m }}{% endfor %}")
    assert chat_template_sha256(None, tok) == _sha(b"{% for m in messages %}{{ m }}{% endfor %}")  # it wins
    given = tmp_path / "mine.jinja"
    given.write_bytes(b"mine")
    assert chat_template_sha256(str(given), tok) == _sha(b"mine")  # --chat-template FILE
    assert chat_template_sha256("chatml", tok) == _sha(b"sglang-template:chatml")  # a built-in, by name
    named = _model(tmp_path, "named", tokenizer_config__json=json.dumps(
        {"chat_template": [{"name": "default", "template": "a"}, {"name": "tool_use", "template": "b"}]}).encode())
    assert chat_template_sha256(None, named) == _sha(json.dumps(
        [{"name": "default", "template": "a"}, {"name": "tool_use", "template": "b"}], sort_keys=True).encode())
    bare = _model(tmp_path, "bare", tokenizer_config__json=b"not json")
    assert chat_template_sha256(None, bare) is None and chat_template_sha256(None, None) is None


def test_served_identity_of_a_speculative_and_a_plain_server(tmp_path):
    target = _model(tmp_path, "target", tokenizer_config__json=json.dumps({"chat_template": "t"}).encode())
    draft = _model(tmp_path, "draft", config=b'{"architectures": ["LlamaForCausalLMEagle3"]}')
    args = types.SimpleNamespace(model_path=target, tokenizer_path=target, revision=None, chat_template=None,
                                 speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                                 speculative_draft_model_revision="v2", speculative_num_steps=3,
                                 speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    served = served_identity(args)
    assert served == {
        "target": {"path": target, "revision": None, "config_sha256": _sha(b'{"architectures": ["DeepseekV3ForCausalLM"]}')},
        "draft": {"path": draft, "revision": "v2", "config_sha256": _sha(b'{"architectures": ["LlamaForCausalLMEagle3"]}')},
        "speculative": {"algorithm": "EAGLE3", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4},
        "chat_template_sha256": _sha(b"t"),
    }
    json.dumps(served)  # goes into manifest.json as it is
    plain = served_identity(types.SimpleNamespace(model_path=target, tokenizer_path=None))
    assert plain["draft"] is None and plain["speculative"] is None and plain["chat_template_sha256"] == _sha(b"t")
    ngram = served_identity(types.SimpleNamespace(model_path=target, speculative_algorithm="NGRAM"))
    assert ngram["draft"] is None and ngram["speculative"]["algorithm"] == "NGRAM"


def test_resolved_args_prefer_what_sglang_resolved(monkeypatch):
    """SGLang resolves an MTP draft's path to the target's in the runtime context's `spec` namespace; the flags
    (server_args) keep None there. The manifest must name what was resolved."""
    from sglang.srt import runtime_context

    from sglang_hs.server.identity import resolved_args

    class Bag:
        def __init__(self, **fields):
            self.__dict__.update(fields)

    bags = {"spec": Bag(speculative_draft_model_path="/ckpt", speculative_algorithm="EAGLE"), "model": Bag(revision="r1")}

    class Context:
        def config_bag(self, name):
            if name not in bags:
                raise ValueError(name)
            return bags[name]

    flags = types.SimpleNamespace(speculative_draft_model_path=None, speculative_algorithm="NEXTN", chat_template="x",
                                  revision=None)
    monkeypatch.setattr(runtime_context, "get_context", lambda: Context())
    args = resolved_args(flags)
    assert (args.speculative_draft_model_path, args.speculative_algorithm, args.revision) == ("/ckpt", "EAGLE", "r1")
    assert args.chat_template == "x" and args.tokenizer_path is None  # the flags, then None
    bags.clear()  # nothing published (e.g. before the scheduler publishes): the flags
    assert resolved_args(flags).speculative_draft_model_path is None
    assert resolved_args(None).model_path is None
