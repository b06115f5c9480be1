"""serve.check_server_args on SGLang's own resolved arguments: every refused flag is named, in one line.

Each case builds the real ServerArgs the way the server process does (`prepare_server_args(argv)`,
`resolve_once()`, `resolving_view`) for the embedded tiny DeepSeek-V3 in CPU mode, as the launcher
would start it. No server, no model load: resolution reads only the checkpoint's config.
"""
import os
import sys

import pytest

from sglang_hs.tools import tiny_model
from sglang_hs.server.capture_spec import CaptureConfigError
from sglang_hs.server.cpu import stubs_dir
from sglang_hs.server.serve import check_server_args, cpu_torch_compile

# (extra SGLang argv, the flag the refusal must name first). Flags that put KV into a slot without a
# forward pass (the store's rows for that slot would be stale), then the older refusals.
REFUSED = [
    (["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
    (["--enable-hicache"], "--enable-hierarchical-cache"),  # SGLang's alias of the same field
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "file"], "--enable-hierarchical-cache"),
    (["--hicache-storage-backend", "file"], "--hicache-storage-backend"),
    (["--enable-lmcache"], "--enable-lmcache"),
    (["--enable-flexkv"], "--enable-flexkv"),
    (["--radix-cache-backend", "flexkv"], "--radix-cache-backend"),
    (["--enable-unified-cache-external-linker"], "--enable-unified-cache-external-linker"),
    (["--enable-hisparse"], "--enable-hisparse"),
    # the CPU engine's default torch_native backend is not in the unified pool's allow-list: resolution
    # rejects it before us, so pick an allowed one (resolution only; nothing runs)
    (["--enable-unified-memory", "--attention-backend", "triton"], "--enable-unified-memory"),
    (["--disaggregation-mode", "decode"], "--disaggregation-mode"),
    (["--disaggregation-mode", "prefill"], "--disaggregation-mode"),
    (["--disaggregation-mode", "decode", "--disaggregation-decode-enable-offload-kvcache",
      "--hicache-storage-backend", "file"], "--disaggregation-decode-enable-offload-kvcache"),
    (["--tp", "2", "--dcp-size", "2"], "--dcp-size > 1"),
    (["--dp-size", "2"], "--dp-size > 1 without DP attention"),
    (["--tp", "2", "--attn-cp-size", "2"], "--attn-cp-size > 1"),
    (["--pp-size", "2"], "--pp-size > 1"),
    (["--enable-two-batch-overlap"], "--enable-two-batch-overlap"),
    (["--enable-pdmux"], "--enable-pdmux"),
    (["--speculative-algorithm", "STANDALONE"], "--speculative-algorithm STANDALONE"),  # capture under it: not yet
    (["--enable-torch-compile"], "--enable-torch-compile"),
    (["--enable-return-aux-hidden-states", "--speculative-algorithm", "DFLASH", "--return-aux-hidden-state-layer-ids",
      "1", "2"], "--enable-return-aux-hidden-states with --speculative-algorithm DFLASH"),
    (["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"], "--enable-lora"),
    (["--enable-decoder-swa-bounded-replay"], "--enable-decoder-swa-bounded-replay"),  # DeepSeek-V4.1
]

# Audited and left allowed (see the comment in check_server_args): none puts KV into a slot without a
# forward of this server.
ALLOWED = [
    [],
    ["--disable-radix-cache"],
    ["--enable-streaming-session"],
    ["--enable-session-radix-cache"],
    ["--enable-pd-role-switch"],  # acts only in PD mode, which is refused
    ["--tp", "2", "--enable-dp-attention"],  # one attention-DP group (attn_dp_size 1)
    ["--tp", "2", "--attn-dp-size", "2"],  # one writer per DP attention group (tests/e2e/test_multi_rank.py)
    ["--tp", "2", "--dp-size", "2", "--enable-dp-attention"],  # the same, older spelling (resolves to attn_dp_size)
    ["--speculative-algorithm", "NGRAM"],  # its verify is the target's forward; the store follows its KV moves
    ["--speculative-algorithm", "EAGLE3"],  # the same, and the draft's aux layers are captured with ours
    ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"],  # SGLang's JSON aux beside ours
]

# Also audited and not refused by sglang-hs: SGLang's own resolution rejects each of these unless a flag
# refused above comes with it (PD mode, the external linker, unified memory).
NEED_A_REFUSED_FLAG = [
    (["--enable-kv-cache-sharding"], "PD prefill workers"),
    (["--disaggregation-decode-retraction-backup", "host_pool"], "PD decode server"),
    (["--disaggregation-decode-host-receive-threshold", "0.5"], "PD decode server"),
    (["--disaggregation-decode-enable-offload-kvcache"], "decode side"),
    (["--enable-linker-mla-dedup"], "requires the Mooncake linker"),
    (["--enable-page-major-kv-layout"], "without --enable-unified-memory"),
]


@pytest.fixture(scope="module")
def resolve():
    """argv -> SGLang's resolved view, built in the CPU mode the launcher sets up (SGLANG_USE_CPU_ENGINE,
    the sgl_kernel stand-in first on the path); os.environ, which SGLang's resolution writes to, and
    sys.path are restored afterwards."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    saved_env, saved_path = dict(os.environ), list(sys.path)
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    sys.path.insert(0, stubs_dir())
    model = tiny_model.ensure()

    def _resolve(extra, model_path=None):
        server_args = prepare_server_args(["--model-path", model_path or model, "--device", "cpu",
                                           "--max-total-tokens", "4096", *extra])
        server_args.resolve_once()
        return resolving_view(server_args)

    try:
        yield _resolve
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path


@pytest.fixture
def capturing(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HS_DUMP_DIR", str(tmp_path / "hs"))


def _id(case):
    return " ".join(case[0]) or "plain"


@pytest.mark.parametrize("extra, flag", REFUSED, ids=[_id(c) for c in REFUSED])
def test_refused_naming_the_flag(resolve, capturing, extra, flag):
    cfg = resolve(extra)
    with pytest.raises(CaptureConfigError) as e:
        check_server_args(cfg)
    message = str(e.value)
    print(message)
    assert message.startswith(f"unsupported with --hs-dump-dir: {flag}"), message
    assert "\n" not in message and "; " in message  # one line, then what to do instead


@pytest.mark.parametrize("extra", ALLOWED, ids=[" ".join(a) or "plain" for a in ALLOWED])
def test_allowed_configs_pass(resolve, capturing, extra):
    check_server_args(resolve(extra))


@pytest.mark.parametrize("extra, flag", REFUSED, ids=[_id(c) for c in REFUSED])
def test_nothing_refused_without_capture(resolve, monkeypatch, extra, flag):
    monkeypatch.delenv("SGLANG_HS_DUMP_DIR", raising=False)
    check_server_args(resolve(extra))  # plain serving: every SGLang feature stays available


@pytest.mark.parametrize("extra, reason", NEED_A_REFUSED_FLAG, ids=[_id(c) for c in NEED_A_REFUSED_FLAG])
def test_sglang_rejects_alone(resolve, extra, reason):
    """If SGLang 0.5.23 ever accepts one of these on its own, it needs a refusal of its own here."""
    with pytest.raises((ValueError, AssertionError), match=reason):
        resolve(extra)


@pytest.mark.parametrize("variant, extra, given, served, said", [
    ("v3", ["--dtype", "float32"], None, "1", "TORCHDYNAMO_DISABLE=1 (set by sglang-hs for float32"),
    ("v3", ["--dtype=float"], None, "1", "TORCHDYNAMO_DISABLE=1 (set by sglang-hs for float32"),
    ("v3", [], None, None, "torch.compile on (dtype auto;"),  # SGLang turns auto into float16 or bfloat16, never float32
    ("v3", ["--dtype", "float32", "--enable-torch-compile"], None, None, "torch.compile on (--enable-torch-compile;"),
    # SGLang serves Mistral Large 3 in bfloat16 whatever --dtype asks (arg_groups/model_override_base.py)
    ("mistral-large-3", ["--dtype", "float32"], None, None, "torch.compile on (dtype bfloat16;"),
    ("v3", ["--dtype", "float32"], "0", "0", "TORCHDYNAMO_DISABLE=0 (from the environment)"),  # the user's: kept
    ("v3", ["--dtype", "float32"], "", "", "TORCHDYNAMO_DISABLE= (from the environment)"),
    ("v3", [], "1", "1", "TORCHDYNAMO_DISABLE=1 (from the environment)"),
])
def test_cpu_mode_runs_compiled_helpers_eagerly_only_where_sglang_serves_float32(resolve, variant, extra, given,
                                                                                   served, said):
    """The server's processes get TORCHDYNAMO_DISABLE=1 when SGLang's resolved dtype is float32 and the user
    set none (benchmarks/bench_cpu_startup.py): there eager computes SGLang's compiled helpers in the same
    precision. Other dtypes compile (in bfloat16 the compiled MoE top-k keeps its sigmoid in float32, eager
    would not), so does --enable-torch-compile; the dtype is SGLang's, not the flag's."""
    cfg = resolve(extra, tiny_model.ensure(variant))
    env = {} if given is None else {"TORCHDYNAMO_DISABLE": given}
    line = cpu_torch_compile(env, cfg)
    assert env.get("TORCHDYNAMO_DISABLE") == served and said in line, (env, line)
