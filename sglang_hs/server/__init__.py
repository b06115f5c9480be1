"""The server side: what runs inside SGLang's processes. The model overlay (models/), the runtime patches of
SGLang with their ledger (patches/), the shared-memory store, admission and finish worker (store/), the copy
kernel (ops/), the CPU engine's stand-ins (cpu/), and serve.py, the entry SGLang's processes start from."""
