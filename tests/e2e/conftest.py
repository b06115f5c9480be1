"""One real server per configuration, shared by the tests of a session: a server several modules use
(`shared`) starts with the first test that needs it and stops right after the last selected test that
uses it, not at the session's end, so no more servers run at once than the tests at hand need."""
import glob
import os
import time

import pytest

from helpers import Launcher, leftover_server_processes, serving
from sglang_hs.tools.supervisor import mapped_shm

_LAST_USER = {}  # shared server fixture -> nodeid of the last selected test that uses it
_RUNNING = {}  # shared server fixture -> its server generator, until stopped
SHARED = ("capture_server", "plain_sched_server", "float32_pool_server")


def pytest_collection_finish(session):
    for item in session.items:  # the selection as it will run (-k, deselection and ordering done)
        for name in SHARED:
            if name in getattr(item, "fixturenames", ()):
                _LAST_USER[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test that uses a shared server (and the fixtures its module tore down): stop it. A
    failure of its teardown checks is this test's teardown error."""
    for name, nodeid in list(_LAST_USER.items()):
        if nodeid == item.nodeid:
            _stop(name)


def _shared(name, server_gen):
    """A fixture body for server fixture `name`, stopped after its last user (or at the session's end)."""
    server = next(server_gen)
    _RUNNING[name] = server_gen
    try:
        yield server
    finally:
        _stop(name)


def _stop(name):
    gen = _RUNNING.pop(name, None)
    if gen is not None:
        for _ in gen:  # the rest of the generator: the server's stop and its checks
            pass

CHUNK = 16
HARVEST_SAMPLE_KEY = "5eed" * 8  # harvest_server's --hs-capture-sample-key (a server draws one by default)
POOL = 128  # KV slots of the float32 servers: freed slots are handed out again at once (test_exact_rows.py)
FINISH_DELAY = 0.05  # seconds their finish worker waits before each gather: writes into its slots wait meanwhile
HOLD_RID, HOLD_S = "x-hold-", 20  # their gather of a request with this rid prefix waits for a write to wait for it
# SGLang's admission reserves new_token_ratio x the remaining max_new_tokens of KV for each running
# request's decode (0.7 at start, decaying to 0.1; the request being admitted reserves all of its own).
# The float32 servers start at RETRACT_RATIO, and go back to it when idle: next to nothing is reserved
# for running requests, so concurrent decodes outgrow the POOL-token pool and SGLang retracts requests
# (frees their KV and prefills them again later, prompt and generated tokens; test_exact_rows.py)
RETRACT_RATIO = 0.02


@pytest.fixture(scope="session")
def dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hs") / "dump"


@pytest.fixture(scope="session")
def capture_server(dump_dir):
    """The embedded tiny DeepSeek-V3 on the CPU engine with capture on, chunked prefill of 16 tokens,
    radix cache, overlap scheduler and the server's own warm-up all left on; both final states (--hs-last
    both: SpecForge's post-norm and speculators' pre-norm, so both --format choices extract from it)."""
    yield from _shared("capture_server", _serve(dump_dir, ["--hs-last", "both", "--chunked-prefill-size", str(CHUNK)]))


# The float32 pool servers' flags (tests/e2e/test_exact_rows.py, tests/e2e/test_full_pool.py): float32 (rows
# match HF float32 to ~1e-6), a KV pool of POOL tokens that the radix cache keeps full (every finished prefix
# stays until eviction makes room), chunked prefill of CHUNK tokens, the overlap scheduler left on (SGLang's
# default, also in CPU mode), both final states (each judged per row), metrics on (SGLang's eviction counter
# shows the pool was full), and the finish worker slowed (_slow_finish).
FULL_POOL_FLAGS = ["--dtype", "float32", "--hs-last", "both", "--chunked-prefill-size", str(CHUNK),
                   "--max-total-tokens", str(POOL), "--enable-metrics"]


@pytest.fixture(scope="session")
def float32_pool_server(tmp_path_factory):
    """The exact oracle's direct-copy server (test_exact_rows.py) and the full pool's (test_full_pool.py):
    FULL_POOL_FLAGS, --hs-copy direct; a finish worker that waits FINISH_DELAY before each gather (slots
    are freed and handed out again while gathers are pending), and admission that reserves next to nothing
    for decode (RETRACT_RATIO: decode retracts requests). Shared: stopped after the last test using it."""
    yield from _shared("float32_pool_server", _slow_finish(_serve(tmp_path_factory.mktemp("hs-f32-pool") / "dump",
                                                                  FULL_POOL_FLAGS)))


@pytest.fixture(scope="module")
def exact_staging_server(tmp_path_factory):
    """The other float32 server: --hs-copy staging with an 8-row stage (each 16-token prefill chunk and
    each decode batch of more than 8 rows is shipped in several pieces), overlap scheduler off."""
    yield from _slow_finish(_serve(tmp_path_factory.mktemp("hs-exact-staging") / "dump",
                                   ["--dtype", "float32", "--hs-last", "both", "--chunked-prefill-size", str(CHUNK),
                                    "--hs-copy", "staging", "--hs-staging-rows", "8", "--disable-overlap-schedule",
                                    "--max-total-tokens", str(POOL)]))


@pytest.fixture(scope="module")
def full_pool_opt_in_server(tmp_path_factory):
    """A full KV pool under --hs-capture opt-in (uncaptured requests leave markers), --hs-copy staging with
    an 8-row stage: between them the two full-pool servers take both copy strategies."""
    yield from _slow_finish(_serve(tmp_path_factory.mktemp("hs-full-pool-opt-in") / "dump",
                                   [*FULL_POOL_FLAGS, "--hs-capture", "opt-in", "--hs-copy", "staging",
                                    "--hs-staging-rows", "8"]))


@pytest.fixture(scope="module")
def harvest_server(tmp_path_factory):
    """A float32 server harvesting like a production one (tests/e2e/test_harvest.py): only requests that
    opt in or fall in a 10% sample are captured, and when its 2 MiB output ring is too full for a new
    record the request is served without capture (--hs-when-behind skip). Chunked prefill of 16 tokens,
    radix cache and overlap scheduler on, --hs-last, metrics on."""
    yield from _serve(tmp_path_factory.mktemp("hs-harvest") / "dump",
                      ["--dtype", "float32", "--hs-last", "--chunked-prefill-size", str(CHUNK),
                       "--hs-capture", "opt-in", "--hs-capture-sample", "0.1", "--hs-when-behind", "skip",
                       "--hs-capture-sample-key", HARVEST_SAMPLE_KEY,  # so the tests know which rids are sampled
                       "--hs-ring-size", "2MiB", "--context-length", "128", "--enable-metrics"])


@pytest.fixture(scope="module")  # used by one module: stopped after it
def contract_server(tmp_path_factory):
    """The request-contract server (tests/e2e/test_request_contract.py): float32 (rows judged against HF
    float32), --hs-last, chunked prefill of CHUNK tokens, radix cache and overlap scheduler on, and
    --enable-return-hidden-states, so every per-request shape SGLang 0.5.23 accepts can be sent to it
    (beam search, sessions and n > 1 need no server flag)."""
    yield from _serve(tmp_path_factory.mktemp("hs-contract") / "dump",
                      ["--dtype", "float32", "--hs-last", "--chunked-prefill-size", str(CHUNK),
                       "--enable-return-hidden-states"])


# The speculative servers (tests/e2e/test_speculative.py), one per algorithm, one at a time: float32, chunked
# prefill of CHUNK tokens, the radix cache, --hs-last both, metrics on, and harvesting as a production server
# would (--hs-capture opt-in: only requests that ask are captured, the others leave a marker). NGRAM: SGLang's default tree of 12
# draft tokens per verify (up to 10 branches), so accepted drafts' KV (and rows) are moved within each
# request's window. EAGLE: the "v3-mtp" checkpoint's MTP layer as the draft, DeepSeek's MTP setting (one
# step, top-1, 2 verify tokens); the draft proposes the target's last token again, perturbed by its own attention
# (tiny_model._add_mtp_layer, MTP_ATTENTION);
# served with `--tp 2 --dp 2 --enable-dp-attention` (SPEC_TP, SPEC_DP: DeepSeek's production pairing at scale, MTP
# under DP attention; the launcher binds one core per rank, each group's rank writes), so every EAGLE test below runs
# on two attention groups, each verify batch padded to the other group's.
# EAGLE3: a tiny EAGLE-3 draft (tiny_eagle3) reading target layers of its own beside ours, same setting; its
# server comes with a twin without capture (`.plain`, started alongside), whose drafts must fare the same.
# Each also samples half of the requests that do not opt in (HARVEST_SAMPLE_KEY) and keeps of those only the
# ones its draft did poorly on (--hs-capture-accept-below SPEC_ACCEPT_BELOW; NGRAM: the lowest half of the last 8).
# (--speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens) of each EAGLE-family server,
# both running the draft's multi-step decode backend (patches/eagle_cpu_draft.py) for their steps 1 and 2. EAGLE:
# DeepSeek's production MTP setting, a chain of 3 drafts verified with the last token (4 tokens). EAGLE3: a tree,
# two branches per step, of which the best 4 drafts are verified with the last token
SPEC_DRAFT = {"EAGLE": (3, 1, 4), "EAGLE3": (3, 2, 5)}


def _spec_step(steps, topk, tokens):
    return ["--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(tokens)]


SPEC_SAMPLE, SPEC_ACCEPT_BELOW = 0.5, 1.25
# NGRAM selects on a fraction of recent traffic instead (--hs-capture-accept-lowest, over a window of 8 requests)
SPEC_ACCEPT_LOWEST, SPEC_ACCEPT_WINDOW = 0.5, 8
SPECULATIVE = {
    "NGRAM": ["--speculative-algorithm", "NGRAM"],
    "EAGLE": ["--speculative-algorithm", "EAGLE", *_spec_step(*SPEC_DRAFT["EAGLE"])],
    "EAGLE3": ["--speculative-algorithm", "EAGLE3", *_spec_step(*SPEC_DRAFT["EAGLE3"])],
}
SPEC_TP = {"EAGLE": 2}  # ranks (--tp) of each speculative server; 1 where not named
SPEC_DP = {"EAGLE": 2}  # DP-attention groups (--dp, --enable-dp-attention) of each; 1 where not named
# NGRAM also never holds a request for its reader (--hs-when-behind skip: test_speculative's skip test), on a ring
# of SPEC_RING that a reader not draining fills: room for the module's longest request (the aborted one, 51 + 2,000
# tokens) with SPEC_RECORD_TOKENS, and for about twenty of the skip test's records, not its 24
SPEC_RING, SPEC_RECORD_TOKENS = "24MiB", 2100
SPEC_WHEN_BEHIND = {"NGRAM": ["--hs-when-behind", "skip", "--hs-ring-size", SPEC_RING,
                              "--hs-max-record-tokens", str(SPEC_RECORD_TOKENS)]}


@pytest.fixture(scope="module", params=sorted(SPECULATIVE))
def speculative_server(request, tmp_path_factory):
    from sglang_hs.tools import tiny_eagle3, tiny_model

    model = {"EAGLE": ["--model-path", tiny_model.ensure("v3-mtp")],
             "EAGLE3": ["--speculative-draft-model-path", tiny_eagle3.ensure()]}.get(request.param, [])
    tp, dp = SPEC_TP.get(request.param, 1), SPEC_DP.get(request.param, 1)
    flags = [*model, "--dtype", "float32", "--chunked-prefill-size", str(CHUNK * dp), *SPECULATIVE[request.param],
             *(["--tp", str(tp)] if tp > 1 else []),
             *(["--dp", str(dp), "--enable-dp-attention"] if dp > 1 else []), "--enable-metrics"]
    plain = Launcher(flags) if request.param == "EAGLE3" else None
    try:
        dump = tmp_path_factory.mktemp(f"hs-{request.param.lower()}") / "dump"
        # EAGLE3: without --hs-layers the capture would take the draft's own layers (server/layer_source.py); the
        # default's 2,4,5 keep ours apart from the draft's (2, 5, 7)
        ours = ["--hs-layers", "2,4,5"] if request.param == "EAGLE3" else []
        select = ["--hs-capture-accept-lowest", str(SPEC_ACCEPT_LOWEST), "--hs-capture-accept-window",
                  str(SPEC_ACCEPT_WINDOW)] if request.param == "NGRAM" else \
            ["--hs-capture-accept-below", str(SPEC_ACCEPT_BELOW)]
        gen = _serve(dump, [*flags, *ours, "--hs-last", "both", "--hs-capture", "opt-in", "--hs-capture-sample",
                            str(SPEC_SAMPLE), "--hs-capture-sample-key", HARVEST_SAMPLE_KEY, *select,
                            *SPEC_WHEN_BEHIND.get(request.param, [])])
        server = next(gen)
        server.algorithm, server.tp, server.dp = request.param, tp, dp
        try:
            server.plain = plain and plain.wait_ready()
            yield server
        finally:
            for _ in gen:  # stop it and check it left nothing
                pass
    finally:
        if plain is not None:
            assert plain.stop() == 128 + 15, f"launcher exit {plain.proc.returncode}:\n{plain.tail()}"
            assert not leftover_server_processes(plain.output)


@pytest.fixture(scope="session")
def hf():
    """HF transformers' float32 `output_hidden_states` of the embedded checkpoint, for token ids, with the
    final pre-norm state (the input of model.model.norm, taken by a forward hook) as `.pre_norm`; its
    tokenizer as `hf.tok` and the model as `hf.model`. The reference every captured row is judged against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_hs.tools import tiny_model

    path = tiny_model.ensure()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)

    def hidden_states(ids):
        return hf_states(model, ids)

    hidden_states.tok = tok
    hidden_states.model = model  # test_speculative's MTP draft reference shares its embedding and head
    return hidden_states


@pytest.fixture(scope="session")
def plain_dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hs-plain") / "dump"


@pytest.fixture(scope="session")
def plain_sched_server(plain_dump_dir):
    """The same model with the scheduling features off: no chunking (prompts fit one chunk), no radix
    cache, no overlap scheduler. Records must agree with the capture server's."""
    yield from _shared("plain_sched_server", _serve(plain_dump_dir, ["--hs-last", "--disable-radix-cache",
                                                                     "--disable-overlap-schedule"]))


class States(list):
    """output_hidden_states[0..n] of one sequence, and its final pre-norm state as `pre_norm` [T, H]."""
    pre_norm = None


def hf_states(model, ids):
    """HF's output_hidden_states of `ids` ([T, H] each) and, through a forward hook on the final norm's
    input, the final residual stream before the norm."""
    import torch

    taken = []
    handle = model.model.norm.register_forward_hook(lambda mod, args, out: taken.append(args[0][0].detach()))
    try:
        with torch.no_grad():
            out = States(h[0] for h in model(torch.tensor([list(ids)]), output_hidden_states=True).hidden_states)
    finally:
        handle.remove()
    assert len(taken) == 1
    out.pre_norm = taken[0]
    return out


def _slow_finish(server_gen):
    """Start the server of `server_gen` with SGLANG_HS_TEST_FINISH_DELAY=FINISH_DELAY, the held gathers of
    HOLD_RID requests (SGLANG_HS_TEST_HOLD_RID, at most HOLD_S) and SGLANG_INIT_NEW_TOKEN_RATIO=RETRACT_RATIO,
    then run its teardown."""
    env = {"SGLANG_HS_TEST_FINISH_DELAY": str(FINISH_DELAY), "SGLANG_HS_TESTING": "1",  # the switch's gate
           "SGLANG_HS_TEST_HOLD_RID": HOLD_RID, "SGLANG_HS_TEST_HOLD_S": str(HOLD_S),
           "SGLANG_INIT_NEW_TOKEN_RATIO": str(RETRACT_RATIO)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        server = next(server_gen)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    yield server
    yield from server_gen


def _sglang_shm():
    return set(glob.glob("/dev/shm/sglang_loads_*.shm"))


def _serve(dump_dir, args):
    before = _sglang_shm()
    yield from serving(dump_dir, ["--hs-ring-size", "64MiB", *args])
    assert not list(dump_dir.glob("overlay-*.json")) and not list(dump_dir.glob("store-*.bin"))
    # nor SGLang's own start-up segments; one a live process maps belongs to another server still running
    # (a concurrent test run, or the other part of `make test`), not to this stopped one. Such a server's segment
    # is briefly unmapped while it is created or removed, so a stray one must stay stray for a while to count.
    deadline = time.monotonic() + 30
    while True:
        stray = _sglang_shm() - before - mapped_shm(("/dev/shm/sglang_loads_",))
        if not stray or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not stray, stray
