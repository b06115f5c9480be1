"""The tools: the launcher and its supervisor (launch_server, supervisor, server_process, argv), the /dev/shm
planner (plan), the self-test (selftest), the demo, and the tiny checkpoints they build (tiny_model). Their
public commands are the top-level modules: python -m sglang_hs.launch_server | plan | selftest | demo."""
