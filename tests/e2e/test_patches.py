"""patches/*.patch against the installed sglang 0.5.23, and the source patch standing in for its
runtime twin (sglang_hs/server/patches/) in a real server."""
import glob
import os
import shutil
import subprocess
import sys

import pytest
import sglang

from helpers import REPO, Launcher, leftover_server_processes
from sglang_hs.server.cpu import stubs_dir

pytestmark = pytest.mark.e2e
SITE = os.path.dirname(os.path.dirname(sglang.__file__))
PATCHES = sorted(glob.glob(os.path.join(REPO, "patches", "[0-9][0-9][0-9][0-9]-*.patch")))


def _touched(patch):
    return [l[6:].strip() for l in open(patch) if l.startswith("+++ b/")]


def _patched_tree(root):
    """A copy of the installed sglang as symlinks, with real copies of the files the patches touch,
    then scripts/apply_patches.sh run on it. The installed bytecode is linked too: without it every process
    on this tree compiled each SGLang module it imports from source (and wrote nothing back where
    PYTHONDONTWRITEBYTECODE is set): test_source_patch_and_runtime_fix_agree took 39 s instead of 24 s, the
    module 75 s of its children's CPU instead of 68 s (loaded machine). A patched file's bytecode no longer
    matches its source's mtime and size, so Python compiles that file afresh (and if it writes the result, it
    replaces the link in this tree, not the installed file)."""
    shutil.copytree(os.path.join(SITE, "sglang"), os.path.join(root, "sglang"), symlinks=False,
                    copy_function=os.symlink)
    for patch in PATCHES:
        for rel in _touched(patch):
            dst = os.path.join(root, rel)
            os.unlink(dst)
            shutil.copy(os.path.join(SITE, rel), dst)
    return root


def test_every_patch_names_sglang_0_5_23_and_applies_idempotently(tmp_path):
    assert PATCHES
    for patch in PATCHES:
        text = open(patch).read()
        assert text.startswith("From ") and "\nSubject: [PATCH] " in text and "sglang 0.5.23" in text
    root = _patched_tree(str(tmp_path))
    script = os.path.join(REPO, "scripts", "apply_patches.sh")
    first = subprocess.run(["bash", script, root], capture_output=True, text=True)
    assert first.returncode == 0 and first.stdout.count(": applied") == len(PATCHES), first.stdout + first.stderr
    for patch in PATCHES:  # the applied state is recognised ...
        assert subprocess.run(["git", "apply", "--reverse", "--check", patch], cwd=root).returncode == 0
    again = subprocess.run(["bash", script, root], capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout.count("already applied") == len(PATCHES)  # ... and kept
    # the installed sglang itself stays untouched
    for patch in PATCHES:
        assert subprocess.run(["git", "apply", "--check", patch], cwd=SITE).returncode == 0


DRIFT = """
import types
from sglang.srt.models.deepseek_common import attention_backend_handler as abh
from sglang_hs.server.patches import mla_torch_native as rt
assert abh.__file__.startswith({root!r}), abh.__file__
source = abh.AttentionBackendRegistry.get_handler("torch_native")
assert source is abh.handle_attention_torch_native
for mode in ("extend", "decode"):
    fb = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_decode=lambda: mode == "decode"))
    attn = types.SimpleNamespace()
    assert source(attn, fb) == rt.handle_attention_torch_native(attn, fb), mode
assert rt.apply() is source  # the runtime twin stands aside on a patched sglang
print("OK")
"""


@pytest.fixture(scope="module")
def patched_root(tmp_path_factory):
    root = _patched_tree(str(tmp_path_factory.mktemp("sglang-patched")))
    subprocess.run(["bash", os.path.join(REPO, "scripts", "apply_patches.sh"), root], check=True,
                   capture_output=True)
    return root


def test_source_patch_and_runtime_fix_agree(patched_root):
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join([patched_root, stubs_dir(), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", DRIFT.format(root=patched_root)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def test_numerics_with_the_source_patch_and_the_runtime_fix_off(patched_root, tmp_path):
    """The server on the patched copy, the runtime twin disabled: prompt logprobs still match HF."""
    from test_numerics import check_prompt_logprobs

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [patched_root, os.environ.get("PYTHONPATH")])),
           "SGLANG_HS_DISABLE_PATCHES": "mla_torch_native"}
    server = Launcher(["--hs-dump-dir", str(tmp_path / "hs"), "--chunked-prefill-size", "16"], env=env)
    try:
        server.wait_ready()
        applied = ("runtime-patches=['capture_hooks', 'cpu_gloo_groups', 'cpu_inplace_all_reduce', "
                   "'dsa_spec_verify', 'dsa_torch_native', "
                   "'dsv4_cpu_moe', 'dsv4_cpu_spec', 'dsv4_cpu_tp', 'dsv4_torch_native', 'eagle_cpu_draft', "
                   "'moe_native_ep', "
                   "'spec_verify_torch_native', 'torch_native_cpu_pad', 'torch_native_extend']")
        assert applied in server.output  # the MLA fix came from the source
        check_prompt_logprobs(server)
    finally:
        server.stop()
        assert not leftover_server_processes(server.output)
