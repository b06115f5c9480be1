"""Model overlays. SGLang imports every module of this package when
SGLANG_EXTERNAL_MODEL_PACKAGE=sglang_hs.server.models, so it holds model modules only."""
